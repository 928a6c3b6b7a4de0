"""One optimizer step over a step's microbatches: exact for any layout and sync policy.

Each microbatch backpropagates sum(token losses) / (loss tokens of the whole global batch),
the count all-reduced before the first backward, and FSDP sums (never averages) across
ranks, so the accumulated gradient is the gradient of the one-big-batch token mean.
A mixture of experts that asks for its router's balancing loss gets it added, exactly too (moe.py).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from accum_cli.config import policy
from accum_cli.cpu import attention as cpu_attention
from accum_cli.data.batches import Microbatch
from accum_cli.loss import fused_loss, vocab_parallel
from accum_cli.loss.tokens import token_loss_sum
from accum_cli.model import moe
from accum_cli.parallel import grad_use, reduce
from accum_cli.parallel.runtime import all_reduce_sum


class NonFiniteError(RuntimeError):
    """A loss or gradient norm that is NaN or infinite, caught before the optimizer step; or a
    parameter that is, caught before anything is saved from it (check_finite_parameters)."""


def check_finite_parameters(model: nn.Module, step: int, device: torch.device) -> None:
    """Collective, before each save (a checkpoint, and so final/ after the last one): raise
    NonFiniteError on every rank when any rank's parameters hold a NaN or an infinity, naming the
    first such parameter. A finite loss and gradient norm do not make a finite update: AdamW with
    a zero eps gives 0/0 on every row no token reached, and lr x weight decay can overflow fp32,
    and such weights must never become a checkpoint or a final/ that reads as a success. One pass
    over this rank's parameters (a DTensor's local shard), one host sync, one all-reduce: per save,
    not per step. Not skippable with --on-nonfinite skip: the weights themselves are lost."""
    named = list(model.named_parameters())
    if not named:
        return
    bad = torch.stack(
        [~torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all().to(device) for _, p in named]
    )
    # The parameters are listed in the same order on every rank: the lowest bad index names the
    # same parameter everywhere, whichever rank's shard holds it.
    first = torch.where(bad, torch.arange(len(named), device=device), len(named)).min().reshape(1)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    index = int(first.item())
    if index < len(named):
        raise NonFiniteError(
            f"step {step}: parameter {named[index][0]} holds NaN or inf after the update, so no checkpoint or final/ "
            "was written from it (check the model's weights, --lr, --weight-decay and --adam-eps)"
        )


@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float  # token-weighted mean over the whole global batch, the same on every rank
    loss_tokens: int  # global
    tokens: int  # global, padding excluded
    grad_norm: float  # total L2 norm before clipping
    lr: float  # the learning rate this step used
    skipped: bool = False  # non-finite values with --on-nonfinite skip: nothing was applied
    aux_loss: float | None = None  # MoE router balancing loss (unweighted), when the model asks for it
    rows: int = 0  # global: rows (documents) the step held; packed rows count one each, else one per sequence
    positions: int = 0  # global: positions the forwards computed, padding included


def set_sync_flags(model: nn.Module, sync: str, is_last: bool) -> None:
    """Apply the sync policy before a microbatch's forward (the flags recurse to every layer)."""
    if sync in (policy.LAST, policy.LAST_KEEP_PARAMS):
        model.set_requires_gradient_sync(is_last)
    if sync == policy.LAST_KEEP_PARAMS:
        model.set_reshard_after_backward(is_last)
    if sync == policy.HSDP_DEFER:
        model.set_requires_all_reduce(is_last)


@dataclass(frozen=True, slots=True)
class RouterLoss:
    """A mixture of experts' balancing loss, as the model's config asks (moe.py)."""

    coef: float
    config: object
    exact: bool
    step_choices: object  # the step's expert choices (exact), counted before the first backward


def microbatch_backward(
    model: nn.Module,
    mb: Microbatch,
    sync: str,
    is_last: bool,
    loss_tokens: int,
    device: torch.device,
    share: float = 0.0,
    router: RouterLoss | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One microbatch's forward and backward under the sync policy: its loss sum and its router
    term, detached. The memory estimate (estimate.py) runs this same code on a fake model."""
    if isinstance(model, FSDPModule):  # a replicated model reduces once, after the last microbatch
        set_sync_flags(model, sync, is_last)
    mb = mb.to(device)
    # No KV cache: training never reads it, and filling one guards a compiled layer on its index.
    # The output projection left to the loss, where it is fused; the vocabulary matrices used where
    # they lie, where the sharded layout can.
    # Packed rows on a CPU: attention one row at a time, not the masked square (cpu/attention.py).
    rows_apart = cpu_attention.rows_apart(mb.position_ids if device.type == "cpu" else None)
    with vocab_parallel.diverted(model), fused_loss.recording(model), rows_apart:
        out = model(**mb.model_inputs(), use_cache=False)
    recorded = fused_loss.recorded(model, out.logits)
    mb_loss_sum = fused_loss.token_loss_sum(recorded, mb.labels) if recorded else token_loss_sum(out.logits, mb.labels)
    del recorded
    loss = mb_loss_sum / loss_tokens
    aux = None
    if router is not None and not mb.empty:
        aux = (
            balancing_term(out, router.config, mb.attention_mask, router.step_choices)
            if router.exact
            else out.aux_loss.float() * share
        )
        loss = loss + router.coef * aux
    del out  # the logits are then held by the loss's graph alone, freed as soon as its backward ran
    loss.backward()
    return mb_loss_sum.detach(), (aux.detach() if aux is not None else None)


def global_counts(microbatches: list[Microbatch], device: torch.device) -> tuple[int, int]:
    return step_counts(microbatches, device)[:2]


def step_counts(microbatches: list[Microbatch], device: torch.device) -> tuple[int, int, int, int]:
    """The step's global loss tokens, tokens, rows and positions computed, in one all-reduce."""
    local = [[mb.loss_tokens, mb.tokens, mb.rows, mb.positions] for mb in microbatches]
    counts = all_reduce_sum(torch.tensor(local, dtype=torch.int64, device=device).sum(0))
    loss_tokens, tokens, rows, positions = (int(c) for c in counts.tolist())
    return loss_tokens, tokens, rows, positions


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


def balancing_term(out, config, attention_mask: torch.Tensor, step_choices) -> torch.Tensor:
    """This microbatch's exact share of the step's router balancing loss (moe.py). Our formula is
    checked against the model's own aux loss on the same microbatch, so a model that balances
    differently is refused rather than trained on another loss."""
    choices, prob_sums, rows = moe.router_stats(config, out.router_logits, attention_mask)
    own = moe.balancing_loss(choices, prob_sums, rows)
    if not torch.allclose(own.detach(), out.aux_loss.detach().float(), rtol=1e-3, atol=1e-6):
        raise moe.unsupported(config)
    if step_choices is None:  # the step is this one microbatch
        return own
    return moe.balancing_loss(step_choices[0], prob_sums, step_choices[1])


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    microbatches: list[Microbatch],
    sync: str,
    grad_clip: float,
    device: torch.device,
    step: int = 1,  # the step's number, from 1, for messages
    on_nonfinite: str = "abort",
    moe_aux_loss: str = moe.EXACT,
) -> StepResult:
    loss_tokens, tokens, rows, positions = step_counts(microbatches, device)
    if loss_tokens == 0:  # nothing to learn from (every completion cut off, say)
        if on_nonfinite == "skip":  # dropped on every rank alike, as a non-finite step is
            lr = optimizer.param_groups[0]["lr"]
            scheduler.step()
            return StepResult(math.nan, 0, tokens, math.nan, lr, skipped=True, rows=rows, positions=positions)
        raise NonFiniteError(f"step {step} has no loss tokens: every label is -100")

    config = getattr(model, "config", None)
    aux_coef = moe.aux_loss_coef(config)
    # Exact balancing loss: the step's expert choices first, unless the step is one microbatch in all.
    one_microbatch = len(microbatches) == 1 and dist.get_world_size() == 1
    exact_aux = bool(aux_coef) and moe_aux_loss == moe.EXACT
    step_choices = moe.step_choices(model, config, microbatches, device) if exact_aux and not one_microbatch else None
    vocab_parallel.release(model)  # what the choices' forwards (or an evaluation) left gathered
    router = RouterLoss(aux_coef, config, exact_aux, step_choices) if aux_coef else None
    mb_losses = []  # kept on the device: no host sync per microbatch (but vocab_parallel's exchanges)
    mb_aux = [torch.zeros((), device=device)]
    replicated = not isinstance(model, FSDPModule)  # FSDP2 reduces under the sync policy's flags
    use = grad_use.tracker(model)  # the sharded layout's marks of which parameters had a gradient
    for index, mb in enumerate(microbatches):
        is_last = index == len(microbatches) - 1
        # A placeholder (a rank with fewer samples than microbatches) holds one pad token that
        # counts nowhere, yet its backward would give every expert that token reaches a zero
        # gradient, marking them used where one process never saw the token: AdamW would move
        # them. A replicated model has no collective but the reduction, which can run without a
        # backward, so it skips the placeholder; FSDP's collectives need its forward and backward
        # on every rank, so there it runs and is not marked.
        if mb.empty and replicated:
            if is_last:
                with reduce.summed_over_ranks(model):
                    pass
            mb_losses.append(torch.zeros((), device=device))
            continue
        if use is not None and is_last and index > 0:
            use.before_last_backward()
        share = mb.tokens / tokens  # this microbatch's part of the step's unpadded tokens
        with (
            reduce.summed_over_ranks(model) if replicated and is_last else contextlib.nullcontext(),
            use.not_marking() if use is not None and mb.empty else contextlib.nullcontext(),
        ):
            mb_loss, aux = microbatch_backward(model, mb, sync, is_last, loss_tokens, device, share, router)
        mb_losses.append(mb_loss)
        if aux is not None:
            mb_aux.append(aux)
    # The marks ride with the loss's sums: no collective of their own.
    marks = use.take(device) if use is not None else torch.zeros(0, device=device)
    sums = all_reduce_sum(torch.cat([torch.stack([torch.stack(mb_losses).sum(), torch.stack(mb_aux).sum()]), marks]))
    if use is not None:
        use.drop_unused(sums[2:])
    ce_sum, aux = sums[:2].tolist()
    aux_loss = aux if aux_coef else None
    loss = ce_sum / loss_tokens + aux_coef * aux
    max_norm = grad_clip if grad_clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    lr = optimizer.param_groups[0]["lr"]
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        if on_nonfinite == "skip":
            scheduler.step()  # the schedule follows the step count, applied or not
            return StepResult(
                loss,
                loss_tokens,
                tokens,
                grad_norm,
                lr,
                skipped=True,
                aux_loss=aux_loss,
                rows=rows,
                positions=positions,
            )
        raise NonFiniteError(f"step {step}: {where_nonfinite(mb_losses, device)}; loss {loss}, grad norm {grad_norm}")

    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, loss_tokens, tokens, grad_norm, lr, aux_loss=aux_loss, rows=rows, positions=positions)
