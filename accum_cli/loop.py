"""One optimizer step over a step's microbatches: exact for any layout and sync policy.

Each microbatch backpropagates sum(token losses) / (loss tokens of the whole global batch),
the count all-reduced before the first backward, and FSDP sums (never averages) across
ranks, so the accumulated gradient is the gradient of the one-big-batch token mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from accum_cli import policy
from accum_cli.data import IGNORE_INDEX, Microbatch
from accum_cli.runtime import all_reduce_sum


class NonFiniteError(RuntimeError):
    """A loss or gradient norm that is NaN or infinite, caught before the optimizer step."""


@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float  # token-weighted mean over the whole global batch, the same on every rank
    loss_tokens: int  # global
    tokens: int  # global, padding excluded
    grad_norm: float  # total L2 norm before clipping
    lr: float  # the learning rate this step used
    skipped: bool = False  # non-finite values with --on-nonfinite skip: nothing was applied


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the positions that count, in fp32."""
    vocab = logits.size(-1)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def set_sync_flags(model: nn.Module, sync: str, is_last: bool) -> None:
    """Apply the sync policy before a microbatch's forward (the flags recurse to every layer)."""
    if sync in (policy.LAST, policy.LAST_KEEP_PARAMS):
        model.set_requires_gradient_sync(is_last)
    if sync == policy.LAST_KEEP_PARAMS:
        model.set_reshard_after_backward(is_last)
    if sync == policy.HSDP_DEFER:
        model.set_requires_all_reduce(is_last)


def microbatch_backward(
    model: nn.Module, mb: Microbatch, sync: str, is_last: bool, loss_tokens: int, device: torch.device
) -> torch.Tensor:
    """One microbatch's forward and backward under the sync policy; its loss sum, detached.
    The memory estimate (estimate.py) runs this same code on a fake model."""
    set_sync_flags(model, sync, is_last)
    mb = mb.to(device)
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    mb_loss_sum = token_loss_sum(logits, mb.labels)
    (mb_loss_sum / loss_tokens).backward()
    return mb_loss_sum.detach()


def global_counts(microbatches: list[Microbatch], device: torch.device) -> tuple[int, int]:
    local = [sum(mb.loss_tokens for mb in microbatches), sum(mb.tokens for mb in microbatches)]
    counts = all_reduce_sum(torch.tensor(local, dtype=torch.int64, device=device))
    loss_tokens, tokens = (int(c) for c in counts.tolist())
    return loss_tokens, tokens


def where_nonfinite(mb_losses: list[torch.Tensor], device: torch.device) -> str:
    """Collective, on the failure path only: the first rank and microbatch whose loss is not finite."""
    bad = (~torch.isfinite(torch.stack(mb_losses))).nonzero()
    first = int(bad[0, 0]) + 1 if len(bad) else 0
    per_rank = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    per_rank[dist.get_rank()] = first
    per_rank = all_reduce_sum(per_rank).tolist()
    for rank, index in enumerate(per_rank):
        if index:
            return f"non-finite loss in microbatch {index - 1} on rank {rank}"
    return "the loss is finite in every microbatch but the gradient norm is not"


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    microbatches: list[Microbatch],
    sync: str,
    grad_clip: float,
    device: torch.device,
    step: int = 0,
    on_nonfinite: str = "abort",
) -> StepResult:
    loss_tokens, tokens = global_counts(microbatches, device)
    if loss_tokens == 0:
        raise NonFiniteError(f"step {step} has no loss tokens: every label is -100")

    mb_losses = [  # kept on the device: no host sync per microbatch
        microbatch_backward(model, mb, sync, index == len(microbatches) - 1, loss_tokens, device)
        for index, mb in enumerate(microbatches)
    ]

    loss = all_reduce_sum(torch.stack(mb_losses).sum()).item() / loss_tokens
    max_norm = grad_clip if grad_clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    lr = optimizer.param_groups[0]["lr"]
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        if on_nonfinite == "skip":
            scheduler.step()  # the schedule follows the step count, applied or not
            return StepResult(loss, loss_tokens, tokens, grad_norm, lr, skipped=True)
        raise NonFiniteError(f"step {step}: {where_nonfinite(mb_losses, device)}; loss {loss}, grad norm {grad_norm}")

    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, loss_tokens, tokens, grad_norm, lr)
