"""Load a Hugging Face causal LM and its tokenizer, shard it with FSDP2, save it back.

Sharding: `fully_shard` on every decoder layer (the classes the model names in
`_no_split_modules`), then on the root, which owns the embeddings, the final norm and the
LM head. Tied input/output embeddings are one parameter of the root group, so they are
sharded, gathered and reduced once (sharding the embedding and the head separately would
split one parameter across two groups).

Attention: the best implementation the model class supports on this device (sdpa where it
can, else the class's own default, eager), or the one the user asked for, checked against the
class before any work.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import importlib.util
import json
import os
import pickle
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

# FSDP2's interface for a reduce-scatter of one's own (set_custom_reduce_scatter takes one): public
# API with a private home, imported in this one place (an upgrade that moves it fails at import).
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from accum_cli import cpu_linear, fused_loss, grad_use, kernels, moe, outdir, vocab_parallel
from accum_cli.config import ATTENTION_IMPLEMENTATIONS
from accum_cli.errors import UserError, first_line
from accum_cli.sharding import ShardSettings

EMBEDDED_MODEL_DIR = Path(__file__).parent / "embedded" / "model"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings")  # fmt: skip
MAX_LAYERS = 2048  # beyond any real model; a typo here would otherwise spend minutes building it
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the model comes from, checked before anything heavy happens."""

    name: str  # what the user passed, or "embedded"
    location: str  # a local folder or a hub id
    is_local: bool
    has_weights: bool


def resolve_source(model: str | None) -> ModelSource:
    if model is None:
        return ModelSource("embedded", str(EMBEDDED_MODEL_DIR), True, False)
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"--model {model} is a file; pass the folder written by save_pretrained")
        if not (path / "config.json").is_file():
            raise UserError(f"--model {model} has no config.json; pass a folder written by save_pretrained")
        has_weights = any(any(path.glob(p)) for p in WEIGHT_PATTERNS)
        return ModelSource(model, str(path), True, has_weights)
    if model.startswith((".", "/", "~")) or not _HUB_ID.match(model):
        raise UserError(f"--model {model} does not exist; pass an existing folder or a hub id")
    return ModelSource(model, model, False, True)


def load_config(source: ModelSource, trust_remote_code: bool):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        with _quiet_transformers():  # its warnings on a broken config would bury our one line
            config = AutoConfig.from_pretrained(source.location, trust_remote_code=trust_remote_code)
    except Exception as exc:  # a folder's config.json can hold anything (a size as a string, ...)
        if "custom code" in str(exc) or "trust_remote_code" in str(exc):
            raise UserError(
                f"--model {source.name} ships its own code (auto_map) to run at load; read it, then pass "
                "--trust-remote-code if you trust it"
            ) from None
        hint = "" if source.is_local else " (is the hub reachable from here?)"
        raise UserError(f"--model {source.name}: cannot read its config{hint}: {first_line(exc)}") from None
    for name in SIZE_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise UserError(f"--model {source.name}: its config has {name} {value}; it must be a positive integer")
    remote_causal = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not (remote_causal and trust_remote_code):
        arch = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        extra = " (it ships its own code: add --trust-remote-code)" if remote_causal else ""
        raise UserError(
            f"--model {source.name} ({arch}) is not a causal language model{extra}; "
            "pass a model that AutoModelForCausalLM can load"
        )
    if getattr(config, "is_decoder", None) is False:
        # An encoder family's causal LM head (BERT, RoBERTa, ELECTRA, ...) attends to the tokens it
        # predicts unless its config says decoder: trained so, it learns to copy the next token.
        config.is_decoder = True
    return config


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _causal_lm_class(config):
    """The class AutoModelForCausalLM instantiates for this config; None for remote code."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)


# Flash attention packages, by implementation: transformers imports them at load time.
_FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def _attention_problem(cls, name: str, device_type: str) -> str | None:
    """Why `cls` cannot use attention `name` on this device, or None when it can."""
    if name == "eager":
        return None
    if name == "sdpa":
        return None if cls._supports_sdpa else f"{cls.__name__} does not support it"
    if name == "flex_attention":
        return None if cls._supports_flex_attn else f"{cls.__name__} does not support it"
    if not cls._supports_flash_attn:
        return f"{cls.__name__} does not support it"
    if device_type != "cuda":
        return "flash attention needs a CUDA device"
    if importlib.util.find_spec(_FLASH_PACKAGES[name]) is None:
        return f"the {_FLASH_PACKAGES[name]} package is not installed"
    return None


def set_attention(config, requested: str | None, device_type: str) -> None:
    """Check the attention implementation against the model class and record it on the config
    (transformers' own field for it), so that every load of this config uses it.

    Not asked for: sdpa where the class supports it (PyTorch's fused attention, which on CUDA
    dispatches to flash kernels itself), else eager, the default of classes without sdpa.
    Flash attention packages are used only on request: they change numerics and need bf16."""
    cls = _causal_lm_class(config)
    if cls is None:  # the model's own code: transformers applies its default or checks the request
        config._attn_implementation = requested
        return
    if requested is None:
        config._attn_implementation = "sdpa" if _attention_problem(cls, "sdpa", device_type) is None else "eager"
        return
    problem = _attention_problem(cls, requested, device_type)
    if problem is not None:
        usable = [n for n in ATTENTION_IMPLEMENTATIONS if _attention_problem(cls, n, device_type) is None]
        raise UserError(f"--attn-implementation {requested}: {problem}; use one of: {', '.join(usable)}")
    config._attn_implementation = requested


def check_router_loss(config, moe_aux_loss: str) -> None:
    """A mixture of experts' balancing loss can be computed as --moe-aux-loss asks (moe.py)."""
    moe.check_exact(config, moe_aux_loss, _causal_lm_class(config))


def describe_attention(config, requested: str | None) -> str:
    """The header's attention line: what runs and why."""
    name = config._attn_implementation
    cls = _causal_lm_class(config)
    if requested is not None:
        return f"{requested} (requested)"
    if cls is None:
        return f"{name or 'the model code default'} (its own code decides)"
    if name == "sdpa":
        return "sdpa (PyTorch fused attention, the best this model class supports here)"
    return f"{name} ({cls.__name__} has no sdpa; its default)"


def describe_model(config, requested_attention: str | None, moe_aux_loss: str) -> list[str]:
    """Header lines: the attention that runs and, for a mixture of experts, its balancing loss."""
    lines = [f"attention         {describe_attention(config, requested_attention)}"]
    router = moe.describe(config, moe_aux_loss)
    if router is not None:
        lines.append(f"router aux loss   {router}")
    return lines


def parameter_shapes(config, trust_remote_code: bool) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes without allocating weights (meta device); tied weights once."""
    from transformers import AutoModelForCausalLM

    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise UserError(
            f"the model's config asks for {layers:,} layers, more than the {MAX_LAYERS:,} accum-train builds; "
            "check num_hidden_layers in its config.json"
        )
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:  # a config no model can be built from (negative sizes, ...)
        raise UserError(
            f"the model's config does not describe a buildable model ({first_line(exc)[:200]}); fix its config.json"
        ) from None
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_weights(source: ModelSource) -> None:
    """Read every safetensors header (cheap): a corrupt or truncated weights file is refused
    before any process group or file exists, not as a traceback mid-load."""
    if not (source.is_local and source.has_weights):
        return
    from safetensors import safe_open

    folder = Path(source.location)
    # transformers reads a single model.safetensors first and never looks at an index beside it:
    # a sharded save into a folder that held a single file would train from the old weights.
    if (folder / "model.safetensors").is_file() and (folder / "model.safetensors.index.json").is_file():
        raise UserError(
            f"--model {source.name}: holds both model.safetensors and model.safetensors.index.json (sharded "
            "weights); transformers would load model.safetensors alone: remove whichever of the two is stale"
        )
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as weights:
                weights.keys()
        except Exception as exc:  # safetensors raises its own error type for a bad header
            raise UserError(
                f"--model {source.name}: weights file {file.name} is corrupt or truncated "
                f"({first_line(exc)[:120]}); restore it from its source"
            ) from None


def load_model(source: ModelSource, config, trust_remote_code: bool, seed: int) -> nn.Module:
    """fp32 master weights on CPU: pretrained when the source has weights, else seeded init."""
    from transformers import AutoModelForCausalLM

    if source.has_weights:
        try:
            with _quiet_transformers():  # its table of missing weights would bury our one line
                model, info = AutoModelForCausalLM.from_pretrained(
                    source.location,
                    config=config,
                    dtype=torch.float32,
                    trust_remote_code=trust_remote_code,
                    attn_implementation=config._attn_implementation,
                    output_loading_info=True,
                )
        except Exception as exc:  # a shard the index names is gone, a tensor of another shape, ...
            if _refused_unpickling(exc):  # torch's own text would advise weights_only=False
                raise UserError(
                    f"--model {source.name}: a weights file holds pickled objects other than tensors, which "
                    "only running code could build; it is not loaded: use safetensors weights from a source you trust"
                ) from None
            raise UserError(
                f"--model {source.name}: its weights cannot be loaded ({first_line(exc)[:200]}); restore the "
                "folder from its source"
            ) from None
        # transformers fills a tensor the files lack with random values and goes on: a model whose
        # names do not match (another prefix, a layer missing) would train from scratch unnoticed.
        missing = sorted(info["missing_keys"])
        if missing:
            raise UserError(
                f"--model {source.name}: its weights files lack {len(missing)} of the model's "
                f"{sum(1 for _ in model.parameters())} tensors (first: {missing[0][:120]}), which would start from "
                "random values; pass a folder whose weights match its config.json"
            )
    else:
        # Every rank draws the same initial weights from the same seed.
        torch.manual_seed(seed)
        model = build_fp32(config, trust_remote_code)
    model.train()
    return model


def _refused_unpickling(exc: BaseException) -> bool:
    """Whether torch.load(weights_only=True) refused a pickle (a .bin that builds other objects)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" in str(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def build_fp32(config, trust_remote_code: bool) -> nn.Module:
    """The model built from its config with fp32 parameters (on the current default device: the
    meta device builds no storage), whatever dtype the config declares. A copy of the config:
    from_config(dtype=fp32) records fp32 in the config it is given, and the run's config must keep
    the dtype the model declares (the default dtype of its export)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(
        copy.deepcopy(config),
        dtype=torch.float32,
        trust_remote_code=trust_remote_code,
        attn_implementation=config._attn_implementation,
    )


def load_tokenizer(source: ModelSource, trust_remote_code: bool):
    """The model's tokenizer; the byte-level ByT5 tokenizer for the embedded model; None if absent."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    if source.name == "embedded":
        return ByT5Tokenizer()
    try:
        return AutoTokenizer.from_pretrained(source.location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:  # none there (pre-tokenised data needs none)
        if "custom code" in str(exc) or "trust_remote_code" in str(exc):  # there, but it runs code: not dropped unsaid
            raise UserError(
                f"--model {source.name}: its tokenizer ships its own code (auto_map) to run at load; read it, then "
                "pass --trust-remote-code if you trust it"
            ) from None
        return None
    except Exception as exc:  # files there that do not make a tokenizer (a tokenizer.json of other content)
        raise UserError(
            f"--model {source.name}: its tokenizer cannot be loaded ({first_line(exc)[:200]}); fix or remove its "
            "tokenizer files"
        ) from None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def compile_layers(model: nn.Module) -> None:
    """Regional compilation, as torchtitan does it: each decoder layer's forward compiled on its
    own, now (`--compile`) or once the run has measured that it pays (`prepare_compile`, then
    `compile_now`). The layers share one class, so they share one compiled graph (compile time is
    one layer's, not the model's), and replacing `forward` rather than the module's call keeps
    FSDP's and checkpointing's hooks eager, outside the graph. The state dict's names do not
    change, so a checkpoint moves freely between compiled and eager runs."""
    prepare_compile(model)
    compile_now(model)


class SwitchableForward:
    """A decoder layer's forward, eager until `compiled` is set. `torch.compile` is lazy: nothing
    compiles until the first compiled call."""

    def __init__(self, eager) -> None:
        self.eager = eager
        self.compiled = None

    def __call__(self, *args, **kwargs):
        return (self.compiled or self.eager)(*args, **kwargs)


def prepare_compile(model: nn.Module) -> None:
    """Every decoder layer's forward made switchable, eager for now (before fully_shard, which
    renames the layers' classes, and before its hooks wrap the forward)."""
    for layer in decoder_layers(model):
        layer.forward = SwitchableForward(layer.forward)


def compile_now(model: nn.Module) -> int:
    """Switch the layers `prepare_compile` made switchable to their compiled forward; how many."""
    switched = 0
    for module in model.modules():  # by what was prepared: fully_shard renames the layers' classes
        forward = module.__dict__.get("forward")
        if isinstance(forward, SwitchableForward) and forward.compiled is None:
            forward.compiled = torch.compile(forward.eager)
            switched += 1
    return switched


def _copy_view_outputs(module: nn.Module, args, output):
    """Forward hook: a layer output that is a view (OPT returns `(residual + h).view(shape)`)
    becomes a tensor of its own. FSDP2 registers its pre-backward hook (which all-gathers the
    layer's parameters for backward) on the outputs, and an in-place op on a view would drop
    that hook silently; FSDP2 warns about it on every step. A copy of the activations of one
    layer removes the hazard for every consumer and layout, and the warning with it."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output._base is not None else output
    if isinstance(output, tuple):
        return tuple(t.clone() if isinstance(t, torch.Tensor) and t._base is not None else t for t in output)
    return output


class InPlaceReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter for gloo ranks, as an all-reduce in place on FSDP's own
    staging buffer followed by a copy of this rank's shard. Gloo's reduce-scatter first copies the
    whole input (a 32K x 512 fp32 output projection: 62.5 MiB more at the backward's peak) and, on
    2 CPU ranks, took 1.8x the time of this (212 vs 117 ms for 64 MiB). The buffer is FSDP's to
    discard once the reduction returns. Synchronous: gloo on CPU has no stream to overlap on."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> None:
        dist.all_reduce(input_tensor, op=op, group=group)
        shards = input_tensor.view(dist.get_world_size(group), -1)
        output_tensor.copy_(shards[dist.get_rank(group)])


def _eager_kernels_and_fused_loss(model: nn.Module, settings: ShardSettings, device: torch.device) -> bool:
    """The eager kernels where the layers stay eager (compiled, they fuse the norm's ops and choose
    their GEMMs themselves), then the fused loss (fused_loss.py, fp32 only), whose probe runs the
    model once: before any layer is compiled, so that the probe is not the compiled layers' first
    call. Returns whether the loss is fused."""
    if not settings.compile:
        kernels.fuse_rms_norms(model)
        cpu_linear.use_onednn(model)
    return not settings.bf16 and fused_loss.install(model, device)


def shard(model: nn.Module, mesh, settings: ShardSettings) -> nn.Module:
    """fully_shard each decoder layer, then the root; gradients are summed, never averaged.

    On a 2-D mesh (replicate, shard) fully_shard gives HSDP."""
    fused = _eager_kernels_and_fused_loss(model, settings, torch.device(mesh.device_type))
    if settings.compile:  # before fully_shard: its hooks then wrap the compiled forward, eager
        compile_layers(model)
    elif settings.compile_auto:
        prepare_compile(model)
    if settings.activation_checkpointing:
        # Inside each layer's forward, so FSDP's hooks re-gather the layer for the recompute.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs = {"mesh": mesh, "reshard_after_forward": settings.reshard_after_forward}
    if settings.bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if settings.offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        layer.register_forward_hook(_copy_view_outputs)  # before fully_shard: runs before FSDP's own hook
        fully_shard(layer, **kwargs)
    embedding, head = edge_units(model)
    if embedding is not None:
        lookup_only = type(embedding).forward is nn.Embedding.forward
        fully_shard(embedding, **kwargs)
        if lookup_only:  # its backward scatters the output's gradient into rows, never reading the weight,
            embedding.set_unshard_in_backward(False)  # so gathering it there would only add to the step's peak
    if head is not None:  # its backward follows its forward at once: resharding between them only re-gathers
        fully_shard(head, **(kwargs | {"reshard_after_forward": False}))
    # The fused loss reads the output projection's weight after the forward; where the root holds
    # it (tied), the root keeps its parameters until its backward, which gathers them first anyway.
    fully_shard(model, **(kwargs | {"reshard_after_forward": False} if fused else kwargs))
    # FSDP2 leaves a parameter without a gradient on this rank (an expert no token of this rank
    # reached) out of its reduce-scatter, so the ranks' collectives would differ in size: gloo
    # aborts, NCCL hangs. Zeros in its place keep them alike and add nothing to the sum; one that
    # no rank had a gradient for gets none back at the step's end (grad_use.py).
    if hasattr(model, "set_reduce_scatter_unused_params"):  # torch >= 2.9
        model.set_reduce_scatter_unused_params(True)
    # One shard dimension: the vocabulary matrices are used where they lie (vocab_parallel.py), the
    # head where the loss is fused.
    if vocab_parallel.qualifies(mesh, settings.offload_params, settings.bf16):
        plain = embedding if embedding is not None and vocab_parallel.plain_lookup(embedding) else None
        vocab_parallel.install(model, mesh.get_group(), plain, head if fused else None, fused_loss.recording_sharded)
    grad_use.track(model, vocab_parallel.born_sharded(model))
    # The root's outputs (logits, router loss) are read only by our loss code, which never changes
    # them in place, so a view among them (Doge's) cannot drop FSDP2's pre-backward hook.
    root_view_warning = f"FSDP2-wrapped module ({type(model).__name__}) returned a view tensor"
    warnings.filterwarnings("ignore", message=re.escape(root_view_warning))
    # The loss is already divided by the global loss-token count, so FSDP must sum across
    # ranks instead of averaging. The divide factor is per module (not recursive). Gloo has
    # no PREMUL_SUM, so there the factor 1.0 also needs forced SUM reductions (DESIGN.md).
    gloo = dist.get_backend() == "gloo"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if gloo:
                module.set_force_sum_reduction_for_comms(True)
                module.set_custom_reduce_scatter(InPlaceReduceScatter())
    return model


def edge_units(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The input embedding and the output projection, each where it can be an FSDP unit of its own:
    parameters of its own (a tied weight is one parameter, which only one unit can hold), held by
    no other module. Left in the root, they stay gathered for the whole forward and backward, with
    their whole gradients, which for a large vocabulary is most of the model (32K x 512 untied:
    73% of a 45M model); as units of their own they are gathered only around their own use."""
    try:
        pair = (model.get_input_embeddings(), model.get_output_embeddings())
    except (AttributeError, NotImplementedError):
        return None, None
    held_by: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            held_by.setdefault(id(param), []).append(module)

    def own(module) -> nn.Module | None:
        if not isinstance(module, nn.Module) or list(module.children()):
            return None
        params = list(module.parameters(recurse=False))
        alone = all(held_by[id(p)] == [module] for p in params)
        return module if params and alone else None

    return own(pair[0]), own(pair[1])


def vocabulary_gathers(model: nn.Module, min_bytes: int) -> list[nn.Module]:
    """The sharded modules whose forward gathers a vocabulary matrix of at least min_bytes: the input
    embedding and the output projection where each is a unit of its own (edge_units), else the root
    that holds it. Where one is used in place (vocab_parallel.py), its own forward runs only when
    it is gathered after all: a microbatch of more rows than the vocabulary, an evaluation."""

    def matrix_bytes(module) -> int:
        weight = getattr(module, "weight", None)
        return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else 0

    own_embedding, head = edge_units(model)
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    gathers = [(own_embedding or model, embedding), (head, head)]
    return [module for module, matrix in gathers if module is not None and matrix_bytes(matrix) >= min_bytes]


def describe_sharding(model: nn.Module) -> str:
    """The header's line on what was wrapped: layer class, FSDP units, the root's parameters."""
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model]
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])

    def base(module: nn.Module) -> str:  # fully_shard renames a module's class FSDP<class>
        return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__

    classes = sorted({base(m) for _, m in units if base(m) in layer_classes})
    n_layers = sum(base(m) in layer_classes for _, m in units)
    edges = "".join(f", {name}" for name, m in units if base(m) not in layer_classes)
    prefixes = tuple(f"{name}." for name, _ in units)
    names_by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not name.startswith(prefixes):
            names_by_param.setdefault(id(param), []).append(name)
    root = [" = ".join(names) + (" (tied)" if len(names) > 1 else "") for names in names_by_param.values()]
    layers = f"{n_layers} x {', '.join(classes)}" if classes else "no decoder-layer class found"
    return f"{len(units) + 1} FSDP units: {layers}{edges} + root holding {', '.join(root) or 'no parameters'}"


def build_replicated(source: ModelSource, config, cfg, settings: ShardSettings, rt) -> nn.Module:
    """The whole model on every rank (layout.py): every rank reads the same weights, or draws
    the same ones from the seed, so the replicas start equal and stay equal."""
    model = load_model(source, config, cfg.trust_remote_code, cfg.seed).to(rt.device)
    _eager_kernels_and_fused_loss(model, settings, rt.device)
    if settings.compile:
        compile_layers(model)
    elif settings.compile_auto:
        prepare_compile(model)
    if settings.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def describe_replicated(model: nn.Module) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    return f"replicated: all {n_params:,} parameters on every rank, gradients summed once per step"


def build_sharded(source: ModelSource, config, cfg, settings: ShardSettings, rt, mesh) -> nn.Module:
    """The sharded model on every rank, its weights read once per rank or once in all."""
    if not (settings.rank0_loading and rt.world_size > 1):
        return shard(load_model(source, config, cfg.trust_remote_code, cfg.seed), mesh, settings)

    # Only rank 0 holds the full weights in CPU memory; the others shard an empty (meta)
    # model and receive their shards by broadcast.
    if rt.is_main:
        model = load_model(source, config, cfg.trust_remote_code, cfg.seed)
        full_state = model.state_dict()
    else:  # fp32 as rank 0's, whatever the config declares: the broadcast copies into these
        with torch.device("meta"):
            model = build_fp32(config, cfg.trust_remote_code)
        model.train()
        full_state = {}
    shard(model, mesh, settings)
    if not rt.is_main:
        model.to_empty(device="cpu" if settings.offload_params else rt.device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    # Buffers that are not in the state dict (rotary inv_freq) come from rank 0 as well.
    for _, buffer in model.named_buffers():
        dist.broadcast(buffer, src=0)
    return model


EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def declared_dtype(config) -> torch.dtype:
    """The dtype a model's config declares (`dtype` in transformers 5, `torch_dtype` before);
    fp32 when it declares none or one we do not export (a model built from a bare config)."""
    for key in ("dtype", "torch_dtype"):
        value = vars(config).get(key)
        if isinstance(value, str):
            value = getattr(torch, value, None)
        if value in EXPORT_DTYPES.values():
            return value
    return torch.float32


def export_dtype(choice: str, config) -> torch.dtype:
    """--export-dtype: auto is the dtype of the config the model was loaded from."""
    return declared_dtype(config) if choice == "auto" else EXPORT_DTYPES[choice]


def stamp_dtype(folder: Path, dtype: torch.dtype) -> None:
    """save_pretrained records the dtype of the module's (fp32 master) parameters, not of the
    tensors it was handed: write the exported one into config.json."""
    path = folder / "config.json"
    record = json.loads(path.read_text())
    key = "torch_dtype" if "torch_dtype" in record and "dtype" not in record else "dtype"
    record[key] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


@contextlib.contextmanager
def safetensors_writes():
    """safetensors reports a failed write (a full disk) as its own SafetensorError, not as an
    OSError: give it back as the OSError it wraps, so the callers' one-line reports see it."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as exc:
        code = _OS_ERROR.search(str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from exc


def follow_umask(tree: Path) -> None:
    """mkdtemp makes 0700 folders and transformers writes 0600 safetensors: give a published
    model the modes every other file gets (0666/0777 less the umask), so colleagues on a
    shared filesystem can read it."""
    mask = os.umask(0)
    os.umask(mask)
    tree.chmod(0o777 & ~mask)
    for path in tree.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def save_final(model: nn.Module, tokenizer, out_dir: Path, is_main: bool, dtype: torch.dtype) -> None:
    """Gather the full weights (a collective) and let rank 0 write HF format atomically, in
    `dtype` (the fp32 master weights cast once, at the end)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return
    # Gathered shards are separate tensors even where the model ties them, so save_pretrained
    # cannot see the tie and would store the tensor twice: keep the name the model stores it as.
    for tied_name in model.get_expanded_tied_weights_keys(all_submodels=True):
        state.pop(tied_name, None)
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.is_dir() and not outdir.is_marked(out_dir) and any(out_dir.iterdir()):
        raise FileExistsError(errno.EEXIST, "it holds files accum-train did not write (move them away)", str(out_dir))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        outdir.mark(tmp, "final model")
        with safetensors_writes():
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        stamp_dtype(tmp, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        follow_umask(tmp)
        if out_dir.exists() and outdir.is_marked(out_dir):
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
