"""bench/gpu_check.py where CI runs it, without a GPU: it imports (with bench/gpu_peers.py), parses its
arguments, keeps its five contestants, builds their commands, turns step times into the table's figures,
reports a failing or slow contestant as a row, and without CUDA says so and exits 0 at once."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest
from helpers import REPO

CONTESTANTS = ("accum-train", "raw-fsdp2", "hf-trainer", "accum-train --micro-batch auto", "accum-train --compile")
COLUMNS = ["contestant", "tokens/s", "vs best peer", "MFU", "peak GiB", "estimate GiB", "note"]


def load(name: str):
    """bench/NAME.py by path (bench/ is no package); registered first, as dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gc():
    return load("gpu_check")


@pytest.fixture(scope="module")
def peers():
    return load("gpu_peers")


def contestant(gc, name: str):
    return next(c for c in gc.CONTESTANTS if c.name == name)


def test_gpu_check_imports_and_parses_its_arguments(gc):
    args = gc.parse_args(["--micro-batch", "1", "4", "--sync", "last"])
    assert (args.micro_batch, args.sync, args.seq_len) == ([1, 4], ["last"], 2048)
    default = gc.parse_args([])
    assert (default.seq_len, default.layers, default.global_batch, default.train_micro_batch) == (2048, 16, 16, 4)
    assert (default.steps, default.auto_steps, default.micro_batch) == (8, 3, [4])
    assert default.sync == ["every", "last", "replicated"] and default.memory and default.speed and not default.tiny
    assert default.only == list(CONTESTANTS) and default.json == "gpu_check.json"
    assert default.budget_s + gc.RESERVE_S < 8 * 60  # the whole check within 8 minutes on one GPU
    custom = gc.parse_args(["--only", "raw-fsdp2", "accum-train --compile", "--no-memory", "--steps", "5",
                            "--budget-s", "300", "--json", "out/g.json"])  # fmt: skip
    assert custom.only == ["raw-fsdp2", "accum-train --compile"] and not custom.memory and custom.speed
    assert (custom.steps, custom.budget_s, custom.json) == (5, 300.0, "out/g.json")
    tiny = gc.parse_args(["--tiny"])
    assert (tiny.seq_len, tiny.layers, tiny.micro_batch) == (64, 2, [4])
    with pytest.raises(SystemExit):
        gc.parse_args(["--only", "accelerate"])


def test_the_contestants_are_the_five_side_by_side(gc):
    assert gc.NAMES == CONTESTANTS
    assert gc.PEERS == ("raw-fsdp2", "hf-trainer")
    assert [c.peer for c in gc.CONTESTANTS] == [None, "fsdp2", "trainer", None, None]
    assert contestant(gc, "accum-train").flags == ()  # its defaults: bf16 on CUDA, no compile
    assert contestant(gc, "accum-train --micro-batch auto").auto_steps
    assert contestant(gc, "accum-train --compile").flags == ("--compile",)
    assert {c.peer for c in gc.CONTESTANTS if c.peer} <= set(load("gpu_peers").ROLES)


def test_the_llama_shape_is_llama_3_2_1b(gc):
    shape = gc.llama_config(gc.parse_args([]))
    assert shape == dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                         tie_word_embeddings=True)  # fmt: skip


def test_accum_train_runs_its_cli_and_the_fsdp2_peer_runs_under_torchrun(gc, tmp_path):
    args = gc.parse_args([])
    w = gc.Workload(tmp_path / "model", tmp_path / "tokens.jsonl", tmp_path, {}, {}, True)

    def flag(cmd: list[str], name: str) -> str:
        assert cmd.count(name) == 1, cmd
        return cmd[cmd.index(name) + 1]

    default = gc.accum_train_cmd(contestant(gc, "accum-train"), args, w, tmp_path / "out")
    assert default[:3] == [sys.executable, "-m", "accum_cli"]
    assert "--compile" not in default and "--precision" not in default and "--layout" not in default
    assert (flag(default, "--micro-batch"), flag(default, "--max-steps"), flag(default, "--seq-len")) == (
        "4",
        "8",
        "2048",
    )
    auto = gc.accum_train_cmd(contestant(gc, "accum-train --micro-batch auto"), args, w, tmp_path / "out")
    assert (flag(auto, "--micro-batch"), flag(auto, "--max-steps")) == ("auto", "3")
    assert "--compile" in gc.accum_train_cmd(contestant(gc, "accum-train --compile"), args, w, tmp_path / "out")
    fsdp2 = gc.peer_cmd(contestant(gc, "raw-fsdp2"), args, w)
    assert fsdp2[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone"]
    assert fsdp2[5:7] == [str(REPO / "bench" / "gpu_peers.py"), "fsdp2"]
    trainer = gc.peer_cmd(contestant(gc, "hf-trainer"), args, w)
    assert trainer[1:3] == [str(REPO / "bench" / "gpu_peers.py"), "trainer"]
    assert (flag(trainer, "--global-batch"), flag(trainer, "--micro-batch"), flag(trainer, "--steps")) == (
        "16",
        "4",
        "8",
    )


def test_the_peers_module_parses_its_roles(peers):
    assert peers.ROLES == ("workload", "fsdp2", "trainer")
    args = peers.parse_args(["fsdp2", "--model", "m", "--data", "d.jsonl"])
    assert (args.global_batch, args.micro_batch, args.steps, args.lr, args.grad_clip) == (16, 4, 8, 1e-4, 1.0)
    assert peers.parse_args(["workload", "--model", "m", "--data", "d", "--rows", "9"]).rows == 9
    with pytest.raises(SystemExit):
        peers.parse_args(["accelerate", "--model", "m", "--data", "d"])


def test_step_times_become_the_tables_figures(gc):
    assert gc.median_rate([30.0, 9.0, 1.0, 2.0, 4.0], 100) == 50.0  # the first two steps left out
    assert gc.median_rate([1.0, 2.0], 100) is None
    records = [{"elapsed_s": 3.0}, {"elapsed_s": 4.0}, {"elapsed_s": 4.5}]
    assert gc.step_seconds(records) == [3.0, 1.0, 0.5]
    rows = [
        gc.Row("accum-train", tokens_per_s=120.0, peak_gib=30.0, estimate_gib=31.0, note="replicate"),
        gc.Row("raw-fsdp2", tokens_per_s=100.0),
        gc.Row("hf-trainer", tokens_per_s=80.0),
        gc.Row("accum-train --compile", status="failed", note="out of memory"),
    ]
    gc.finish_rows(rows, flops_per_token=1e9, peak_flops=1e12)
    assert [r.vs_best_peer for r in rows] == [pytest.approx(1.2), 1.0, pytest.approx(0.8), None]
    assert rows[0].mfu == pytest.approx(0.12) and rows[3].mfu is None
    lines = gc.table(rows).splitlines()
    assert [cell.strip() for cell in lines[0].split("|")] == COLUMNS
    assert len(lines) == 5 and [cell.strip() for cell in lines[1].split("|")] == [
        "accum-train", "120", "1.20", "12.0%", "30.00", "31.00", "replicate",
    ]  # fmt: skip
    assert lines[4].split("|")[1].strip() == "-" and lines[4].endswith("out of memory")
    gc.finish_rows(rows[:1], 1e9, None)  # no peer, no known peak: no ratio, no MFU, and no error
    assert rows[0].vs_best_peer is None


def test_a_failure_is_one_short_note(gc):
    assert gc.failure_note("x\ntorch.OutOfMemoryError: CUDA out of memory. Tried", "exited", 1) == "out of memory"
    assert gc.failure_note("loading\nValueError: boom\n\n", "exited", 2) == "exit 2: ValueError: boom"
    assert gc.failure_note("", "timeout", None) == "timed out: no output"


def fake_peer(tmp_path, body: str):
    script = tmp_path / "fake_peer.py"
    script.write_text("import json, sys, time\n" + body + "\n")
    return script


@pytest.mark.parametrize(
    ("body", "status", "note"),
    [
        ('print("RESULT " + json.dumps({"step_s": [9, 9, 2, 4, 2], "peak_gib": 1.5, "accum_steps": 4}))', "ok",
         "Trainer bf16 autocast, adamw_torch, m=4 x 4"),
        ('print("Traceback ...\\nRuntimeError: no kernel image", file=sys.stderr); sys.exit(1)', "failed",
         "exit 1: RuntimeError: no kernel image"),
        ("print('loading', flush=True); time.sleep(60)", "timeout", "timed out: loading"),
    ],
)  # fmt: skip
def test_a_peer_that_fails_or_hangs_is_a_row_not_a_crash(gc, tmp_path, monkeypatch, body, status, note):
    monkeypatch.setattr(gc, "PEERS_SCRIPT", fake_peer(tmp_path, body))
    w = gc.Workload(tmp_path, tmp_path / "tokens.jsonl", tmp_path, {}, {}, True)
    args = gc.parse_args(["--tiny"])
    started = time.monotonic()
    row = gc.run_peer(contestant(gc, "hf-trainer"), args, w, timeout_s=3)
    assert time.monotonic() - started < 30
    assert (row.status, row.note) == (status, note), row.log_tail
    if status == "ok":
        assert row.tokens_per_s == 16 * 64 / 2 and row.peak_gib == 1.5
    else:
        assert row.tokens_per_s is None and row.log_tail


def test_a_package_accum_train_cannot_import_is_named(gc, monkeypatch):
    monkeypatch.setattr(gc, "ACCUM_TRAIN_NEEDS", ("json", "no_such_package_here"))
    assert gc.missing_packages() == ["no_such_package_here"]


def test_a_stopped_process_group_is_gone(gc, tmp_path):
    proc = gc.start([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "log")
    assert gc.wait(proc, 60, done=lambda: True, kill=True) == "stopped"
    assert proc.returncode is not None


def test_the_json_goes_to_the_path_and_under_out(gc, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    paths = gc.write_json({"rows": [{"contestant": "accum-train"}]}, str(tmp_path / "here" / "g.json"))
    assert paths == [tmp_path / "here" / "g.json", tmp_path / "out" / "g.json"]
    assert all(json.loads(p.read_text())["rows"][0]["contestant"] == "accum-train" for p in paths)


def test_without_cuda_it_says_so_and_exits_0(gc, monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert gc.main([]) == 0
    assert capsys.readouterr().out.strip() == gc.NO_CUDA
    assert not (tmp_path / "gpu_check.json").exists()


def test_the_script_itself_exits_0_here(tmp_path):
    """As `make gpu-check` runs it, from the checkout; CI's machine has no CUDA."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU here: the script would measure for minutes")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu_check: no CUDA device here; nothing to measure"
