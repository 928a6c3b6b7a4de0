"""Any causal LM: one optimizer step of many architectures equals Hugging Face's own one big batch.

Tiny random models of each family are saved with save_pretrained and trained for one step
through the real CLI on pre-tokenised rows with masked prompts. The reference is independent
of the code under test: one process, no FSDP, the attention transformers picks by itself, one
forward/backward over the whole global batch with the model's own loss (`labels=`), which
for a mixture of experts includes its router balancing loss when the config asks for it.
W=1 runs go in process (CliRunner) to spare a Python start per case; a subset runs W=2.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from helpers import read_metrics, rel_err, run_cli, write_ragged_tokens
from typer.testing import CliRunner

from accum_cli.cli.main import app
from accum_cli.data.batches import SampleOrder

G, SEED, TOL = 12, 3, 1e-5
VOCAB = 384  # write_ragged_tokens draws ids below 384
NO_DROPOUT = {"attention_dropout": 0.0}
LLAMA_LIKE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
)  # fmt: skip
GPT2_LIKE = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
AUX_COEF = 0.5  # far above real configs' 0.001, so that dropping the term moves the gradient norm too
ROUTER_LOSS = {"output_router_logits": True, "router_aux_loss_coef": AUX_COEF}

# name -> (config class, keyword arguments); every dropout is 0 so train mode is deterministic.
ARCHITECTURES = {
    "llama": ("LlamaConfig", LLAMA_LIKE | {"tie_word_embeddings": False}),
    "llama-tied": ("LlamaConfig", LLAMA_LIKE | {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", LLAMA_LIKE),
    "qwen3": ("Qwen3Config", LLAMA_LIKE | {"head_dim": 8}),
    "mistral": ("MistralConfig", LLAMA_LIKE),
    "gemma2": ("Gemma2Config", LLAMA_LIKE | {"head_dim": 8}),  # no sdpa: eager
    "gemma3": ("Gemma3TextConfig", LLAMA_LIKE | {"head_dim": 8}),
    "phi3": ("Phi3Config", LLAMA_LIKE | {"resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "olmo2": ("Olmo2Config", LLAMA_LIKE),
    "stablelm": ("StableLmConfig", LLAMA_LIKE | {"hidden_dropout": 0.0}),
    "gpt-neox": ("GPTNeoXConfig", LLAMA_LIKE | {"hidden_dropout": 0.0}),
    "falcon": (
        "FalconConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=0,
        ),
    ),  # fmt: skip
    "opt": (
        "OPTConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            word_embed_proj_dim=32,
        ),
    ),  # fmt: skip
    "gpt2": ("GPT2Config", GPT2_LIKE),
    "gpt-bigcode": ("GPTBigCodeConfig", GPT2_LIKE),
    "bloom": (
        "BloomConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            n_layer=2,
            n_head=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=0,
        ),
    ),  # no sdpa: eager  # fmt: skip
    "gpt-neo": (
        "GPTNeoConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=64,
            window_size=8,
            embed_dropout=0.0,
            attention_dropout=0.0,
            resid_dropout=0.0,
        ),
    ),  # fmt: skip
    # Mixtures of experts: Mixtral's family and Qwen's (Qwen2-MoE with its gated shared expert);
    # all but Qwen3-MoE (router loss in its own tests below) with the router loss on, so each
    # step's balancing term is checked too.
    "mixtral": ("MixtralConfig", LLAMA_LIKE | {"num_local_experts": 4, "num_experts_per_tok": 2} | ROUTER_LOSS),
    "qwen2-moe": ("Qwen2MoeConfig", LLAMA_LIKE | MOE | {"shared_expert_intermediate_size": 32} | ROUTER_LOSS),
    "qwen3-moe": ("Qwen3MoeConfig", LLAMA_LIKE | MOE | {"head_dim": 8, "decoder_sparse_step": 1}),
    "olmoe": ("OlmoeConfig", LLAMA_LIKE | MOE | ROUTER_LOSS),
}
# W=2 `last`: tied, without sdpa, and the view-returning OPT; the mixture of experts at W=2 is
# test_moe_router_balancing_loss_is_exact_at_two_ranks (Qwen3-MoE with its router loss on).
AT_W2 = ["llama-tied", "bloom", "opt"]


def save_model(path: Path, name: str, **overrides) -> Path:
    class_name, kwargs = ARCHITECTURES[name]
    config = getattr(transformers, class_name)(**(kwargs | overrides))
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("archs")
    write_ragged_tokens(root / "data.jsonl")
    return root


@pytest.fixture(scope="module")
def models(workdir):
    """Folders saved on first use, shared by the tests of this module."""
    made: dict[str, Path] = {}

    def get(name: str, **overrides) -> Path:
        key = name + "".join(f"-{k}={v}" for k, v in overrides.items())
        if key not in made:
            made[key] = save_model(workdir / key, name, **overrides)
        return made[key]

    return get


def reference(model_dir: Path, data: Path, **config_overrides) -> tuple[float, float]:
    """One process, no sharding, one forward/backward over the whole global batch: (loss, grad norm)."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    batch = [rows[i] for i in SampleOrder(len(rows), SEED).rows(range(G))]
    width = max(len(r["input_ids"]) for r in batch)
    ids = torch.zeros(G, width, dtype=torch.long)
    labels = torch.full((G, width), -100, dtype=torch.long)
    mask = torch.zeros(G, width, dtype=torch.long)
    for i, r in enumerate(batch):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **config_overrides)
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), float("inf"))
    return loss.item(), float(norm)


def cli_args(model_dir: Path, data: Path, out: Path, micro: int, sync: str) -> list[str]:
    return ["--model", str(model_dir), "--dataset", str(data), "--output-dir", str(out), "--global-batch", str(G),
            "--micro-batch", str(micro), "--sync", sync, "--max-steps", "1", "--seed", str(SEED),
            "--lr-schedule", "constant", "--warmup-steps", "0", "--verbose"]  # fmt: skip


def train_in_process(args: list[str]) -> tuple[dict, str]:
    """One run through the real command in this process; fails on FSDP2's view-output warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]
    return read_metrics(Path(args[args.index("--output-dir") + 1]))[0], result.output


def assert_matches(step: dict, ref: tuple[float, float]) -> None:
    errors = rel_err(step["loss"], ref[0]), rel_err(step["grad_norm"], ref[1])
    print(f"rel err loss {errors[0]:.1e}, grad norm {errors[1]:.1e}")  # the figures docs/MODELS.md quotes (pytest -s)
    assert errors[0] < TOL, (step["loss"], ref[0])
    assert errors[1] < TOL, (step["grad_norm"], ref[1])


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_one_step_equals_hf_one_big_batch(workdir, models, tmp_path, name):
    """W=1, micro batch 5 of 12 (5, 5, 2 rows): ragged microbatches with masked prompts."""
    model_dir = models(name)
    step, output = train_in_process(cli_args(model_dir, workdir / "data.jsonl", tmp_path / "run", 5, "every"))
    assert_matches(step, reference(model_dir, workdir / "data.jsonl"))
    assert "attention" in output and "FSDP units: 2 x " in output


@pytest.mark.distributed
@pytest.mark.parametrize("name", AT_W2)
def test_two_ranks_sync_last_equal_hf_one_big_batch(workdir, models, tmp_path, name):
    """W=2 `last`, micro batch 4: each rank runs 4 + 2 rows."""
    model_dir = models(name)
    result = run_cli(cli_args(model_dir, workdir / "data.jsonl", tmp_path / "run", 4, "last"), nproc=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_matches(read_metrics(tmp_path / "run")[0], reference(model_dir, workdir / "data.jsonl"))
    assert "returned a view tensor" not in result.stderr


def test_header_names_attention_and_sharding(workdir, models, tmp_path):
    _, output = train_in_process([*cli_args(models("llama-tied"), workdir / "data.jsonl", tmp_path / "a", 12, "every")])
    assert "sdpa (PyTorch fused attention, the best this model class supports here)" in output
    assert "3 FSDP units: 2 x LlamaDecoderLayer + root holding model.embed_tokens.weight = lm_head.weight (tied)" in (
        output
    )
    assert "host memory       freed tensors go back to the system" in output  # sharded on CPU: hostmem.py
    _, output = train_in_process([*cli_args(models("llama"), workdir / "data.jsonl", tmp_path / "u", 12, "every")])
    assert "5 FSDP units: 2 x LlamaDecoderLayer, model.embed_tokens, lm_head + root holding model.norm.weight" in output
    _, output = train_in_process([*cli_args(models("bloom"), workdir / "data.jsonl", tmp_path / "b", 12, "every")])
    assert "eager (BloomForCausalLM has no sdpa; its default)" in output
    assert "2 x BloomBlock" in output
    _, output = train_in_process([*cli_args(models("llama"), workdir / "data.jsonl", tmp_path / "r", 12, "auto")])
    assert "replicated: all " in output
    assert "host memory       freed tensors kept on the heap for the next microbatch" in output  # hostmem.py


@pytest.mark.parametrize(
    "name, flags, message",
    [
        ("bloom", ["--attn-implementation", "sdpa"],
         "--attn-implementation sdpa: BloomForCausalLM does not support it; use one of: eager"),
        ("bloom", ["--attn-implementation", "flash_attention_2"],
         "--attn-implementation flash_attention_2: BloomForCausalLM does not support it; use one of: eager"),
        ("llama", ["--attn-implementation", "flash_attention_2"], "--attn-implementation flash_attention_2: "
         + ("the flash_attn package is not installed" if torch.cuda.is_available() else "flash attention needs a CUDA device")),
        ("bloom", ["--attn-implementation", "flashy"], "--attn-implementation 'flashy' is unknown; use one of: sdpa, "),
        ("bloom", ["--moe-aux-loss", "sometimes"], "--moe-aux-loss 'sometimes' is unknown; use one of: exact, microbatch"),
    ],
)  # fmt: skip
def test_an_unusable_choice_is_refused_before_any_work(workdir, models, tmp_path, name, flags, message):
    """One line, exit 2, before the process group starts or weights load, nothing written."""
    if name == "llama" and torch.cuda.is_available() and importlib.util.find_spec("flash_attn"):
        pytest.skip("flash attention is usable here")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [*cli_args(models(name), workdir / "data.jsonl", out, 4, "every"), *flags])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"accum-train: error: {message}"), result.output
    assert not torch.distributed.is_initialized()
    assert not out.exists()


def test_a_requested_attention_is_used(workdir, models, tmp_path):
    """eager asked for a model that has sdpa: the header says so and the step still matches."""
    model_dir = models("llama")
    args = [
        *cli_args(model_dir, workdir / "data.jsonl", tmp_path / "run", 5, "every"),
        "--attn-implementation",
        "eager",
    ]
    step, output = train_in_process(args)
    assert "eager (requested)" in output
    assert_matches(step, reference(model_dir, workdir / "data.jsonl", attn_implementation="eager"))


@pytest.fixture(scope="module")
def moe_aux(workdir, models) -> tuple[Path, tuple[float, float], tuple[float, float]]:
    """A Qwen3-MoE config with output_router_logits, and HF's step with and without the router loss."""
    model_dir = models("qwen3-moe", output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    data = workdir / "data.jsonl"
    return model_dir, reference(model_dir, data), reference(model_dir, data, output_router_logits=False)


def test_moe_router_balancing_loss_is_exact_under_accumulation(workdir, moe_aux, tmp_path):
    """Default (exact): ragged microbatches (5, 5, 2 rows) give HF's one-big-batch loss and gradient,
    router balancing loss included; the cross-entropy alone would be far off."""
    model_dir, with_aux, ce_only = moe_aux
    step, output = train_in_process(cli_args(model_dir, workdir / "data.jsonl", tmp_path / "run", 5, "every"))
    assert_matches(step, with_aux)
    assert rel_err(step["loss"], ce_only[0]) > 100 * TOL and rel_err(step["grad_norm"], ce_only[1]) > 100 * TOL
    assert f"router aux loss   {AUX_COEF:g} x load balancing, exact" in output


def test_moe_router_balancing_loss_per_microbatch_is_close(workdir, moe_aux, tmp_path):
    """--moe-aux-loss microbatch: the cross-entropy part is exact; the balancing term, each
    microbatch's own weighted by its token share, is close to the big batch's (docs/MODELS.md)."""
    model_dir, with_aux, ce_only = moe_aux
    args = [*cli_args(model_dir, workdir / "data.jsonl", tmp_path / "run", 5, "every"), "--moe-aux-loss", "microbatch"]
    step, output = train_in_process(args)
    assert "weighted by its token share" in output
    assert rel_err(step["loss"] - AUX_COEF * step["aux_loss"], ce_only[0]) < TOL
    big_batch_aux = (with_aux[0] - ce_only[0]) / AUX_COEF
    print(f"aux {step['aux_loss']:.6f} vs {big_batch_aux:.6f}: rel {rel_err(step['aux_loss'], big_batch_aux):.2e}; "
          f"loss rel {rel_err(step['loss'], with_aux[0]):.2e}, grad norm rel {rel_err(step['grad_norm'], with_aux[1]):.2e}")  # fmt: skip
    assert 0 < rel_err(step["aux_loss"], big_batch_aux) < 3e-3


@pytest.mark.distributed
def test_moe_router_balancing_loss_is_exact_at_two_ranks(workdir, moe_aux, tmp_path):
    """W=2 `last` (4 + 2 rows per rank): expert choices all-reduced over ranks and microbatches."""
    model_dir, with_aux, _ = moe_aux
    result = run_cli(cli_args(model_dir, workdir / "data.jsonl", tmp_path / "run", 4, "last"), nproc=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_matches(read_metrics(tmp_path / "run")[0], with_aux)


def test_a_router_loss_of_another_form_is_refused_when_exact(workdir, tmp_path):
    """Doge's product-key router balances differently: exact is refused in one line before any
    work (nothing written, so the advice works as given), microbatch runs."""
    config = transformers.DogeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, is_moe=True, num_experts=16, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=AUX_COEF, pad_token_id=0,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "doge")
    args = cli_args(tmp_path / "doge", workdir / "data.jsonl", tmp_path / "run", 5, "every")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "accum-train: error: doge: the model's router loss is not transformers' load_balancing_loss_func, "
        "so its exact share cannot be computed here; pass --moe-aux-loss microbatch"
    ]
    assert not (tmp_path / "run").exists()
    step, _ = train_in_process([*args, "--moe-aux-loss", "microbatch"])
    assert step["aux_loss"] > 0


def test_an_encoder_familys_causal_head_does_not_see_the_tokens_it_predicts(tmp_path):
    """BERT's, RoBERTa's ... causal LM heads attend both ways unless their config says decoder:
    trained so, the model learns to copy the next token. Built as accum-train builds it, a change
    at position 9 reaches no position before it."""
    from transformers import BertConfig

    from accum_cli.model import load as modeling

    BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64).save_pretrained(tmp_path)  # fmt: skip
    source = modeling.resolve_source(str(tmp_path))
    model = modeling.load_model(source, modeling.load_config(source, False), False, 0).eval()
    ids = torch.randint(5, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 9] += 1
    with torch.no_grad():
        before, after = model(input_ids=ids).logits, model(input_ids=changed).logits
    assert torch.equal(before[0, :9], after[0, :9])
    assert not torch.equal(before[0, 9:], after[0, 9:])
