"""The command line: help, --plan, and bad input (one line, exit 2, no traceback, nothing written)."""

from __future__ import annotations

import subprocess
import sys

from helpers import BIN, env, save_tiny_model
from typer.testing import CliRunner

from accum_cli.cli.main import app

runner = CliRunner()


def invoke(args: list[str]):
    return runner.invoke(app, args, catch_exceptions=False)


def test_help_lists_the_fixed_interface():
    result = invoke(["--help"])
    assert result.exit_code == 0, result.output
    for flag in ("--model", "--dataset", "--text-column", "--seq-len", "--global-batch", "--micro-batch",
                 "--max-steps", "--lr", "--warmup-steps", "--lr-schedule", "--weight-decay", "--grad-clip",
                 "--seed", "--sync", "--output-dir", "--recipe", "--plan", "--world-size", "--strict-batch",
                 "--trust-remote-code"):  # fmt: skip
        assert flag in result.output, flag


def test_plan_for_a_cluster_from_a_laptop():
    result = invoke(["--plan", "--global-batch", "2048", "--micro-batch", "4", "--world-size", "8"])
    assert result.exit_code == 0, result.output
    assert "accumulation      64 microbatches per rank per step" in result.output
    assert "tokens per step   262,144" in result.output
    assert "per rank          256 sequences per step" in result.output
    assert "estimated at      micro batch 4, seq len 128, bf16" in result.output
    # this machine's RAM holds the whole bf16 training state: replicated, one all-reduce per step
    assert "layout: replicate — estimated peak " in result.output and "chosen: last — replicated" in result.output


def test_plan_explains_a_non_divisible_batch_and_the_policy_numbers():
    result = invoke(["--plan", "--global-batch", "1000", "--micro-batch", "4", "--world-size", "64",
                     "--device-memory-gib", "80"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "ranks 0-39 take 16, ranks 40-63 take 15" in result.output
    assert "nearest divisible global batches: 768, 1024" in result.output
    for policy in ("every", "last", "last-keep-params"):
        assert f"  {policy} " in result.output


def test_plan_with_a_model_folder(tmp_path):
    model = save_tiny_model(tmp_path / "m")
    result = invoke(["--plan", "--model", str(model), "--dataset", "x.jsonl", "--global-batch", "32",
                     "--micro-batch", "4", "--world-size", "2"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "tokens per step   8,192 (32 x seq len 256)" in result.output


def test_installed_script_and_module_are_the_same_program():
    script = BIN / "accum-train"  # installed by `pip install` into the environment running the tests
    assert script.is_file(), f"{script} is missing: the package's console script is not installed"
    for cmd in ([str(script)], [sys.executable, "-m", "accum_cli"]):
        result = subprocess.run([*cmd, "--plan", "--global-batch", "2048", "--micro-batch", "4", "--world-size", "8"],
                                capture_output=True, text=True, env=env(), timeout=120)  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "64 microbatches" in result.stdout
        bad = subprocess.run([*cmd, "--global-batch", "0"], capture_output=True, text=True, env=env(), timeout=120)
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr


def test_a_micro_batch_above_a_ranks_share_is_planned_and_estimated_as_that_share():
    """G=8 on 2 ranks: no microbatch holds more than 4 sequences, whatever --micro-batch says;
    the plan and the memory estimate (which decides the layout) are those of 4, not 1,000."""
    common = ["--plan", "--global-batch", "8", "--world-size", "2", "--device-memory-gib", "16"]
    big, share = invoke([*common, "--micro-batch", "1000"]), invoke([*common, "--micro-batch", "4"])
    assert big.exit_code == share.exit_code == 0, big.output
    assert "micro batch       4 sequences per forward/backward" in big.output

    def without_timing(output: str) -> list[str]:  # "(in 1.2 s)" or "(in 0.0 s, from the cache)"
        return [line.split(" (in ")[0] for line in output.splitlines()]

    capped = "  micro batch       4 (--micro-batch 1000 capped at a rank's share of the step, ceil(G/W) = 4)"
    assert without_timing(big.output) == [
        capped if line == "  micro batch       4 (as requested)" else line for line in without_timing(share.output)
    ]
