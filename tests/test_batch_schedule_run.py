"""--batch-schedule through the real CLI: the same training on any world size and micro batch at every stage,
step k on the next G_k samples of the order, and a resume mid-stage or at a stage boundary equal to the
uninterrupted run (docs/PRETRAINING.md)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from helpers import read_metrics, rel_err, run_cli, save_tiny_model, write_ragged_tokens
from safetensors.torch import load_file

from accum_cli.data.batches import SampleOrder

pytestmark = pytest.mark.distributed
SEED, LR, ROWS = 3, 3e-3, 40
SCHEDULE, BATCHES = "0:5,2s:9", [5, 5, 9, 9]  # a stage boundary after step 2; 9 is ragged on 2 ranks
TOL = 1e-5


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("schedule")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "data.jsonl", n_rows=ROWS)
    return root


def args(root: Path, out: Path, micro: int, *extra: str, schedule: str = SCHEDULE) -> list[str]:
    return ["--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--batch-schedule", schedule,
            "--batch-schedule-lr", "sqrt", "--micro-batch", str(micro), "--max-steps", "4", "--seed", str(SEED),
            "--lr", str(LR), "--warmup-steps", "0", "--lr-schedule", "constant", "--output-dir", str(out),
            *extra]  # fmt: skip


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def worst(got: list[dict], want: list[dict]) -> tuple[float, float]:
    """The largest relative differences of loss and grad norm, step by step (the steps must match)."""
    want_by_step = {m["step"]: m for m in want}
    assert got and all(m["step"] in want_by_step for m in got)
    loss = max(rel_err(m["loss"], want_by_step[m["step"]]["loss"]) for m in got)
    norm = max(rel_err(m["grad_norm"], want_by_step[m["step"]]["grad_norm"]) for m in got)
    for m in got:
        assert m["global_batch"] == want_by_step[m["step"]]["global_batch"]
    return loss, norm


@pytest.fixture(scope="module")
def runs(root, tmp_path_factory):
    """The schedule on 1 rank (m=4, checkpoints every step) and on 2 ranks (m=3: ragged microbatches)."""
    out = {}
    for world, micro in ((1, 4), (2, 3)):
        folder = tmp_path_factory.mktemp(f"w{world}") / "run"
        result = ok(run_cli(args(root, folder, micro, "--checkpoint-every", "1", "--keep-checkpoints", "9"),
                            nproc=world))  # fmt: skip
        out[world] = (folder, result.stdout)
    return out


def test_every_stage_is_the_same_training_on_any_world_size_and_micro_batch(runs):
    one, two = read_metrics(runs[1][0]), read_metrics(runs[2][0])
    assert [m["global_batch"] for m in one] == BATCHES
    loss, norm = worst(two, one)
    print(f"W=1 m=4 vs W=2 m=3: loss rel {loss:.2e}, grad norm rel {norm:.2e}")
    assert loss < TOL and norm < 10 * TOL
    assert "stage: from step 3 (" in runs[2][1] and "the global batch is 9 sequences" in runs[2][1]
    assert "stage 2           steps 3-4 (2)" in runs[2][1]
    assert "one epoch = 40 sequences (the steps: the batch schedule below)" in runs[2][1]
    # --batch-schedule-lr sqrt: the second stage's lr is the first's times sqrt(9/5)
    assert [m["lr"] for m in one][:2] == [LR, LR] and math.isclose(one[2]["lr"], LR * math.sqrt(9 / 5), rel_tol=1e-12)


def test_step_k_trains_on_the_next_g_k_samples_of_the_order(root, runs):
    rows = [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]
    order, first, expected = SampleOrder(len(rows), SEED), 0, []
    for g in BATCHES:
        picked = order.rows(range(first, first + g))
        expected.append(sum(sum(1 for x in rows[i]["labels"][1:] if x != -100) for i in picked))
        first += g
    assert [m["loss_tokens"] for m in read_metrics(runs[2][0])] == expected


def test_the_checkpoint_records_the_schedule_and_the_stage(runs):
    metas = [json.loads((runs[1][0] / "checkpoints" / f"step-00000{k}" / "meta.json").read_text()) for k in (2, 3)]
    assert [m["batch_schedule"] for m in metas] == ["0s:5,2s:9"] * 2
    assert [(m["samples"], m["origin_step"], m["origin_samples"], m["global_batch"]) for m in metas] == [
        (10, 0, 0, 5), (19, 2, 10, 9)]  # fmt: skip


@pytest.mark.parametrize(
    "step, world, micro", [(1, 2, 3), (2, 2, 2), (3, 1, 2)], ids=["mid-stage W1->2", "at the boundary W1->2", "W1 m2"]
)
def test_a_resume_mid_stage_or_at_a_boundary_is_the_uninterrupted_run(root, runs, tmp_path, step, world, micro):
    source = runs[1][0]
    out = tmp_path / "resumed"
    checkpoint = source / "checkpoints" / f"step-00000{step}"
    result = ok(run_cli(args(root, out, micro, "--resume", str(checkpoint)), nproc=world))
    resumed = read_metrics(out)
    assert [m["step"] for m in resumed] == list(range(step + 1, 5))
    loss, norm = worst(resumed, read_metrics(source))
    print(f"resumed after step {step} on W={world} m={micro}: loss rel {loss:.2e}, grad norm rel {norm:.2e}")
    assert loss < TOL and norm < 10 * TOL
    assert "the same training as an uninterrupted run" in result.stdout
    final, expected = load_file(out / "final/model.safetensors"), load_file(source / "final/model.safetensors")
    assert max(rel_err(final[name], expected[name]) for name in final) < TOL


def test_a_resume_with_another_schedule_is_refused_unless_allowed(root, runs, tmp_path):
    checkpoint = runs[1][0] / "checkpoints" / "step-000002"
    out = tmp_path / "other"
    refused = run_cli(args(root, out, 4, "--resume", str(checkpoint), schedule="0:5,2s:10"))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and "was trained with --batch-schedule 0s:5,2s:9, this run gives --batch-schedule "
        "0s:5,2s:10; resume with the same schedule, or pass --allow-data-change"
        in lines[0]
    ), refused.stderr
    assert not (out / "metrics.jsonl").exists()
    allowed = ok(run_cli(args(root, out, 4, "--resume", str(checkpoint), "--allow-data-change", schedule="0:5,2s:10")))
    assert "schedule changed --allow-data-change: 0s:5,2s:9 -> 0s:5,2s:10" in allowed.stdout
    assert [m["global_batch"] for m in read_metrics(out)] == [10, 10]


def test_the_report_marks_the_stages(runs):
    from accum_cli.rundir.report import read_run, summary

    records, plan = read_run(runs[2][0])
    assert "global batch 5, 9 from step 3 (dotted)" in summary(runs[2][0], records, plan)


def test_a_runs_config_json_reruns_the_schedule(runs):
    from accum_cli.config.settings import build_config

    cfg = build_config(str(runs[1][0] / "config.json"), {})
    assert (cfg.batch_schedule, cfg.batch_schedule_lr, cfg.global_batch) == (SCHEDULE, "sqrt", 9)


def test_token_thresholds_and_max_tokens_on_packed_text(tmp_path):
    """The embedded corpus packed into 128-token sequences: 2K tokens are passed after 4 steps of 4 (2,048),
    so step 5 is the second stage's; --max-tokens 5K holds 39 sequences: 4 x 4 + 2 x 8 = 32, a third 8 would
    pass it. W=1 (m=8) and W=2 (m=3) train the same."""
    common = ["--batch-schedule", "0:4,2K:8", "--max-tokens", "5K", "--seq-len", "128", "--seed", "1",
              "--lr", "1e-3", "--warmup-steps", "0"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    ok(run_cli([*common, "--micro-batch", "8", "--output-dir", str(one)]))
    ok(run_cli([*common, "--micro-batch", "3", "--output-dir", str(two)], nproc=2))
    assert [m["global_batch"] for m in read_metrics(one)] == [4, 4, 4, 4, 8, 8]
    loss, norm = worst(read_metrics(two), read_metrics(one))
    print(f"tokens thresholds, W=1 m=8 vs W=2 m=3: loss rel {loss:.2e}, grad norm rel {norm:.2e}")
    assert loss < TOL and norm < 10 * TOL


def test_a_mixture_of_experts_router_loss_stays_exact_through_a_stage(root, tmp_path):
    """Qwen3-MoE with its router balancing loss (exact: the step's expert choices counted first): the schedule
    on W=1 (m=4) and W=2 (m=3) gives the same loss, router loss and gradient norm at every step."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, head_dim=8, decoder_sparse_step=1,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True,
        router_aux_loss_coef=0.5,
    )  # fmt: skip
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    out = {}
    for world, micro in ((1, 4), (2, 3)):
        out[world] = tmp_path / f"w{world}"
        flags = args(root, out[world], micro)
        flags[flags.index("--model") + 1] = str(tmp_path / "moe")
        result = ok(run_cli(flags, nproc=world))
        assert "microbatch" in result.stdout and (world == 1 or "of at most 3" in result.stdout)
    one, two = read_metrics(out[1]), read_metrics(out[2])
    assert [m["global_batch"] for m in one] == BATCHES and all(m["aux_loss"] > 0 for m in one)
    loss, norm = worst(two, one)
    aux = max(rel_err(a["aux_loss"], b["aux_loss"]) for a, b in zip(one, two, strict=True))
    print(f"MoE, W=1 m=4 vs W=2 m=3: loss rel {loss:.2e}, router loss rel {aux:.2e}, grad norm rel {norm:.2e}")
    assert loss < TOL and aux < TOL and norm < 10 * TOL


def test_streaming_through_the_stages_to_the_streams_end_and_a_resume_on_another_world_size(root, tmp_path):
    """40 rows streamed: steps of 5, 5, 9, 9 take 28; the third stage's 13 would need 41, so the stream ends
    after step 4, seen one step ahead with the next stage's batch. A resume after step 1 on W=2 (m=3) reads
    the stream again to sample 5 and equals the uninterrupted run."""
    common = ["--streaming", "--shuffle-buffer", "8", "--max-steps", "100"]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    schedule = "0:5,2s:9,4s:13"
    result = ok(run_cli(args(root, first, 4, *common, "--checkpoint-every", "1", "--keep-checkpoints", "9",
                            schedule=schedule)))  # fmt: skip
    assert "the stream ends after step 4 (28 samples): the last step" in result.stdout
    assert [m["global_batch"] for m in read_metrics(first)] == BATCHES
    checkpoint = str(first / "checkpoints" / "step-000001")
    ok(run_cli(args(root, resumed, 3, *common, "--resume", checkpoint, schedule=schedule), nproc=2))
    loss, norm = worst(read_metrics(resumed), read_metrics(first))
    print(f"streaming, resumed after step 1 on W=2 m=3: loss rel {loss:.2e}, grad norm rel {norm:.2e}")
    assert [m["step"] for m in read_metrics(resumed)] == [2, 3, 4] and loss < TOL and norm < 10 * TOL
