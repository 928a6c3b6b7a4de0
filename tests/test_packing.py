"""--packing of rows: whole rows bin-packed into --seq-len sequences, each with position ids from 0, attention
kept within each row and no loss across a row boundary, so that a step over packed rows trains exactly what
the same rows unpacked train. Through the real CLI: one step covering every row, packed against unpacked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from helpers import CHAT_TEMPLATE, read_metrics, rel_err, run_cli, save_tiny_model, write_ragged_tokens

from accum_cli.data import formats, packing

SEED, SEQ, TOL = 3, 128, 1e-5
TINY = dict(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, attention_dropout=0.0)  # fmt: skip


def save_model(path: Path, config_class: str, **kwargs) -> Path:
    torch.manual_seed(1)
    config = getattr(transformers, config_class)(**kwargs)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def write_chat(path: Path, n_rows: int = 14) -> Path:
    rng = np.random.default_rng(5)
    with open(path, "w") as f:
        for i in range(n_rows):
            words = " ".join(["ab", "cde", "f"][j % 3] for j in range(int(rng.integers(1, 6))))
            turns = [{"role": "user", "content": f"q{i} {words}"}, {"role": "assistant", "content": f"a{i} {words}"}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def write_pairs(path: Path, n_rows: int = 14) -> Path:
    rng = np.random.default_rng(6)
    with open(path, "w") as f:
        for i in range(n_rows):
            prompt, completion = f"Q{i}: " + "xy " * int(rng.integers(1, 15)), "z" * int(rng.integers(1, 20))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def packed_count(model: Path, data: Path) -> int:
    """How many sequences the rows pack into (packing.pack on the tokenised rows' lengths)."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    if "input_ids" in rows[0]:
        lengths = [len(r["input_ids"]) for r in rows]
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        fmt = "chat" if "messages" in rows[0] else "prompt-completion"
        columns = {name: [r[name] for r in rows] for name in rows[0]}
        built = formats.make_rows(columns, tokenizer, formats.Options(SEQ), fmt, packed=False)
        lengths = [len(r) for r in built["input_ids"]]
    return len(packing.pack(np.asarray(lengths), SEQ, SEED))


def one_step(model: Path, data: Path, out: Path, global_batch: int, *extra: str, nproc: int = 1) -> tuple[dict, str]:
    result = run_cli(["--model", str(model), "--dataset", str(data), "--output-dir", str(out), "--seq-len", str(SEQ),
                      "--global-batch", str(global_batch), "--micro-batch", "2", "--max-steps", "1", "--seed",
                      str(SEED), "--lr-schedule", "constant", "--warmup-steps", "0", *extra], nproc=nproc)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(out)[0], result.stdout


@pytest.mark.parametrize("arch", ["llama-chat", "llama-pairs", "qwen2-tokens", "mistral-tokens"])
def test_a_step_over_packed_rows_equals_the_step_over_the_same_rows_unpacked(tmp_path, arch):
    if arch.startswith("llama"):
        model = save_tiny_model(tmp_path / "m", chat_template=CHAT_TEMPLATE)
        data = (write_chat if arch == "llama-chat" else write_pairs)(tmp_path / "d.jsonl")
    else:
        name = {"qwen2": "Qwen2Config", "mistral": "MistralConfig"}[arch.split("-")[0]]
        model, data = save_model(tmp_path / "m", name, **TINY), write_ragged_tokens(tmp_path / "d.jsonl", 14)
    n_rows = len(data.read_text().splitlines())
    bins = packed_count(model, data)
    assert bins < n_rows / 2  # several rows per sequence, so packing is exercised
    unpacked, _ = one_step(model, data, tmp_path / "rows", n_rows)
    packed, header = one_step(model, data, tmp_path / "packed", bins, "--packing")
    line = next(x for x in header.splitlines() if x.strip().startswith("packing "))
    assert f"{n_rows} rows whole into {bins} sequences of up to {SEQ} tokens (about {n_rows:.1f} rows, " in line
    assert f", {unpacked['loss_tokens']:,} loss tokens a step)" in line  # the step holds every row
    share, padded = (int(x.split("%")[0].rsplit(" ", 1)[1]) for x in line.split(";")[1].split(","))
    assert 0 < padded < share <= 100, line  # packed rows waste fewer positions than padded ones
    assert "one epoch = 1 optimizer steps" in header, header
    assert packed["loss_tokens"] == unpacked["loss_tokens"], (packed, unpacked)
    assert packed["tokens"] == unpacked["tokens"], (packed, unpacked)
    assert packed["rows"] == unpacked["rows"] == n_rows, (packed, unpacked)  # rows packed; unpacked: sequences
    assert packed["positions"] < unpacked["positions"], (packed, unpacked)  # less padding computed
    assert packed["tokens"] <= packed["positions"] <= bins * SEQ, packed
    errors = rel_err(packed["loss"], unpacked["loss"]), rel_err(packed["grad_norm"], unpacked["grad_norm"])
    print(f"{arch}: {n_rows} rows in {bins} sequences; rel err loss {errors[0]:.1e}, grad norm {errors[1]:.1e}")
    assert errors[0] < TOL and errors[1] < TOL, (packed, unpacked)
    if arch == "llama-chat":  # 2 ranks sharded (FSDP2), 3 sequences each (microbatches of 2 and 1): the same step
        two, _ = one_step(model, data, tmp_path / "packed2", bins, "--packing", "--layout", "shard", nproc=2)
        assert two["loss_tokens"] == unpacked["loss_tokens"] and two["rows"] == n_rows, (two, unpacked)
        errors = rel_err(two["loss"], unpacked["loss"]), rel_err(two["grad_norm"], unpacked["grad_norm"])
        print(f"{arch} on 2 sharded ranks: rel err loss {errors[0]:.1e}, grad norm {errors[1]:.1e}")
        assert errors[0] < TOL and errors[1] < TOL, (two, unpacked)


def test_prepare_only_reports_rows_and_the_packed_sequences_they_make(tmp_path):
    model = save_tiny_model(tmp_path / "m", chat_template=CHAT_TEMPLATE)
    data = write_chat(tmp_path / "chat.jsonl", 40)
    bins = packed_count(model, data)
    result = run_cli(["--prepare-only", "--model", str(model), "--dataset", str(data), "--output-dir",
                      str(tmp_path / "o"), "--seq-len", str(SEQ), "--global-batch", "4", "--packing",
                      "--seed", str(SEED)])  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "format            chat, rows packed whole into sequences (--packing)" in result.stdout
    assert f"samples           {bins} packed sequences of 40 rows; one epoch = {bins // 4} optimizer steps of 4" in (
        result.stdout
    )
    assert f"packing           40 rows whole into {bins} sequences of up to {SEQ} tokens" in result.stdout
    assert not (tmp_path / "o").exists()


def test_a_packed_run_resumed_from_its_checkpoint_is_the_uninterrupted_run(tmp_path):
    """Packed rows across an epoch boundary (16 sequences, 4 a step), interrupted after step 3: the resumed
    steps on 1 rank and elastically on 2 equal the uninterrupted run's (the same packing, the same order)."""
    model = save_tiny_model(tmp_path / "m", chat_template=CHAT_TEMPLATE)
    data = write_chat(tmp_path / "chat.jsonl", 40)

    def run(out: Path, *extra: str, nproc: int = 1) -> list[dict]:
        result = run_cli(["--model", str(model), "--dataset", str(data), "--output-dir", str(out), "--seq-len",
                          str(SEQ), "--global-batch", "4", "--micro-batch", "2", "--max-steps", "6", "--seed",
                          str(SEED), "--lr", "3e-3", "--warmup-steps", "2", "--packing", *extra], nproc=nproc)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        return read_metrics(out)

    whole = run(tmp_path / "whole", "--checkpoint-every", "3")
    assert packed_count(model, data) == 16 and [m["step"] for m in whole] == [1, 2, 3, 4, 5, 6]
    checkpoint = str(tmp_path / "whole" / "checkpoints" / "step-000003")
    for nproc, tol in ((1, 1e-6), (2, 1e-5)):
        resumed = run(tmp_path / f"resumed{nproc}", "--resume", checkpoint, nproc=nproc)
        assert [m["step"] for m in resumed] == [4, 5, 6], resumed
        for got, want in zip(resumed, whole[3:], strict=True):
            assert (got["rows"], got["loss_tokens"], got["tokens"]) == (
                want["rows"],
                want["loss_tokens"],
                want["tokens"],
            )
            assert rel_err(got["loss"], want["loss"]) < tol and rel_err(got["grad_norm"], want["grad_norm"]) < 10 * tol


def test_a_model_with_alibi_is_refused_in_one_line_before_any_work(tmp_path):
    model = save_model(tmp_path / "bloom", "BloomConfig", vocab_size=384, hidden_size=32, n_layer=2, n_head=4)
    data = write_ragged_tokens(tmp_path / "d.jsonl", 8)
    out = tmp_path / "out"
    result = run_cli(["--model", str(model), "--dataset", str(data), "--output-dir", str(out), "--global-batch", "2",
                      "--max-steps", "1", "--packing"])  # fmt: skip
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    assert "--model" in lines[0] and "BLOOM uses ALiBi position biases and takes no position ids" in lines[0], lines
    assert "--no-packing" in lines[0] and not out.exists()


def test_packing_rows_is_refused_with_streaming_in_one_line(tmp_path):
    data = write_ragged_tokens(tmp_path / "d.jsonl", 8)
    model = save_tiny_model(tmp_path / "m")
    result = run_cli(["--model", str(model), "--dataset", str(data), "--output-dir", str(tmp_path / "o"),
                      "--global-batch", "2", "--max-steps", "1", "--packing", "--streaming"])  # fmt: skip
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    assert (
        "--packing of tokens rows packs whole rows from prepared data; it is not available with --streaming" in lines[0]
    )


def test_the_packing_is_seeded_whole_rows_within_seq_len_and_an_oversized_row_alone():
    lengths = np.random.default_rng(0).integers(1, 60, 200)
    lengths[7] = 150  # longer than seq_len: a sequence of its own
    bins = packing.pack(lengths, 100, seed=1)
    assert sorted(np.concatenate(bins).tolist()) == list(range(200))  # every row once, whole
    assert [b.tolist() for b in bins] == [b.tolist() for b in packing.pack(lengths, 100, seed=1)]
    assert [7] in [b.tolist() for b in bins]
    assert all(lengths[b].sum() <= 100 for b in bins if 7 not in b)
    assert len(bins) <= int(np.ceil((lengths.sum() - 150) / 100)) + 2  # best fit: close to the bound
    ties = np.full(40, 30)  # equal lengths: the seed decides which rows share a sequence
    assert [b.tolist() for b in packing.pack(ties, 100, 1)] != [b.tolist() for b in packing.pack(ties, 100, 2)]


def test_document_masking_restarts_positions_after_each_eos_and_keeps_documents_apart(tmp_path):
    """--document-masking: a text block's documents get position ids of their own, so the model's output on a
    document within the block is its output on the document alone."""
    from accum_cli.data.batches import collate

    assert packing.document_positions(np.array([5, 6, 1, 7, 8, 1, 9]), eos=1).tolist() == [0, 1, 2, 0, 1, 2, 0]
    model = transformers.AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "m"), dtype=torch.float32)
    first, second = [5, 6, 7, 1], [8, 9, 10, 11, 12]
    ids = np.array(first + second)
    labels = ids.copy()
    mb = collate([(ids, labels, packing.document_positions(ids, 1)), (ids[:3], labels[:3], np.arange(3))], pad_id=0)
    assert mb.rows == 3  # the documents the microbatch holds (its padding, positions from 0 too, is none)
    assert mb.positions == 2 * len(ids) and mb.tokens == len(ids) + 3  # padding computed, not counted
    with torch.no_grad():
        masked = model(**mb.model_inputs(), use_cache=False).logits[0, len(first) :]  # a cache turns packing off
        alone = model(input_ids=torch.tensor([second])).logits[0]
        crossing = model(input_ids=torch.from_numpy(ids)[None]).logits[0, len(first) :]
    assert rel_err(masked, alone) < TOL and rel_err(crossing, alone) > 100 * TOL


def test_row_by_row_attention_on_a_cpu_equals_the_masked_square(tmp_path):
    """cpu/attention.py: a packed microbatch's attention one row at a time gives the logits and gradients that
    sdpa under transformers' block-diagonal mask gives (Llama with grouped key/value heads)."""
    from accum_cli.cpu import attention
    from accum_cli.data.batches import collate

    model = transformers.AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "m"), dtype=torch.float32)
    rng = np.random.default_rng(0)
    rows = [rng.integers(3, 300, n) for n in (7, 12, 5, 9, 20)]
    packed = [np.concatenate(rows[:3]), np.concatenate(rows[3:])]
    positions = [np.concatenate([np.arange(len(r)) for r in rows[:3]]), np.concatenate([np.arange(9), np.arange(20)])]
    mb = collate([(ids, ids.copy(), pos) for ids, pos in zip(packed, positions, strict=True)], pad_id=0)
    assert attention.spans(mb.position_ids) == [[(0, 7), (7, 19), (19, 24), (24, 29)], [(0, 9), (9, 29)]]

    def forward_backward(apart: bool):
        model.zero_grad()
        with attention.rows_apart(mb.position_ids if apart else None):
            logits = model(**mb.model_inputs(), use_cache=False).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    (masked, masked_grads), (apart, apart_grads) = forward_backward(False), forward_backward(True)
    real = mb.attention_mask.bool()
    assert rel_err(apart[real], masked[real]) < TOL and rel_err(apart_grads, masked_grads) < TOL
    sdpa = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert sdpa.__module__.startswith("transformers"), "the model's own sdpa is back after the forward"


def test_document_masking_trains_text_and_is_refused_for_rows(tmp_path):
    model = save_tiny_model(tmp_path / "m", chat_template=CHAT_TEMPLATE)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"doc {i} " + "ab" * (i % 7)}) + "\n" for i in range(60)))
    plain, _ = one_step(model, text, tmp_path / "plain", 4)
    masked, header = one_step(model, text, tmp_path / "masked", 4, "--document-masking")
    assert "documents masked: each attends within itself only (--document-masking)" in header
    assert masked["loss_tokens"] == plain["loss_tokens"] and rel_err(masked["loss"], plain["loss"]) > 100 * TOL
    chat = write_chat(tmp_path / "chat.jsonl")
    result = run_cli(["--model", str(model), "--dataset", str(chat), "--output-dir", str(tmp_path / "o"),
                      "--global-batch", "2", "--max-steps", "1", "--document-masking"])  # fmt: skip
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    assert lines[0].endswith("--document-masking applies to packed text; the dataset holds chat rows"), lines
