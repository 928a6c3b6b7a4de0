"""Real data: every source and format through the real CLI path, chat data exact under
accumulation, tokenisation once, and a world-size-independent order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    CHAT_TEMPLATE,
    REPO,
    env,
    free_port,
    launch,
    message_lines,
    read_metrics,
    rel_err,
    run_cli,
    save_tiny_model,
    write_ragged_tokens,
)
from typer.testing import CliRunner

from accum_cli.cli.main import app
from accum_cli.config.plan import Plan
from accum_cli.data import cache as prep_cache
from accum_cli.data import formats, prepare
from accum_cli.data.batches import SampleOrder
from accum_cli.data.store import IGNORE_INDEX

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
    "jolly",
    "kings",
]


def sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("m") / "model", chat_template=CHAT_TEMPLATE)


def write_sources(root: Path) -> dict[str, tuple[str, int]]:
    """Every file kind, 12 documents each: name -> (path or glob, documents)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [sentence(i, 30 + i) for i in range(12)]
    (root / "a.txt").write_text("\n\n".join(texts))
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (root / "a.json").write_text(json.dumps([{"text": t} for t in texts]))
    (root / "a.csv").write_text("text\n" + "".join(f'"{t}"\n' for t in texts))
    table = pa.table({"text": texts})
    pq.write_table(table, root / "a.parquet")
    with pa.ipc.new_stream(str(root / "a.arrow"), table.schema) as writer:
        writer.write_table(table)
    (root / "folder").mkdir()
    for i in range(3):
        (root / "folder" / f"part{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[i::3]))
    (root / "content.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    return {
        "txt": (str(root / "a.txt"), 12),
        "jsonl": (str(root / "a.jsonl"), 12),
        "json": (str(root / "a.json"), 12),
        "csv": (str(root / "a.csv"), 12),
        "parquet": (str(root / "a.parquet"), 12),
        "arrow": (str(root / "a.arrow"), 12),
        "folder": (str(root / "folder"), 12),
        "glob": (str(root / "folder" / "part[01].jsonl"), 8),
        "text column": (str(root / "content.jsonl"), 12),
    }


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json", "csv", "parquet", "arrow", "folder", "glob", "text column"])
def test_every_source_loads_through_the_cli(model, tmp_path, kind):
    path, documents = write_sources(tmp_path)[kind]
    extra = ["--text-column", "body"] if kind == "text column" else []
    result = CliRunner().invoke(
        app,
        ["--prepare-only", "--model", str(model), "--dataset", path, "--seq-len", "32", "--global-batch", "2",
         "--output-dir", str(tmp_path / "out"), *extra],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"documents         {documents}" in result.output
    assert "format            text, packed into blocks" in result.output
    assert not (tmp_path / "out").exists()


def test_pretokenised_rows_padded_packed_or_truncated(model, tmp_path):
    rows = [{"input_ids": list(range(3, 3 + n)), "attention_mask": [1] * (n - 2) + [0, 0]} for n in (10, 20, 30, 40)]
    path = tmp_path / "tokens.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def summary(*flags):
        result = CliRunner().invoke(app, ["--prepare-only", "--model", str(model), "--dataset", str(path),
                                          "--global-batch", "1", "--output-dir", str(tmp_path / "o"), *flags])  # fmt: skip
        assert result.exit_code == 0, result.output
        return result.output

    as_is = summary()
    assert "format            tokens, one document per row" in as_is
    assert "tokens            92 " in as_is  # attention_mask zeros dropped: 8 + 18 + 28 + 38
    packed = summary("--packing", "--seq-len", "16")  # rows stay whole, stored as rows; packed when read
    assert "format            tokens, rows packed whole into sequences (--packing)" in packed
    assert "tokens            92 " in packed and "samples           4 packed sequences of 4 rows;" in packed
    truncated = summary("--no-packing", "--seq-len", "16")
    assert "truncated         3 documents" in truncated


@pytest.mark.parametrize("where", ["config", "tokenizer"])
def test_a_pad_id_outside_the_vocabulary_pads_with_one_inside_and_trains_the_same(tmp_path, where):
    """Padding positions are masked out of attention and loss, so any id in the vocabulary pads them
    alike. One outside it (an old Llama config's -1 with no tokenizer; a pad token added to the
    tokenizer without resizing the embeddings: id 384 of 384) crashed the lookup at step 1."""
    from transformers import AutoTokenizer

    rows = write_ragged_tokens(tmp_path / "rows.jsonl", n_rows=8)
    runs = {}
    for name in ("in", "out"):
        folder = save_tiny_model(tmp_path / name)
        if where == "config":  # no tokenizer: the config's pad id is the one used
            for file in folder.iterdir():
                if "token" in file.name or file.name == "special_tokens_map.json":
                    file.unlink()
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(config | {"pad_token_id": -1 if name == "out" else 0}))
        elif name == "out":
            tokenizer = AutoTokenizer.from_pretrained(folder)
            tokenizer.add_special_tokens({"pad_token": "<mypad>"})
            assert tokenizer.pad_token_id == 384
            tokenizer.save_pretrained(folder)
        runs[name] = tmp_path / f"run-{name}"
        result = run_cli(["--model", str(folder), "--dataset", str(rows), "--global-batch", "4", "--micro-batch", "2",
                          "--max-steps", "2", "--output-dir", str(runs[name])])  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
    assert read_metrics(runs["out"])[-1]["loss"] == read_metrics(runs["in"])[-1]["loss"]


def chat_rows(n: int = 26, seed: int = 0) -> list[dict]:
    """Conversations of very different lengths: 1-3 turns, answers from 1 to 40 words."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        turns = int(torch.randint(1, 4, (1,), generator=g))
        messages = []
        for t in range(turns):
            messages.append({"role": "user", "content": sentence(i + t, int(torch.randint(2, 12, (1,), generator=g)))})
            messages.append(
                {"role": "assistant", "content": sentence(i * 3 + t, int(torch.randint(1, 40, (1,), generator=g)))}
            )
        if i % 4 == 0:
            messages.insert(0, {"role": "system", "content": "be brief"})
        rows.append({"messages": messages})
    return rows


def test_loss_counts_only_assistant_tokens(model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "and?"}, {"role": "assistant", "content": "ok"}]  # fmt: skip
    options = formats.Options(seq_len=512)
    row = formats.make_rows({"messages": [messages]}, tokenizer, options, "chat", packed=False)
    ids, labels = row["input_ids"][0], row["labels"][0]
    counted = tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])
    assert counted == "yo\nok\n"
    everything = formats.make_rows({"messages": [messages]}, tokenizer, formats.Options(512, train_on_prompt=True),
                                   "chat", packed=False)  # fmt: skip
    assert everything["labels"][0] == ids


def test_prompt_completion_counts_the_completion(model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    row = formats.make_rows({"prompt": ["Q: 2+2? A:"], "completion": [" 4"]}, tokenizer, formats.Options(64),
                            "prompt-completion", packed=False)  # fmt: skip
    counted = [t for t, lab in zip(row["input_ids"][0], row["labels"][0], strict=True) if lab != -100]
    assert tokenizer.decode(counted) == " 4</s>"


G, SEED, LR = 11, 4, 3e-3
CHAT_SEQ = 256  # the tiny model's maximum: long conversations are truncated, identically on both sides


def chat_reference(model_dir: Path, rows: list[dict], steps: int) -> dict:
    """One process, no sharding, one forward/backward over the whole global batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    built = formats.make_rows(
        {"messages": [r["messages"] for r in rows]}, tokenizer, formats.Options(CHAT_SEQ), "chat", False
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    order = SampleOrder(len(rows), SEED)
    out = {"loss": [], "grad_norm": []}
    for step in range(steps):
        idx = order.rows(range(step * G, (step + 1) * G))
        width = max(len(built["input_ids"][i]) for i in idx)
        ids = torch.zeros(G, width, dtype=torch.long)
        labels = torch.full((G, width), -100)
        mask = torch.zeros(G, width, dtype=torch.long)
        for j, i in enumerate(idx):
            n = len(built["input_ids"][i])
            ids[j, :n], labels[j, :n], mask[j, :n] = (
                torch.tensor(built["input_ids"][i]),
                torch.tensor(built["labels"][i]),
                1,
            )
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        out["loss"].append(loss.item())
        opt.step()
        opt.zero_grad()
    out["batch0"] = (ids, mask, labels) if steps == 1 else None
    return out


@pytest.mark.distributed
def test_chat_data_is_exact_under_ragged_accumulation(model, tmp_path):
    rows = chat_rows()
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    result = run_cli(
        ["--model", str(model), "--dataset", str(path), "--global-batch", str(G), "--micro-batch", "3",
         "--max-steps", "3", "--seed", str(SEED), "--lr", str(LR), "--warmup-steps", "0", "--lr-schedule",
         "constant", "--seq-len", str(CHAT_SEQ), "--output-dir", str(out), "--verbose"],
        nproc=2,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "format            chat, one document per row" in result.stdout
    ref = chat_reference(model, rows, 3)
    metrics = read_metrics(out)
    counts = {m["loss_tokens"] for m in metrics}
    assert len(counts) == 3, "steps hold different numbers of loss tokens"
    for m, loss, norm in zip(metrics, ref["loss"], ref["grad_norm"], strict=True):
        assert rel_err(m["loss"], loss) < 1e-5 and rel_err(m["grad_norm"], norm) < 1e-5, (m, loss, norm)


def test_a_per_microbatch_mean_fails_on_chat_data(model):
    """Teeth: averaging each microbatch of the same chat batch, then dividing by A, is wrong."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = chat_rows()
    tokenizer = AutoTokenizer.from_pretrained(model)
    built = formats.make_rows(
        {"messages": [r["messages"] for r in rows]}, tokenizer, formats.Options(CHAT_SEQ), "chat", False
    )
    idx = SampleOrder(len(rows), SEED).rows(range(G))

    def batch(members):
        width = max(len(built["input_ids"][i]) for i in members)
        ids, labels = torch.zeros(len(members), width, dtype=torch.long), torch.full((len(members), width), -100)
        mask = torch.zeros(len(members), width, dtype=torch.long)
        for j, i in enumerate(members):
            n = len(built["input_ids"][i])
            ids[j, :n], labels[j, :n], mask[j, :n] = (
                torch.tensor(built["input_ids"][i]),
                torch.tensor(built["labels"][i]),
                1,
            )
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def grads(chunks):
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
        for chunk in chunks:
            (m(**batch(chunk)).loss / len(chunks)).backward()
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    naive = grads([idx[i : i + 3] for i in range(0, G, 3)])
    exact = grads([idx])
    assert rel_err(naive, exact) > 1e-3


@pytest.mark.distributed
def test_tokenisation_happens_once_and_the_cache_is_reused(model, tmp_path):
    path, _ = write_sources(tmp_path)["jsonl"]
    cache = tmp_path / "shared-cache"
    args = ["--model", str(model), "--dataset", path, "--seq-len", "32", "--global-batch", "4", "--micro-batch", "1",
            "--max-steps", "1", "--eval-split-ratio", "0.2", "--verbose"]  # fmt: skip
    first = run_cli([*args, "--output-dir", str(tmp_path / "a")], nproc=2, env_extra={"ACCUM_TRAIN_CACHE": str(cache)})
    assert first.returncode == 0, first.stdout + first.stderr
    assert "tokenisation      done once (on 1 of 2 ranks) and cached" in first.stdout
    second = run_cli([*args, "--output-dir", str(tmp_path / "b")], nproc=2, env_extra={"ACCUM_TRAIN_CACHE": str(cache)})
    assert second.returncode == 0, second.stdout + second.stderr
    assert "tokenisation      read from the cache (prepared by an earlier run)" in second.stdout
    assert len([p for p in cache_entries(cache) if not p.name.startswith(".")]) == 1
    one = run_cli([*args, "--output-dir", str(tmp_path / "c")], nproc=1, env_extra={"ACCUM_TRAIN_CACHE": str(cache)})
    assert one.returncode == 0
    e2, e1 = read_metrics(tmp_path / "a")[-1], read_metrics(tmp_path / "c")[-1]
    assert e2["eval_loss_tokens"] == e1["eval_loss_tokens"] > 0
    assert rel_err(e2["eval_loss"], e1["eval_loss"]) < 1e-5, "eval loss is token-weighted over the whole set"


@pytest.mark.parametrize("g, m", [(7, 2), (16, 3), (5, 1)])
def test_the_order_depends_only_on_seed_and_global_batch(g, m):
    order = SampleOrder(23, seed=9)
    for step in range(4):
        by_world = []
        for world in (1, 2, 3):
            plan = Plan(g, m, world)
            rows = [r for rank in range(world) for j in range(plan.accum_steps)
                    for r in order.rows(plan.microbatch_range(step, rank, j))]  # fmt: skip
            by_world.append(rows)
        assert by_world[0] == by_world[1] == by_world[2]
    assert SampleOrder(23, 9).rows(range(23)) != SampleOrder(23, 10).rows(range(23))
    assert sorted(order.rows(range(23, 46))) == list(range(23)), "each epoch is a permutation"
    assert order.rows(range(23)) != order.rows(range(23, 46)), "a fresh shuffle each epoch"


# --- compact storage, streaming preparation, one tokeniser per node ---------------------------


def prepare_here(raw, tokenizer, options: formats.Options, num_proc: int = 1):
    """One process's preparation, the collective's barriers reduced to nothing."""
    return prepare.prepare(raw, tokenizer, options, True, True, lambda: None, num_proc)


def cache_entries(cache: Path) -> list[Path]:
    """The prepared datasets in a cache (the memory estimates' folder beside them left out)."""
    return sorted(p for p in cache.iterdir() if p.name != "estimates") if cache.exists() else []


def test_packed_text_is_stored_in_two_bytes_per_token_and_reads_back(model, tmp_path):
    """The blocks read back are the corpus's token stream (documents + EOS) cut at seq_len,
    computed here from the tokenizer alone; the cache holds uint16 ids and nothing else."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [sentence(i, 5 + i % 23) for i in range(300)]
    data, stats, tokenised = prepare_here(datasets.Dataset.from_dict({"text": texts}), tokenizer,
                                          formats.Options(48, vocab_size=384))  # fmt: skip
    stream = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [1]]
    blocks = [stream[i * 48 : (i + 1) * 48] for i in range(len(stream) // 48)]
    assert tokenised and len(data) == stats.samples == len(blocks)
    for i in (0, 1, len(blocks) // 2, len(blocks) - 1):
        ids, labels = data.sample(i)
        assert ids.tolist() == blocks[i] and labels.tolist() == blocks[i]
    assert stats.loss_tokens == len(blocks) * 47
    (folder,) = cache_entries(Path(prep_cache.cache_root()))
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "tokens.bin"], "no labels, no leftovers"
    assert (folder / "tokens.bin").stat().st_size == 2 * stats.tokens
    assert stats.stored_bytes / stats.tokens <= 2.2


def test_a_changed_byte_in_the_cache_stops_the_run_before_it_reaches_the_model(model, tmp_path):
    """A shared cache outlives its run: a byte changed since it was written (here inside the
    vocabulary, so nothing else would notice) is found by its 1 MiB block's digest the first time
    a sample in that block is read, and the run stops in one line. Blocks not read are not
    hashed: the check costs what the run reads."""
    import datasets
    from transformers import AutoTokenizer

    from accum_cli.data import store

    rows = np.random.default_rng(0).integers(3, 384, (640, 1024)).tolist()  # 1.25 MiB of uint16: 2 blocks
    options = formats.Options(1024, vocab_size=384)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data, _, _ = prepare_here(datasets.Dataset.from_dict({"input_ids": rows}), tokenizer, options)
    (folder,) = cache_entries(Path(prep_cache.cache_root()))
    last = len(rows) - 1
    assert data.sample(last)[0].tolist() == rows[last]
    position = 2 * 1024 * last + 10  # a token of the last row, in the file's second block
    with open(folder / "tokens.bin", "r+b") as f:
        f.seek(position)
        f.write(bytes([(rows[last][5] % 250) + 3]))  # another id, still inside the vocabulary
    data, _, _ = prepare_here(datasets.Dataset.from_dict({"input_ids": rows}), tokenizer, options)
    assert data.sample(0)[0].tolist() == rows[0], "a block that was not changed reads as before"
    assert data.checks["tokens.bin"].checked.tolist() == [True, False], "the changed block was not read yet"
    with pytest.raises(store.DamagedError, match=r"is damaged \(tokens.bin bytes 1,048,576\+ changed since"):
        data.sample(last)

    # Through the CLI: one line, exit 2, naming the folder to delete.
    args = ["--model", str(model), "--dataset", str(tmp_path / "rows.jsonl"), "--global-batch", "2",
            "--micro-batch", "1", "--max-steps", "1", "--output-dir", str(tmp_path / "run")]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"input_ids": r[:16]}) + "\n" for r in rows[:4]))
    cache = tmp_path / "cli-cache"
    assert run_cli(["--prepare-only", *args], env_extra={"ACCUM_TRAIN_CACHE": str(cache)}).returncode == 0
    (tokens,) = cache.glob("*/tokens.bin")
    tokens.write_bytes(bytes([tokens.read_bytes()[0] ^ 1]) + tokens.read_bytes()[1:])
    result = run_cli(args, env_extra={"ACCUM_TRAIN_CACHE": str(cache)})
    assert result.returncode == 2, result.stdout + result.stderr
    assert message_lines(result.stderr) == [
        f"accum-train: error: the prepared data in {tokens.parent} is damaged (tokens.bin bytes 0+ changed since they were "
        "written); delete that folder to prepare it again"
    ]


def test_a_large_vocabulary_takes_four_bytes_and_ids_round_trip(model, tmp_path):
    import datasets

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 128_256, int(n)).tolist() for n in rng.integers(3, 60, 200)]
    raw = datasets.Dataset.from_dict({"input_ids": rows})
    data, stats, _ = prepare_here(raw, None, formats.Options(64, packing=False, vocab_size=128_256))
    assert [data.sample(i)[0].tolist() for i in range(len(data))] == rows
    assert max(max(row) for row in rows) > 65_535 and stats.stored_bytes / stats.tokens <= 4.5


@pytest.mark.parametrize("fmt", ["chat", "prompt-completion", "tokens"])
def test_rows_with_masked_labels_round_trip_to_the_same_labels(model, tmp_path, fmt):
    """Chat, prompt-completion and pre-tokenised rows keep a one-byte loss mask, not int64 labels,
    and read back exactly the labels make_rows builds (the exactness tests' reference)."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if fmt == "chat":
        columns = {"messages": [r["messages"] for r in chat_rows()]}
    elif fmt == "prompt-completion":
        columns = {"prompt": [sentence(i, 3 + i % 5) for i in range(40)],
                   "completion": [sentence(i + 1, 1 + i % 9) for i in range(40)]}  # fmt: skip
    else:
        g = np.random.default_rng(1)
        ids = [g.integers(3, 384, int(n)).tolist() for n in g.integers(2, 30, 40)]
        # some labels of their own (neither the id nor -100), as a user's pre-tokenised data may have
        columns = {"input_ids": ids, "labels": [[-100] + [(t + 1) % 384 for t in row[1:]] for row in ids]}
    options = formats.Options(CHAT_SEQ, vocab_size=384)
    data, stats, _ = prepare_here(datasets.Dataset.from_dict(columns), tokenizer, options)
    expected = formats.make_rows(columns, tokenizer, options, fmt, packed=False)
    assert len(data) == len(expected["input_ids"])
    for i in range(len(data)):
        ids, labels = data.sample(i)
        assert ids.tolist() == expected["input_ids"][i] and labels.tolist() == expected["labels"][i], i
    (folder,) = cache_entries(Path(prep_cache.cache_root()))
    names = sorted(p.name for p in folder.iterdir())
    assert names == (["labels.bin"] if fmt == "tokens" else []) + ["mask.bin", "meta.json", "offsets.bin",
                                                                      "tokens.bin"]  # fmt: skip
    if fmt != "tokens":
        assert stats.stored_bytes / stats.tokens < 3.5  # 2 (ids) + 1 (mask) + offsets per row


def test_worker_processes_give_the_same_files_as_one_process(model, tmp_path, monkeypatch):
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    monkeypatch.setattr(prepare, "PARALLEL_ABOVE_BYTES", 0)
    monkeypatch.setattr(prepare, "BATCH_ROWS", 7)
    raw = datasets.Dataset.from_dict({"prompt": [sentence(i, 2 + i % 6) for i in range(100)],
                                      "completion": [sentence(i, 1 + i % 4) for i in range(100)]})  # fmt: skip
    built = {}
    for procs in (1, 2):
        monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path / f"cache{procs}"))
        data, stats, _ = prepare_here(raw, tokenizer, formats.Options(32, vocab_size=384), num_proc=procs)
        (folder,) = cache_entries(tmp_path / f"cache{procs}")
        built[procs] = ({p.name: p.read_bytes() for p in folder.glob("*.bin")}, stats)
    assert built[1] == built[2]


PUBLISH_RACE = """
import hashlib, json, os, sys, time
from pathlib import Path

import datasets
import numpy as np
from transformers import AutoTokenizer

from accum_cli.data import formats, prepare

model_dir, texts, gate = sys.argv[1:4]
raw = datasets.Dataset.from_dict({"text": json.loads(Path(texts).read_text())})
tokenizer = AutoTokenizer.from_pretrained(model_dir)
Path(gate, os.environ["RANK"]).touch()
while len(os.listdir(gate)) < int(os.environ["WORLD_SIZE"]):  # all set: they start preparing together
    time.sleep(0.001)
data, _, tokenised = prepare.prepare(raw, tokenizer, formats.Options(64, vocab_size=384), True, True, lambda: None, 1)
# One write per line: the ranks share stdout, unbuffered (print writes the line and its end apart).
os.write(1, (json.dumps([hashlib.sha256(np.asarray(data.tokens).tobytes()).hexdigest(), tokenised]) + "\\n").encode())
"""


def test_a_concurrent_publisher_of_the_same_key_wins_or_loses_cleanly(model, tmp_path):
    """Four processes prepare the same data into one cache at the same moment: all succeed with
    the same data, one copy is published, and no temporary folder is left behind. (Four real
    processes forked from the suite's warm parent: each prepares as the only one it knows of.)"""
    cache, texts, gate = tmp_path / "cache", tmp_path / "texts.json", tmp_path / "gate"
    texts.write_text(json.dumps([sentence(i, 50) for i in range(400)]))
    gate.mkdir()
    done = launch(PUBLISH_RACE, [str(model), str(texts), str(gate)], ranks=4, kind="code", timeout=120,
                  environment=env(ACCUM_TRAIN_CACHE=str(cache)))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(outcomes) == 4, done.stdout
    assert len({digest for digest, _ in outcomes}) == 1
    assert sum(tokenised for _, tokenised in outcomes) >= 1
    (published,) = cache_entries(cache)
    assert not published.name.startswith(".") and (published / "meta.json").is_file()


def test_publishing_onto_a_published_copy_keeps_the_first(tmp_path):
    first, second, final = tmp_path / "a", tmp_path / "b", tmp_path / "key"
    for folder, tag in ((first, "first"), (second, "second")):
        folder.mkdir()
        (folder / "meta.json").write_text(json.dumps({"tag": tag}))
    assert prep_cache.publish(first, final) is True
    assert prep_cache.publish(second, final) is False
    assert json.loads((final / "meta.json").read_text())["tag"] == "first"


@pytest.mark.distributed
def test_a_node_without_the_shared_cache_tokenises_once(model, tmp_path):
    """Two "nodes" of two ranks each (torchrun's --nnodes 2 environment, the ranks forked from the warm
    parent), each with a cache folder of its own: rank 0 and node 1's first local rank tokenise; node 1's
    second rank waits and reads its node's copy. Each cache ends with one complete copy and no leftovers."""
    import concurrent.futures

    path = tmp_path / "corpus.jsonl"  # big enough that a second tokeniser on node 1 would overlap the first
    path.write_text("".join(json.dumps({"text": sentence(i, 150)}) + "\n" for i in range(3000)))
    port = free_port()
    caches = [tmp_path / "cache-node0", tmp_path / "cache-node1"]
    argv = ["--prepare-only", "--model", str(model), "--dataset", str(path), "--seq-len", "32", "--global-batch", "4",
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        nodes = [pool.submit(launch, "accum_cli", argv, ranks=2, nnodes=2, node_rank=rank, master_port=port,
                             environment=env(ACCUM_TRAIN_CACHE=str(caches[rank]))) for rank in (0, 1)]  # fmt: skip
        done = [node.result() for node in nodes]
    for node in done:
        assert node.returncode == 0, node.stdout + node.stderr
    assert "tokenisation      done once (on 2 of 4 ranks) and cached" in done[0].stdout
    for cache in caches:
        assert not (cache / "estimates").exists(), "--prepare-only trains nothing: no memory estimate"
        assert len(cache_entries(cache)) == 1 and not cache_entries(cache)[0].name.startswith(".")
        assert (cache_entries(cache)[0] / "meta.json").is_file()


def test_a_read_only_cache_is_refused_in_one_line(model, tmp_path, monkeypatch):
    """The cache cannot be written: a read-only folder, or (as root ignores permissions) a path
    below a file. Either way: one line, exit 2, nothing in --output-dir."""
    import os

    if os.geteuid() == 0:
        (tmp_path / "a-file").write_text("x")
        cache = tmp_path / "a-file" / "cache"
    else:
        cache = tmp_path / "read-only"
        cache.mkdir(mode=0o555)
    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(cache))
    path, _ = write_sources(tmp_path)["jsonl"]
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["--model", str(model), "--dataset", path, "--seq-len", "32",
                                      "--global-batch", "2", "--output-dir", str(out)])  # fmt: skip
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("accum-train: error: cannot write the data cache") and "ACCUM_TRAIN_CACHE" in lines[0]
    assert not out.exists()


def test_packed_rows_with_labels_keep_their_mask(model):
    """Pre-tokenised rows packed whole (--packing, packing.py): each sequence holds its rows' labels back to
    back, each row's first label -100 (it would be predicted from the row before), and position ids
    that start again at 0 with each row; the loss positions are those of the rows unpacked."""
    import datasets

    from accum_cli.data.packing import PackedRows

    g = np.random.default_rng(3)
    ids = [g.integers(3, 384, int(n)).tolist() for n in g.integers(2, 30, 60)]
    labels = [[-100 if g.random() < 0.4 else t for t in row] for row in ids]
    raw = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    data, stats, _ = prepare_here(raw, None, formats.Options(64, packing=True, vocab_size=384))
    packed = PackedRows(data, 64, seed=0)
    assert len(data) == 60 and len(packed) < 30
    counted = 0
    for i, rows in enumerate(packed.bins):
        got_ids, got_labels, positions = packed.sample(i)
        assert got_ids.tolist() == [t for r in rows for t in ids[r]] and len(got_ids) <= 64
        assert got_labels.tolist() == [t for r in rows for t in [-100, *labels[r][1:]]]
        assert positions.tolist() == [p for r in rows for p in range(len(ids[r]))]
        counted += int((got_labels[1:] != -100).sum())
    assert stats.loss_tokens == counted == sum(1 for row in labels for t in row[1:] if t != -100)


def test_chat_rows_that_are_not_turns_are_named(model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for bad in (None, "hi there", [{"content": "a turn without a role"}], [good[0], "text"]):
        with pytest.raises(
            prepare.UserError, match=r"row 8 of the dataset \(counting from 0\): messages is not a list"
        ):
            formats.make_rows({"messages": [good, bad]}, tokenizer, formats.Options(64), "chat", False, first_row=7)


def test_chat_turns_with_differing_keys_are_prepared_as_turns(model, tmp_path):
    """Turns of differing keys (a system turn with a `name`) make `datasets` type them as JSON,
    which Arrow hands over as text: prepared, they give the ids of the same turns without it
    (the template ignores `name`), as streaming does."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"},
             {"role": "assistant", "content": "a" * (i + 1)}] for i in range(6)]  # fmt: skip
    for name, named in (("plain", False), ("named", True)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for turns in rows:
                f.write(json.dumps({"messages": [dict(t, name="x") if named and t["role"] == "system" else t
                                                 for t in turns]}) + "\n")  # fmt: skip
    prepared = {}
    for name in ("plain", "named"):
        raw = datasets.load_dataset("json", data_files=str(tmp_path / f"{name}.jsonl"), split="train")
        data, _, _ = prepare_here(raw, tokenizer, formats.Options(64))
        prepared[name] = [[t.tolist() for t in data.sample(i)[:2]] for i in range(len(data))]
    assert "Json" in repr(raw.features["messages"])  # the case at hand: this datasets types them as JSON
    assert prepared["named"] == prepared["plain"] and len(prepared["plain"]) == 6


def test_a_conversation_the_template_cannot_render_is_named(model):
    """An empty conversation, and a template's own refusal (Llama 2's and Mistral's raise on
    roles that do not alternate), are one line naming the row, not a traceback."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(prepare.UserError, match=r"row 8 of the dataset \(counting from 0\): messages is empty"):
        formats.make_rows({"messages": [good, []]}, tokenizer, formats.Options(64), "chat", False, first_row=7)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(
        prepare.UserError,
        match=r"row 8 .*: the chat template cannot render it \(Conversation roles must alternate user/assistant\)",
    ):
        formats.make_rows({"messages": [good, good[::-1]]}, tokenizer, formats.Options(64), "chat", False, first_row=7)


def test_a_full_disk_while_preparing_is_one_line_and_leaves_nothing(model, tmp_path):
    """The cache's disk fills up mid-way (a file-size limit stands in: the same writes fail, with
    EFBIG instead of ENOSPC): one line naming the cache and the fix, exit 2, no folder left."""
    import resource

    data = tmp_path / "big.jsonl"
    data.write_text("".join(json.dumps({"text": sentence(i, 60)}) + "\n" for i in range(1500)))  # ~400K tokens
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "accum_cli", "--prepare-only", "--model", str(model), "--dataset", str(data),
           "--seq-len", "64", "--global-batch", "2", "--num-proc", "1", "--output-dir", str(tmp_path / "run")]  # fmt: skip

    def limit_file_size():  # 256 KiB: the tokens (2 bytes each) do not fit
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 2**10, resource.RLIM_INFINITY))

    result = subprocess.run(cmd, cwd=REPO, env=env(ACCUM_TRAIN_CACHE=str(cache)), capture_output=True, text=True,
                            timeout=300, preexec_fn=limit_file_size)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert message_lines(result.stderr) == [
        f"accum-train: error: the data cache {cache} has no room for the prepared data (File too large); "
        "free space there or set ACCUM_TRAIN_CACHE to a folder on another disk"
    ]
    assert cache_entries(cache) == [], "nothing half-written is left in the cache"


def test_hidden_files_in_a_dataset_folder_are_not_data(tmp_path):
    """As `datasets` reads a folder: Jupyter's autosaved copies, a .git, __pycache__ are not rows
    (a notebook's checkpoint copy would train every row twice)."""
    from accum_cli.data import sources

    (tmp_path / "data" / ".ipynb_checkpoints").mkdir(parents=True)
    (tmp_path / "data" / "__pycache__").mkdir()
    (tmp_path / "data" / "part").mkdir()
    for name in ("a.jsonl", ".ipynb_checkpoints/train-checkpoint.jsonl", "__pycache__/x.jsonl",
                 ".hidden.jsonl", "part/b.jsonl"):  # fmt: skip
        (tmp_path / "data" / name).write_text('{"text": "a"}\n')
    assert sources.local_files(str(tmp_path / "data")) == [tmp_path / "data" / "a.jsonl",
                                                          tmp_path / "data" / "part" / "b.jsonl"]  # fmt: skip
    (tmp_path / ".data").mkdir()  # a hidden folder named as the dataset is what the user asked for
    (tmp_path / ".data" / "a.jsonl").write_text('{"text": "a"}\n')
    assert sources.local_files(str(tmp_path / ".data")) == [tmp_path / ".data" / "a.jsonl"]


def test_a_folder_split_by_file_names_trains_on_its_train_split_alone(tmp_path):
    """As `datasets` reads a folder: train.jsonl and test.jsonl are two splits, and --split picks
    one (a test split trained on would leak the evaluation into training). A file in no split, a
    split not there, and an evaluation folder with splits to pick from are one line each."""
    from accum_cli.data import sources

    def folder(name: str, *files: str) -> str:
        for file in files:
            (tmp_path / name / file).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / file).write_text('{"text": "a"}\n')
        return str(tmp_path / name)

    data = folder("data", "train.jsonl", "train-2.jsonl", "test.jsonl", "my-val.jsonl", ".hidden/test.jsonl")
    assert sources.local_files(data) == [tmp_path / "data" / "train-2.jsonl", tmp_path / "data" / "train.jsonl"]
    assert sources.local_files(data, split="test") == [tmp_path / "data" / "test.jsonl"]
    assert sources.local_files(data, split="validation") == [tmp_path / "data" / "my-val.jsonl"]
    said = f"--dataset {data} is split by its file names into test, train, validation"
    with pytest.raises(sources.UserError, match=re.escape(f"{said} (as `datasets` reads a folder), none of them 'dev'; "
                                                          "pass --split test or train or validation")):  # fmt: skip
        sources.local_files(data, split="dev")
    with pytest.raises(sources.UserError, match=re.escape(f"pass the evaluation files themselves, e.g. "
                                                          f"{tmp_path / 'data' / 'my-val.jsonl'}")):  # fmt: skip
        sources.local_files(data, "--eval-dataset", split=None)
    by_folder = folder("by-folder", "train/a.jsonl", "train/b.jsonl", "validation/c.jsonl")
    assert sources.local_files(by_folder) == [tmp_path / "by-folder" / "train" / "a.jsonl",
                                              tmp_path / "by-folder" / "train" / "b.jsonl"]  # fmt: skip
    (tmp_path / "data" / "more.jsonl").write_text('{"text": "a"}\n')  # datasets would leave it out, unsaid
    with pytest.raises(sources.UserError, match=r"but more.jsonl is in none of them; rename it into one"):
        sources.local_files(data)


def test_a_killed_preparation_leaves_nothing_behind_at_the_next_start(model, tmp_path):
    """A preparation killed mid-way (kill -9) leaves its temporary folder; the next one on this
    host removes it, and leaves alone those of live processes."""
    import os
    import socket

    import datasets

    cache = Path(prep_cache.cache_root())
    cache.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    abandoned = cache / f".tmp-{socket.gethostname()}@{dead.pid}-x1"
    in_progress = cache / f".tmp-{socket.gethostname()}@{os.getpid()}-x2"
    # Another host whose name is this one's plus "-<digits>" (vm, vm-9): its folder is not ours.
    other_host = cache / f".tmp-{socket.gethostname()}-9@{dead.pid}-x3"
    for folder in (abandoned, in_progress, other_host):
        folder.mkdir()
        (folder / "tokens.bin").write_bytes(b"\0" * 64)
    raw = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]] * 4})
    prepare_here(raw, None, formats.Options(8, vocab_size=384))
    assert not abandoned.exists() and in_progress.exists() and other_host.exists()
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1


@pytest.mark.parametrize("kind", ["txt", "jsonl", "csv", "parquet", "folder"])
def test_local_files_are_read_as_they_are_prepared_with_no_copy_of_the_corpus(model, tmp_path, monkeypatch, kind):
    """Local files are read batch by batch while tokenising (memory flat whatever their size): the
    result is the same as preparing the same rows from memory, the datasets cache gets no Arrow copy
    of them, and editing a file makes it other data (another cache key)."""
    import datasets
    from transformers import AutoTokenizer

    from accum_cli.data import sources

    # datasets reads its cache folder from its config at each load (the variable only at import)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    monkeypatch.setattr(prepare, "BATCH_ROWS", 5)  # several tables, and blocks straddling them
    monkeypatch.setattr(prepare, "PARALLEL_ABOVE_BYTES", 0)  # through the worker processes too
    path, _ = write_sources(tmp_path)[kind]
    tokenizer = AutoTokenizer.from_pretrained(model)
    options = formats.Options(32, vocab_size=384)
    texts = [sentence(i, 30 + i) for i in range(12)]
    if kind == "folder":  # part0, part1, part2 in order
        texts = [t for i in range(3) for t in texts[i::3]]
    rows = sources.load_raw(path)
    from_files, stats, _ = prepare_here(rows, tokenizer, options, num_proc=2)
    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path / "memory-cache"))
    from_memory, _, _ = prepare_here(datasets.Dataset.from_dict({"text": texts}), tokenizer, options)
    assert stats.documents == 12 and len(from_files) == len(from_memory) > 5
    assert np.array_equal(np.asarray(from_files.tokens), np.asarray(from_memory.tokens))
    assert not list((tmp_path / "hf").rglob("*.arrow")), "no Arrow copy of the corpus"
    key = prep_cache.cache_key(rows, tokenizer, options, "text")
    edited = sorted(Path(path).rglob("*.jsonl"))[0] if kind == "folder" else Path(path)
    modified = edited.stat().st_mtime_ns + 10**9  # rewritten: datasets' own fingerprint goes by time too
    os.utime(edited, ns=(modified, modified))
    assert prep_cache.cache_key(sources.load_raw(path), tokenizer, options, "text") != key
