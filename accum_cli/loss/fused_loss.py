"""The output projection and the loss as one: the logits of a microbatch are never whole.

A causal LM's last step projects every position onto the vocabulary, and the loss then needs,
besides those logits, a gradient of the same size: for a 32K vocabulary at micro batch 2 and seq
128, 31 MiB each, at the backward's peak (the projection's backward holds its gathered weight,
its whole weight gradient and the logits' gradient at once); for a 128K vocabulary at seq 8192,
4 GiB each. Here the projection is computed a chunk of rows at a time inside the loss, whose
forward computes its gradients at once (softmax - one-hot, then the input's and the weight's
gradients of that chunk), so one chunk of logits is alive at a time and nothing is kept for a
backward but the gradients themselves. The same GEMMs as the projection's own forward and
backward; the weight's gradient is summed over the chunks (fp32 reassociation only, tested).

How: the output embedding's forward, inside the run's own microbatch step (`recording`), records its
input and returns a zero-strided placeholder of the logits' shape instead of computing them; any
other forward (evaluation, a caller's own `model(..., labels=...)`) gets real logits. A model that
hands its logits out untouched (Llama, Mistral, Qwen, GPT-2, ...) hands out that very object, and
the loss is then computed from the recorded input. A model that changes them after the projection
(Gemma's softcapping, Cohere's logit scale) would compute on the placeholder: a probe forward of
two tokens at setup finds that, on every rank alike, and leaves such a model's head alone; each
microbatch checks it again (`recorded`). fp32 only: under bf16 mixed precision the weight
gradient's sum over chunks would round once per chunk, and the head is left alone there.
ACCUM_TRAIN_FUSED_LOSS=0 leaves every head alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from accum_cli.cpu import linear as cpu_linear
from accum_cli.data.store import IGNORE_INDEX
from accum_cli.loss import vocab_parallel
from accum_cli.loss.tokens import add_projection_gradients, chunk_starts, hand_on, shifted_targets
from accum_cli.parallel import runtime
from accum_cli.parallel.runtime import all_ok

# Rows per chunk keep a chunk's logits near 16 MiB (fp32): on this project's CPU, chunks of that
# size ran the 32K-vocabulary head as fast as one whole GEMM; 8 MiB chunks took 1.1-1.2x its time.
CHUNK_ELEMENTS = 2**22
ATTRIBUTE = "_accum_train_fused_head"  # on the model: the head whose forward records its input


@dataclass(slots=True)
class Recorded:
    hidden: torch.Tensor  # the head's input, as its forward received it (FSDP's hooks included)
    weight: torch.Tensor  # as its forward saw it: the gathered weight under FSDP
    bias: torch.Tensor | None
    placeholder: torch.Tensor  # what the forward returned in place of the logits
    counted: vocab_parallel.Exchange | None = None  # vocabulary-parallel: weight and bias are this rank's shards


def enabled(env) -> bool:
    return env.get("ACCUM_TRAIN_FUSED_LOSS", "1").strip() != "0"


def install(model: nn.Module, device: torch.device | None = None) -> bool:
    """Make the model's output projection record instead of project, where the probe shows that
    its logits reach the output untouched and (given the device of a process group) every rank
    agrees. After any other change to the head's forward, before fully_shard (whose hooks then
    wrap this forward). Returns whether it was installed."""
    head = _plain_head(model)
    # A rank that builds on meta to receive its weights by broadcast (rank-0 loading) cannot run
    # the probe (transformers' masks read values): it goes with the ranks that hold the weights.
    on_meta = head is not None and head.weight.is_meta
    fits = head is not None and enabled(os.environ) and (on_meta or _passes_placeholder_through(model, head))
    # A head left alone is gathered in another order than a recording one: the ranks must agree.
    # Not in the memory estimate's world (one process, its collectives no-ops).
    if device is not None and dist.is_initialized() and not runtime.is_simulated():
        fits = all_ok(fits, device)
    if fits:
        head.forward = functools.partial(_recording_forward, head, head.forward)
        object.__setattr__(model, ATTRIBUTE, head)  # not nn.Module's: that would register a second copy
    return fits


def describe(model: nn.Module) -> str:
    """The header's line on how the loss meets the output projection."""
    if getattr(model, ATTRIBUTE, None) is not None:
        return "fused with the output projection: logits a chunk of rows at a time, never whole"
    return "after the output projection, on whole logits (fused only for a plain fp32 head left untouched)"


def _plain_head(model: nn.Module) -> nn.Linear | None:
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if type(head) is not nn.Linear or head.weight.dtype != torch.float32:
        return None  # a subclass (quantised, LoRA) computes otherwise; bf16: see the docstring
    return head


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[None]:
    """The forwards inside record (where the model has a recording head); none outside."""
    head = getattr(model, ATTRIBUTE, None)
    if head is None:
        yield
        return
    head._accum_train_armed = True
    try:
        yield
    finally:
        head._accum_train_armed = False


def _recording_forward(head: nn.Linear, project, hidden: torch.Tensor) -> torch.Tensor:
    armed = head.__dict__.get("_accum_train_armed", False) and head.training and torch.is_grad_enabled()
    if not armed or hidden.dtype != torch.float32:
        return project(hidden)  # evaluation, generation, anyone else's forward: real logits
    placeholder = _Placeholder.apply(hidden, head.out_features)
    head._accum_train_recorded = Recorded(hidden, head.weight, head.bias, placeholder)
    return placeholder


def recording_sharded(shard: vocab_parallel.Shard, hidden: torch.Tensor) -> torch.Tensor:
    """The training forward of a head whose loss is computed vocabulary-parallel (vocab_parallel.py):
    records beside its sharded weight without entering the module, so that FSDP's hooks do not
    gather it. Where the microbatch has too many rows for that, and in any other forward: the module."""
    head = shard.module
    if not (head.training and torch.is_grad_enabled() and hidden.dtype == torch.float32):
        return head(hidden)
    counted = vocab_parallel.exchange(shard, hidden.shape[:-1].numel())
    if counted is None:
        return head(hidden)  # FSDP gathers it, and it records as in the other layouts
    head.reshard()  # kept gathered by a microbatch before it (last-keep-params): its shards are what is read
    placeholder = _Placeholder.apply(hidden, head.out_features)
    head._accum_train_recorded = Recorded(hidden, head.weight, head.bias, placeholder, counted)
    return placeholder


def _passes_placeholder_through(model: nn.Module, head: nn.Linear) -> bool:
    """A two-token forward with the recording head: are the output's logits the placeholder?
    On the model's own device (fake tensors in the memory estimate), in eval mode so that dropout
    draws nothing."""
    device = head.weight.device
    training = model.training
    own_forward = head.__dict__.get("forward")  # oneDNN's (cpu_linear.py), or none: the class's
    probe = functools.partial(_recording_forward, head, head.forward)
    head.forward = lambda hidden: _forced(head, probe, hidden)
    try:
        model.eval()
        with torch.no_grad():
            out = model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
        recorded = getattr(head, "_accum_train_recorded", None)
        return recorded is not None and _is_placeholder(getattr(out, "logits", None), recorded.placeholder)
    except Exception:  # a model that cannot run on its placeholder is one to leave alone
        return False
    finally:
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward
        head.__dict__.pop("_accum_train_recorded", None)
        head.__dict__.pop("_accum_train_armed", None)
        model.train(training)


def _forced(head: nn.Linear, probe, hidden: torch.Tensor) -> torch.Tensor:
    """The recording forward as it runs in the step, under the probe's eval and no_grad."""
    was = head.training
    head.training, head._accum_train_armed = True, True
    try:
        with torch.enable_grad():
            return probe(hidden)
    finally:
        head.training, head._accum_train_armed = was, False


def recorded(model: nn.Module, logits: torch.Tensor) -> Recorded | None:
    """What the head recorded in this forward, with the logits as the model returned them: its
    placeholder or a whole view of it (a hook's `view_as`, PyTorch's memory tracker's); the loss
    hands these its zero gradient, so every hook on them runs. None where the head projected (no
    recording head, or inputs it leaves alone). Logits other than the placeholder after it recorded
    are a fault the probe should have found: they were computed from zeros."""
    head = getattr(model, ATTRIBUTE, None)
    found = head.__dict__.pop("_accum_train_recorded", None) if head is not None else None
    if found is None:
        return None
    if not _is_placeholder(logits, found.placeholder):
        raise RuntimeError(f"{type(model).__name__} changed the logits its output projection returned, "
                           "which the probe found it does not do; set ACCUM_TRAIN_FUSED_LOSS=0")  # fmt: skip
    found.placeholder = logits
    return found


def _is_placeholder(logits, placeholder: torch.Tensor) -> bool:
    return logits is placeholder or (
        isinstance(logits, torch.Tensor) and logits._base is placeholder and logits.shape == placeholder.shape
    )


def token_loss_sum(rec: Recorded, labels: torch.Tensor) -> torch.Tensor:
    """The sum of next-token cross-entropies over the positions that count, from the head's input:
    `loss.token_loss_sum(F.linear(hidden, weight, bias), labels)` without whole logits."""
    targets = shifted_targets(labels).reshape(-1)
    if rec.hidden.shape[:-1].numel() != targets.numel():  # a model that projects only some positions
        raise RuntimeError(f"the output projection got {rec.hidden.shape[:-1].numel()} positions for "
                           f"{targets.numel()} labels; set ACCUM_TRAIN_FUSED_LOSS=0")  # fmt: skip
    if rec.counted is not None:
        bias = rec.bias.to_local() if rec.bias is not None else None
        return vocab_parallel.token_loss_sum(
            rec.hidden, rec.weight.to_local(), bias, rec.placeholder, targets, rec.counted, CHUNK_ELEMENTS
        )
    return _LinearCrossEntropySum.apply(rec.hidden, rec.weight, rec.bias, rec.placeholder, targets)


class _Placeholder(torch.autograd.Function):
    """Zeros of the logits' shape in 4 bytes (every stride 0), not a view (FSDP2 warns of views),
    and in the graph: the loss hands it a zero gradient, so that the hooks FSDP2 puts on a unit's
    outputs run as they would for real logits (the root re-gathers its parameters there when it
    was resharded after the forward). No gradient goes on to the head's input from here."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
        shape = (*hidden.shape[:-1], vocab)
        return torch.empty_strided(shape, (0,) * len(shape), dtype=hidden.dtype, device=hidden.device).zero_()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None


class _LinearCrossEntropySum(torch.autograd.Function):
    """Forward: the loss sum, and its gradients for the input, weight and bias, a chunk of rows at a
    time. Backward: those gradients times the loss's own (1 / global loss tokens)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, placeholder, targets):
        rows = hidden.reshape(-1, hidden.size(-1))
        counts = targets != IGNORE_INDEX
        safe = torch.where(counts, targets, 0)  # an ignored row reads column 0, then is masked out
        wants = ctx.needs_input_grad
        grad_rows = torch.empty_like(rows) if wants[0] else None
        grad_weight = torch.empty_like(weight) if wants[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and wants[2] else None
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        step, starts = chunk_starts(rows, CHUNK_ELEMENTS // weight.size(0))
        if grad_weight is not None and not starts:  # no rows: no chunk writes it
            grad_weight.zero_()
        for start in starts:
            span = slice(start, start + step)
            h, mask, target = rows[span], counts[span], safe[span].unsqueeze(1)
            logits = cpu_linear.linear(h, weight, bias)
            log_norm = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target).squeeze(1)
            # where, not a product with the mask: an ignored row's non-finite logits must not count
            total += torch.where(mask, log_norm - picked, 0.0).sum()
            probs = logits.sub_(log_norm.unsqueeze(1)).exp_()  # softmax - one-hot, in the logits' place
            probs.scatter_add_(1, target, torch.full_like(probs[:, :1], -1.0))
            probs.mul_(mask.unsqueeze(1))
            add_projection_gradients(probs, h, weight, span, start == starts[0], (grad_rows, grad_weight, grad_bias))
            del logits, probs  # before the next chunk's: one chunk's logits alive, not two
        ctx.grads = (grad_rows.view_as(hidden) if grad_rows is not None else None, grad_weight, grad_bias)
        ctx.placeholder = (placeholder.shape, placeholder.dtype, placeholder.device)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        return (*hand_on(ctx, grad_total), None)
