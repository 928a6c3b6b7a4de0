"""LoRA through peft: adapters injected into the loaded model in place (the model keeps its class,
its module names gain `.base_layer` and `.lora_A/B.default`), before it is sharded or replicated.
The base is frozen; the adapters are fp32 (bf16 compute under the run's mixed precision, as every
parameter); only they have gradients and optimizer state. final/ is a peft adapter folder."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from torch import nn

from accum_cli.errors import UserError

INSTALL = "pip install 'accum-train[lora]'"
ADAPTER = "default"  # peft's name for the one adapter
PEFT_PREFIX = "base_model.model."  # where PeftModel.from_pretrained looks for the adapter's keys
SAMPLED_CHUNKS, CHUNK = 16, 1 << 16


def require_peft():
    """The peft module, or one line that says how to install it."""
    try:
        import peft
    except ImportError:
        raise UserError(f"--lora-r needs the peft library, which is not installed: {INSTALL}") from None
    return peft


def check(cfg) -> None:
    """Preflight: what a LoRA run cannot do, refused in one line before any work."""
    if cfg.lora_r is None:
        return
    require_peft()
    if cfg.compile:
        raise UserError("--compile with --lora-r is not supported yet; leave --compile out (LoRA runs stay eager)")
    if not [t for t in cfg.lora_target_modules.split(",") if t.strip()]:
        raise UserError("--lora-target-modules names no module; pass all-linear or names such as q_proj,v_proj")


def spec(cfg) -> dict | None:
    """LoRA's settings as the memory estimate's query holds them (JSON), None without LoRA."""
    if cfg.lora_r is None:
        return None
    return {"lora_r": cfg.lora_r, "lora_alpha": alpha(cfg), "lora_dropout": cfg.lora_dropout,
            "lora_target_modules": cfg.lora_target_modules}  # fmt: skip


def settings_of(spec: dict | None) -> SimpleNamespace:
    """What `apply` reads, from a `spec` (the estimate's child has no TrainConfig of the run)."""
    return SimpleNamespace(**(spec or {"lora_r": None}), seed=0)


@contextlib.contextmanager
def adapters_where_built():
    """Around `apply` in FakeTensorMode (the memory estimate's child, where every tensor is a fake fp32
    CPU tensor): peft moves each new adapter to its base layer's device and dtype with `Module.to()`,
    which cannot swap a fake parameter (torch swaps fake parameters, and peft still holds a reference).
    The adapters are built where the move would put them, so the move is skipped."""
    with mock.patch.object(nn.Module, "to", lambda self, *args, **kwargs: self):
        yield


def alpha(cfg) -> float:
    return float(cfg.lora_alpha) if cfg.lora_alpha is not None else 2.0 * cfg.lora_r


def peft_config(cfg):
    peft = require_peft()
    targets = cfg.lora_target_modules.strip()
    targets = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    return peft.LoraConfig(
        r=cfg.lora_r, lora_alpha=alpha(cfg), lora_dropout=cfg.lora_dropout, target_modules=targets,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip


def apply(model: nn.Module, cfg) -> nn.Module:
    """The adapters injected into `model` (in place), drawn from the run's seed so that every rank
    (and peft's get_peft_model after torch.manual_seed(seed)) draws the same ones; the global RNG is
    left as it was. Every other parameter frozen."""
    if cfg.lora_r is None:
        return model
    return inject(model, peft_config(cfg), cfg.seed)


def inject(model: nn.Module, config, seed: int) -> nn.Module:
    """peft's LoraConfig `config` injected into `model` (see apply)."""
    peft = require_peft()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = peft.inject_adapter_in_model(config, model)
        except ValueError as exc:  # target modules that the model does not have
            raise UserError(f"--lora-target-modules: {str(exc).splitlines()[0][:200]}") from None
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
        if is_adapter(name) and param.dtype != torch.float32 and not param.is_meta:
            param.data = param.data.float()
    return model


def merged(model: nn.Module) -> nn.Module:
    """The model with every adapter merged into the weight it adapts (peft's own merge), its modules
    back to the plain ones: what AutoModelForCausalLM builds and loads."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model


def parameter_shapes(config, cfg, trust_remote_code: bool) -> dict[str, tuple[int, ...]]:
    """The adapted model's parameter names and shapes (meta device): the checkpoint's fingerprint, so
    that a resume with another rank or other target modules is refused as another model is."""
    return adapted_shapes(config, peft_config(cfg), trust_remote_code)


def adapted_shapes(config, lora_config, trust_remote_code: bool) -> dict[str, tuple[int, ...]]:
    """parameter_shapes for peft's LoraConfig `lora_config` (a checkpoint's adapter_config.json): no weights read."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    inject(model, copy.deepcopy(lora_config), seed=0)  # peft may resolve the config's target modules in place
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def state_options(model: nn.Module):
    """What a checkpoint holds: every parameter, or under LoRA the adapters only (the frozen base is
    read from --model again; the fingerprint in meta.json holds which base)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if any(not p.requires_grad for p in model.parameters()):
        return StateDictOptions(ignore_frozen_params=True, strict=False)
    return StateDictOptions()


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def adapted(model: nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in model.named_parameters())


def describe(shapes: dict[str, tuple[int, ...]], cfg) -> str:
    """The header's and --plan's line: the adapters and their share of the parameters (`shapes`:
    the adapted model's, parameter_shapes)."""
    trainable = sum(math.prod(shape) for name, shape in shapes.items() if is_adapter(name))
    total = sum(math.prod(shape) for shape in shapes.values())
    modules = {n.split(".lora_")[0] for n in shapes if is_adapter(n)}
    return (
        f"r={cfg.lora_r} alpha={alpha(cfg):g} dropout={cfg.lora_dropout:g} on {len(modules)} modules "
        f"({cfg.lora_target_modules}): {trainable:,} of {total:,} parameters train ({share(trainable, total)})"
    )


def share(part: int, whole: int) -> str:
    return f"{100 * part / max(whole, 1):.2f}%"


def adapter_state(model: nn.Module, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a full state dict, under the names peft saves them with."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, state_dict=full_state, adapter_name=ADAPTER)
    return {PEFT_PREFIX + name: tensor.detach().float().contiguous() for name, tensor in state.items()}


def save_config(model: nn.Module, folder: Path) -> None:
    """adapter_config.json (peft's) in `folder` where the model carries adapters; nothing otherwise."""
    if hasattr(model, "peft_config") and adapted(model):
        config = copy.deepcopy(model.peft_config[ADAPTER])
        config.base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None)
        config.save_pretrained(str(folder))


def save_adapter(model: nn.Module, full_state: dict[str, torch.Tensor], folder: Path) -> None:
    """A peft adapter folder (adapter_config.json, adapter_model.safetensors) in `folder`, loadable
    with PeftModel.from_pretrained(base_model, folder); the adapters in fp32."""
    from safetensors.torch import save_file

    save_config(model, folder)
    save_file(adapter_state(model, full_state), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def base_identity(source) -> dict:
    """Which base weights the adapters are trained on: the names and sizes of the model's
    safetensors files and a digest of their headers (every tensor's name, dtype, shape, offset) and
    of 16 chunks of 64 KiB spread over each file: another fine-tune of the same architecture differs
    in them, and reading them costs ~1 MiB per file however large. A model built from its config has
    no files: its config and seed make it (the run's fingerprint and config hold both)."""
    if not getattr(source, "has_weights", False):
        return {"model": str(getattr(source, "name", "")), "weights": None}
    digest = hashlib.sha256()
    files = sorted(Path(source.location).glob("*.safetensors"))
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header, 1 << 26)))
            for i in range(SAMPLED_CHUNKS):
                f.seek(8 + header + (size - 8 - header) * i // SAMPLED_CHUNKS)
                digest.update(f.read(CHUNK))
    return {"model": str(getattr(source, "name", "")), "weights": digest.hexdigest()}


def fingerprint(names_and_shapes: str, base: dict) -> str:
    """A checkpoint's model identity under LoRA (16 hex digits, as checkpoint_meta.fingerprint's):
    the adapted model's names and shapes, and the base weights the adapters belong to."""
    return hashlib.sha256(f"{names_and_shapes}:{base['weights']}".encode()).hexdigest()[:16]
