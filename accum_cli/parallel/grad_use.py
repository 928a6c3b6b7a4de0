"""The sharded layout's parameters that no rank had a gradient for in a step: their gradient is None.

FSDP2 leaves a parameter this rank has no gradient for (an expert no token of this rank
reached) out of its reduce-scatter; the ranks' collectives would then differ, so `model.shard`
has it reduce zeros in its place. A parameter that no rank had a gradient for in the whole step
would then end it with a zero gradient, and AdamW would move it by its momentum and decay it,
where in one process (and in the replicated layout, reduce.py) its gradient is None and AdamW
leaves it alone: an unused module's weights would drift. So a hook on each of FSDP's unsharded
parameters (the tensors autograd accumulates into) marks what this rank used; the step sums the
marks over ranks in the all-reduce that sums its loss (no collective of its own), and a
parameter that no rank marked gets its gradient back to None before the optimizer step. Under
mixed precision with gradients accumulated unreduced, those zeros need the dtype of the unit's
accumulated gradients (`before_last_backward`).

The unsharded parameters are FSDP2's internals (torch 2.7-2.14 lay them out alike). Where a torch
lays them out otherwise, nothing is tracked and such a parameter keeps its zeros.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

ATTRIBUTE = "_accum_gradient_use"


def _fsdp_param_groups(model: nn.Module) -> list[list] | None:
    """FSDP2's per-parameter records, unit by unit, or None where this torch has no such layout."""
    found = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.9: one group per unit, or none
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        found.extend(list(group.fsdp_params) for group in groups)
    if not all(hasattr(p, "sharded_param") for group in found for p in group):
        return None
    return found


class GradientUse:
    """This rank's marks for the current step, one per sharded parameter."""

    def __init__(self, model: nn.Module, groups: list[list]) -> None:
        self.groups = groups
        self.fsdp_params = [p for group in groups for p in group]
        self.marks = [False] * len(self.fsdp_params)
        self.marking = True
        self.unseen = list(range(len(self.fsdp_params)))  # no unsharded parameter yet: not hooked
        # FSDP creates an unsharded parameter at its unit's first all-gather, inside the forward;
        # after the root's forward, and before any backward, every unit that ran has one.
        model.register_forward_hook(lambda module, args, output: self._hook_new())

    def _hook_new(self) -> None:
        if not self.unseen:  # every unit has run: nothing left to do at each microbatch
            return
        unseen = []
        for index in self.unseen:
            unsharded = getattr(self.fsdp_params[index], "_unsharded_param", None)
            if unsharded is None:
                unseen.append(index)
            # A frozen parameter has no gradient to mark (and cannot take the hook): it stays 0.
            elif unsharded.requires_grad:
                unsharded.register_post_accumulate_grad_hook(lambda _, index=index: self._mark(index))
        self.unseen = unseen

    def _mark(self, index: int) -> None:
        if self.marking:
            self.marks[index] = True

    @contextlib.contextmanager
    def not_marking(self) -> Iterator[None]:
        """Around a placeholder microbatch's forward and backward (loop.train_step): its zero
        gradients are no use of a parameter."""
        self.marking = False
        try:
            yield
        finally:
            self.marking = True

    def before_last_backward(self) -> None:
        """Mixed precision, gradients accumulated unreduced (`last`, `last-keep-params`): FSDP holds
        a unit's earlier gradients in its reduce dtype (fp32) and would hand a parameter that has
        none yet (not used on this rank so far) as a bf16 gradient, or bf16 zeros, beside them; its
        reduce-scatter refuses mixed dtypes and the rank leaves the collective. An fp32 zero in
        each such place keeps the unit in one dtype; FSDP adds the last microbatch's gradient to it."""
        for group in self.groups:
            held = [
                p.unsharded_accumulated_grad
                for p in group
                if getattr(p, "unsharded_accumulated_grad", None) is not None
            ]
            if not held:  # nothing accumulated in this unit (one microbatch, fp32): nothing to match
                continue
            for fsdp_param in group:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is None or not unsharded.requires_grad:
                    continue
                if fsdp_param.unsharded_accumulated_grad is None and unsharded.grad is None:
                    fsdp_param.unsharded_accumulated_grad = torch.zeros(
                        unsharded.shape, dtype=held[0].dtype, device=held[0].device
                    )

    def take(self, device: torch.device) -> torch.Tensor:
        """This step's marks (1.0 where this rank had a gradient), to be summed over ranks; cleared."""
        marks = torch.tensor(self.marks, dtype=torch.float32, device=device)
        self.marks = [False] * len(self.fsdp_params)
        return marks

    def drop_unused(self, summed: torch.Tensor) -> None:
        """`summed`: the marks summed over ranks. No rank had a gradient: none, as in one process."""
        for index in (summed == 0).nonzero().flatten().tolist():
            self.fsdp_params[index].sharded_param.grad = None


def track(model: nn.Module, born_sharded: set[int] = frozenset()) -> None:
    """Mark, step by step, the sharded parameters this rank had a gradient for (after fully_shard).
    `born_sharded`: the ids of parameters whose sharded gradient is computed outside FSDP (vocab_parallel.py),
    always, as in one process: not tracked."""
    groups = _fsdp_param_groups(model)
    if groups:
        groups = [[p for p in group if id(p.sharded_param) not in born_sharded] for group in groups]
        groups = [group for group in groups if group]
    if groups:
        setattr(model, ATTRIBUTE, GradientUse(model, groups))


def tracker(model: nn.Module) -> GradientUse | None:
    return getattr(model, ATTRIBUTE, None)
