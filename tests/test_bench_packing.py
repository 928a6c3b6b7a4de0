"""bench/packing.py (issue 40): its arguments, its seeded long-tailed corpus and its figures, without training."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_packing", Path(__file__).resolve().parents[1] / "bench" / "packing.py"
)
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def test_defaults_are_seq_2048_and_quick_is_smaller_but_flags_win():
    full, quick = bench.parse_args([]), bench.parse_args(["--quick"])
    assert (full.seq_len, full.reps, full.micro_batch) == (2048, 2, 4)
    assert quick.seq_len < full.seq_len and quick.rows < full.rows
    assert bench.parse_args(["--quick", "--seq-len", "512"]).seq_len == 512
    with pytest.raises(SystemExit):
        bench.parse_args(["--micro-batch", "0"])


def test_the_corpus_is_seeded_log_normal_and_chat_rows(tmp_path):
    sizes = bench.write_corpus(tmp_path / "a.jsonl", 4000, 300, 1.0, seed=0)
    assert sizes == bench.write_corpus(tmp_path / "b.jsonl", 4000, 300, 1.0, seed=0)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert sizes != bench.write_corpus(tmp_path / "c.jsonl", 4000, 300, 1.0, seed=1)
    logs = np.log(sizes)
    assert abs(np.median(sizes) - 300) < 20 and abs(logs.std() - 1.0) < 0.05  # log-normal, median 300, sigma 1
    assert np.mean(sizes) > 1.5 * np.median(sizes) and max(sizes) > 2048  # long-tailed
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    first = rows[0]["messages"]
    assert [t["role"] for t in first] == ["user", "assistant"]
    assert len(first[0]["content"]) + len(first[1]["content"]) + bench.MARKERS == sizes[0]


def test_the_figures_of_a_run():
    records = [
        {"step": 1, "loss": 4.0, "loss_tokens": 100, "tokens": 300, "positions": 400, "rows": 5, "elapsed_s": 10.0},
        {"step": 2, "loss": 2.0, "loss_tokens": 300, "tokens": 500, "positions": 600, "rows": 7, "elapsed_s": 12.0},
        {"step": 3, "loss": 1.0, "loss_tokens": 100, "tokens": 700, "positions": 800, "rows": 6, "elapsed_s": 14.0},
    ]
    got = bench.summarize(records, warmup=1)
    assert got["real_tokens_per_s"] == pytest.approx((500 + 700) / 4.0)  # steps after the warm-up, their time
    assert got["positions_per_loss_token"] == pytest.approx(1800 / 500)
    assert got["loss_per_token"] == pytest.approx((400 + 600 + 100) / 500)
    assert got["rows"] == 18 and got["real_share"] == pytest.approx(1500 / 1800)


def test_the_rows_and_sequences_are_read_from_the_header():
    header = "  packing           1,240 rows whole into 311 sequences of up to 2048 tokens (about 31.9 rows, ..."
    assert bench.rows_and_sequences(header) == (1240, 311)
