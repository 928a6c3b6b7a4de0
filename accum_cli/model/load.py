"""Load a Hugging Face causal LM and its tokenizer, checked before any weight is read.

The config first (size fields bounded, remote code only with --trust-remote-code), the weights'
files verified (no unpickling), the attention implementation the best the model class supports
on this device (sdpa where it can, else the class's own default, eager) or the one the user
asked for, checked against the class before any work. Wrapping for the layout is model/wrap.py.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# FSDP2's interface for a reduce-scatter of one's own (set_custom_reduce_scatter takes one): public
# API with a private home, imported in this one place (an upgrade that moves it fails at import).
from accum_cli.config.settings import ATTENTION_IMPLEMENTATIONS
from accum_cli.errors import UserError, first_line
from accum_cli.model import moe

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
    check_remote_code(source, config, trust_remote_code)
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


def check_remote_code(source: ModelSource, config, trust_remote_code: bool) -> None:
    """Without --trust-remote-code, a config whose auto_map names code is refused by name. For a
    model_type it knows, transformers loads its own classes and skips that code without a word (an
    unknown type it refuses itself, above): the model would train as another architecture than the
    one its author shipped, and the user would never know."""
    auto_map = getattr(config, "auto_map", None)
    if trust_remote_code or not isinstance(auto_map, dict) or not auto_map:
        return
    # The entry that changes what trains first, for the message: the model class, its config, the rest.
    entry = next((k for k in ("AutoModelForCausalLM", "AutoConfig") if k in auto_map), next(iter(auto_map)))
    named = json.dumps({entry: auto_map[entry]})  # as config.json writes it, escaped: one line
    named = named if len(named) <= 160 else named[:157] + "..."
    raise UserError(
        f"--model {source.name}: its config's auto_map names code to run at load ({named}), which transformers "
        f"would skip for its own {config.model_type} classes without a word; read it, then pass "
        "--trust-remote-code if you trust it"
    )


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
