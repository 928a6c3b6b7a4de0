"""Trust: other people's files are sacred, nothing runs from a checkpoint, damaged state never
loads, one run per folder, workers never outlive their launcher, a full disk costs nothing.

Every test attempts the attack or the accident for real: files planted by hand, payloads
written through pickle and DCP themselves, bytes flipped in real shards, real processes
killed, a real (tmpfs) disk filled.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    BIN,
    REPO,
    Payload,
    env,
    free_port,
    python,
    read_metrics,
    run_cli,
    save_tiny_model,
    tree_digest,
    wait_for_steps,
    worker_pids,
    write_ragged_tokens,
)
from typer.testing import CliRunner

from accum_cli.cli.main import app
from accum_cli.rundir import checkpoint_meta
from accum_cli.rundir import export as exporting

SENTINEL_NAME = "payload-ran"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trust")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "data.jsonl", n_rows=40)
    return root


def args(root: Path, out: Path, steps: int = 2, *extra: str) -> list[str]:
    return ["--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--global-batch", "8",
            "--micro-batch", "4", "--max-steps", str(steps), "--output-dir", str(out), *extra]  # fmt: skip


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def one_error_line(text: str, prog: str = "accum-train") -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), text
    assert "Traceback" not in text
    return lines[0]


def invoke(argv: list[str]):
    return CliRunner().invoke(app, argv)


@pytest.fixture(scope="module")
def trained(root, tmp_path_factory) -> Path:
    """A real 2-step run with a checkpoint after each step (both kept)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    ok(run_cli(args(root, out, 2, "--checkpoint-every", "1", "--keep-checkpoints", "5")))
    return out


def copy_checkpoint(trained: Path, tmp_path: Path, step: int = 2) -> Path:
    target = tmp_path / f"ckpt-{step}"
    shutil.copytree(trained / "checkpoints" / f"step-{step:06d}", target)
    return target


def rewrite_record(ckpt: Path, *names: str) -> None:
    """What an attacker with write access does: make meta.json agree with the altered files."""
    meta = json.loads((ckpt / "meta.json").read_text())
    for name in names:
        data = (ckpt / name).read_bytes()
        meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "meta.json").write_text(json.dumps(meta))


# --- other people's files ---------------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "--overwrite"])
def test_a_folder_of_someone_elses_files_is_refused_and_left_alone(root, tmp_path, overwrite):
    victim = tmp_path / "v"
    (victim / "final").mkdir(parents=True)
    (victim / "checkpoints").mkdir()
    (victim / "final" / "precious.bin").write_bytes(b"weights of a week of training")
    (victim / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    before = tree_digest(victim)
    result = invoke([*args(root, victim, 1), *(["--overwrite"] if overwrite else [])])
    assert result.exit_code == 2
    line = one_error_line(result.output)
    assert "holds files accum-train did not write" in line and "pass an empty or new folder" in line
    assert tree_digest(victim) == before
    assert sorted(p.name for p in victim.iterdir()) == ["checkpoints", "final", "metrics.jsonl"], "no lock left"


def test_overwrite_removes_only_accum_trains_own_files(root, tmp_path):
    out = tmp_path / "run"
    ok(run_cli(args(root, out, 1)))
    (out / "notes.txt").write_text("mine")
    (out / "checkpoints" / "my-backup").mkdir()
    (out / "checkpoints" / "my-backup" / "w.bin").write_bytes(b"mine too")
    old_final = (out / "final" / "model.safetensors").stat().st_mtime_ns
    ok(run_cli([*args(root, out, 1), "--overwrite"]))
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "checkpoints" / "my-backup" / "w.bin").read_bytes() == b"mine too"
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns != old_final
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["my-backup", "step-000001"]


@pytest.mark.parametrize("name", [".accum-train.lock", "metrics.jsonl", "final", "checkpoints/step-000002"])
@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
def test_a_run_folder_with_a_link_among_our_names_is_refused_and_the_target_left_alone(
    root, trained, tmp_path, name, flag
):
    """A run folder handed over with one of accum-train's own names linked elsewhere: writing the
    lock's holder, appending metrics or removing final/ through the link would reach the user's
    file or folder. Refused before any work, the link and its target untouched."""
    out = tmp_path / "run"
    shutil.copytree(trained, out, symlinks=True)
    victim = tmp_path / "victim"
    if name in ("final", "checkpoints/step-000002"):
        shutil.copytree(out / name, victim)  # looks like ours: marked, complete
        (victim / "notes.txt").write_text("mine")
    else:
        victim.write_text("mine")
    link = out / name
    if link.is_dir():
        shutil.rmtree(link)
    link.unlink(missing_ok=True)
    link.symlink_to(victim)
    before, links_before = tree_digest(victim) if victim.is_dir() else victim.read_bytes(), tree_digest(out)
    result = invoke([*args(root, out, 3, "--checkpoint-every", "1"), flag])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert f"{name} is a symbolic link" in line and "remove the link or pick another --output-dir" in line
    assert (tree_digest(victim) if victim.is_dir() else victim.read_bytes()) == before
    assert link.is_symlink() and tree_digest(out) == links_before


def test_a_checkpoint_save_never_deletes_a_folder_of_the_users_where_it_stages(root, trained, tmp_path):
    """A save writes into checkpoints/.tmp-step-N, then renames it: a folder of that name that
    accum-train did not make is the user's. The save fails with one line, the folder is left alone."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    staging = out / "checkpoints" / ".tmp-step-000003"
    staging.mkdir()
    (staging / "notes.txt").write_text("mine")
    result = run_cli(args(root, out, 3, "--checkpoint-every", "1", "--resume"))
    assert result.returncode != 0
    assert (staging / "notes.txt").read_text() == "mine"
    assert ".tmp-step-000003 exists and is not accum-train's; move it away" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_lock_is_never_opened_through_a_link(tmp_path):
    """Should a link appear after the run's checks: the holder's record is never written into its target."""
    from accum_cli.errors import UserError
    from accum_cli.rundir import outdir

    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (out / ".accum-train.lock").symlink_to(victim)
    with pytest.raises(UserError, match=r"cannot open .*\.accum-train\.lock .*remove it if it is a link"):
        outdir.RunLock(out).acquire()
    assert victim.read_text() == "mine"


def test_a_torn_metrics_line_does_not_stop_a_resume(root, trained, tmp_path):
    """A full disk (or a kill) mid-append leaves metrics.jsonl ending in half a record: the resume
    drops it with the records it redoes, and goes on."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 5.1, "grad_n')
    ok(run_cli(args(root, out, 3, "--resume", str(out / "checkpoints" / "step-000002"))))
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]


def test_resume_auto_on_a_finished_run_without_checkpoints_keeps_it(root, trained, tmp_path):
    """A finished run whose checkpoints the user deleted to free space, requeued with --resume
    auto: nothing to continue from, and starting fresh would discard its final/ and metrics."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    shutil.rmtree(out / "checkpoints")
    before = tree_digest(out)
    result = invoke([*args(root, out, 2), "--resume", "auto"])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert "holds a finished run (final/) but no checkpoint to continue from" in line
    assert tree_digest(out) == before


def test_overwrite_refuses_a_final_folder_of_someone_elses(root, tmp_path):
    """A run of ours whose final/ the user replaced with their own: refused at the start, not
    after the whole training when final/ cannot be replaced."""
    out = tmp_path / "run"
    ok(run_cli(args(root, out, 1)))
    shutil.rmtree(out / "final")
    (out / "final").mkdir()
    (out / "final" / "precious.bin").write_bytes(b"mine")
    before = tree_digest(out)
    result = invoke([*args(root, out, 1), "--overwrite"])
    assert result.exit_code == 2, result.output
    assert "its final/ holds files accum-train did not write" in one_error_line(result.output)
    assert tree_digest(out) == before


def test_a_resumed_run_never_replaces_a_final_folder_of_someone_elses(root, tmp_path):
    """--resume that would train on, with final/ holding the user's files (or an accum-export): refused
    before the first step, in one line naming the move; the files kept. The final write itself
    refuses them too (one appearing during the run): kept, the error says so."""
    out = tmp_path / "run"
    ok(run_cli(args(root, out, 1)))
    shutil.rmtree(out / "final")
    (out / "final").mkdir()
    (out / "final" / "precious.bin").write_bytes(b"mine")
    result = run_cli(args(root, out, 2, "--resume"))
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_error_line(result.stderr)
    assert "its final/ holds a model accum-train did not write" in line and f"mv {out / 'final'} " in line
    assert [m["step"] for m in read_metrics(out)] == [1], "refused before any step"
    assert [p.name for p in (out / "final").iterdir()] == ["precious.bin"]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "model")
    with pytest.raises(FileExistsError, match="it holds files accum-train did not write"):
        exporting.save_final(model, None, out / "final", True, torch.float32)
    assert [p.name for p in (out / "final").iterdir()] == ["precious.bin"]
    assert (out / "final" / "precious.bin").read_bytes() == b"mine"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".final")) == [], "no staging folder left"


def test_files_follow_the_umask(trained):
    """safetensors writes 0600; a colleague on a shared filesystem must be able to read them."""
    umask = os.umask(0)
    os.umask(umask)
    rng = trained / "checkpoints" / "step-000002" / "rng-rank0.safetensors"
    assert rng.stat().st_mode & 0o777 == 0o666 & ~umask


# --- nothing runs from a checkpoint ------------------------------------------------------------


def test_a_payload_in_dcp_metadata_never_runs_on_export(trained, tmp_path):
    ckpt = copy_checkpoint(trained, tmp_path)
    sentinel = tmp_path / SENTINEL_NAME
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(sentinel)))
    rewrite_record(ckpt, ".metadata")
    result = python(
        ["-c", "from accum_cli.cli.main import export_entry; export_entry()", str(ckpt),
         str(tmp_path / "hf")], cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_error_line(result.stderr, "accum-export")
    assert "is refused: its .metadata asks to load posix.system, which DCP never writes" in line
    assert not sentinel.exists(), "the payload ran"
    assert not (tmp_path / "hf").exists()


def export(ckpt: Path, target: Path):
    from accum_cli.cli.main import export_app

    return CliRunner().invoke(export_app, [str(ckpt), str(target)])


def test_export_never_deletes_a_folder_of_the_users_where_it_stages(trained, tmp_path):
    """An export writes into `.tmp-<target>` beside the target, then renames it: a folder of that
    name that accum-train did not make is the user's, refused and left alone."""
    staging = tmp_path / ".tmp-hf"
    staging.mkdir()
    (staging / "notes.txt").write_text("mine")
    result = export(trained / "checkpoints" / "step-000002", tmp_path / "hf")
    assert result.exit_code == 2, result.output
    assert "exists and is not accum-train's; move it away or pick another target" in one_error_line(
        result.output, "accum-export"
    )
    assert (staging / "notes.txt").read_text() == "mine" and not (tmp_path / "hf").exists()


def test_a_sigterm_during_an_export_leaves_nothing_half_written(trained, tmp_path):
    """The SIGTERM arrives while the weights are being written (a job's time limit): the folder
    being written goes, one line says so, and the exit code is the signal's."""
    code = (
        "import os, signal; from accum_cli.rundir import export; written = export.stamp_dtype\n"
        "def stopped(*a):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return written(*a)\n"
        "export.stamp_dtype = stopped\nfrom accum_cli.cli.main import export_entry; export_entry()"
    )
    ckpt = trained / "checkpoints" / "step-000002"
    result = python(["-c", code, str(ckpt), str(tmp_path / "hf")], cwd=REPO, env=env(),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 128 + signal.SIGTERM, result.stdout + result.stderr
    assert "stopped by SIGTERM; nothing was written to" in one_error_line(result.stderr, "accum-export")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_reads_only_the_files_the_checkpoint_lists(trained, tmp_path):
    """transformers reads a folder's tokenizer files by name, listed or not: a chat template
    planted beside a checkpoint's verified files was exported as the model's. Export reads a
    copy of the listed files alone."""
    ckpt = copy_checkpoint(trained, tmp_path)
    (ckpt / "chat_template.jinja").write_text("{{ 'PLANTED' }}")
    result = export(ckpt, tmp_path / "hf")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file(), "the listed tokenizer is exported"
    exported = [f for f in (tmp_path / "hf").iterdir() if f.is_file()]
    assert not any(b"PLANTED" in f.read_bytes() for f in exported), [f.name for f in exported]


def test_export_of_a_checkpoint_whose_model_cannot_be_built_is_one_line(trained, tmp_path):
    ckpt = copy_checkpoint(trained, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"model_type": "no-such-model"}))
    rewrite_record(ckpt, "config.json")
    result = export(ckpt, tmp_path / "hf")
    assert result.exit_code == 2, result.output
    assert f"checkpoint {ckpt}: its model cannot be built (" in one_error_line(result.output, "accum-export")
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".tmp-hf").exists()


def test_a_payload_in_resume_metadata_never_runs(root, trained, tmp_path):
    ckpt = copy_checkpoint(trained, tmp_path)
    sentinel = tmp_path / SENTINEL_NAME
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(sentinel)))
    rewrite_record(ckpt, ".metadata")
    result = run_cli(args(root, tmp_path / "out", 4, "--resume", str(ckpt)))
    assert result.returncode == 2
    assert "its .metadata asks to load posix.system" in one_error_line(result.stderr)
    assert not sentinel.exists(), "the payload ran"


def test_dcp_metadata_cannot_patch_a_class_it_is_allowed_to_name(root, trained, tmp_path):
    """The unpickler admits pathlib's classes (DCP pickles paths), and pickle's BUILD sets
    attributes on whatever it is given, a class too: `PosixPath.is_file = PosixPath` (always
    true) would make every folder look like one of accum-train's own, and a resume then replaced
    the user's unmarked final/. Refused before anything is set."""
    ckpt = copy_checkpoint(trained, tmp_path)
    path_class = b"cpathlib\nPosixPath\n"
    patch = path_class + b"N}X" + (7).to_bytes(4, "little") + b"is_file" + path_class + b"s\x86b0"
    original = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(original[:2] + patch + original[2:])  # after PROTO: the rest is DCP's own
    rewrite_record(ckpt, ".metadata")
    result = run_cli(args(root, tmp_path / "out", 4, "--resume", str(ckpt)))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "its .metadata sets attributes of the class PosixPath, which DCP never does" in one_error_line(result.stderr)
    from accum_cli.rundir import safe_dcp

    with pytest.raises(safe_dcp.UnsafeCheckpoint, match="sets attributes of the class PosixPath"):
        safe_dcp.read_metadata(ckpt, json.loads((ckpt / "meta.json").read_text())["files"])
    assert not Path(tmp_path / "nothing-here").is_file()


def test_a_payload_in_a_shard_item_never_runs(root, trained, tmp_path):
    """Non-tensor items (the optimizer's hyper-parameters) are pickled by DCP itself: plant one
    through DCP's own writer, as an attacker would, and resume from it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = copy_checkpoint(trained, tmp_path)
    dcp_to_torch_save(ckpt, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    sentinel = tmp_path / SENTINEL_NAME
    state["optim"]["param_groups"][0]["lr"] = Payload(sentinel)
    for stale in [*ckpt.glob("*.distcp"), ckpt / ".metadata"]:
        stale.unlink()
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    assert not sentinel.exists()
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"] = {k: v for k, v in meta["files"].items() if not k.endswith(".distcp")}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    rewrite_record(ckpt, ".metadata", *(p.name for p in ckpt.glob("*.distcp")))

    result = run_cli(args(root, tmp_path / "out", 4, "--resume", str(ckpt)))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is refused: an item holds objects that would run code when unpickled" in result.stderr
    assert "Traceback" not in result.stderr
    assert not sentinel.exists(), "the payload ran"
    assert not (tmp_path / "out").exists(), "nothing is written"


# --- damaged state never loads -----------------------------------------------------------------


def shard_offsets(ckpt: Path) -> dict[str, tuple[str, int, int]]:
    """fqn -> (file, offset, length) of each tensor in the checkpoint, from its verified metadata."""
    from accum_cli.rundir import safe_dcp

    meta = json.loads((ckpt / "meta.json").read_text())
    metadata = safe_dcp.read_metadata(ckpt, meta["files"])
    return {
        index.fqn: (info.relative_path, info.offset, info.length)
        for index, info in metadata.storage_data.items()
        if info.length > 256
    }


def flip(path: Path, at: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, at + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["model", "optim", "last-bytes", ".metadata"])
def test_flipped_bytes_in_a_shard_are_refused(root, trained, tmp_path, where):
    ckpt = copy_checkpoint(trained, tmp_path)
    offsets = shard_offsets(ckpt)
    if where == "last-bytes":
        shard = next(ckpt.glob("*.distcp"))
        flip(shard, shard.stat().st_size - 16)
    elif where == ".metadata":  # same size, so only its checksum can tell
        flip(ckpt / ".metadata", (ckpt / ".metadata").stat().st_size // 2, n=4)
    else:
        fqn = next(name for name in offsets if name.startswith(where) and "layers.1" in name)
        file, offset, length = offsets[fqn]
        flip(ckpt / file, offset + length // 2)
    result = run_cli(args(root, tmp_path / "out", 4, "--resume", str(ckpt)))
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_error_line(result.stderr)
    assert "does not match the checksum written with it" in line
    assert not (tmp_path / "out").exists()


def test_a_same_size_shard_from_another_step_is_refused(root, trained, tmp_path):
    ckpt = copy_checkpoint(trained, tmp_path, step=2)
    older = trained / "checkpoints" / "step-000001"
    for shard in older.glob("*.distcp"):
        assert shard.stat().st_size == (ckpt / shard.name).stat().st_size
        shutil.copy(shard, ckpt / shard.name)
    result = run_cli(args(root, tmp_path / "out", 4, "--resume", str(ckpt)))
    assert result.returncode == 2
    assert "does not match the checksum written with it" in one_error_line(result.stderr)


META_EDITS = [
    ({"step": -1}, "step must be an integer >= 1"),
    ({"step": 0}, "step must be an integer >= 1"),
    ({"step": True}, "step must be an integer >= 1"),
    ({"samples": "x"}, "samples must be an integer >= 1"),
    ({"samples": 17}, "samples 17 is not what the steps imply (16)"),
    ({"origin_step": 2}, "origin_step 2 is not before step 2"),
    ({"global_batch": 0}, "global_batch must be an integer >= 1"),
    ({"seed": 2**70}, "seed must be an integer >= 0"),
    ({"fingerprint": "../../x"}, "fingerprint is malformed"),
    ({"format": 1}, "format 1, this accum-train reads format 2"),
    ({"files": {"../../etc/passwd": {"bytes": 1, "sha256": "0" * 64}}}, "files must list every file"),
    ({"files": {".metadata": {"bytes": -1, "sha256": "0" * 64}}}, "files entry '.metadata' is malformed"),
]


@pytest.mark.parametrize("edit, message", META_EDITS, ids=[json.dumps(e[0])[:40] for e in META_EDITS])
def test_an_edited_meta_json_is_refused_in_one_line(root, trained, tmp_path, edit, message):
    ckpt = copy_checkpoint(trained, tmp_path)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta.update(edit)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    out = tmp_path / "out"
    result = invoke([*args(root, out, 4), "--resume", str(ckpt)])
    assert result.exit_code == 2
    line = one_error_line(result.output)
    assert "meta.json is corrupt" in line and message in line, line
    assert not out.exists()


def test_a_file_the_record_does_not_list_is_refused(root, trained, tmp_path):
    """A .metadata that points a tensor at a file outside the record (say ../../elsewhere)."""
    ckpt = copy_checkpoint(trained, tmp_path)
    meta = json.loads((ckpt / "meta.json").read_text())
    shard = next(name for name in meta["files"] if name.endswith(".distcp"))
    (ckpt / shard).rename(ckpt / "renamed.distcp")
    del meta["files"][shard]
    meta["files"]["renamed.distcp"] = {"bytes": (ckpt / "renamed.distcp").stat().st_size, "sha256": "0" * 64}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    result = invoke([*args(root, tmp_path / "out", 4), "--resume", str(ckpt)])
    assert result.exit_code == 2
    assert "its .metadata points to a file that its meta.json does not list" in one_error_line(result.output)


def test_resume_on_changed_data_is_refused_unless_allowed(root, trained, tmp_path):
    changed = tmp_path / "changed.jsonl"
    rows = (root / "data.jsonl").read_text().splitlines()
    changed.write_text("\n".join(rows[:-1]) + "\n")  # one row fewer: another data order
    ckpt = trained / "checkpoints" / "step-000001"
    flags = ["--model", str(root / "model"), "--dataset", str(changed), "--global-batch", "8", "--micro-batch", "4",
             "--max-steps", "3", "--resume", str(ckpt)]  # fmt: skip
    refused = run_cli([*flags, "--output-dir", str(tmp_path / "a")])
    assert refused.returncode == 2
    assert "was trained on other data" in one_error_line(refused.stderr)
    assert not (tmp_path / "a").exists()
    allowed = ok(run_cli([*flags, "--output-dir", str(tmp_path / "b"), "--allow-data-change"]))
    assert "data changed     --allow-data-change" in allowed.stdout
    assert "the same training as an uninterrupted run" not in allowed.stdout


# --- one run per folder ------------------------------------------------------------------------


def test_a_second_run_is_refused_and_a_stale_lock_is_taken_over(root, tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "accum_cli", *args(root, out, 400, "--checkpoint-every", "1")],
        cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_steps(out, 2, first)
        second = run_cli(args(root, out, 400, "--resume"))
        assert second.returncode == 2
        line = one_error_line(second.stderr)
        assert f"is in use by another accum-train run (pid {first.pid} on " in line
        assert first.poll() is None, "the first run goes on"
    finally:
        first.kill()  # SIGKILL: no chance to release the lock
        first.communicate()
    assert (out / ".accum-train.lock").exists()
    third = ok(run_cli(args(root, out, len(read_metrics(out)) + 2, "--resume")))
    assert f"took over the stale lock of a run that is gone (pid {first.pid} on" in third.stdout
    assert not (out / ".accum-train.lock").exists(), "released at the end"


# --- launchers ---------------------------------------------------------------------------------


def start_wrapper(root: Path, out: Path, launcher: str = "wrapper") -> subprocess.Popen:
    """A 2-rank run under the --nproc wrapper or torchrun, in a session of its own."""
    flags = args(root, out, 400, "--micro-batch", "2", "--checkpoint-every", "3")
    if launcher == "wrapper":
        cmd = [sys.executable, "-m", "accum_cli", "--nproc", "2", "--master-port", str(free_port()), *flags]
    else:
        cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "accum_cli", *flags]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["wrapper", "torchrun"])
def test_workers_stop_when_their_launcher_is_killed(root, tmp_path, launcher):
    out = tmp_path / "run"
    wrapper = start_wrapper(root, out, launcher)
    wait_for_steps(out, 2, wrapper)
    workers = worker_pids(str(out))
    assert sorted(workers) == [0, 1]
    os.killpg(wrapper.pid, signal.SIGKILL)  # kill -9 of the launcher's process group: nobody can stop them
    wrapper.wait()  # not communicate(): the workers hold the same pipes, so reading them waits for the workers
    killed = time.monotonic()
    while worker_pids(str(out)) and time.monotonic() - killed < 30:
        time.sleep(0.2)
    gone_after = time.monotonic() - killed
    wrapper.stdout.close()
    wrapper.stderr.close()
    left = worker_pids(str(out))
    for pid in left.values():  # a failed test leaves no orphans behind
        os.kill(pid, signal.SIGKILL)
    assert not left, "workers outlived their launcher"
    print(f"workers gone {gone_after:.1f} s after kill -9 of the launcher")
    steps = len(read_metrics(out))
    assert (out / "checkpoints" / f"step-{steps:06d}" / "meta.json").is_file(), "they saved before leaving"


@pytest.mark.distributed
def test_a_lost_rank_is_one_line_naming_it(root, tmp_path):
    out = tmp_path / "run"
    wrapper = start_wrapper(root, out)
    wait_for_steps(out, 4, wrapper)
    os.kill(worker_pids(str(out))[1], signal.SIGKILL)
    _, stderr = wrapper.communicate(timeout=120)
    assert wrapper.returncode == 128 + signal.SIGKILL, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("accum-train: error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert "worker rank 1 was killed by SIGKILL" in errors[0]
    from accum_cli.rundir.checkpoint_meta import latest

    assert f"the last checkpoint {latest(out)} is intact: rerun with --resume" in errors[0]


# --- a full disk -------------------------------------------------------------------------------


def mount_tmpfs(mount: Path, size: str) -> Path:
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.decode().strip()}); needs root")
    return mount


@pytest.fixture
def small_disk(tmp_path):
    """A real 2.5 MB filesystem: room for one checkpoint of the tiny model, not two."""
    yield mount_tmpfs(tmp_path / "disk", "2600k")
    subprocess.run(["umount", "-l", str(tmp_path / "disk")], check=False)


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 2 MB filesystem: room for one checkpoint of the tiny model (1.7 MB), not for the
    final model (0.5 MB) beside it."""
    yield mount_tmpfs(tmp_path / "disk", "2000k")
    subprocess.run(["umount", "-l", str(tmp_path / "disk")], check=False)


def test_a_full_disk_costs_nothing_saved(root, small_disk):
    out = small_disk / "run"
    result = run_cli(args(root, out, 4, "--checkpoint-every", "1", "--keep-checkpoints", "1"))
    assert result.returncode == 74, result.stdout + result.stderr
    line = one_error_line(result.stderr)
    assert "step-000002 could not be written: the disk is full (about" in line
    assert "MB needed" in line and "the previous checkpoint step-000001 is intact" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"], "no temporary folder left"
    from accum_cli.rundir.checkpoint_meta import read_meta

    read_meta(out / "checkpoints" / "step-000001")  # complete and verified


def test_a_write_failure_without_an_errno_is_a_full_disk_only_when_the_room_is_short(tmp_path):
    """DCP sometimes reports a full disk as torch.save's RuntimeError("unexpected pos"), no errno."""
    from accum_cli.rundir.checkpoint import full_disk

    room = shutil.disk_usage(tmp_path).free
    assert full_disk(None, room * 2, tmp_path).startswith("the disk is full (about")
    assert full_disk(None, 1000, tmp_path) is None, "room enough: another failure"
    assert full_disk(errno.EACCES, room * 2, tmp_path) is None, "a failure with another errno is that failure"
    assert full_disk(errno.ENOSPC, 1000, tmp_path) is not None


def test_a_full_disk_at_the_final_save_is_one_line_whose_advice_works(root, tiny_disk, tmp_path):
    """safetensors reports ENOSPC as its own error type, not OSError: it must still be one line."""
    out = tiny_disk / "run"
    result = run_cli(args(root, out, 1))
    assert result.returncode == 74, result.stdout + result.stderr
    line = one_error_line(result.stderr)
    assert f"the final model could not be written to {out / 'final'}: the disk is full (about" in line
    assert "MB needed" in line and "step-000001 holds the trained state" in line
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".accum-train"], "no temporary folder"
    from accum_cli.rundir.checkpoint_meta import read_meta

    ckpt = read_meta(out / "checkpoints" / "step-000001").path
    export = ["-c", "from accum_cli.cli.main import export_entry; export_entry()", str(ckpt)]
    full = python([*export, str(tiny_disk / "hf")])
    assert full.returncode == 2, full.stdout + full.stderr
    assert "export to" in one_error_line(full.stderr, "accum-export") and "No space left on device" in full.stderr
    assert not (tiny_disk / "hf").exists() and not (tiny_disk / ".tmp-hf").exists()
    ok(python([*export, str(tmp_path / "hf")]))
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_resave_of_a_step_never_leaves_it_missing(trained, tmp_path):
    """A re-save of a step (a resumed run) sets the old checkpoint aside by a rename and removes
    it only once the new one has its name: killed between the two renames, the next start puts
    the old one back; killed after them, it removes what was set aside."""
    from accum_cli.rundir import checkpoint

    folder = tmp_path / "run" / "checkpoints"
    shutil.copytree(trained / "checkpoints", folder)
    old = tree_digest(folder / "step-000002")
    new = folder / ".tmp-step-000002"
    shutil.copytree(folder / "step-000002", new)
    (new / "meta.json").write_text((new / "meta.json").read_text() + " ")
    checkpoint.swap_in(new, folder / "step-000002")
    assert sorted(p.name for p in folder.iterdir()) == ["step-000001", "step-000002"]
    assert tree_digest(folder / "step-000002") != old

    again = folder / ".tmp-step-000002"
    shutil.copytree(folder / "step-000001", again)
    rename = Path.rename

    def killed_at_the_new_ones_rename(self, target):
        if self == again:
            raise KeyboardInterrupt
        return rename(self, target)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Path, "rename", killed_at_the_new_ones_rename)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.swap_in(again, folder / "step-000002")
    assert checkpoint.tidy(folder.parent) == [".tmp-step-000002"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-000001", "step-000002"]
    assert tree_digest(folder / "step-000002") != old  # the re-saved one, whole
    assert checkpoint_meta.latest(folder.parent) == folder / "step-000002"

    shutil.copytree(folder / "step-000001", folder / ".replaced-step-000001")  # killed after them
    assert checkpoint.tidy(folder.parent) == [".replaced-step-000001"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-000001", "step-000002"]


def test_leftovers_of_an_interrupted_save_are_tidied_at_the_next_start(root, trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    ours = out / "checkpoints" / ".tmp-step-000003"
    shutil.copytree(out / "checkpoints" / "step-000002", ours)
    torn = out / "checkpoints" / "step-000004"
    shutil.copytree(out / "checkpoints" / "step-000002", torn)
    (torn / "meta.json").unlink()
    theirs = out / "checkpoints" / "step-000009"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("not ours")
    final_tmp = out / ".final-k1ll3d"  # the final model's temporary folder (killed while writing it)
    shutil.copytree(out / "final", final_tmp)
    their_tmp = out / ".final-theirs"
    their_tmp.mkdir()
    (their_tmp / "keep.txt").write_text("not ours")
    result = ok(run_cli(args(root, out, 3, "--resume")))
    assert "removed what an interrupted save left: .final-k1ll3d, .tmp-step-000003, step-000004" in result.stdout
    assert not ours.exists() and not torn.exists() and not final_tmp.exists()
    assert (theirs / "keep.txt").read_text() == "not ours"
    assert (their_tmp / "keep.txt").read_text() == "not ours"
