"""The sharded layout uses its vocabulary matrices where they lie (accum_cli/loss/vocab_parallel.py):
exact, never gathered for a microbatch with fewer rows than the vocabulary, gathered as before for
one with more. The real CLI's runs of it are in test_equivalence.py (the untied model's sharded
cases: vocabulary 384, at most 240 rows a microbatch over two ranks)."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, launch, run_cli, save_tiny_model, write_ragged_tokens


@pytest.mark.distributed
@pytest.mark.parametrize("sync", ["every", "last", "last-keep-params"])
def test_vocabulary_parallel_edges_train_as_one_process_and_are_not_gathered(tmp_path, sync):
    """Three steps of the run's own train_step on two gloo ranks against an unsharded copy whose
    gradients are all-reduced: an odd vocabulary (19 and 18 rows), a padding row, a head with a
    bias, ignored labels, a placeholder microbatch beside a real one, microbatches of more rows than
    the vocabulary (gathered through FSDP: both ways in one step, in either order), several chunks of
    the loss a microbatch, and an evaluation's forward, whose gathered head a step frees first."""
    out = tmp_path / "vocab.json"
    result = launch(str(REPO / "tests/vocab_probe.py"), [str(out), sync], ranks=2, kind="path", timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in range(2):
        probe = json.loads(out.with_name(f"vocab.json.{rank}").read_text())
        assert probe["installed"] == {"embed": True, "head": True}
        assert {"embed.weight", "head.weight", "head.bias"} <= probe["errors"].keys()
        assert max(probe["errors"].values()) < 1e-6, probe["errors"]
        assert max(probe["loss_errors"]) < 1e-6, probe["loss_errors"]
        first, *mixed = probe["gathers"]
        assert first == {"embed": 0, "head": 0}, first  # 32 rows a microbatch: used in place
        assert all(step["embed"] >= 1 and step["head"] >= 1 for step in mixed), mixed  # 48 rows: gathered
        assert "a token id outside the vocabulary's 37 rows" in probe["refused"]
        assert probe["head_sharded"] and all(probe["head_sharded"]), probe["head_sharded"]


@pytest.mark.distributed
def test_the_header_says_which_matrices_are_used_in_place(tmp_path):
    """A sharded run of an untied model says so; a tied one (one matrix, held by the root) does not."""
    write_ragged_tokens(tmp_path / "data.jsonl")
    for tied in (False, True):
        model = save_tiny_model(tmp_path / f"model-{tied}", tied=tied)
        args = ["--model", str(model), "--dataset", str(tmp_path / "data.jsonl"), "--global-batch", "4",
                "--micro-batch", "2", "--max-steps", "1", "--layout", "shard", "--output-dir", str(tmp_path / f"o{tied}"),
                "--verbose"]  # fmt: skip
        result = run_cli(args, nproc=2)
        assert result.returncode == 0, result.stdout + result.stderr
        line = "model.embed_tokens and lm_head used where they lie (vocabulary-parallel)"
        assert (line in result.stdout) != tied, result.stdout
