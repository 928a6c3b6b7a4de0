"""--global-batch-tokens N: the global batch in tokens, N / --seq-len sequences, exact or refused."""

from __future__ import annotations

import json

import pytest
from helpers import read_metrics, run_cli

from accum_cli.config import batch_tokens
from accum_cli.config.settings import as_recipe, build_config
from accum_cli.errors import UserError


def error_line(result) -> str:
    """The run's one line on stderr (exit 2, no traceback)."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("accum-train: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "text, tokens",
    [("4096", 4096), ("4K", 4000), ("4k", 4000), ("4M", 4_000_000), ("2B", 2_000_000_000), ("1.5M", 1_500_000),
     (" 500K ", 500_000), ("4194304", 2**22), (4096, 4096)],
)  # fmt: skip
def test_suffixes_are_decimal(text, tokens):
    assert batch_tokens.parse_tokens(text) == tokens


@pytest.mark.parametrize(
    "text, message",
    [("4X", "must be a whole number of tokens, optionally with a suffix K, M or B"),
     ("", "must be a whole number of tokens"), ("-1", "must be a whole number of tokens"),
     ("0", "must be at least 1 token, got '0'"), (0, "must be at least 1 token"), (-5, "must be at least 1 token"),
     ("1.5", "1.5 is 1.5 tokens, not a whole number"), ("1e6", "must be a whole number of tokens"),
     ("9" * 40, "must be a whole number of tokens")],
)  # fmt: skip
def test_bad_values_are_refused(text, message):
    with pytest.raises(UserError, match=message):
        batch_tokens.parse_tokens(text)


def test_tokens_become_sequences_where_the_config_is_built():
    cfg = build_config(None, {"global_batch_tokens": "4096", "seq_len": 128})
    assert (cfg.global_batch, cfg.global_batch_tokens) == (32, "4096")
    assert build_config(None, {"global_batch_tokens": "2M", "seq_len": 2000}).global_batch == 1000
    with pytest.raises(UserError, match="--global-batch-tokens needs --seq-len"):
        build_config(None, {"global_batch_tokens": "4K"})
    with pytest.raises(UserError, match="more than 1,099,511,627,776 sequences"):
        build_config(None, {"global_batch_tokens": "99999999999999999999B", "seq_len": 2})


def test_a_count_that_is_not_whole_sequences_names_the_nearest_values():
    line = error_line(run_cli(["--global-batch-tokens", "4M", "--seq-len", "2048", "--plan"]))
    assert line == (
        "accum-train: error: --global-batch-tokens 4M (4,000,000 tokens) is not a whole number of --seq-len 2048 "
        "sequences (1953.125); use --global-batch-tokens 3999744 or 4001792 (--global-batch 1953 or 1954)"
    )
    with pytest.raises(UserError, match=r"use --global-batch-tokens 128 \(--global-batch 1\)$"):
        build_config(None, {"global_batch_tokens": "100", "seq_len": 128})


def test_given_with_global_batch_it_is_refused(tmp_path):
    line = error_line(run_cli(["--global-batch-tokens", "4K", "--global-batch", "32", "--seq-len", "125", "--plan"]))
    assert line == (
        "accum-train: error: --global-batch-tokens and --global-batch both given; pick one (tokens or sequences per step)"
    )
    both = tmp_path / "both.yaml"
    both.write_text("global_batch_tokens: 4K\nglobal_batch: 32\nseq_len: 125\n")
    with pytest.raises(UserError, match="keys global_batch_tokens and global_batch both given; keep one"):
        build_config(str(both), {})


def test_a_recipe_key_and_flags_over_it(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("global_batch_tokens: 4K\nseq_len: 125\n")
    assert build_config(str(recipe), {}).global_batch == 32
    recipe.write_text("global_batch_tokens: 4000\nseq_len: 125\n")  # an integer too (and 4e3: YAML 1.2 numbers)
    assert build_config(str(recipe), {}).global_batch == 32
    recipe.write_text("global_batch_tokens: 4e3\nseq_len: 125\n")
    assert build_config(str(recipe), {}).global_batch == 32
    assert build_config(str(recipe), {"global_batch": 8}).global_batch == 8  # the flag wins over the recipe
    assert build_config(str(recipe), {"global_batch": 8}).global_batch_tokens is None
    sequences = tmp_path / "s.yaml"
    sequences.write_text("global_batch: 8\nseq_len: 125\n")
    assert build_config(str(sequences), {"global_batch_tokens": "2K"}).global_batch == 16


def test_print_config_round_trips(tmp_path):
    cfg = build_config(None, {"global_batch_tokens": "4K", "seq_len": 125})
    printed = tmp_path / "printed.yaml"
    printed.write_text(as_recipe(cfg, "x"))
    assert "\nglobal_batch_tokens: 4K\n" in printed.read_text() and "\nglobal_batch:" not in printed.read_text()
    assert build_config(str(printed), {}) == cfg
    # without tokens the recipe keeps global_batch and a null global_batch_tokens
    plain = build_config(None, {"global_batch": 24})
    printed.write_text(as_recipe(plain, "x"))
    assert build_config(str(printed), {}) == plain


def test_plan_shows_sequences_and_tokens():
    result = run_cli(["--global-batch-tokens", "4096", "--seq-len", "128", "--micro-batch", "8", "--plan"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "global batch      32 sequences per optimizer step" in result.stdout
    assert "tokens per step   4,096 (32 x seq len 128)" in result.stdout


def test_a_run_equals_the_same_run_given_in_sequences(tmp_path):
    common = ["--seq-len", "64", "--micro-batch", "3", "--max-steps", "3", "--lr", "3e-3", "--warmup-steps", "1"]
    runs = {}
    for name, batch in (("tokens", ["--global-batch-tokens", "1024"]), ("sequences", ["--global-batch", "16"])):
        out = tmp_path / name
        result = run_cli([*common, *batch, "--output-dir", str(out)])
        assert result.returncode == 0, result.stdout + result.stderr
        assert "global batch      16 sequences per optimizer step, tokens 1,024 (16 x seq len 64)" in result.stdout
        runs[name] = out

    def trained(m: dict) -> dict:  # all but what is measured (times, memory)
        return {k: v for k, v in m.items() if not k.endswith(("_s", "_gib"))}

    for a, b in zip(read_metrics(runs["tokens"]), read_metrics(runs["sequences"]), strict=True):
        assert {"loss", "grad_norm", "lr", "loss_tokens"} <= set(trained(a)) and trained(a) == trained(b)
        assert a["tokens"] == 1024  # the tokens asked for, every step
    record = {name: json.loads((out / "config.json").read_text()) for name, out in runs.items()}
    assert record["tokens"]["plan"] == record["sequences"]["plan"]
    assert record["tokens"]["config"]["global_batch"] == 16
    assert record["tokens"]["config"]["global_batch_tokens"] == "1024"
    # the run's config.json reruns it: its global_batch was derived, so it is no second batch
    assert build_config(str(runs["tokens"] / "config.json"), {}).global_batch == 16
