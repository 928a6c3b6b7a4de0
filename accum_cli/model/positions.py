"""Whether a model can train rows packed with position ids of their own (--packing of rows, data/packing.py).

Packed rows are kept apart by their position ids alone: transformers builds block-diagonal attention masks from
them (masking_utils.find_packed_sequence_indices) when the model takes position ids and makes its masks with
masking_utils. A model that cannot (ALiBi biases, no position ids, layers that are not attention) would let
rows attend to one another, or shift their positions, and train something else than the rows unpacked.
"""

from __future__ import annotations

import inspect
import sys

ALIBI = {"bloom": "BLOOM", "mpt": "MPT"}  # model types whose positions are ALiBi biases
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}
MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")


def packing_refusal(config) -> str | None:
    """Why the model of `config` cannot train packed rows, or None where it can."""
    model_type = getattr(config, "model_type", "")
    if model_type in ALIBI or getattr(config, "alibi", False):
        return f"{ALIBI.get(model_type, model_type)} uses ALiBi position biases and takes no position ids"
    layers = {str(t) for t in getattr(config, "layer_types", None) or []} - ATTENTION_LAYERS
    if layers:
        return f"its {', '.join(sorted(layers))} layers ignore position ids"
    cls = _causal_lm_class(config)
    if cls is None:
        return "ships its own model code, whose use of position ids is not known"
    if "position_ids" not in inspect.signature(cls.forward).parameters:
        return f"{cls.__name__} takes no position ids"
    source = inspect.getsource(sys.modules[cls.__module__])
    if not any(name in source for name in MASK_BUILDERS):
        return f"{cls.__name__} builds its attention masks without position ids"
    return None


def _causal_lm_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


def refusal_line(model_name: str, reason: str, document_masking: bool = False) -> str:
    what, fix = ("--document-masking", "drop it") if document_masking else ("--packing of rows", "pass --no-packing")
    return f"{what} keeps them apart by their position ids, but --model {model_name} cannot: {reason}; {fix}"
