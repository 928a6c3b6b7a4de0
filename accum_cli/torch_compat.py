"""Every private torch symbol accum-train uses, behind one door.

Each is public in use but private in home (a leading underscore, `_internal`, `_tools`): a torch
upgrade may move or rename it. They are named here once, resolved on first use (importing this
module imports nothing), and `tests/test_torch_compat.py` resolves every one, so an upgrade that
moves one fails there, naming the symbol, not somewhere deep in a run.

    from accum_cli import torch_compat
    torch_compat.FakeStore()
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> dotted path of where it lives in the torch this project is tested with (2.13)
PRIVATE: dict[str, str] = {
    # The memory estimate (memory/measure.py): a fake process group of any world size, and the
    # trackers that record every tensor's bytes by kind.
    "FakeStore": "torch.testing._internal.distributed.fake_pg.FakeStore",
    "FakeTensorMode": "torch._subclasses.fake_tensor.FakeTensorMode",
    "is_fake": "torch._subclasses.fake_tensor.is_fake",
    "unset_fake_temporarily": "torch._subclasses.fake_tensor.unset_fake_temporarily",
    "FSDPMemTracker": "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker",
    "FSDPRefType": "torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType",
    "MemTracker": "torch.distributed._tools.mem_tracker.MemTracker",
    "MemRefType": "torch.distributed._tools.mem_tracker._MemRefType",
    # What the estimate's trackers override to keep the step's peak alone (memory/measure.py).
    "MemTracker_update_peak_stats": "torch.distributed._tools.mem_tracker.MemTracker._update_peak_stats",
    "MEM_TRACKER_TOTAL_KEY": "torch.distributed._tools.mem_tracker._TOTAL_KEY",
    # FSDP2's interface for a reduce-scatter of one's own (set_custom_reduce_scatter takes one).
    "ReduceScatter": "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter",
    # oneDNN's linear, as inductor's CPU lowering calls it (cpu/linear.py).
    "mkldnn_linear_pointwise": "torch.ops.mkldnn._linear_pointwise",
    # The chunked kernel of F.linear_cross_entropy, called without its autograd (loss/fused_loss.py).
    "linear_cross_entropy_chunked": "torch.nn.modules.linear_cross_entropy._linear_cross_entropy_batch_chunked",
}


class MovedError(ImportError):
    """A private torch symbol is not where this project expects it (a torch upgrade moved it)."""


def resolve(path: str) -> Any:
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except (AttributeError, RuntimeError) as exc:  # torch.ops raises RuntimeError for an unknown op
            raise MovedError(f"{path}: not found in this torch ({exc})") from None
        return obj
    raise MovedError(f"{path}: no module of it imports in this torch")


def __getattr__(name: str) -> Any:
    if name not in PRIVATE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = resolve(PRIVATE[name])
    globals()[name] = value  # resolved once
    return value
