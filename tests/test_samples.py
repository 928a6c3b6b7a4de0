"""--sample-prompts: greedy completions as the model trains, the same at any world size and layout,
in samples.jsonl (each step once across a resume), on the console and in TensorBoard; the training
itself untouched; a bad prompts file is one line before any work."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import CHAT_TEMPLATE, read_metrics, run_cli, save_tiny_model, write_ragged_tokens
from typer.testing import CliRunner

from accum_cli.cli.main import app

TOKENS = 6  # per completion
PROMPTS = ["Once upon a time", "The capital of France is"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("samples")
    save_tiny_model(root / "model", chat_template=CHAT_TEMPLATE)
    save_tiny_model(root / "plain-model")  # no chat template
    write_ragged_tokens(root / "data.jsonl", n_rows=40)
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n")  # a blank line is no prompt
    (root / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi there"}]}) + "\n")
    return root


def args(root: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--global-batch", "8",
            "--micro-batch", "4", "--max-steps", str(steps), "--lr", "1e-2", "--output-dir", str(out), *extra]  # fmt: skip


def sampling(root: Path, every: int = 2) -> tuple[str, ...]:
    return ("--sample-prompts", str(root / "prompts.txt"), "--sample-every", str(every), "--sample-tokens", str(TOKENS))


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def ran(result) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def one(root, tmp_path_factory) -> dict:
    """One rank, replicated, 3 steps sampled at 2 and at the end (3), to TensorBoard too."""
    out = tmp_path_factory.mktemp("one") / "run"
    extra = ("--layout", "replicate", "--checkpoint-every", "2", "--report-to", "tensorboard")
    stdout = ran(run_cli(args(root, out, 3, *sampling(root), *extra)))
    return {"out": out, "stdout": stdout, "records": records(out)}


@pytest.fixture(scope="module")
def two(root, tmp_path_factory) -> dict:
    """Two real gloo ranks, sharded (FSDP2): the same run."""
    out = tmp_path_factory.mktemp("two") / "run"
    stdout = ran(run_cli(args(root, out, 3, *sampling(root), "--layout", "shard"), nproc=2))
    return {"out": out, "stdout": stdout, "records": records(out)}


def test_completions_at_every_n_steps_and_at_the_end_each_prompt_once(one):
    got = one["records"]
    assert [(r["step"], r["prompt"]) for r in got] == [
        (2, PROMPTS[0]),
        (2, PROMPTS[1]),
        (3, PROMPTS[0]),
        (3, PROMPTS[1]),
    ]
    metrics = read_metrics(one["out"])
    for r in got:
        assert len(r["completion_ids"]) == TOKENS and all(isinstance(i, int) for i in r["completion_ids"])
        assert r["samples"] == 8 * r["step"]
        assert r["tokens"] == sum(m["tokens"] for m in metrics if m["step"] <= r["step"])
    assert got[0]["completion_ids"] != got[2]["completion_ids"], "lr 1e-2: the model changed between the samples"
    for step in (2, 3):
        assert one["stdout"].count(f"samples after step {step}") == 1
    assert f'> "{PROMPTS[1]}"' in one["stdout"]
    header = rf"samples           2 prompts \(\S*prompts\.txt\), {TOKENS} greedy tokens every 2 steps and at the end"
    assert re.search(header, one["stdout"]), one["stdout"]
    assert "samples.jsonl" in one["stdout"].split("── done")[1], "the closing summary names samples.jsonl"


def test_any_world_size_and_layout_writes_the_same_completions(one, two):
    """W=1 replicated and W=2 sharded train the same weights (to fp32 rounding): greedy decoding of
    them gives the same tokens, written once (by rank 0)."""
    assert two["records"] == one["records"]
    assert two["stdout"].count("samples after step 2") == 1


def test_sampling_leaves_the_training_as_it_was(root, one, tmp_path):
    """The same run without --sample-prompts: the same loss at every step and the same final weights, bit
    for bit. Run over a copy of the sampled run (--overwrite), whose samples.jsonl goes with the old run."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    shutil.copytree(one["out"], out)
    ran(run_cli(args(root, out, 3, "--layout", "replicate", "--checkpoint-every", "2", "--overwrite")))
    plain, sampled = read_metrics(out), read_metrics(one["out"])
    assert [m["loss"] for m in plain] == [m["loss"] for m in sampled]
    a, b = load_file(out / "final" / "model.safetensors"), load_file(one["out"] / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (out / "samples.jsonl").exists()


def test_tensorboard_gets_each_sample_step_as_a_text_table(one):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from accum_cli.rundir.tracking import _cell

    texts = {}
    for folder in {events.parent for events in (one["out"] / "trackers").rglob("events.out.tfevents.*")}:
        acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
        acc.Reload()
        for event in acc.Tensors("samples/text_summary") if "samples/text_summary" in acc.Tags()["tensors"] else []:
            assert event.step not in texts
            texts[event.step] = event.tensor_proto.string_val[0].decode()
    assert sorted(texts) == [2, 3]
    for step, text in texts.items():
        written = [r for r in one["records"] if r["step"] == step]
        expected = [f"| {r['prompt']} | {_cell(r['completion'])} |" for r in written]
        assert text.splitlines() == ["| prompt | completion |", "| --- | --- |", *expected]


def test_a_resume_keeps_the_samples_before_its_checkpoint_and_redoes_the_rest(root, one, tmp_path):
    """Resumed at step 2 of a run that sampled at 2 and 3, to step 4: step 2's lines as they were, step 3's
    gone (the resumed run no longer ends there), step 4's appended; each step once."""
    out = tmp_path / "run"
    shutil.copytree(one["out"], out)
    resume = ("--resume", str(out / "checkpoints" / "step-000002"))
    ran(run_cli(args(root, out, 4, *sampling(root), "--layout", "replicate", *resume)))
    lines = (out / "samples.jsonl").read_text().splitlines()
    first = (one["out"] / "samples.jsonl").read_text().splitlines()
    assert lines[:2] == first[:2], "written before the checkpoint: kept as it was"
    got = [json.loads(line) for line in lines]
    assert [r["step"] for r in got] == [2, 2, 4, 4]
    metrics = read_metrics(out)
    assert got[-1]["tokens"] == sum(m["tokens"] for m in metrics) and got[-1]["samples"] == 32


def test_bf16_sharded_chat_prompts_and_a_wandb_table(root, tmp_path, monkeypatch):
    """bf16 (emulated on this CPU: kept tiny), sharded over two ranks, a chat prompt rendered with the
    generation prompt, sampled once at the end (no --sample-every); W&B (offline) gets it as a table."""
    out, home = tmp_path / "run", tmp_path / "wandb-home"
    extra = ("--layout", "shard", "--precision", "bf16", "--sample-prompts", str(root / "chat.jsonl"),
             "--sample-tokens", "3")  # fmt: skip
    wandb = importlib.util.find_spec("wandb") is not None  # a dev extra
    report = ("--report-to", "wandb") if wandb else ()
    for name in ("WANDB_DIR", "WANDB_PROJECT"):  # its files under the output dir, whatever the caller's setting
        monkeypatch.delenv(name, raising=False)
    environment = {"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(home), "WANDB_CACHE_DIR": str(home),
                   "WANDB_DATA_DIR": str(home)}  # fmt: skip
    stdout = ran(run_cli(args(root, out, 1, *extra, *report), nproc=2, env_extra=environment))
    (got,) = records(out)
    assert got["step"] == 1 and got["prompt"] == [{"role": "user", "content": "Hi there"}]
    assert len(got["completion_ids"]) == 3 and stdout.count("samples after step 1") == 1
    if wandb:
        (table,) = (out / "trackers" / "wandb").rglob("samples_1_*.table.json")
        shown = {"columns": ["prompt", "completion"], "data": [["user: Hi there", got["completion"]]]}
        assert json.loads(table.read_text()) == shown


def test_greedy_matches_generate_restores_train_mode_and_touches_no_random_state(root):
    """In process, on a model with dropout in training mode: what transformers' greedy generate gives in
    eval mode, the random state unchanged (dropout drew nothing), training mode back, no gradient."""
    from transformers import AutoModelForCausalLM

    from accum_cli.step.sample import greedy

    model = AutoModelForCausalLM.from_pretrained(root / "model", attention_dropout=0.5, attn_implementation="eager")
    model.train()
    prompts = [[72, 101, 108], [50]]
    state = torch.get_rng_state()
    got = greedy(model, prompts, 5, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state) and model.training
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    for prompt, completion in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                                  do_sample=False, pad_token_id=0)  # fmt: skip
        assert completion == expected[0, len(prompt) :].tolist()


def test_prompts_are_tokenised_as_the_training_reads_text_and_chats_get_the_generation_prompt(root):
    from transformers import AutoTokenizer

    from accum_cli.data import prompts

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    loaded = prompts.load(str(root / "chat.jsonl"), tokenizer, 4, 256, 384)
    assert tokenizer.decode(loaded.ids[0]) == "<|user|>Hi there\n<|assistant|>"
    loaded = prompts.load(str(root / "prompts.txt"), tokenizer, 4, 256, 384)
    assert [tokenizer.decode(ids) for ids in loaded.ids] == PROMPTS  # no EOS added


CASES = [
    (["--sample-prompts", "{missing.txt}"], "--sample-prompts {missing.txt} does not exist; pass a text file of"),
    (["--sample-prompts", "{blank.txt}"], "holds no prompt; pass a text file of prompts, one per line"),
    (["--sample-prompts", "{bad.jsonl}"], "bad.jsonl, line 2 is not JSON ("),
    (["--sample-prompts", "{no-turns.jsonl}"], 'no-turns.jsonl, line 1 is not a list of turns, each with a role'),
    (["--sample-prompts", "{folder}"], "is not a regular file"),
    (["--sample-prompts", "{chat.jsonl}", "--model", "{plain-model}"],
     "holds chat turns but the model's tokenizer has no chat template; add one"),
    (["--sample-prompts", "{prompts.txt}", "--sample-tokens", "235"],
     "line 2 has 24 tokens: with --sample-tokens 235 more, above the model's 256 positions"),
    (["--sample-every", "5"], "--sample-every needs --sample-prompts FILE"),
    (["--sample-prompts", "{prompts.txt}", "--sample-tokens", "0"], "--sample-tokens must be >= 1, got 0"),
]  # fmt: skip


@pytest.mark.parametrize("flags, message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_prompts_file_is_one_line_before_any_work(root, tmp_path, flags, message):
    (root / "blank.txt").write_text("\n  \n")
    (root / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": [\n')
    (root / "no-turns.jsonl").write_text('{"messages": "hello"}\n')
    (root / "folder").mkdir(exist_ok=True)
    before = {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}
    out = tmp_path / "out"
    given = [f.replace("{", f"{root}/").replace("}", "") for f in flags]
    result = CliRunner().invoke(app, args(root, out, 1, *given))
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    expected = message.replace("{", f"{root}/").replace("}", "")
    assert lines[0].startswith("accum-train: error: ") and expected in lines[0], lines[0]
    assert not out.exists(), "nothing is written on bad input"
    assert {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()} == before, "the user's files untouched"


def test_a_samples_file_that_cannot_be_written_is_one_note_and_the_training_goes_on(root, tmp_path, capsys):
    """A full disk (here: samples.jsonl taken by a folder, the same OSError path) costs the samples, not the
    run: one note, the console block and the trackers still get them."""
    from transformers import AutoTokenizer

    from accum_cli.data.prompts import Prompt, Prompts
    from accum_cli.rundir.samples import FILE, SampleLog

    (tmp_path / FILE).mkdir()
    sent = []
    tracker = type("Trackers", (), {"log_samples": lambda self, step, pairs: sent.append((step, pairs))})()
    prompts = Prompts(str(root / "prompts.txt"), [Prompt(1, PROMPTS[0], None)], [[3, 4]])
    log = SampleLog(tmp_path, prompts, AutoTokenizer.from_pretrained(root / "model"), True)
    log.write(7, 56, 900, [[5, 6, 7]], tracker)
    out = capsys.readouterr().out
    assert "note: samples.jsonl not written at step 7" in out and "training goes on" in out, out
    assert "samples after step 7" in out and sent and sent[0][0] == 7
    assert (tmp_path / FILE).is_dir() and not list((tmp_path / FILE).iterdir()), "nothing written into the folder"
