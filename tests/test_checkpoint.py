"""Nothing lost: checkpoints, exact and elastic resume, preemption by a real signal, export,
non-finite values. Real multi-process runs on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    assert_complete_hf_model,
    env,
    free_port,
    probe_logits,
    python,
    read_metrics,
    rel_err,
    run_cli,
    save_tiny_model,
    worker_pids,
    write_first_step_without_loss_tokens,
    write_ragged_tokens,
)
from safetensors.torch import load_file, save_file

from accum_cli.config.plan import Plan
from accum_cli.data.batches import SampleOrder

pytestmark = pytest.mark.distributed
G, SEED = 10, 3


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "data.jsonl", n_rows=40)
    return root


def args(root: Path, out: Path, micro: int = 2, steps: int = 6, *extra: str) -> list[str]:
    return ["--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--global-batch", str(G),
            "--micro-batch", str(micro), "--max-steps", str(steps), "--seed", str(SEED), "--lr", "3e-3",
            "--warmup-steps", "2", "--output-dir", str(out), *extra]  # fmt: skip


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def assert_losses_match(got: list[dict], want: list[dict], tol: float) -> None:
    want_by_step = {m["step"]: m for m in want}
    assert got, "no steps to compare"
    for m in got:
        w = want_by_step[m["step"]]
        assert rel_err(m["loss"], w["loss"]) < tol, (m["step"], m["loss"], w["loss"])
        assert rel_err(m["grad_norm"], w["grad_norm"]) < 10 * tol


@pytest.fixture(scope="module")
def uninterrupted(root, tmp_path_factory):
    """Reference runs: 2 ranks (m=2) and 1 rank (m=4), checkpoints every 2 steps, kept."""
    runs = {}
    for world, micro in ((2, 2), (1, 4)):
        out = tmp_path_factory.mktemp(f"u{world}") / "run"
        ok(run_cli(args(root, out, micro, 6, "--checkpoint-every", "2", "--keep-checkpoints", "5"), nproc=world))
        runs[world] = out
    return runs


def test_checkpoints_are_complete_and_pruned(root, uninterrupted, tmp_path):
    out = uninterrupted[2]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-000002", "step-000004", "step-000006"], "every 2 steps and at the end, no temp left"
    for name in names:
        meta = json.loads((out / "checkpoints" / name / "meta.json").read_text())
        assert meta["samples"] == meta["step"] * G and meta["world_size"] == 2
    pruned = tmp_path / "pruned"
    ok(run_cli(args(root, pruned, 2, 5, "--checkpoint-every", "1", "--keep-checkpoints", "2")))
    assert sorted(p.name for p in (pruned / "checkpoints").iterdir()) == ["step-000004", "step-000005"]


def test_a_rewind_sets_later_checkpoints_aside_and_wrong_folders_are_refused(root, uninterrupted, tmp_path):
    """Found by a review, each seen going wrong first. A run resumed from an older checkpoint of
    its folder (a rewind) had its new checkpoints pruned in favour of the abandoned later ones,
    which --resume auto then took; a checkpoint or final/ given as --output-dir was trained into
    (its config.json replaced); --resume final/ was called an unfinished save; an exported final/
    was refused only after the resumed training."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted[1], out)  # checkpoints at steps 2, 4 and 6, and final/
    rewound = ok(run_cli(args(root, out, 4, 3, "--checkpoint-every", "1", "--keep-checkpoints", "2",
                              "--resume", str(out / "checkpoints" / "step-000002"))))  # fmt: skip
    assert (
        "rewound to step 2: later checkpoints kept aside as rewound-step-000004, rewound-step-000006" in rewound.stdout
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "rewound-step-000004", "rewound-step-000006", "step-000002", "step-000003"]  # fmt: skip
    assert_losses_match(read_metrics(out)[2:], read_metrics(uninterrupted[1])[2:3], 1e-5)  # step 3, as before
    auto = ok(run_cli(args(root, out, 4, 4, "--resume", "auto")))
    assert "step-000003" in auto.stdout and [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]

    checkpoint_dir = out / "checkpoints" / "step-000003"
    before = (checkpoint_dir / "config.json").read_bytes()
    for target, kind in ((checkpoint_dir, "checkpoint"), (out / "final", "final model")):
        refused = run_cli(args(root, target, 4, 1, "--resume", "auto"))
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stderr.strip().splitlines() == [
            f"accum-train: error: --output-dir {target} is a {kind} accum-train wrote, not a run folder; pass the "
            "run's own folder as --output-dir (and a checkpoint to --resume)"
        ]
    assert (checkpoint_dir / "config.json").read_bytes() == before and not (checkpoint_dir / "checkpoints").exists()

    refused = run_cli(args(root, tmp_path / "other", 4, 6, "--resume", str(out / "final")))
    assert refused.returncode == 2 and "is a model (a final/ or an export), not a checkpoint" in refused.stderr

    shutil.rmtree(out / "final")
    ok(python(["-c", "from accum_cli.cli.main import export_entry; export_entry()",
                       str(out / "checkpoints" / "step-000003"), str(out / "final")],
                      cwd=REPO, env=env(), capture_output=True, text=True, timeout=120))  # fmt: skip
    refused = run_cli(args(root, out, 4, 6, "--resume", str(out / "checkpoints" / "step-000003")))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "its final/ holds a model accum-train did not write (an export?)" in refused.stderr
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4], "refused before any step"


def test_any_layout_is_the_same_training(uninterrupted):
    assert_losses_match(read_metrics(uninterrupted[1]), read_metrics(uninterrupted[2]), 1e-5)


@pytest.mark.parametrize(
    "source_world, world, micro",
    [(2, 2, 2), (2, 1, 3), (1, 2, 3), (1, 1, 3)],
    ids=["exact 2->2", "elastic 2->1 m2->3", "elastic 1->2 m4->3", "elastic m4->m3"],
)
def test_resume_continues_the_same_training(root, uninterrupted, tmp_path, source_world, world, micro):
    source = uninterrupted[source_world]
    out = tmp_path / "resumed"
    result = ok(run_cli(args(root, out, micro, 6, "--resume", str(source / "checkpoints/step-000002")), nproc=world))
    resumed = read_metrics(out)
    assert [m["step"] for m in resumed] == [3, 4, 5, 6]
    exact = (source_world, 2 if source_world == 2 else 4) == (world, micro)
    assert_losses_match(resumed, read_metrics(source), 1e-6 if exact else 1e-5)
    if not exact:
        assert "layout changed" in result.stdout and "the same training as an uninterrupted run" in result.stdout
    final, expected = load_file(out / "final/model.safetensors"), load_file(source / "final/model.safetensors")
    for name in final:
        assert rel_err(final[name], expected[name]) < 1e-5, name


def test_resume_across_layouts_continues_the_same_training(root, uninterrupted, tmp_path):
    """The reference runs replicate (the tiny state fits); resuming sharded must not notice. The
    resumed run is told its devices hold 1 MiB: `--layout auto` shards because the replicated
    layout's estimated peak does not fit, as rank 0 found and sent to the other rank."""
    source = uninterrupted[2]
    assert json.loads((source / "config.json").read_text())["plan"]["layout"] == "replicate"
    out = tmp_path / "sharded"
    resume = ("--resume", str(source / "checkpoints/step-000002"), "--sync", "last", "--device-memory-gib", "0.001")
    result = ok(run_cli(args(root, out, 2, 6, *resume), nproc=2))
    assert "layout            shard (estimated peak " in result.stdout and "too big to replicate" in result.stdout
    assert json.loads((out / "config.json").read_text())["plan"]["layout"] == "shard"
    assert_losses_match(read_metrics(out), read_metrics(source), 1e-5)


def test_sigterm_stops_every_rank_at_a_step_boundary_and_resume_is_exact(root, tmp_path):
    """A real SIGTERM to one worker of a real 2-process run (started by the --nproc wrapper)."""
    # A constant LR, so the schedule does not depend on the number of steps asked for.
    constant = ("--lr-schedule", "constant")
    out = tmp_path / "preempted"
    cmd = [sys.executable, "-m", "accum_cli", "--nproc", "2", "--master-port", str(free_port()),
           *args(root, out, 2, 400, *constant)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be signalled"
        time.sleep(0.05)
    os.kill(worker_pids(str(out))[1], signal.SIGTERM)  # rank 1 only: rank 0 must agree to stop too
    signalled = time.monotonic()
    stdout, stderr = proc.communicate(timeout=120)
    seconds = time.monotonic() - signalled
    assert proc.returncode == 75, stdout + stderr
    assert "stopped by a signal on another rank after step" in stderr
    print(f"SIGTERM to exit of the whole 2-rank run: {seconds:.2f} s")

    done = len(read_metrics(out))
    assert (out / "checkpoints" / f"step-{done:06d}" / "meta.json").is_file()
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert not (out / "final").exists(), "an interrupted run has no final model"

    # Resume in place with `--resume` alone (the latest checkpoint), to a shorter end than asked,
    # two steps past the stop (however late the signal landed on a slow machine), against an
    # uninterrupted run of that length.
    end = done + 2
    reference = tmp_path / "reference"
    ok(run_cli(args(root, reference, 2, end, *constant), nproc=2))
    ok(run_cli([*args(root, out, 2, end, *constant), "--resume"], nproc=2))
    assert [m["step"] for m in read_metrics(out)] == list(range(1, end + 1))
    assert_losses_match(read_metrics(out), read_metrics(reference), 1e-6)


def test_export_round_trip(uninterrupted, tmp_path):
    out = uninterrupted[2]
    target = tmp_path / "hf"
    result = python(
        ["-c", "from accum_cli.cli.main import export_entry; export_entry()",
         str(out / "checkpoints/step-000006"), str(target)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The export of the last checkpoint is the trained model of final/, every tensor of it.
    trained = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32, attn_implementation="sdpa")
    assert_complete_hf_model(target, trained.state_dict(), probe_logits(trained), 1e-7)
    assert AutoTokenizer.from_pretrained(target)("a")["input_ids"][0] == 100


def poison_token(model_dir: Path, token: int = 383) -> None:
    """Finite weights whose loss is inf wherever `token` is the label: its output row is -3e38 on
    dimension 0, which the embedding's column 0 (all ones) keeps positive in every final hidden
    state, so its logit overflows to -inf everywhere and only a `token` label costs inf. (Not a NaN
    weight: a run never saves non-finite weights, test_trust_weights.py.)"""
    weights = load_file(model_dir / "model.safetensors")
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    weights["lm_head.weight"][token] = 0.0
    weights["lm_head.weight"][token, 0] = -3e38
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def poisoned(root, tmp_path_factory):
    """A model whose loss is inf where token 383 is the label (poison_token), and data where only
    one row, read in step 1, holds that token: a real inf loss in a known step, rank and microbatch."""
    folder = tmp_path_factory.mktemp("nan")
    poison_token(save_tiny_model(folder / "model"))
    n_rows = 30
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 300, (12,), generator=g).tolist() for _ in range(n_rows)]
    plan = Plan(G, 2, 2)
    rank, micro = 1, 1
    index = plan.microbatch_range(1, rank, micro)[0]
    bad_row = SampleOrder(n_rows, SEED).rows(range(index, index + 1))[0]
    rows[bad_row][5] = 383
    with open(folder / "data.jsonl", "w") as f:
        for ids in rows:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return folder, rank, micro


def test_nonfinite_abort_names_the_step_and_keeps_the_last_checkpoint(poisoned, tmp_path):
    folder, rank, micro = poisoned
    out = tmp_path / "run"
    result = run_cli(args(folder, out, 2, 4, "--checkpoint-every", "1"), nproc=2, wrapper=True)
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"non-finite values at step 2: non-finite loss in microbatch {micro} on rank {rank}" in result.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    assert [m["step"] for m in read_metrics(out)] == [1]


def test_nonfinite_skip_goes_on_without_applying_the_step(poisoned, uninterrupted, tmp_path):
    folder, _, _ = poisoned
    out = tmp_path / "run"
    # The same schedule (6 steps, 2 of warmup) as the uninterrupted 2-rank run.
    ok(run_cli(args(folder, out, 2, 6, "--on-nonfinite", "skip"), nproc=2))
    metrics = read_metrics(out)
    skipped = [m.get("skipped", False) for m in metrics]
    assert skipped[:3] == [False, True, False] and not all(skipped[2:]), skipped
    # Strict JSON (no NaN or Infinity, which other parsers refuse): the skipped step's loss is null.
    strict = [json.loads(line, parse_constant=pytest.fail) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert strict[1]["loss"] is None and all(isinstance(m["loss"], float) for m in strict if not m.get("skipped"))
    # A skipped step still moves the schedule: every step's lr is the unskipped run's.
    assert [m["lr"] for m in metrics] == pytest.approx([m["lr"] for m in read_metrics(uninterrupted[2])], rel=1e-12)
    weights = load_file(out / "final/model.safetensors")
    for name, tensor in weights.items():
        assert torch.isfinite(tensor).all(), name


@pytest.mark.parametrize("policy", ["abort", "skip"])
def test_a_step_without_loss_tokens_aborts_or_is_skipped(tmp_path, policy):
    """Every label of step 1's samples is -100 (prompts whose completions were cut off): abort
    names the step (exit 3); skip drops it and goes on, the schedule moving as for any skipped step."""
    model_dir = save_tiny_model(tmp_path / "model")
    n_rows, global_batch = 8, 4
    write_first_step_without_loss_tokens(tmp_path / "data.jsonl", n_rows, global_batch, SEED)
    out = tmp_path / "run"
    result = run_cli(["--model", str(model_dir), "--dataset", str(tmp_path / "data.jsonl"), "--global-batch",
                      str(global_batch), "--micro-batch", "2", "--max-steps", "2", "--seed", str(SEED),
                      "--on-nonfinite", policy, "--output-dir", str(out)])  # fmt: skip
    if policy == "abort":
        assert result.returncode == 3, result.stdout + result.stderr
        assert "step 1 has no loss tokens: every label is -100" in result.stderr
        return
    ok(result)
    metrics = read_metrics(out)
    assert [m.get("skipped", False) for m in metrics] == [True, False]
    assert metrics[0]["loss_tokens"] == 0 and metrics[1]["loss_tokens"] > 0


@pytest.mark.parametrize("new_batch, steps", [(4, [3, 4, 5, 6, 7, 8]), (12, [3, 4])])
def test_epochs_resumed_at_another_global_batch_train_on_the_same_samples(root, tmp_path, new_batch, steps):
    """--epochs 1 over 40 samples at global batch 8, resumed after step 2 (16 samples) at another
    global batch: the rest of the epoch, 24 samples, in steps of the new one. Counting the epoch
    in steps of the new batch from the start trained 48 samples at 4 (into a second epoch) and 28
    at 12 (stopping short)."""

    def run(out: Path, global_batch: int, *extra: str) -> Path:
        ok(run_cli(["--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--global-batch",
                    str(global_batch), "--micro-batch", "4", "--epochs", "1", "--seed", str(SEED),
                    "--output-dir", str(out), "--keep-checkpoints", "5", *extra]))  # fmt: skip
        return out

    whole = run(tmp_path / "whole", 8, "--checkpoint-every", "2")
    resumed = run(tmp_path / "resumed", new_batch, "--resume", str(whole / "checkpoints/step-000002"))
    assert [m["step"] for m in read_metrics(resumed)] == steps
    last = json.loads((resumed / f"checkpoints/step-{steps[-1]:06d}/meta.json").read_text())
    assert last["samples"] == 40 == json.loads((whole / "checkpoints/step-000005/meta.json").read_text())["samples"]


def test_a_checkpoint_after_only_skipped_steps_changes_nothing_and_resumes(tmp_path):
    """Step 1 is non-finite and skipped, so the optimizer has no state when the checkpoint after it
    is saved. Saving must not make any up (torch's get_state_dict runs an AdamW step at lr 0 on an
    optimizer without state: the live run then counted one step more and its next update was ~26%
    smaller), and a resume from that checkpoint must go on as the run that never saved."""
    model_dir = save_tiny_model(tmp_path / "model")
    poison_token(model_dir)
    n_rows, global_batch = 12, 4
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 300, (12,), generator=g).tolist() for _ in range(n_rows)]
    rows[SampleOrder(n_rows, SEED).rows(range(0, 1))[0]][5] = 383  # read in step 1 only
    with open(tmp_path / "data.jsonl", "w") as f:
        for ids in rows:
            f.write(json.dumps({"input_ids": ids}) + "\n")

    def run(out: Path, *extra: str) -> dict:
        ok(run_cli(["--model", str(model_dir), "--dataset", str(tmp_path / "data.jsonl"), "--global-batch",
                    str(global_batch), "--micro-batch", "2", "--max-steps", "3", "--seed", str(SEED), "--lr", "1e-2",
                    "--lr-schedule", "constant", "--warmup-steps", "0", "--on-nonfinite", "skip",
                    "--output-dir", str(out), *extra]))  # fmt: skip
        assert [m.get("skipped", False) for m in read_metrics(out)] == [True, False, False][-len(read_metrics(out)) :]
        return load_file(out / "final/model.safetensors")

    whole = run(tmp_path / "whole")
    saved = run(tmp_path / "saved", "--checkpoint-every", "1", "--keep-checkpoints", "3")
    resumed = run(tmp_path / "resumed", "--resume", str(tmp_path / "saved/checkpoints/step-000001"))
    for name, expected in whole.items():
        assert rel_err(saved[name], expected) < 1e-7, name
        assert rel_err(resumed[name], expected) < 1e-7, name


def test_parameters_the_training_never_uses_keep_no_optimizer_state_and_resume(tmp_path):
    """GPT-2 built with cross-attention, which a causal LM's forward never calls: those parameters
    never have a gradient, so AdamW never creates their state (nor decays them), and a checkpoint
    holds none for them. A resume must load it all the same (DCP refused: "missing key") and go on
    as the uninterrupted run did; sharded (FSDP on one rank), their gradient stays None too."""
    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=384, n_embd=32, n_layer=2, n_head=2, n_positions=128, add_cross_attention=True,
                        eos_token_id=1, bos_token_id=1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "model")
    ByT5Tokenizer().save_pretrained(tmp_path / "model")
    initial = load_file(tmp_path / "model/model.safetensors")
    write_ragged_tokens(tmp_path / "data.jsonl", n_rows=24)

    def run(out: Path, *extra: str) -> Path:
        ok(run_cli(["--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.jsonl"), "--global-batch",
                    "4", "--micro-batch", "2", "--max-steps", "4", "--weight-decay", "0.1", "--lr-schedule",
                    "constant", "--warmup-steps", "0", "--layout", "shard", "--output-dir", str(out), *extra]))  # fmt: skip
        return out

    whole = run(tmp_path / "whole", "--checkpoint-every", "2")
    resumed = run(tmp_path / "resumed", "--resume", str(whole / "checkpoints/step-000002"))
    assert [m["step"] for m in read_metrics(resumed)] == [3, 4]
    final, expected = load_file(resumed / "final/model.safetensors"), load_file(whole / "final/model.safetensors")
    unused = [name for name in final if "crossattention" in name or "ln_cross_attn" in name]
    assert unused and len(unused) < len(final)
    for name in final:
        assert rel_err(final[name], expected[name]) < 1e-6, name
    for name in unused:  # never decayed, never moved
        assert torch.equal(final[name], initial[name]), name
