"""What the memory estimate is asked (`Query`: every input the peak depends on) and what it answers."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

CACHE_VERSION = 9  # bump when what is measured changes, so old figures are not reused
KINDS = ("sharded_params", "unsharded_params", "gradients", "optimizer", "activations", "temporaries")


@dataclass(frozen=True, slots=True)
class Query:
    """Everything the peak depends on; `model_config` is the model's config as a JSON dict."""

    model_config: dict
    world_size: int
    replicas: int
    micro_batch: int
    seq_len: int
    sync: str
    bf16: bool
    activation_checkpointing: bool
    reshard_after_forward: bool = True
    accum_steps: int = 2  # microbatches per step in the estimate (>= 2: the policies differ from the second on)
    replicated: bool = False  # the whole model on every rank (layout.py), not sharded
    device_type: str = "cpu"  # the run's ("cuda", "cpu"): the fused loss's bf16 path differs (fused_loss.py)
    # LoRA's settings (model/lora.py `spec`): frozen base, gradients and AdamW for the adapters only.
    lora: dict | None = None

    def key(self) -> str:
        import torch
        import transformers

        from accum_cli.loss import fused_loss

        fused = [fused_loss.enabled(os.environ), fused_loss.always(os.environ)]  # the child measures as the run trains
        text = json.dumps(
            [CACHE_VERSION, torch.__version__, transformers.__version__, fused, asdict(self)], sort_keys=True
        )
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Estimate:
    peak: int  # bytes per rank at the step's peak
    breakdown: dict  # KINDS -> bytes at that peak
    seconds: float  # time the measurement took (0 when read from the cache)
    cached: bool = False
