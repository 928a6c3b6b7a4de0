"""`accum-train verify` (issue 39): the configured run's first steps against a reference that differs
only in how the global batch is split and reduced, through the real command on real tiny models.
It passes where accum-train is exact (both layouts, one and two ranks, ragged batches, bf16, other
architectures) and fails, naming the quantity and the step, on the faults it exists to find: a model
whose forward mixes the samples of its batch, and the classic normalisation bug injected into the
real ranks. Nothing is written to --output-dir."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers import free_port, message_lines, run_cli, run_cli_after, save_tiny_model, write_ragged_tokens

G = 13  # ragged at every world size and micro batch used here
COMMON = ["--global-batch", str(G), "--max-steps", "3", "--lr", "1e-3", "--warmup-steps", "0", "--seed", "5",
          "--grad-clip", "1.0"]  # fmt: skip

# A Llama whose MLPs subtract their output's mean over the batch: a sample's loss depends on which
# samples share its forward, as with a norm over the batch in someone's own model code.
BATCH_MIXING_CODE = """
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP


class BatchMixConfig(LlamaConfig):
    model_type = "batchmix"


class BatchMixMLP(LlamaMLP):
    def forward(self, x):
        out = super().forward(x)
        return out - out.mean(dim=0, keepdim=True)


class BatchMixForCausalLM(LlamaForCausalLM):
    config_class = BatchMixConfig

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = BatchMixMLP(config)
"""

# The classic bug, in the real ranks: each microbatch's loss divided by its own loss-token count
# instead of the step's global one (run first in every process: helpers.run_cli_after).
OWN_COUNT_BUG = """
from accum_cli.step import loop

_backward = loop.microbatch_backward


def own_count(model, mb, sync, is_last, loss_tokens, *args, **kwargs):
    return _backward(model, mb, sync, is_last, max(mb.loss_tokens, 1), *args, **kwargs)


loop.microbatch_backward = own_count
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    save_tiny_model(root / "model")
    write_ragged_tokens(root / "data.jsonl")
    return root


def verify(workdir: Path, out: Path, *flags: str, model: Path | None = None, nproc: int = 1, wrapper=False,
           prelude: str | None = None, **how):  # fmt: skip
    """`accum-train verify ...` on `nproc` ranks; through the --nproc wrapper (`verify --nproc N ...`) if asked;
    each rank running `prelude` first if given (helpers.run_cli_after)."""
    launch = ["--nproc", str(nproc), "--master-port", str(free_port())] if wrapper else []
    args = ["verify", *launch, "--model", str(model or workdir / "model"), "--dataset", str(workdir / "data.jsonl"),
            "--output-dir", str(out), *COMMON, *flags]  # fmt: skip
    if wrapper:
        return run_cli(args, nproc=1, launcher="fresh process", **how)
    if prelude is not None:
        return run_cli_after(prelude, args, nproc=nproc, **how)
    return run_cli(args, nproc=nproc, **how)


def passed(result) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict           PASS" in result.stdout, result.stdout
    return result.stdout


@pytest.mark.parametrize(
    "world, layout, micro, sync",
    [(1, "shard", 3, "last"), (1, "replicate", 3, "last"), (2, "replicate", 2, "last")],
    ids=str,
)
def test_passes_in_both_layouts_on_a_ragged_batch_and_writes_nothing(workdir, tmp_path, world, layout, micro, sync):
    """W=2 replicated goes through the --nproc wrapper, which forwards `verify` to its workers. The
    output dir holds a file of the user's, which a training run would refuse; verify leaves it as it is."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    flags = ["--layout", layout, "--micro-batch", str(micro), "--sync", sync]
    stdout = passed(verify(workdir, out, *flags, nproc=world, wrapper=world > 1))
    assert f"{world} rank{'s' if world > 1 else ''}, layout {layout}, micro batch {micro}" in stdout
    assert "one process (rank 0" in stdout and f"the whole global batch of {G} in one forward" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_the_one_process_reference_takes_as_few_forwards_as_the_memory_estimate_allows(workdir, tmp_path):
    """A budget (--device-memory-gib) that holds the tiny model's state but not the whole global batch in one
    forward: the reference splits it into the fewest forwards the estimate fits, says so, and still passes."""
    flags = ["--layout", "replicate", "--micro-batch", "3", "--sync", "last", "--device-memory-gib", "0.007"]
    stdout = passed(verify(workdir, tmp_path / "out", *flags))
    found = re.search(
        rf"the global batch of {G} in (\d+) forwards of up to (\d+) samples \(sized by the memory estimate", stdout
    )
    assert found, stdout
    forwards, per_forward = map(int, found.groups())
    assert 1 < per_forward < G and forwards == -(-G // per_forward), stdout


@pytest.mark.distributed
def test_two_sharded_ranks_against_micro_batch_1_every_as_json(workdir, tmp_path):
    """Sharded over two ranks, the reference is the same ranks with micro batch 1 and sync every;
    --json prints one document on stdout, two steps of three quantities each."""
    out = tmp_path / "out"
    result = verify(workdir, out, "--layout", "shard", "--micro-batch", "3", "--sync", "last", "--verify-steps", "2",
                    "--json", nproc=2)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "pass" and report["exit_code"] == 0 and report["reference_kind"] == "same-ranks"
    assert "micro batch 1 (7 microbatches per rank), sync every" in report["reference"]
    assert [s["step"] for s in report["steps"]] == [1, 2]
    for step in report["steps"]:
        for quantity in ("loss", "grad_norm", "parameters"):
            assert step[quantity]["ok"] and step[quantity]["relative"] <= step[quantity]["tolerance"], step
    assert report["steps"][0]["parameters"]["parameter"].startswith("model.")
    assert not out.exists()


def test_bf16_passes_within_the_bf16_tolerances(workdir, tmp_path):
    stdout = passed(verify(workdir, tmp_path / "out", "--precision", "bf16", "--micro-batch", "3", "--sync", "last",
                           "--layout", "shard"))  # fmt: skip
    assert "precision         bf16; tolerance (relative) loss 0.001, grad norm 0.01" in stdout
    assert "under bf16 autocast over fp32 weights" in stdout


def save_architecture(path: Path, name: str) -> Path:
    vocab = 384
    configs = {
        # GPT-2 with its default dropouts (0.1): verify switches them off, and says so
        "gpt2": transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        # a mixture of experts with its router's balancing loss on (exact under accumulation)
        "qwen2-moe": transformers.Qwen2MoeConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, output_router_logits=True,
            router_aux_loss_coef=0.5,
        ),
        # attention keys with a bias, whose gradient softmax cancels: rounding noise, left out of the check
        "opt": transformers.OPTConfig(vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32),
    }  # fmt: skip
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(configs[name]).save_pretrained(path)
    return path


@pytest.mark.parametrize("name", ["gpt2", "qwen2-moe", "opt"])
def test_passes_on_other_architectures(workdir, tmp_path, name):
    model = save_architecture(tmp_path / name, name)
    stdout = passed(verify(workdir, tmp_path / "out", "--micro-batch", "5", "--sync", "every", "--layout", "shard",
                           model=model))  # fmt: skip
    if name == "gpt2":
        assert "set to 0: resid_pdrop 0.1, embd_pdrop 0.1, attn_pdrop 0.1" in stdout
    if name == "opt":  # OPT sets dropout 0.1 too; its key biases' parameters part by up to 2 lr, rightly
        assert "left out, their gradient is rounding noise" in stdout and "k_proj.bias" in stdout, stdout


def test_a_forward_that_mixes_the_samples_of_its_batch_fails_on_the_loss_at_step_1(workdir, tmp_path):
    model = tmp_path / "batchmix"
    shutil.copytree(workdir / "model", model)
    (model / "batchmix.py").write_text(BATCH_MIXING_CODE)
    config = json.loads((model / "config.json").read_text())
    config |= {"model_type": "batchmix", "architectures": ["BatchMixForCausalLM"],
               "auto_map": {"AutoConfig": "batchmix.BatchMixConfig",
                            "AutoModelForCausalLM": "batchmix.BatchMixForCausalLM"}}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = verify(workdir, out, "--micro-batch", "3", "--sync", "last", "--layout", "shard", "--trust-remote-code",
                    model=model)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "verdict           FAIL: the loss differs at step 1" in result.stdout, result.stdout
    assert "a forward that mixes the samples of a batch" in result.stdout
    assert not out.exists()


@pytest.mark.distributed
def test_the_classic_normalisation_bug_in_the_real_ranks_fails_on_the_gradient_norm(workdir, tmp_path):
    """The loss the run reports is summed apart from the backward, so the bug shows first in the gradient norm."""
    result = verify(workdir, tmp_path / "out", "--layout", "replicate", "--micro-batch", "3", "--sync", "last",
                    "--json", nproc=2, prelude=OWN_COUNT_BUG)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "fail"
    assert report["first_difference"] == {"step": 1, "quantity": "grad_norm", "parameter": None}
    assert any("divided by its own token count" in cause for cause in report["causes"])
    assert report["steps"][0]["loss"]["ok"] and not report["steps"][0]["grad_norm"]["ok"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--verify-steps", "0"], "--verify-steps must be a positive integer, got '0'"),
        (["--verify-steps"], "--verify-steps needs a value"),
        (["--plan"], "verify runs the first steps of the run from its initial weights; drop --plan"),
        (["--resume", "auto"], "drop --resume"),
    ],
)
def test_bad_input_is_one_line_exit_2(workdir, tmp_path, flags, message):
    result = verify(workdir, tmp_path / "out", *flags)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = message_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("accum-train: error: ") and message in lines[0], result.stderr
