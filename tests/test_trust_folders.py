"""Issue 37, what a run folder, a checkpoint and the data cache hold, believed no further than it can be checked:
a link among the names accum-train writes (trackers/ included), a trackers/ids.json of the wrong kind or value,
a checkpoint's step and samples edited together, a cache's meta.json edited (or its ids, digests recomputed).

Each is a real CLI run (a subprocess: where a guard is missing the run trains, and a run ends with os._exit) on
files planted by hand: refused in one line, exit 2, nothing written to the output folder or behind the link.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli, save_tiny_model, tree_digest, write_ragged_tokens

from accum_cli.data import store
from accum_cli.rundir import tracking


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("folders")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "tokens.jsonl", n_rows=24)
    with open(root / "text.jsonl", "w") as f:  # packed text: ~1,700 tokens of the byte tokenizer
        for i in range(30):
            f.write(
                json.dumps({"text": f"row {i}: the quick brown fox jumps over the lazy dog, again and again."}) + "\n"
            )
    return root


def args(root: Path, out: Path, *extra: str, data: str = "tokens.jsonl") -> list[str]:
    return ["--model", str(root / "model"), "--dataset", str(root / data), "--global-batch", "4", "--micro-batch",
            "2", "--max-steps", "2", "--seq-len", "32", "--output-dir", str(out), *extra]  # fmt: skip


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def refused(result: subprocess.CompletedProcess) -> str:
    """The run's one line: exit 2, `accum-train: error: ...`, no traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("accum-train: error: "), result.stderr
    return lines[0]


def everything(folder: Path) -> tuple[list[str], dict[str, str]]:
    """Every entry under `folder` (links and folders too) and every file's digest."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")), tree_digest(folder)


@pytest.fixture(scope="module")
def trained(root, tmp_path_factory) -> Path:
    """A real 2-step run with a checkpoint after each step (both kept)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    ok(run_cli(args(root, out, "--checkpoint-every", "1", "--keep-checkpoints", "5")))
    return out


# --- 1. no link among the names accum-train writes through, trackers/ included ---------------------------------


@pytest.mark.parametrize("link", ["trackers", "trackers/wandb"])
def test_a_trackers_link_is_refused_and_the_users_folder_left_alone(root, trained, tmp_path, link):
    """`trackers` linked to a folder of the user's (or trackers/wandb, the folder W&B is handed): W&B's files went
    there and its ids.json was replaced. Refused before any work; the folder byte for byte as it was. (Links W&B
    makes below its folder, one into its data dir among them, are its own: test_see_the_run.py reruns over them.)"""
    out = tmp_path / "run"
    shutil.copytree(trained, out, symlinks=True)
    victim = tmp_path / "mine"
    victim.mkdir()
    (victim / "ids.json").write_text('{"wandb": "mine0000", "note": "the user\'s"}\n')
    (victim / "notes.txt").write_text("mine")
    (out / link).parent.mkdir(parents=True, exist_ok=True)
    (out / link).symlink_to(victim)
    before = everything(victim)
    result = run_cli([*args(root, out), "--overwrite", "--report-to", "wandb,tensorboard"],
                     env_extra={"WANDB_MODE": "offline"})  # fmt: skip
    line = refused(result)
    assert f"{link} is a symbolic link" in line and "remove the link or pick another --output-dir" in line, line
    assert everything(victim) == before
    assert (out / link).is_symlink() and (out / "config.json").read_bytes() == (trained / "config.json").read_bytes()


def test_a_trackers_ids_json_that_is_a_folder_is_one_line(root, trained, tmp_path):
    """It was exit 1 and an 84-line traceback, once the run could not rename its ids.json over the folder."""
    out = tmp_path / "run"
    shutil.copytree(trained, out, symlinks=True)
    (out / "trackers" / "ids.json").mkdir(parents=True)
    (out / "trackers" / "ids.json" / "kept.txt").write_text("mine")
    before = everything(out)
    result = run_cli([*args(root, out), "--overwrite", "--report-to", "wandb"], env_extra={"WANDB_MODE": "offline"})
    line = refused(result)
    assert "trackers/ids.json is a folder, where accum-train keeps a file of its own" in line, line
    assert everything(out) == before


@pytest.mark.parametrize("stored", [1e9, 10**9, -3, True, "2"], ids=str)
def test_a_sent_until_past_the_run_is_not_believed(trained, tmp_path, stored):
    """`sent_until: 1e9` in trackers/ids.json sent W&B and trackio nothing more, silently. A value past every step
    the run went or planned (or not a whole number) is ignored; one within them still spares a resume's redone steps."""
    out = tmp_path / "run"
    shutil.copytree(trained, out, symlinks=True)
    (out / "trackers").mkdir(exist_ok=True)
    records = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text(records[0])  # logged up to step 1: a rewind dropped step 2's record
    ids = out / "trackers" / "ids.json"
    ids.write_text(json.dumps({"wandb": "abcdef0123456789", "sent_until": 2}))
    assert tracking.sent_until(out) == 2, "a step the run took is believed"
    ids.write_text(json.dumps({"wandb": "abcdef0123456789", "sent_until": stored}))
    assert tracking.sent_until(out) == 1


# --- 2. a checkpoint's step and samples edited together ---------------------------------------------------------


@pytest.mark.parametrize(
    "folder, edit, said",
    [
        ("step-000002", {"step": 1, "samples": 4}, "it records step 1, but the folder is named for step 2"),
        ("ckpt", {"step": 1, "samples": 4}, "it records step 1, but the optimizer state saved with it has taken 2"),
        ("step-000002", {"origin_samples": 4, "samples": 12},
         "origin_samples 4 cannot be the data position at origin_step 0"),
    ],
    ids=["folder-name", "optimizer-state", "origin"],
)  # fmt: skip
def test_a_checkpoint_whose_step_and_samples_were_edited_together_is_refused(root, trained, tmp_path, folder, edit,
                                                                              said):  # fmt: skip
    """meta.json's step and samples, edited to agree with each other, resumed another training (another data
    position and learning rate) as the same one. The folder's name, the origin and the optimizer state (whose
    bytes the digests cover) tell; the resume is refused naming meta.json, and the output folder stays unwritten."""
    ckpt = tmp_path / "elsewhere" / folder
    shutil.copytree(trained / "checkpoints" / "step-000002", ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps(meta | edit))
    out = tmp_path / "out"
    line = refused(run_cli([*args(root, out), "--max-steps", "3", "--resume", str(ckpt)]))
    assert f"--resume {ckpt}: meta.json is corrupt ({said}" in line and "resume an earlier checkpoint" in line, line
    assert not (out / "config.json").exists() and not (out / "metrics.jsonl").exists()
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


# --- 3. the prepared-data cache's meta.json, checked against its key's options and its files ----------------------


@pytest.fixture(scope="module")
def prepared(root) -> Path:
    """A cache holding the packed text's prepared folder (tokens.bin only: uint16 ids, blocks of 32)."""
    cache = root / "cache"
    ok(run_cli(["--prepare-only", *args(root, root / "unused", data="text.jsonl")],
               env_extra={"ACCUM_TRAIN_CACHE": str(cache)}))  # fmt: skip
    return cache


def entry_of(cache: Path) -> Path:
    (folder,) = [p for p in cache.iterdir() if (p / "meta.json").is_file()]
    return folder


def with_ids_out_of_vocabulary(folder: Path, meta: dict) -> dict:
    """An id no embedding row holds, written into tokens.bin, and meta.json's digests made to agree."""
    ids = np.fromfile(folder / "tokens.bin", np.uint16)
    ids[5] = 1000
    ids.tofile(folder / "tokens.bin")
    return meta | {"digests": {"tokens.bin": store.block_digests(folder / "tokens.bin")}}


def more_samples(folder: Path, meta: dict) -> dict:
    counts = {"samples": meta["samples"] + 1, "tokens": meta["tokens"] + 32}
    return meta | counts | {"stats": meta["stats"] | counts}


CACHE_EDITS = [
    ("seq_len", lambda folder, meta: meta | {"seq_len": 64}, "meta.json records seq_len 64, not --seq-len 32"),
    ("dtype", lambda folder, meta: meta | {"dtype": "uint32"}, "meta.json records dtype 'uint32', not the uint16"),
    ("samples", more_samples, "bytes for tokens.bin, not the"),
    ("ids", with_ids_out_of_vocabulary, "tokens.bin holds id 1000, outside the model's vocabulary of 384"),
]


@pytest.mark.parametrize("name, edit, said", CACHE_EDITS, ids=[e[0] for e in CACHE_EDITS])
def test_an_edited_data_cache_is_refused_as_damaged_before_the_run_writes(root, prepared, tmp_path, name, edit,
                                                                          said):  # fmt: skip
    """The block digests cover tokens.bin, not meta.json: its seq_len (a --seq-len 32 run trained on 64-token
    sequences, exit 0), its sample count, its dtype were believed, and ids outside the vocabulary with digests
    recomputed stopped the run mid-step with an IndexError. Now damaged, in one line, before config.json is
    written, so that the same command trains once the entry is deleted."""
    cache = tmp_path / "cache"
    shutil.copytree(prepared, cache)
    folder = entry_of(cache)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps(edit(folder, meta)))
    out = tmp_path / "run"
    command = args(root, out, data="text.jsonl")
    line = refused(run_cli(command, env_extra={"ACCUM_TRAIN_CACHE": str(cache)}))
    assert line.startswith(f"accum-train: error: the prepared data in {folder} is damaged (")
    assert said in line and line.endswith("); delete that folder to prepare it again"), line
    assert not out.exists(), "nothing is written before the data is checked"
    if name == "seq_len":  # the advice works: the same command, with the entry gone
        shutil.rmtree(folder)
        ok(run_cli(command, env_extra={"ACCUM_TRAIN_CACHE": str(cache)}))
        assert json.loads((entry_of(cache) / "meta.json").read_text())["seq_len"] == 32
