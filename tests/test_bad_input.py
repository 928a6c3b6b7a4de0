"""Bad input: one line naming the problem and the fix, exit code 2, no traceback, nothing
written. Table-driven through the real command (Typer's CliRunner, in process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, env, python, save_tiny_model, write_pickled_payload, write_ragged_tokens
from typer.testing import CliRunner

from accum_cli.cli.main import app


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    f = {"root": root}
    f["tiny"] = save_tiny_model(root / "tiny")
    f["cpu-2proc"] = REPO / "recipes" / "accelerate" / "cpu-2proc.yaml"
    (root / "no-config").mkdir()
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        root / "vit"
    )
    (root / "content.jsonl").write_text('{"content": "hello"}\n')
    (root / "empty.jsonl").write_text("")
    (root / "arrays.jsonl").write_text("\n[1, 2, 3]\n[4, 5, 6]\n")  # token ids, not rows of columns
    (root / "small.txt").write_text("just a few words of text\n")
    write_ragged_tokens(root / "tokens.jsonl", n_rows=12)
    (root / "a-file").write_text("x")
    (root / "unknown-key.yaml").write_text("global_batch: 8\nmicro_bach: 2\n")
    (root / "wrong-type.yaml").write_text("global_batch: lots\n")
    (root / "bad.yaml").write_text("global_batch: [\n")
    bad_data = {  # one bad row among good ones: the problem is found while tokenising
        "null-text.jsonl": [{"text": "a good row of text"}, {"text": None}],
        "number-text.jsonl": [{"text": 5}, {"text": 6}],
        "id-outside-vocab.jsonl": [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 384, 7]}],
        "negative-id.jsonl": [{"input_ids": [5, 6, 7]}, {"input_ids": [5, -3, 7]}],
        "string-ids.jsonl": [{"input_ids": ["a", "b"]}, {"input_ids": ["c"]}],
        "mixed-ids.jsonl": [{"input_ids": [5, "b"]}],
        "short-labels.jsonl": [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [5, 6, 7], "labels": [5]}],
        "long-mask.jsonl": [{"input_ids": [5, 6], "attention_mask": [1, 1, 1]}],
        "no-loss.jsonl": [{"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}] * 8,
        "empty-rows.jsonl": [{"input_ids": []}] * 8,
        "null-id.jsonl": [{"input_ids": [5, 6, 7]}, {"input_ids": [5, None, 7]}],
        "null-mask.jsonl": [
            {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},
            {"input_ids": [5, 6, 7], "attention_mask": [1, None, 1]},
        ],
        "long-eval.jsonl": [{"input_ids": [5] * 300}],  # above the tiny model's 256 positions
        "one-row.jsonl": [{"input_ids": [5, 6, 7]}],
    }
    for name, rows in bad_data.items():
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "latin1.yaml").write_bytes("dataset: donn\u00e9es.jsonl\n".encode("latin-1"))
    (root / "big-seed.yaml").write_text(f"seed: {2**64}\n")
    # A billion-item alias bomb in a few hundred bytes: refused fast, its value quoted short.
    levels = ["&a [" + ", ".join(["lol"] * 9) + "]"]
    levels += [f"&{c} [" + ", ".join([f"*{p}"] * 9) + "]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
    (root / "bomb.yaml").write_text("model: [" + ", ".join(levels) + "]\n")
    (root / "huge.yaml").write_text("# a comment line\n" * 70_000)
    (root / "deep.yaml").write_text("model: " + "[" * 3000 + "]" * 3000 + "\n")
    (root / "huge-int.yaml").write_text(f"epochs: {10**400}\n")
    (root / "twice.yaml").write_text("global-batch: 8\nglobal_batch: 16\n")
    (root / "evil.yaml").write_text(
        'lr: 1e-3\nseed: !!python/object/apply:os.system ["touch {}"]\n'.format(root / "ran")
    )
    os.mkfifo(root / "pipe.yaml")  # what `--recipe <(...)` passes: read once, and never by the workers

    # A real checkpoint of the tiny model, and broken copies of it.
    run = root / "trained"
    result = python(
        ["-m", "accum_cli", "--model", str(f["tiny"]), "--dataset", str(root / "tokens.jsonl"),
         "--global-batch", "4", "--micro-batch", "2", "--max-steps", "1", "--output-dir", str(run)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    good = run / "checkpoints" / "step-000001"
    f["ckpt"] = good
    f["incomplete"] = root / "incomplete"
    shutil.copytree(good, f["incomplete"])
    (f["incomplete"] / "meta.json").unlink()
    f["corrupt-meta"] = root / "corrupt-meta"
    shutil.copytree(good, f["corrupt-meta"])
    (f["corrupt-meta"] / "meta.json").write_text("{not json")
    f["tampered"] = root / "tampered"
    shutil.copytree(good, f["tampered"])
    with open(f["tampered"] / ".metadata", "ab") as handle:
        handle.write(b"appended by someone else")
    f["torn-shard"] = root / "torn-shard"
    shutil.copytree(good, f["torn-shard"])
    shard = next(f["torn-shard"].glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:64])

    # Broken model folders: weights cut in half, a negative size, an absurd depth, a size as text.
    for name, edit in (
        ("half-weights", None),
        ("neg-vocab", {"vocab_size": -5}),
        ("deep", {"num_hidden_layers": 100_000}),
        ("text-size", {"hidden_size": "64"}),
    ):
        folder = save_tiny_model(root / name)
        if edit is None:
            weights = folder / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        else:
            config = json.loads((folder / "config.json").read_text()) | edit
            (folder / "config.json").write_text(json.dumps(config))
    # Weights that load into random values: a layer's tensors gone, every name under another prefix;
    # a shard its index names gone; a tokenizer.json of other content.
    from safetensors.torch import load_file, save_file

    for name, rename in (("missing-layer", lambda k: None if ".layers.1." in k else k), ("renamed", "other.{}".format)):
        folder = save_tiny_model(root / name)
        weights = load_file(folder / "model.safetensors")
        kept = {rename(k): v for k, v in weights.items() if rename(k) is not None}
        save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    folder = save_tiny_model(root / "lost-shard")
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_file(weights, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    index = {
        "metadata": {},
        "weight_map": {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(weights)},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    # A sharded save into a folder that held one file: transformers would read the old file alone.
    folder = save_tiny_model(root / "stale-single")
    weights = load_file(folder / "model.safetensors")
    save_file(weights, folder / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in weights}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    # A legacy weights file whose pickle would run code: torch.load(weights_only=True) refuses it.
    folder = save_tiny_model(root / "pickled-payload")
    (folder / "model.safetensors").unlink()
    write_pickled_payload(folder / "pytorch_model.bin", marker=root / "payload-ran")
    folder = save_tiny_model(root / "bad-tokenizer")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "Nothing"}}))
    return f


# (flags, part of the one-line message); {name} refers to the `files` fixture.
CASES = [
    (["--global-batch", "0"], "--global-batch must lie in [1, 1099511627776], got 0"),
    (["--plan", "--global-batch", "99999999999999999999999"], "--global-batch must lie in [1, 1099511627776], got 9999"),
    (["--micro-batch", "-3"], "--micro-batch must be >= 1"),
    (["--micro-batch", "abc"], "--micro-batch must be a positive integer or auto, got 'abc'"),
    (["--global-batch", "2.5"], "Invalid value for '--global-batch'"),
    (["--plan", "--global-batch", "4", "--world-size", "8"], "smaller than the world size 8"),
    (["--plan", "--strict-batch", "--global-batch", "100", "--micro-batch", "8", "--world-size", "4"],
     "--strict-batch: global batch 100 is not a multiple of micro batch x world size = 8 x 4; use --global-batch 96 or 128"),
    (["--plan", "--replicas", "3", "--world-size", "4"], "--replicas 3 does not divide the world size 4"),
    (["--model", "/definitely/not/here"], "--model /definitely/not/here does not exist"),
    (["--model", "{no-config}"], "has no config.json; pass a folder written by save_pretrained"),
    (["--model", "{vit}"], "is not a causal language model"),
    (["--model", "{a-file}"], "is a file; pass the folder written by save_pretrained"),
    (["--dataset", "/no/such/data.jsonl"], "--dataset /no/such/data.jsonl does not exist"),
    (["--dataset", "{content.jsonl}"], "has no column 'text' (columns: content); pass --text-column NAME"),
    (["--dataset", "{empty.jsonl}"], "is empty; pass a dataset with at least one row"),
    (["--dataset", "{arrays.jsonl}"],
     'line 2 of arrays.jsonl is a list, not an object; write one object per line, e.g. {"input_ids": [...]}'),
    (["--dataset", "{small.txt}"], "the dataset holds fewer than --seq-len 1024 tokens; lower --seq-len"),
    (["--dataset", "{tokens.jsonl}", "--model", "{tiny}", "--global-batch", "64"],
     "the dataset holds 12 sequences of up to 256 tokens, fewer than one global batch of 64"),
    (["--seq-len", "5000"], "--seq-len 5000 exceeds the model's maximum of 1024 positions"),
    (["--output-dir", "{a-file}/out"], "is a file; pick another folder"),
    (["--resume", "/no/such/checkpoint"], "--resume /no/such/checkpoint does not exist"),
    (["--resume"], "--resume: no complete checkpoint in"),
    (["--model", "{tiny}", "--resume", "{incomplete}"], "is incomplete (no meta.json"),
    (["--model", "{tiny}", "--resume", "{corrupt-meta}"], "meta.json is corrupt"),
    (["--model", "{tiny}", "--resume", "{tampered}"], "is corrupt: file .metadata is"),
    (["--model", "{tiny}", "--dataset", "{tokens.jsonl}", "--global-batch", "4", "--resume", "{torn-shard}"],
     "is corrupt: file __0_0.distcp is 64 bytes but"),
    (["--resume", "{ckpt}"], "was saved from a different model"),
    # --resume auto keeps every check of --resume: the run's folder holds the tiny model's checkpoint
    (["--output-dir", "{trained}", "--resume", "auto"], "was saved from a different model"),
    (["--recipe", "{unknown-key.yaml}"], "unknown key 'micro_bach'; did you mean micro_batch?"),
    (["--recipe", "{wrong-type.yaml}"], "key 'global_batch' must be int, got str 'lots'"),
    (["--recipe", "{bad.yaml}"], "is not valid YAML"),
    (["--recipe", "{evil.yaml}"], "the tag !!python/object/apply:os.system (line 2) is not allowed; a recipe holds"),
    (["--recipe", "{pipe.yaml}"], "is not a regular file (a pipe?); save the recipe to a file and pass that"),
    (["--recipe", "/no/recipe.yaml"], "recipe /no/recipe.yaml does not exist"),
    (["--world-size", "4"], "--world-size only applies with --plan"),
    (["--nproc", "2", "--plan"], "--plan does not start processes"),
    (["--lr", "0"], "--lr must be a positive number, got 0.0"),
    (["--lr", "-1e-3"], "--lr must be a positive number, got -0.001"),
    (["--sync", "sometimes"], "--sync 'sometimes' is unknown; use one of: auto, every, last"),
    (["--sync", "hsdp-defer"], "--sync hsdp-defer needs --replicas 2 or more"),
    (["--precision", "fp16"], "--precision 'fp16' is unknown"),
    (["--on-nonfinite", "ignore"], "--on-nonfinite 'ignore' is unknown"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
    (["--bogus-flag"], "No such option: --bogus-flag"),
    (["--output-dir", ""], "--output-dir is empty; pass a folder"),
    (["--resume", "{tokens.jsonl}"], "is a file; pass a checkpoint folder (OUTPUT_DIR/checkpoints/step-N)"),
    (["--model", "{half-weights}"], "weights file model.safetensors is corrupt or truncated"),
    (["--model", "{stale-single}"], "holds both model.safetensors and model.safetensors.index.json"),
    (["--model", "{neg-vocab}"], "its config has vocab_size -5; it must be a positive integer"),
    (["--model", "{deep}"], "asks for 100,000 layers, more than the 2,048 accum-train builds"),
    (["--model", "{text-size}"], "text-size: cannot read its config: Validation error for field 'hidden_size'"),
    (["--model", "{bad-tokenizer}", "--dataset", "{tokens.jsonl}", "--global-batch", "4"],
     "its tokenizer cannot be loaded ("),
    (["--layout", "sideways"], "--layout 'sideways' is unknown; use one of: auto, shard, replicate"),
    (["--layout", "replicate", "--sync", "every"],
     "--layout replicate cannot be used: --sync every reduces more than once per step"),
    (["--layout", "replicate", "--device-memory-gib", "0.001"],
     "--layout replicate does not fit: estimated peak"),
    (["--model", "{tiny}", "--dataset", "{null-text.jsonl}"], "row 1 of the dataset (counting from 0): column 'text' is null"),
    (["--model", "{tiny}", "--dataset", "{number-text.jsonl}"], "column 'text' holds int64, not text"),
    (["--model", "{tiny}", "--dataset", "{id-outside-vocab.jsonl}"],
     "row 1 of the dataset (counting from 0): input_ids holds 384, outside the model's vocabulary of 384"),
    (["--model", "{tiny}", "--dataset", "{negative-id.jsonl}"], "input_ids holds -3, outside the model's vocabulary"),
    (["--model", "{tiny}", "--dataset", "{string-ids.jsonl}"],
     "column 'input_ids' holds lists of string; it must hold lists of integer token ids"),
    (["--model", "{tiny}", "--dataset", "{mixed-ids.jsonl}"], "it must hold lists of integer token ids"),
    (["--model", "{tiny}", "--dataset", "{short-labels.jsonl}"],
     "row 1 of the dataset (counting from 0): labels is 1 long but input_ids holds 3 tokens"),
    (["--model", "{tiny}", "--dataset", "{long-mask.jsonl}"], "attention_mask is 3 long but input_ids holds 2 tokens"),
    (["--model", "{tiny}", "--dataset", "{no-loss.jsonl}", "--global-batch", "4"],
     "no position of the dataset counts in the loss"),
    (["--model", "{tiny}", "--dataset", "{empty-rows.jsonl}", "--global-batch", "4"],
     "no position of the dataset counts in the loss"),
    (["--model", "{tiny}", "--dataset", "{null-id.jsonl}"],
     "row 1 of the dataset (counting from 0): input_ids holds something that is not a token id (a null"),
    (["--model", "{tiny}", "--dataset", "{null-mask.jsonl}"],
     "row 1 of the dataset (counting from 0): attention_mask holds a value other than 0 and 1"),
    # The evaluation's rows must fit the model too: refused before training, not at the first evaluation.
    (["--model", "{tiny}", "--dataset", "{one-row.jsonl}", "--global-batch", "1", "--eval-split-ratio", "0.5"],
     "--eval-split-ratio needs at least 2 sequences to hold one out, and the dataset makes 1"),
    (["--model", "{tiny}", "--dataset", "{tokens.jsonl}", "--global-batch", "4", "--eval-dataset", "{long-eval.jsonl}"],
     "a pre-tokenised row has 300 tokens, above the model's 256 positions"),
    (["--recipe", "{latin1.yaml}"], "is not UTF-8 text (line 1); save it as UTF-8"),
    (["--seed", str(2**64)], f"--seed must lie in [0, {2**64 - 1}], got {2**64}"),
    (["--recipe", "{big-seed.yaml}"], f"--seed must lie in [0, {2**64 - 1}]"),
    (["--seed", "-1"], "--seed must lie in [0, "),
    (["--device-memory-gib", "inf"], "--device-memory-gib must be a finite number, got inf"),
    (["--device-memory-gib", "nan"], "--device-memory-gib must be a finite number, got nan"),
    (["--recipe", "{bomb.yaml}"], "key 'model' must be str, got list [['lol', 'lol', 'lol', 'lol', ...], [[...],"),
    (["--recipe", "{huge.yaml}"], "is larger than 1 MiB"),
    (["--recipe", "{deep.yaml}"], "is nested too deeply"),
    (["--recipe", "{no-config}"], "is a folder; pass a YAML file to --recipe"),
    (["--adam-beta1", "1"], "--adam-beta1 must lie in [0, 1), got 1.0"),
    (["--adam-beta2", "1"], "--adam-beta2 must lie in [0, 1), got 1.0"),
    (["--micro-batch", "\u00b2"], "--micro-batch must be a positive integer or auto, got '\u00b2'"),
    (["--micro-batch=--4"], "--micro-batch must be a positive integer or auto, got '--4'"),
    (["--epochs", "1e308"], "--epochs must lie in (0, 1000000], got 1e+308"),
    (["--plan", "--device-memory-gib", "1e308"], "--device-memory-gib must lie in (0, 1073741824], got 1e+308"),
    (["--epochs", "0"], "--epochs must lie in (0, 1000000], got 0.0"),  # not "<= 1000000": the low side is wrong
    (["--plan", "--device-memory-gib", "0"], "--device-memory-gib must lie in (0, 1073741824], got 0.0"),
    (["--recipe", "{huge-int.yaml}"], "key 'epochs' is too large for a number, got 1000"),
    # "" from an unset shell variable ("--dataset $DATA") is not the default it would silently become
    (["--dataset="], "--dataset is empty; pass a value or leave the flag out"),
    (["--model="], "--model is empty; pass a value or leave the flag out"),
    (["--report-to="], "--report-to is empty; pass a value or leave the flag out"),  # no tracker, unsaid
    (["--run-name="], "--run-name is empty; pass a value or leave the flag out"),
    (["--split="], "--split is empty; pass a value or leave the flag out"),
    (["--recipe="], "--recipe is empty; pass a YAML file"),
    (["--recipe", "{twice.yaml}"], "key 'global_batch' sets global_batch a second time; keep one of them"),
    (["--plan", "--prepare-only"], "--plan prints the plan without touching the data; drop --plan or --prepare-only"),
    (["--num-proc", "100000"], "--num-proc must lie in [1, 1024], got 100000"),
    # The wrapper refuses before any worker starts: a recipe given as the Accelerate config, a world
    # size for a run, a plan that does not fit the config's processes.
    (["--nproc", "1", "--accelerate-config", "{unknown-key.yaml}"],
     "unknown-key.yaml is not an Accelerate config (A `distributed_type` must be specified"),
    (["--nproc", "2", "--world-size", "4"], "--world-size only applies with --plan"),
    (["--accelerate-config", "{cpu-2proc}", "--global-batch", "1"], "--global-batch 1 is smaller than the world size 2"),
]  # fmt: skip


def expand(arg: str, files: dict[str, Path]) -> str:
    for name, path in files.items():
        arg = arg.replace("{" + name + "}", str(path))
    if "{" in arg:  # a file of the fixture's root folder
        arg = arg.replace("{", str(files["root"]) + "/").replace("}", "")
    return arg


@pytest.mark.parametrize("flags, message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input(files, tmp_path, flags, message):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["--output-dir", str(out), *(expand(f, files) for f in flags)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1, result.output
    assert lines[0].startswith("accum-train: error: ") and message in lines[0], lines[0]
    assert len(lines[0]) < 1000, "a value quoted in a message is bounded"
    assert "Traceback" not in result.output
    assert not out.exists(), "nothing is written on bad input"


@pytest.mark.parametrize(
    "folder, message",
    [("missing-layer", "its weights files lack 9 of the model's 21 tensors (first: model.layers.1."),
     ("renamed", "its weights files lack 21 of the model's 21 tensors (first: lm_head.weight)"),
     ("lost-shard", "its weights cannot be loaded ("),
     ("pickled-payload", "a weights file holds pickled objects other than tensors, which only running code")],
)  # fmt: skip
def test_weights_that_would_load_as_random_values_are_refused(files, tmp_path, folder, message):
    """transformers fills a tensor the files lack with random values and goes on (a model whose
    names do not match would train from scratch, "pretrained" in the header). Weights are read
    where the model is built, after the plan and data: one error line ends the output there,
    exit 2, and the folder takes the corrected run as if nothing had happened."""
    out = tmp_path / "out"
    flags = ["--dataset", str(files["root"] / "tokens.jsonl"), "--global-batch", "4", "--output-dir", str(out)]
    result = CliRunner().invoke(app, ["--model", str(files["root"] / folder), *flags])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("accum-train: error: --model ") and message in last, last
    assert "Traceback" not in result.output
    assert not (files["root"] / "payload-ran").exists()
    fixed = CliRunner().invoke(app, ["--model", str(files["tiny"]), *flags, "--max-steps", "1"])
    assert fixed.exit_code == 0, fixed.output


# Each message by words its folder's name does not hold ("incomplete" alone would match the path).
EXPORT_CASES = [
    ("incomplete", "is incomplete (no meta.json: the save did not finish)"),
    ("corrupt-meta", ": meta.json is corrupt ("),
    ("torn-shard", "is corrupt: file __0_0.distcp is 64 bytes but"),
    ("a-file", "is a file; pass a checkpoint folder"),
]


@pytest.mark.parametrize("name, message", EXPORT_CASES, ids=[name for name, _ in EXPORT_CASES])
def test_export_of_a_broken_checkpoint_is_one_line(files, tmp_path, name, message):
    from accum_cli.cli.main import export_app

    target = tmp_path / "hf"
    folder = files[name] if name in files else files["root"] / name
    result = CliRunner().invoke(export_app, [str(folder), str(target)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"accum-export: error: checkpoint {folder}"), result.output
    assert message in lines[0], lines[0]
    assert not target.exists()


def test_a_read_only_data_cache_is_one_line(files, tmp_path, monkeypatch):
    """ACCUM_TRAIN_CACHE where nothing can be written: a read-only filesystem (root writes
    through mode bits), else a folder without write permission."""
    cache = tmp_path / "cache"
    cache.mkdir()
    if os.geteuid() == 0:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(cache)], capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here ({made.stderr.decode().strip()})")
    else:
        cache.chmod(0o555)
    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(cache))
    out = tmp_path / "out"
    try:
        result = CliRunner().invoke(app, ["--model", str(files["tiny"]), "--dataset", str(files["root"] / "tokens.jsonl"),
                                          "--global-batch", "4", "--max-steps", "1", "--output-dir", str(out)])  # fmt: skip
    finally:
        subprocess.run(["umount", "-l", str(cache)], capture_output=True, check=False)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert (
        f"cannot write the data cache {cache}" in lines[0] and "set ACCUM_TRAIN_CACHE to a writable folder" in lines[0]
    )
    assert not out.exists(), "nothing is written on bad input"


def file_modes_apply() -> list[str]:
    """A command prefix under which file modes apply: none for a user; for root (which reads
    through them), setpriv dropping the capabilities that let it."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root reads through file modes, and setpriv is not here to stop that")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


UNREADABLE = {  # what is made unreadable, its mode, the command's arguments, part of the line
    "export": ("ckpt", 0o000, ["{target}", "{out}"], "checkpoint {target} cannot be read (Permission denied"),
    "resume": ("ckpt", 0o000, ["--resume", "{target}"], "--resume {target} cannot be read (Permission denied"),
    "resume latest": ("checkpoints", 0o000, ["--resume"], "--resume {target} cannot be read (Permission denied"),
    "output dir": ("run", 0o300, ["--resume"], "--output-dir {target} cannot be read"),
}


@pytest.mark.parametrize("case", UNREADABLE)
def test_an_unreadable_checkpoint_or_run_is_one_line(files, tmp_path, case):
    """A folder of a colleague's that this user may not read: one line, exit 2, not a traceback."""
    what, mode, argv, message = UNREADABLE[case]
    run = tmp_path / "run"
    shutil.copytree(files["ckpt"].parents[1], run)
    target = {"ckpt": run / "checkpoints" / "step-000001", "checkpoints": run / "checkpoints", "run": run}[what]
    out = tmp_path / "hf" if case == "export" else run
    argv = [a.format(target=target, out=out) for a in argv]
    if case == "export":
        cmd = [sys.executable, "-c", "from accum_cli.cli.main import export_entry; export_entry()", *argv]
    else:
        cmd = [sys.executable, "-m", "accum_cli", "--model", str(files["tiny"]), "--dataset",
               str(files["root"] / "tokens.jsonl"), "--global-batch", "4", "--micro-batch", "2", "--max-steps", "2",
               "--output-dir", str(run), *argv]  # fmt: skip
    target.chmod(mode)
    try:
        result = subprocess.run([*file_modes_apply(), *cmd], cwd=REPO, env=env(), capture_output=True, text=True)
    finally:
        target.chmod(0o755)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    prog = "accum-export" if case == "export" else "accum-train"
    assert lines[0].startswith(f"{prog}: error: " + message.format(target=target)), lines[0]
    assert not (tmp_path / "hf").exists()


def test_the_table_covers_at_least_25_cases():
    assert len(CASES) >= 25


def test_a_checkpoint_survives_a_failed_resume(files):
    before = {p.name: p.stat().st_mtime_ns for p in files["ckpt"].iterdir()}
    result = CliRunner().invoke(app, ["--resume", str(files["ckpt"]), "--output-dir", str(files["root"] / "x")])
    assert result.exit_code == 2
    assert {p.name: p.stat().st_mtime_ns for p in files["ckpt"].iterdir()} == before
    assert json.loads((files["ckpt"] / "meta.json").read_text())["step"] == 1
