"""See the run: TensorBoard, W&B (offline) and trackio (local) receive every metric, report.png
pictures the run, accum-report draws a run from the outside, and the console follows --log-every."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, env, python, read_metrics, run_cli, save_tiny_model, write_ragged_tokens
from typer.testing import CliRunner

from accum_cli.cli.main import app


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("see")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "data.jsonl", n_rows=40)
    return root


def args(root: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--global-batch", "8",
            "--micro-batch", "4", "--max-steps", str(steps), "--output-dir", str(out), *extra]  # fmt: skip


def scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard holds, read back with its own reader: tag -> step -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for folder in sorted({events.parent for events in logdir.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for event in acc.Scalars(tag):
                assert event.step not in found.get(tag, {}), f"{tag} twice at step {event.step}"
                found.setdefault(tag, {})[event.step] = event.value
    return found


DETERMINISTIC = ("loss", "loss_tokens", "tokens", "grad_norm", "lr")  # the same when a resume redoes a step
RESUME_STEP = 2  # the checkpoint the resumed run starts from; the first run went on to step 3
TRACKER_ENV = ("WANDB_DIR", "WANDB_PROJECT", "WANDB_MODE", "TRACKIO_DIR", "TRACKIO_PROJECT")


def wandb_records(path: Path):
    """The records of a .wandb file (W&B's own protobuf Record, in the LevelDB-log framing its writer uses:
    a 7-byte header, then 32 KiB blocks of chunks [crc32c u32, length u16, type u8: 1 full, 2 first,
    3 middle, 4 last]). wandb 0.31 ships no Python reader."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, parts = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", "not a .wandb file"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_runs(folder: Path) -> list[dict]:
    """Every offline W&B run segment under `folder`, in start order: its run id, config and history."""
    runs = []
    for path in folder.rglob("*.wandb"):
        run = {"history": [], "config": {}}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name,
                           start=record.run.start_time.ToMicroseconds())  # fmt: skip
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                row = {k: v for k, v in row.items() if not k.startswith("_")}
                run["history"].append((record.history.step.num, row))
        runs.append(run)
    return sorted(runs, key=lambda run: run["start"])


TRACKIO_READER = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
project = sys.argv[1]
runs = [(r["name"], r["created_at"], SQLiteStorage.get_logs(project, r["name"], run_id=r["id"]))
        for r in SQLiteStorage.get_run_records(project)]
print(json.dumps(sorted(runs, key=lambda run: run[1])))
"""


def trackio_runs(folder: Path, project: str = "accum-train") -> list[tuple[str, list[dict]]]:
    """Every run of a local trackio project, oldest first: (name, logs), read by trackio's own storage
    class (in a subprocess: trackio reads TRACKIO_DIR once, on import)."""
    result = python(["-c", TRACKIO_READER, project], env=env(TRACKIO_DIR=str(folder)),
                            capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return [(name, logs) for name, _, logs in json.loads(result.stdout)]


@pytest.fixture(scope="module")
def resumed_run(root, tmp_path_factory) -> dict:
    """One output dir, three runs logging to W&B (offline), trackio and TensorBoard: a 2-step run at another
    lr, then a fresh 3-step run over it (--overwrite), then a resume from its step-2 checkpoint to step 5."""
    if not (importlib.util.find_spec("wandb") and importlib.util.find_spec("trackio")):
        pytest.skip("wandb and trackio are dev extras: pip install -e '.[dev]'")
    out = tmp_path_factory.mktemp("trackers") / "run"
    home = out.parent / "wandb-home"  # W&B's settings and caches, away from the user's home
    extra = {"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(home), "WANDB_CACHE_DIR": str(home),
             "WANDB_DATA_DIR": str(home)}  # fmt: skip
    report = ("--report-to", "wandb,trackio,tensorboard")
    with pytest.MonkeyPatch.context() as mp:  # the defaults under test: nothing from the caller's environment
        for name in TRACKER_ENV:
            mp.delenv(name, raising=False)
        other = run_cli(args(root, out, 2, *report, "--lr", "3e-3"), env_extra=extra)
        assert other.returncode == 0, other.stdout + other.stderr
        first = run_cli(args(root, out, 3, *report, "--overwrite", "--checkpoint-every", "2"), env_extra=extra)
        assert first.returncode == 0, first.stdout + first.stderr
        first_metrics = read_metrics(out)
        resumed = run_cli(args(root, out, 5, *report, "--resume", str(out / "checkpoints" / f"step-{RESUME_STEP:06d}")),
                          env_extra=extra)  # fmt: skip
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return {"out": out, "first": first_metrics, "final": read_metrics(out)}


def assert_logged_once_each(logged: list[tuple[int, dict]], run: dict) -> None:
    """A continued tracker run holds every step of metrics.jsonl once; a step the resume redid keeps the
    values first logged (all equal to the redone ones but the timings), every other step equals metrics.jsonl."""
    final = run["final"]
    assert [step for step, _ in logged] == [m["step"] for m in final], "each step once, in order"
    redone = {m["step"]: m for m in run["first"] if m["step"] > RESUME_STEP}
    assert redone, "the resume redid no step: the test would prove nothing"
    for (step, row), m in zip(logged, final, strict=True):
        source = redone.get(step, m)
        numeric = {k: v for k, v in source.items() if isinstance(v, (int, float)) and k != "step"}
        assert set(row) == set(numeric), (step, set(row) ^ set(numeric))
        for key, value in numeric.items():
            assert row[key] == pytest.approx(value, rel=1e-9), (step, key)
        for key in DETERMINISTIC:
            assert row[key] == pytest.approx(m[key], rel=1e-9), (step, key)


def test_wandb_offline_holds_every_metric_once_and_a_resume_continues_the_same_run(resumed_run):
    out = resumed_run["out"]
    runs = wandb_runs(out / "trackers" / "wandb")
    run_id = json.loads((out / "trackers" / "ids.json").read_text())["wandb"]
    ours = [run for run in runs if run["id"] == run_id]
    assert len(runs) == 3 and len(ours) == 2, "the --overwrite run is a new W&B run; the resume continues it"
    assert all(run["project"] == "accum-train" and run["name"] == "run" for run in runs)
    assert ours[0]["config"]["plan.accum_steps"] == 2 and ours[0]["config"]["config.global_batch"] == 8
    assert_logged_once_each(ours[0]["history"] + ours[1]["history"], resumed_run)


def test_trackio_holds_every_metric_once_and_a_resume_continues_the_same_run(resumed_run):
    out = resumed_run["out"]
    runs = trackio_runs(out / "trackers" / "trackio")
    assert [name for name, _ in runs] == ["run", "run"], "the --overwrite run is a new trackio run; the resume is not"
    logged = [(row.pop("step"), {k: v for k, v in row.items() if k != "timestamp"}) for row in runs[1][1]]
    assert_logged_once_each(logged, resumed_run)


def test_trackio_gets_each_step_once_when_a_rewound_attempt_stops_before_its_old_last_step(root, tmp_path, monkeypatch):
    """Four steps sent to trackio; a rewind to step 2 run to step 3 only, without trackers (its
    metrics.jsonl then ends at 3); a resume to step 5 with trackio again: steps 1-5 once each."""
    if not importlib.util.find_spec("trackio"):
        pytest.skip("trackio is a dev extra: pip install -e '.[dev]'")
    for name in TRACKER_ENV:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    every = ("--checkpoint-every", "1", "--keep-checkpoints", "10")
    for steps, extra in ((4, ("--report-to", "trackio")), (3, ("--resume", str(out / "checkpoints" / "step-000002"))),
                         (5, ("--report-to", "trackio", "--resume"))):  # fmt: skip
        result = run_cli(args(root, out, steps, *every, *extra))
        assert result.returncode == 0, result.stdout + result.stderr
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5]
    runs = trackio_runs(out / "trackers" / "trackio")
    assert [row["step"] for row in runs[0][1]] == [1, 2, 3, 4, 5] and len(runs) == 1


def test_tensorboard_holds_every_metric_of_every_step_once_a_resume_and_an_overwrite_included(resumed_run):
    out, final = resumed_run["out"], resumed_run["final"]
    logged = scalars(out / "trackers")
    numeric = {k for m in final for k, v in m.items() if isinstance(v, (int, float)) and k != "step"}
    assert numeric <= set(logged), numeric - set(logged)
    # TensorBoard drops the steps a resume redoes, and a fresh run's steps hide those of the run it
    # overwrote (--lr 3e-3 there: other lr values at steps 1 and 2): it holds metrics.jsonl exactly.
    for m in final:
        for key in numeric & set(m):
            assert logged[key][m["step"]] == pytest.approx(m[key], rel=1e-6), (key, m["step"])
    assert sorted(logged["loss"]) == [m["step"] for m in final], "one value per step, none twice"


def test_a_tracker_that_cannot_start_is_one_line_and_leaves_no_run_behind(root, tmp_path, monkeypatch):
    """W&B online with no API key (a home of its own, no network): refused before any step, and the same
    command with WANDB_MODE=offline then runs in that folder (no config.json of a run that never began)."""
    if not importlib.util.find_spec("wandb"):
        pytest.skip("wandb is a dev extra: pip install -e '.[dev]'")
    for name in (*TRACKER_ENV, "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    out = tmp_path / "out"
    command = [sys.executable, "-m", "accum_cli", *args(root, out, 1, "--report-to", "wandb")]
    isolated = {
        "HOME": str(home),
        "WANDB_CONFIG_DIR": str(home),
        "WANDB_CACHE_DIR": str(home),
        "NETRC": str(home / "netrc"),
    }
    result = subprocess.run(command, cwd=REPO, env=env(**isolated, WANDB_MODE="online"), stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("accum-train: error:")]
    assert len(errors) == 1 and "--report-to wandb: the tracker could not start" in errors[0], result.stderr
    assert "WANDB_MODE=offline" in errors[0] and "Traceback" not in result.stderr
    assert not (out / "config.json").exists() and not (out / "metrics.jsonl").exists()
    again = subprocess.run(command, cwd=REPO, env=env(**isolated, WANDB_MODE="offline"), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr


def test_the_wandb_run_id_is_new_for_a_fresh_run_and_kept_by_a_resume(tmp_path):
    from accum_cli.rundir.tracking import IDS, run_ids

    first = run_ids(tmp_path, fresh=True)["wandb"]
    assert run_ids(tmp_path, fresh=False)["wandb"] == first
    assert run_ids(tmp_path, fresh=True)["wandb"] != first, "a fresh run (--overwrite) must not merge into the old"
    for bad in ('{"wandb": "../x"}', "[1, 2]", "not json"):  # a damaged file: a new run, never a crash
        (tmp_path / IDS).write_text(bad)
        renewed = run_ids(tmp_path, fresh=False)["wandb"]
        assert renewed.isalnum() and json.loads((tmp_path / IDS).read_text())["wandb"] == renewed


def test_how_far_the_trackers_were_sent_outlives_a_rewind_but_not_an_overwrite(tmp_path):
    from accum_cli.rundir import metrics, tracking

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))
    # a run folder's record: how far the run meant to go bounds what ids.json may claim was sent
    (tmp_path / "config.json").write_text(json.dumps({"plan": {"total_steps": 7}}))
    assert tracking.sent_until(tmp_path) == 7
    tracking.remember_sent(tmp_path)  # no W&B or trackio run here: nothing to keep
    assert not (tmp_path / tracking.FOLDER).exists()
    tracking.run_ids(tmp_path / tracking.FOLDER, fresh=True)
    tracking.remember_sent(tmp_path)
    metrics.keep_metrics_until(tmp_path, 3)  # a rewind to step 3
    assert tracking.sent_until(tmp_path) == 7
    tracking.forget_sent(tmp_path)  # a fresh run over it (--overwrite)
    assert tracking.sent_until(tmp_path) == 3
    for bad in ('{"sent_until": "9"}', '{"sent_until": true}', "[9]", "not json"):
        (tmp_path / tracking.FOLDER / tracking.IDS).write_text(bad)
        assert tracking.sent_until(tmp_path) == 3


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_a_tracker_that_is_not_installed_names_its_package(root, tmp_path, monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda module, *a: None if module == name else real(module, *a))
    result = CliRunner().invoke(app, args(root, tmp_path / "out", 1, "--report-to", name))
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"accum-train: error: --report-to {name} needs the {name} package: pip install {name} "
        f"(or pip install 'accum-train[{name}]'), or drop it from --report-to"
    )
    assert not (tmp_path / "out").exists()


def test_a_missing_tracker_is_one_line_naming_the_package(root, tmp_path):
    result = CliRunner().invoke(app, args(root, tmp_path / "out", 1, "--report-to", "tensorboard,swanlab"))
    assert result.exit_code == 2
    assert result.output.strip() == (
        "accum-train: error: --report-to swanlab needs the swanlab package: pip install swanlab "
        "(or pip install 'accum-train[swanlab]'), or drop it from --report-to"
    )
    assert not (tmp_path / "out").exists()


def test_report_png_pictures_the_run_and_accum_report_compares_runs(root, tmp_path):
    from PIL import Image

    runs = []
    for lr in ("3e-3", "1e-3"):
        out = tmp_path / f"lr-{lr}"
        result = run_cli(args(root, out, 4, "--lr", lr, "--log-every", "2"), env_extra={"ACCUM_TRAIN_REPORT": "1"})
        assert result.returncode == 0, result.stdout + result.stderr
        assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step ")] == ["2/4", "4/4"]
        runs.append(out)
    # 4 steps inside the default 5 of warmup: the header says the peak is not reached, and how far it goes.
    assert read_metrics(runs[1])[-1]["lr"] == pytest.approx(8e-4)
    note = "the warmup is longer than the run's 4 steps: the learning rate rises to 0.0008 only; --warmup-steps 4"
    assert note in result.stdout, result.stdout
    picture = Image.open(runs[0] / "report.png").convert("L")
    assert picture.size[0] >= 800 and picture.size[1] >= 500
    assert sum(1 for count in picture.histogram() if count) > 20, "not a blank picture"

    compared = tmp_path / "compare.png"
    result = python(
        ["-c", "from accum_cli.cli.report import entry; entry()", str(runs[0]),
         "--compare", str(runs[1]), "--out", str(compared)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert Image.open(compared).size == picture.size
    missing = python(
        ["-c", "from accum_cli.cli.report import entry; entry()", str(tmp_path / "nothing")],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "has no metrics.jsonl" in missing.stderr

    # --out: the format its suffix names, written whole or not at all, in the current folder too.
    svg = python(["-c", "from accum_cli.cli.report import entry; entry()", str(runs[0]), "--out",
                          "picture.svg"], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert svg.returncode == 0, svg.stderr
    assert b"<svg" in (tmp_path / "picture.svg").read_bytes()[:1000]
    (tmp_path / "a-folder").mkdir()
    for out, message in (("a-folder", "--out a-folder is a folder; name the picture's file, e.g. --out a-folder/report.png"),
                         ("notes.txt", "--out notes.txt: name a .png, .svg, .pdf file"),
                         ("picture.svg/r.png", "cannot write picture.svg/r.png (")):  # under a file  # fmt: skip
        before = sorted(p.name for p in tmp_path.rglob("*"))
        bad = python(["-c", "from accum_cli.cli.report import entry; entry()", str(runs[0]),
                              "--out", out], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)  # fmt: skip
        assert bad.returncode == 2 and bad.stderr.startswith(f"accum-report: error: {message}"), bad.stderr
        assert len(bad.stderr.splitlines()) == 1 and sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_metrics_file_with_bytes_that_are_not_utf8_is_read_to_its_last_good_line(tmp_path):
    """A torn last line (a kill mid-write, a full disk) can hold any bytes: accum-report reads the
    records before it, and names a bad line elsewhere in one line, never a traceback."""
    from accum_cli.errors import UserError
    from accum_cli.rundir import report

    good = json.dumps({"step": 1, "loss": 2.5}).encode() + b"\n"
    (tmp_path / "metrics.jsonl").write_bytes(good + b'{"step": 2, "lo\xff\xfe')
    records, _ = report.read_run(tmp_path)
    assert [r["step"] for r in records] == [1]
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe not json\n" + good)
    with pytest.raises(UserError, match="line 1 is not JSON"):
        report.read_run(tmp_path)


def test_accum_report_compares_several_runs_each_in_one_colour_in_every_panel(root, tmp_path):
    """`--compare A B` takes several folders, and a run's eval series takes no colour of its own: each run is
    drawn in one colour, its place in the list, in every panel (read back from the SVG's strokes)."""
    import re
    import shutil

    first = tmp_path / "a"
    result = run_cli(args(root, first, 4, "--eval-split-ratio", "0.25", "--eval-every", "2"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert any("eval_loss" in record for record in read_metrics(first))
    for name in ("b", "c"):  # the same run's files under other names: three runs, each with an eval series
        (tmp_path / name).mkdir()
        for file in ("metrics.jsonl", "config.json"):
            shutil.copy(first / file, tmp_path / name / file)
    picture = tmp_path / "compare.svg"
    result = python(["-c", "from accum_cli.cli.report import entry; entry()", str(first), "--compare",
                     str(tmp_path / "b"), str(tmp_path / "c"), "--out", str(picture)], env=env())  # fmt: skip
    assert result.returncode == 0, result.stderr
    tab10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]  # matplotlib's C0, C1, ...
    used = {colour for colour in re.findall(r"stroke: (#[0-9a-f]{6})", picture.read_text()) if colour in tab10}
    assert used == set(tab10[:3]), f"three runs, three colours: {sorted(used)}"


@pytest.mark.parametrize(
    "given, read",
    [
        (["R", "--compare", "A", "B"], ["R", "--compare", "A", "--compare", "B"]),
        (["R", "--compare=A", "B", "--out", "x.png"], ["R", "--compare=A", "--compare", "B", "--out", "x.png"]),
        (["--compare", "A", "R"], ["--compare", "A", "R"]),  # the run after one folder, as click read it before
        (["--compare", "A", "B", "R"], ["--compare", "A", "--compare", "B", "R"]),
        (["--out", "x.png", "R", "--compare", "A"], ["--out", "x.png", "R", "--compare", "A"]),
    ],
)
def test_compare_takes_several_folders_and_the_run_may_come_last(given, read):
    from accum_cli.cli.report import several_after_compare

    assert several_after_compare(given) == read
