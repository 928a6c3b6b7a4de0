"""Promises that no other test pinned down, each by what a user would see: --strict-batch on a
real run, the learning-rate schedule, the data order across epochs and after a resume with
another global batch, the token counts, the prepared-data cache, `auto` on one rank, dropout in
evaluation and on resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import message_lines, run_cli, save_tiny_model, write_ragged_tokens
from typer.testing import CliRunner

from accum_cli.cli.main import app
from accum_cli.config.plan import Plan
from accum_cli.config.settings import TrainConfig
from accum_cli.data import formats, prepare
from accum_cli.data.batches import SampleOrder, collate
from accum_cli.step import optim


def test_strict_batch_refuses_a_real_run(tmp_path):
    model, data = save_tiny_model(tmp_path / "model"), write_ragged_tokens(tmp_path / "data.jsonl", n_rows=12)
    out = tmp_path / "out"
    result = run_cli(["--model", str(model), "--dataset", str(data), "--global-batch", "5", "--micro-batch", "2",
                      "--max-steps", "1", "--strict-batch", "--output-dir", str(out)])  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = message_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("accum-train: error: --strict-batch: global batch 5"), lines
    assert not out.exists()


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_lr_schedule_warms_up_to_the_peak_and_decays_to_the_floor(schedule):
    peak, warmup, total, floor = 1e-3, 4, 12, 0.1
    cfg = TrainConfig(lr=peak, warmup_steps=warmup, lr_schedule=schedule, min_lr_ratio=floor)
    optimizer, scheduler = optim.build(torch.nn.Linear(2, 2), cfg, total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    ramp = [peak * (k + 1) / warmup for k in range(warmup)]
    assert lrs[:warmup] == pytest.approx(ramp), "linear warmup from lr/warmup_steps to lr"
    assert max(lrs) == pytest.approx(peak)
    after = lrs[warmup:]
    assert all(a >= b for a, b in zip(after, after[1:], strict=False)), "never rises after warmup"
    assert after[-1] == pytest.approx(peak * (floor if schedule == "cosine" else 1.0)), "the last step's lr"


def test_every_epoch_is_a_fresh_shuffle_of_every_row():
    n = 50
    order = SampleOrder(n, seed=7)
    epochs = [order.rows(range(e * n, (e + 1) * n)) for e in range(3)]
    for rows in epochs:
        assert sorted(rows) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]


def test_a_resume_with_another_global_batch_continues_at_the_data_position():
    """The checkpoint saved after 3 steps of G=10 (30 samples); the run goes on with G=4."""
    consumed, plan = 30, Plan(4, 1, 2)
    read = [i for r in range(plan.world_size) for j in range(plan.accum_steps)
            for i in plan.microbatch_range(3, r, j, first_sample=consumed)]  # fmt: skip
    assert sorted(read) == list(range(consumed, consumed + plan.global_batch))


def test_padding_is_not_counted_as_tokens():
    ids, labels = [[5, 6, 7], [8], [9, 10, 11, 12]], [[5, 6, 7], [8], [-100, 10, 11, 12]]
    mb = collate([(np.array(i), np.array(t)) for i, t in zip(ids, labels, strict=True)], pad_id=0)
    assert mb.tokens == 8
    assert mb.loss_tokens == 2 + 0 + 3
    assert mb.attention_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_the_prepared_data_cache_is_keyed_by_the_options(tmp_path, monkeypatch):
    """A second run with another --seq-len must not read the first one's blocks."""
    import datasets
    from transformers import ByT5Tokenizer

    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path / "cache"))
    raw = datasets.Dataset.from_dict({"text": ["some words of text " * 20] * 4})
    tokenizer = ByT5Tokenizer()
    lengths = {}
    for seq_len in (16, 32):
        dataset, stats, _ = prepare.prepare(raw, tokenizer, formats.Options(seq_len), True, True, lambda: None)
        lengths[seq_len] = {len(ids) for ids, _ in dataset.rows(range(len(dataset)))}
    assert lengths == {16: {16}, 32: {32}}


def test_auto_on_one_rank_takes_last_whatever_the_memory(tmp_path):
    result = CliRunner().invoke(app, ["--plan", "--global-batch", "64", "--micro-batch", "4", "--world-size", "1",
                                      "--device-memory-gib", "0.0001"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "chosen: last — one rank" in result.output


def test_a_dataset_with_no_rows_is_refused_before_any_work():
    """Local files without rows fail in the loader (sources.py); a hub split can still be empty."""
    import datasets
    from transformers import ByT5Tokenizer

    from accum_cli.errors import UserError

    with pytest.raises(UserError, match="^the dataset is empty; pass a dataset with at least one row$"):
        formats.check(datasets.Dataset.from_dict({"text": []}), ByT5Tokenizer(), formats.Options(16))


def save_dropout_model(path):
    """The tiny model with attention dropout: train mode draws random numbers in every forward,
    as a user's GPT-2 (dropout 0.1) does. accum-train keeps the model's own dropout."""
    save_tiny_model(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.5}))
    return path


def test_eval_loss_is_computed_without_dropout(tmp_path, monkeypatch):
    """The eval loss of a model with dropout is its eval-mode loss, and training mode comes back."""
    import datasets
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, ByT5Tokenizer

    from accum_cli.data.batches import MicrobatchReader
    from accum_cli.loss.tokens import token_loss_sum
    from accum_cli.step.evaluate import eval_loss

    monkeypatch.setenv("ACCUM_TRAIN_CACHE", str(tmp_path / "cache"))
    raw = datasets.Dataset.from_dict({"text": [f"row {i} of some words of text " * 3 for i in range(6)]})
    dataset, _, _ = prepare.prepare(raw, ByT5Tokenizer(), formats.Options(32), True, True, lambda: None)
    model = AutoModelForCausalLM.from_pretrained(save_dropout_model(tmp_path / "model"), dtype=torch.float32)
    model.train()
    reader = MicrobatchReader(dataset, None, pad_id=0)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # conftest ends it
    loss, tokens = eval_loss(model, reader, 0, 1, 2, torch.device("cpu"))
    assert model.training, "training mode is restored after evaluation"
    model.eval()
    with torch.no_grad():
        mb = reader.read(range(len(dataset)))
        want = token_loss_sum(model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits, mb.labels)
    assert tokens == mb.loss_tokens
    assert loss == pytest.approx(float(want) / mb.loss_tokens, rel=1e-5)


def test_resume_restores_the_random_state_dropout_draws_from(tmp_path):
    """With dropout, step 2 of a resumed run is step 2 of the uninterrupted one only if the
    checkpoint's RNG state is restored (the masks differ otherwise)."""
    model, data = save_dropout_model(tmp_path / "model"), write_ragged_tokens(tmp_path / "data.jsonl", n_rows=16)
    common = ["--model", str(model), "--dataset", str(data), "--global-batch", "4", "--micro-batch", "2",
              "--lr-schedule", "constant", "--warmup-steps", "0", "--seed", "3"]  # fmt: skip
    metrics = {}
    for name, steps, extra in (("whole", 2, []), ("part", 1, ["--checkpoint-every", "1"]), ("part", 2, ["--resume"])):
        result = run_cli([*common, "--max-steps", str(steps), "--output-dir", str(tmp_path / name), *extra])
        assert result.returncode == 0, result.stdout + result.stderr
        metrics[name] = {m["step"]: m["loss"] for m in map(json.loads, (tmp_path / name / "metrics.jsonl").open())}
    assert metrics["part"][2] == pytest.approx(metrics["whole"][2], rel=1e-6)
