"""One optimizer step over a step's microbatches: exact for any layout and sync policy.

Each microbatch backpropagates sum(token losses) / (loss tokens of the whole global batch),
the count all-reduced before the first backward, and FSDP sums (never averages) across
ranks, so the accumulated gradient is the gradient of the one-big-batch token mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
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


def global_counts(microbatches: list[Microbatch], device: torch.device) -> tuple[int, int]:
    local = [sum(mb.loss_tokens for mb in microbatches), sum(mb.tokens for mb in microbatches)]
    counts = all_reduce_sum(torch.tensor(local, dtype=torch.int64, device=device))
    loss_tokens, tokens = (int(c) for c in counts.tolist())
    return loss_tokens, tokens


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    microbatches: list[Microbatch],
    sync: str,
    grad_clip: float,
    device: torch.device,
    step: int = 0,
) -> StepResult:
    loss_tokens, tokens = global_counts(microbatches, device)
    if loss_tokens == 0:
        raise NonFiniteError(f"step {step} has no loss tokens: every label is -100")

    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for index, mb in enumerate(microbatches):
        set_sync_flags(model, sync, is_last=index == len(microbatches) - 1)
        mb = mb.to(device)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        mb_loss_sum = token_loss_sum(logits, mb.labels)
        (mb_loss_sum / loss_tokens).backward()
        loss_sum += mb_loss_sum.detach()

    loss = all_reduce_sum(loss_sum).item() / loss_tokens
    max_norm = grad_clip if grad_clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(f"step {step}: loss {loss}, grad norm {grad_norm}; nothing was applied")

    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, loss_tokens, tokens, grad_norm, lr)
