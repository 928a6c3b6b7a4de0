"""accum-export of a LoRA checkpoint (which holds the adapters, not the frozen base): the adapters as a
peft adapter folder, or with --merge the base model with the adapters merged into its weights, as
AutoModelForCausalLM.from_pretrained loads it. The base comes from --base and must be the one the
adapters were trained on (the checkpoint's fingerprint says which: model/lora.py `fingerprint`)."""

from __future__ import annotations

from pathlib import Path

from accum_cli.errors import UserError
from accum_cli.model import load as modeling
from accum_cli.model import lora
from accum_cli.rundir import checkpoint_meta
from accum_cli.rundir.checkpoint import dcp_load

ADAPTER_CONFIG = "adapter_config.json"  # peft's, written into a LoRA run's every checkpoint


def is_lora(meta) -> bool:
    return ADAPTER_CONFIG in meta.files


def prepare(meta, listed: Path, base: str | None, trust_remote_code: bool):
    """The base from --base with the checkpoint's adapters on it: (the model, the adapters' state, the
    base's config); refused in one line without --base, or with another base than the one trained on."""
    peft = lora.require_peft()
    if base is None:
        raise UserError(
            f"checkpoint {meta.path} holds LoRA adapters, not the model they adapt: pass --base MODEL, the --model "
            "it was trained on"
        )
    source = modeling.resolve_source(base)
    config = modeling.load_config(source, trust_remote_code)
    lora_config = peft.LoraConfig.from_pretrained(str(listed))
    # Checked on the meta device, before the base's weights are read in full.
    shapes = lora.adapted_shapes(config, lora_config, trust_remote_code)
    if lora.fingerprint(checkpoint_meta.fingerprint(shapes), lora.base_identity(source)) != meta.fingerprint:
        raise UserError(
            f"checkpoint {meta.path} holds LoRA adapters trained on another base model than --base {base}; pass "
            "the --model it was trained with"
        )
    model = lora.inject(modeling.load_model(source, config, trust_remote_code, seed=0), lora_config, seed=0)
    state = {"model": {name: p.detach() for name, p in model.named_parameters() if lora.is_adapter(name)}}
    dcp_load(state, meta, "checkpoint", no_dist=True)
    model.load_state_dict(state["model"], strict=False)
    return model, state["model"], config
