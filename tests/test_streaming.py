"""--streaming through the real CLI: the same training whatever the world size and micro batch,
an exact resume from the stream position, a seeded shuffle buffer seen in what training reads,
and a clean end of the stream."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import CHAT_TEMPLATE, read_metrics, rel_err, run_cli, save_tiny_model, write_ragged_tokens
from typer.testing import CliRunner

from accum_cli.cli.main import app
from accum_cli.data import formats, prepare, sources, stream

# G = 7 over W = 2 is uneven (ranks take 4 and 3): the plan's split must hold for a stream too.
COMMON = ["--streaming", "--seq-len", "32", "--global-batch", "7", "--shuffle-buffer", "16", "--lr", "1e-3"]
STEPS = 4
PLAIN = ["the", "lazy", "dog", "while", "seven", "wizards", "quietly", "hex", "jolly", "kings", "over",
         "quick", "brown", "fox"]  # fmt: skip


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream")
    model = save_tiny_model(root / "model", chat_template=CHAT_TEMPLATE)
    with open(root / "docs.jsonl", "w") as f:  # ~9,000 tokens: about 280 blocks of 32, 40 steps of 7
        for i in range(60):
            f.write(json.dumps({"text": " ".join(PLAIN[(i * 5 + k) % len(PLAIN)] for k in range(10 + i % 23))}) + "\n")
    # Pre-tokenised rows of distinct lengths, shuffled in the file: with a global batch of 1, a
    # step's loss-token count (length - 1) names the row it trained on.
    lengths = [5 + (i * 7) % 24 for i in range(24)]
    assert len(set(lengths)) == 24
    with open(root / "rows.jsonl", "w") as f:
        for n in lengths:
            f.write(json.dumps({"input_ids": [3 + (n + k) % 300 for k in range(n)]}) + "\n")
    with open(root / "chat.jsonl", "w") as f:
        for i in range(30):
            turns = [{"role": "user", "content": " ".join(PLAIN[: 1 + i % 3])},
                     {"role": "assistant", "content": " ".join(PLAIN[i % 5 : 9 + i % 4])}]  # fmt: skip
            f.write(json.dumps({"messages": turns}) + "\n")
    with open(root / "pairs.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"prompt": " ".join(PLAIN[: 2 + i % 9]), "completion": " ".join(PLAIN[i % 6 :])}) + "\n")
    write_ragged_tokens(root / "labelled.jsonl", n_rows=30)
    named = {name: root / f"{name}.jsonl" for name in ("docs", "rows", "chat", "pairs", "labelled")}
    return {"root": root, "model": model, **named, "lengths": lengths}


@pytest.mark.parametrize("name, packing", [("docs", None), ("chat", None), ("pairs", None), ("labelled", None),
                                           ("docs", False)])  # fmt: skip
def test_the_stream_holds_the_prepared_samples_in_stream_order(files, monkeypatch, name, packing):
    """Without a buffer, the stream's samples are the prepared path's, ids and labels alike, in the
    rows' order: the same tokenising, packing across chunks, truncation and loss masks."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(stream, "ROWS_PER_BATCH", 7)  # small chunks: blocks and rows straddle them
    tokenizer = AutoTokenizer.from_pretrained(files["model"])
    options = formats.Options(seq_len=48, packing=packing, vocab_size=384)
    prepared, _, _ = prepare.prepare(sources.load_raw(str(files[name])), tokenizer, options, True, True, lambda: None,
                                     num_proc=1)  # fmt: skip
    raw = sources.load_raw(str(files[name]), streaming=True)
    source = stream.open_source(raw, name, tokenizer, options, seed=0, shuffle_buffer=0, max_positions=256)
    streamed = [stream.as_int64(sample) for sample in stream.samples(source)]
    assert len(streamed) == len(prepared) > 10
    for i, (ids, labels) in enumerate(streamed):
        want_ids, want_labels = prepared.sample(i)
        assert np.array_equal(ids, want_ids) and np.array_equal(labels, want_labels), f"sample {i}"


def train(files, out: Path, *extra: str, nproc: int = 1, dataset: str = "docs") -> list[dict]:
    args = ["--model", str(files["model"]), "--dataset", str(files[dataset]), *extra, "--output-dir", str(out)]
    result = run_cli(args, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(out)


@pytest.fixture(scope="module")
def reference(files) -> Path:
    """One process, one microbatch of 7 per step, a checkpoint at step 2."""
    out = files["root"] / "reference"
    train(files, out, *COMMON, "--micro-batch", "7", "--max-steps", str(STEPS), "--checkpoint-every", "2")
    return out


def losses(metrics: list[dict]) -> list[float]:
    return [m["loss"] for m in metrics if "loss" in m]


def test_the_steps_train_on_the_same_samples_whatever_w_and_m(files, reference, tmp_path):
    """W = 1, m = 7 (one microbatch) against W = 2, m = 2 (ranks of 4 and 3 samples, microbatches
    [2, 2] and [2, 1]); the resume test runs yet another m."""
    expected = losses(read_metrics(reference))
    got = losses(train(files, tmp_path / "run", *COMMON, "--micro-batch", "2", "--max-steps", str(STEPS), nproc=2))
    assert len(got) == len(expected) == STEPS
    for step, (a, b) in enumerate(zip(got, expected, strict=True), 1):
        assert rel_err(a, b) < 1e-5, f"step {step}: {a} vs {b}"


def test_a_resume_continues_the_stream_exactly(files, reference, tmp_path):
    """Saved by one process, resumed by two (another m too): the position is in global samples."""
    expected = losses(read_metrics(reference))
    out = tmp_path / "resumed"
    shutil.copytree(reference, out)
    checkpoint = out / "checkpoints" / "step-000002"
    assert json.loads((checkpoint / "meta.json").read_text())["samples"] == 14  # the stream position
    result = run_cli(["--model", str(files["model"]), "--dataset", str(files["docs"]), *COMMON, "--micro-batch", "3",
                      "--max-steps", str(STEPS), "--output-dir", str(out), "--resume", str(checkpoint)], nproc=2)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "read again up to sample 14 to resume exactly" in result.stdout
    got = losses(read_metrics(out))
    assert [m["step"] for m in read_metrics(out)] == list(range(1, STEPS + 1))
    for step in range(2, STEPS):  # steps 3 and 4 ran after the resume
        assert rel_err(got[step], expected[step]) < 1e-5, f"step {step + 1}: {got[step]} vs {expected[step]}"


def rows_seen(files, out: Path, *extra: str) -> list[int]:
    """The rows training read, in order (by their lengths), streaming to the end of the data."""
    metrics = train(files, out, "--streaming", "--global-batch", "1", "--micro-batch", "1", "--max-steps", "100",
                    *extra, dataset="rows")  # fmt: skip
    return [m["loss_tokens"] + 1 for m in metrics if "loss_tokens" in m]


def test_the_shuffle_buffer_shuffles_locally_and_by_seed(files, tmp_path):
    """(That one seed always gives one order, the W and m test shows: its runs agree step by step.)"""
    lengths, buffer = files["lengths"], 6
    seed0 = rows_seen(files, tmp_path / "seed0", "--shuffle-buffer", str(buffer), "--seed", "0")
    seed1 = rows_seen(files, tmp_path / "seed1", "--shuffle-buffer", str(buffer), "--seed", "1")
    for order in (seed0, seed1):
        assert sorted(order) == sorted(lengths), "every row exactly once"
        assert order != lengths, "the buffer did not shuffle"
        # A buffer of N hands a row out at most N places before its place in the stream.
        assert all(order.index(n) >= lengths.index(n) - buffer for n in lengths)
    assert seed1 != seed0, "another seed gives another order"


def test_without_a_buffer_the_stream_order_is_kept_to_a_clean_end(files, tmp_path):
    out = tmp_path / "end"
    result = run_cli(["--model", str(files["model"]), "--dataset", str(files["rows"]), "--streaming", "--max-steps",
                      "100", "--global-batch", "5", "--micro-batch", "2", "--shuffle-buffer", "0", "--output-dir",
                      str(out)])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the stream ends after step 4 (20 samples): the last step" in result.stdout  # 24 rows: 4 whole steps
    lengths = files["lengths"]
    expected = [sum(n - 1 for n in lengths[k * 5 : (k + 1) * 5]) for k in range(4)]  # the rows in file order
    assert [m["loss_tokens"] for m in read_metrics(out) if "loss" in m] == expected
    assert (out / "checkpoints" / "step-000004" / "meta.json").is_file()
    assert (out / "final" / "config.json").is_file()
    # The same command again (a requeued job's --resume auto): finished where the stream ended.
    again = run_cli(["--model", str(files["model"]), "--dataset", str(files["rows"]), "--streaming", "--max-steps",
                     "100", "--global-batch", "5", "--micro-batch", "2", "--shuffle-buffer", "0", "--output-dir",
                     str(out), "--resume", "auto"])  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to do" in again.stdout and "the stream ended after step 4" in again.stdout, again.stdout


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--streaming needs --max-steps N"),
        (["--max-steps", "2", "--eval-split-ratio", "0.1"], "--eval-split-ratio cannot hold out part of a stream"),
        (["--max-steps", "2", "--prepare-only"], "--prepare-only has nothing to prepare with --streaming"),
        (["--max-steps", "2", "--shuffle-buffer", "-1"], "--shuffle-buffer must be >= 0"),
        (["--max-steps", "2", "--global-batch", "500"], "the stream holds fewer than one global batch of 500"),
        # The evaluation's rows must fit the model on the streaming path too (GPT-2 crashed at its first one).
        (
            ["--max-steps", "2", "--global-batch", "4", "--eval-dataset", "{long-eval}"],
            "a pre-tokenised row has 300 tokens, above the model's",
        ),
    ],
)
def test_bad_streaming_input_is_one_line_and_exit_2(files, tmp_path, extra, message):
    out = tmp_path / "out"
    long_eval = files["root"] / "long-eval.jsonl"
    long_eval.write_text(json.dumps({"input_ids": [5] * 300}) + "\n")  # the tiny model has 256 positions
    extra = [str(long_eval) if x == "{long-eval}" else x for x in extra]
    args = ["--model", str(files["model"]), "--dataset", str(files["rows"]), "--streaming", *extra]
    result = CliRunner().invoke(app, [*args, "--micro-batch", "1", "--output-dir", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("accum-train: error: ") and message in lines[0], result.output
    assert not out.exists()


def test_a_buffered_row_holds_its_own_tokens_not_its_chunk():
    """The shuffle buffer's memory is its samples': a row handed out as a view of its chunk's
    arrays would keep the whole chunk alive (measured: 10,000 buffered rows, 5.7 MiB of their
    own, held 35 MiB of chunks)."""
    lengths = np.full(256, 40, dtype=np.int64)
    ids = np.arange(256 * 40, dtype=np.uint16)
    mask = (np.arange(256 * 40) % 3 != 0).astype(np.uint8)
    chunk = prepare.Chunk(ids, lengths, mask, None, 256, 0, 0, 0, 40, 0)
    rows = list(stream._rows([chunk], None))
    assert len(rows) == 256 and rows[1][0].tolist() == list(range(40, 80))
    for row_ids, row_labels in rows:
        assert row_ids.base is None and row_labels.base is None
