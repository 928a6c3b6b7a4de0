"""bench/verify_sweep.py (issue 39's architecture sweep): one real run through the real command, how the
table shows a FAIL and a refusal (verify's answers faked), and its arguments. The sweep itself is
`make verify-sweep`, by hand."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_verify_sweep", Path(__file__).resolve().parents[1] / "bench" / "verify_sweep.py"
)
sweep = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = sweep  # its dataclass looks its module up there
SPEC.loader.exec_module(sweep)


def test_one_architecture_passes_through_the_real_command(tmp_path, capsys):
    first = next(iter(sweep.ARCHITECTURES))
    out = tmp_path / "sweep.json"
    code = sweep.main(["--only", first, "--worlds", "1", "--layouts", "replicate", "--json-out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    (row,) = [line for line in stdout.splitlines() if line.startswith(first + " ")]
    assert row.split()[1:4] == ["1", "replicate", "one-process"] and row.endswith("PASS"), stdout
    assert "1 runs: 1 PASS, 0 FAIL, 0 refused, 0 errors" in stdout
    (saved,) = json.loads(out.read_text())["rows"]
    assert saved["outcome"] == "pass" and saved["loss"] < 1e-5 and saved["grad_norm"] < 1e-5


def fake_verify(monkeypatch, answers: dict[str, tuple[int, str, str]]) -> list[list[str]]:
    """verify's answer per architecture (exit code, stdout, stderr) instead of a run; the commands it was given."""
    commands = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        model = Path(cmd[cmd.index("--model") + 1]).name
        return subprocess.CompletedProcess(cmd, *answers[model])

    monkeypatch.setattr(sweep.subprocess, "run", run)
    monkeypatch.setattr(sweep, "save_model", lambda path, name: path)
    return commands


def report(verdict: str, first: dict | None, loss: float, grad_norm: float) -> str:
    step = {"step": 1, "loss": {"relative": loss}, "grad_norm": {"relative": grad_norm},
            "parameters": {"relative": 2e-6, "parameter": "model.norm.weight"}}  # fmt: skip
    return json.dumps({"verdict": verdict, "exit_code": int(verdict == "fail"), "first_difference": first,
                       "reference_kind": "same-ranks", "steps": [step]})  # fmt: skip


def test_a_fail_fails_the_sweep_and_a_refusal_is_listed_without_failing_it(monkeypatch, capsys):
    commands = fake_verify(monkeypatch, {
        "llama": (1, "note\n" + report("fail", {"step": 1, "quantity": "grad_norm", "parameter": None}, 1e-7, 0.8), ""),
        "qwen2": (2, "", "accum-train: error: this model cannot be trained here\n"),
    })  # fmt: skip
    code = sweep.main(["--only", "llama,qwen2", "--worlds", "2", "--layouts", "shard"])
    stdout = capsys.readouterr().out
    assert code == 1, stdout
    assert "FAIL (grad_norm, step 1)" in stdout and "8.0e-01" in stdout
    assert "refused: this model cannot be trained here" in stdout
    assert "2 runs: 0 PASS, 1 FAIL, 1 refused, 0 errors" in stdout
    assert all(cmd[3:8] == ["verify", "--nproc", "2", "--master-port", cmd[7]] for cmd in commands)
    assert all(cmd[cmd.index("--layout") + 1] == "shard" and "--json" in cmd for cmd in commands)

    fake_verify(monkeypatch, {"qwen2": (2, "", "accum-train: error: this model cannot be trained here\n")})
    assert sweep.main(["--only", "qwen2", "--worlds", "1", "--layouts", "replicate"]) == 0


def test_a_crash_is_an_error_that_fails_the_sweep(monkeypatch, capsys):
    fake_verify(monkeypatch, {"llama": (-9, "", "Killed\n")})
    assert sweep.main(["--only", "llama", "--worlds", "1", "--layouts", "shard"]) == 1
    assert "ERROR: exit -9: Killed" in capsys.readouterr().out


def test_defaults_sweep_everything():
    args = sweep.parse_args([])
    assert args.only == list(sweep.ARCHITECTURES) and args.worlds == [1, 2]
    assert args.layouts == ["shard", "replicate"] and args.json_out is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "llama,nope"], "unknown architecture(s) nope"),
        (["--only", ""], "unknown architecture(s)"),
        (["--worlds", "0"], "world sizes are positive integers"),
        (["--worlds", "one"], "world sizes are positive integers"),
        (["--layouts", "shard,fsdp"], "layouts are shard and/or replicate"),
        (["--timeout", "0"], "--timeout must be positive"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
