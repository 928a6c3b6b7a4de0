"""Regional compilation of the decoder layers: now (`--compile`) or once the run has measured that it pays."""

from __future__ import annotations

import torch
from torch import nn

from accum_cli.model.load import decoder_layers


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
