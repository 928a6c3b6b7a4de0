"""The output projection and the loss as one: the logits of a microbatch are never whole.

A causal LM's last step projects every position onto the vocabulary, and the loss then needs,
besides those logits, a gradient of the same size: for a 32K vocabulary at micro batch 2 and seq
128, 31 MiB each in fp32, at the backward's peak (the projection's backward holds its gathered
weight, its whole weight gradient and the logits' gradient at once); for a 128K vocabulary at seq
8192, 4 GiB each. Here the projection and the loss are the chunked kernel of torch's own
`F.linear_cross_entropy`: a chunk of rows at a time, it computes the loss and at once the input's,
weight's and bias's gradients, so one chunk of logits is alive at a time and nothing is kept for a
backward but the gradients themselves (under an autograd Function of ours: `_LinearCrossEntropySum`
says why).

In fp32, torch's kernel on fp32 operands, for every microbatch. Under bf16 mixed precision (FSDP2's
bf16 copies of the parameters, or autocast over fp32 master weights in the replicated layout) the
head's GEMMs run in bf16 and what is summed across chunks in fp32 (fused_bf16.py; torch's kernel would
sum the loss and the weight's gradient in bf16), and only for a microbatch of at least 2.5 x hidden x V / (V - hidden) rows: there the
unfused step's logits and their gradient (rows x vocabulary, bf16) outweigh what the fused one holds
besides its chunks (the weight's gradient in fp32, and a bf16 copy of it), as bench/fused_memory.py
measured (`BF16_ROWS_PER_FEATURE`); a smaller microbatch's head projects as it would unfused (`fuses`).
The memory estimate runs this same choice (memory/measure.py), and its search for the micro batch
knows where it switches (memory/fit.py `Target.switch`).

How: the output embedding's forward, inside the run's own microbatch step (`recording`), records its
input and returns a zero-strided placeholder of the logits' shape instead of computing them; any
other forward (evaluation, a caller's own `model(..., labels=...)`) gets real logits. A model that
hands its logits out untouched (Llama, Mistral, Qwen, GPT-2, ...) hands out that very object, and
the loss is then computed from the recorded input. A model that changes them after the projection
(Gemma's softcapping, Cohere's logit scale) would compute on the placeholder: a probe forward of
two tokens at setup finds that, on every rank alike, and leaves such a model's head alone; each
microbatch checks it again (`recorded`). ACCUM_TRAIN_FUSED_LOSS=0 leaves every head alone;
ACCUM_TRAIN_FUSED_LOSS=always fuses a bf16 microbatch of any size (the tests' small ones).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from accum_cli import torch_compat
from accum_cli.data.store import IGNORE_INDEX
from accum_cli.loss import fused_bf16, vocab_parallel
from accum_cli.loss.tokens import hand_on, placeholder_zeros, shifted_targets
from accum_cli.parallel import runtime
from accum_cli.parallel.runtime import all_ok

# Rows per chunk keep a chunk's logits near 16 MiB (fp32): on this project's CPU, chunks of that
# size ran the 32K-vocabulary head as fast as one whole GEMM; 8 MiB chunks took 1.1-1.2x its time.
CHUNK_ELEMENTS = 2**22
# bf16: a microbatch fuses from BF16_ROWS_PER_FEATURE x hidden x V / (V - hidden) rows on (`fuses`).
# The fused step holds the weight's gradient in fp32 (4 bytes a weight, and a bf16 copy at the end)
# and per row its input's gradient and copy; the unfused one per row the logits and their gradient
# (4 bytes a vocabulary entry). bench/fused_memory.py --crossover, 6 Dec, on fake tensors (the memory
# estimate's count) for hidden 512-8192 and vocabularies of 32K-256K, both bf16 forms: the fused step
# holds less from 1.09-2.5 x hidden rows on with a GPU's products, 1.56-3.25 x with a CPU's (whose
# fp32 copy of the weight costs it more), most where the vocabulary is few times the hidden size
# (32K over 8192: 2.38 and 3.25) or the hidden size small (512: fixed 32 MiB chunk buffers, 2.5).
# The rule lies at or above every one of them: up to 2.35x the rows needed (1.4x on average).
BF16_ROWS_PER_FEATURE = 2.5
ATTRIBUTE = "_accum_train_fused_head"  # on the model: the head whose forward records its input


@dataclass(slots=True)
class Recorded:
    hidden: torch.Tensor  # the head's input, as its forward received it (FSDP's hooks included)
    weight: torch.Tensor  # as its forward saw it: the gathered weight under FSDP
    bias: torch.Tensor | None
    placeholder: torch.Tensor  # what the forward returned in place of the logits
    counted: vocab_parallel.Exchange | None = None  # vocabulary-parallel: weight and bias are this rank's shards
    dtype: torch.dtype | None = None  # what the projection computes in (autocast's, where on); None: the weight's


def enabled(env) -> bool:
    return env.get("ACCUM_TRAIN_FUSED_LOSS", "1").strip() != "0"


def always(env) -> bool:
    """Fused whatever the bf16 rule (`fuses`) would choose."""
    return env.get("ACCUM_TRAIN_FUSED_LOSS", "1").strip() == "always"


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
        head.forward = functools.partial(_recording_forward, head, head.forward, forced=always(os.environ))
        object.__setattr__(model, ATTRIBUTE, head)  # not nn.Module's: that would register a second copy
    return fits


def describe(model: nn.Module, bf16: bool = False) -> str:
    """The header's line on how the loss meets the output projection."""
    head = getattr(model, ATTRIBUTE, None)
    if head is None:
        return "after the output projection, on whole logits (fused only for a plain head left untouched)"
    if bf16:
        least = bf16_min_rows(head.in_features, head.out_features)
        least = "any" if always(os.environ) else "no" if least is None else f"at least {least:,}"
        return (f"fused with the output projection (bf16 GEMMs, fp32 sums) for a microbatch of {least} positions "
                "(fewer: whole logits hold less): logits a chunk of rows at a time")  # fmt: skip
    return "fused with the output projection (torch's linear_cross_entropy, fp32 sums): logits a chunk of rows at a time, never whole"  # fmt: skip


def fuses(rows: int, features: int, vocab: int, dtype: torch.dtype) -> bool:
    """Whether a microbatch of `rows` through a head of `features` inputs and `vocab` outputs computing
    in `dtype` is fused: always in fp32; in bf16 where the fused step holds less (BF16_ROWS_PER_FEATURE)."""
    if dtype == torch.float32:
        return True
    least = bf16_min_rows(features, vocab)
    return least is not None and rows >= least


def bf16_min_rows(features: int, vocab: int) -> int | None:
    """The fewest rows of a microbatch that the head fuses under bf16 (memory/fit.py reads it too);
    None: none (a vocabulary no larger than the hidden size, whose logits weigh less than its input)."""
    if vocab <= features:
        return None
    return math.ceil(BF16_ROWS_PER_FEATURE * features * vocab / (vocab - features))


def _plain_head(model: nn.Module) -> nn.Linear | None:
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if type(head) is not nn.Linear or not head.weight.is_floating_point():
        return None  # a subclass (quantised, LoRA) computes otherwise
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


def _recording_forward(head: nn.Linear, project, hidden: torch.Tensor, forced: bool = False) -> torch.Tensor:
    armed = head.__dict__.get("_accum_train_armed", False) and head.training and torch.is_grad_enabled()
    if not armed:
        return project(hidden)  # evaluation, generation, anyone else's forward: real logits
    # Autocast (the replicated layout's bf16) computes F.linear in its dtype from fp32 parameters;
    # FSDP2's mixed precision hands the forward bf16 copies of them, and the weight's dtype says so.
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    rows = hidden.shape[:-1].numel()
    if not (forced or fuses(rows, head.in_features, head.out_features, dtype)):
        return project(hidden)  # bf16, too few rows: whole logits hold less
    placeholder = _Placeholder.apply(hidden, head.out_features)
    head._accum_train_recorded = Recorded(hidden, head.weight, head.bias, placeholder, dtype=dtype)
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
    probe = functools.partial(_recording_forward, head, head.forward, forced=True)  # two rows: whatever the rule
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
    features = rec.weight.size(1)
    dtype = rec.dtype or rec.weight.dtype
    if dtype != torch.float32:
        rows = rec.hidden.reshape(-1, features)
        return fused_bf16.token_loss_sum(rows, rec.weight, rec.bias, rec.placeholder, targets, dtype)
    counts = (targets != IGNORE_INDEX).unsqueeze(1)
    # where, before torch's kernel: it weights an ignored row's loss and gradients by 0, and a padded
    # position's non-finite hidden state would make that 0 * nan = nan in the sum.
    rows = torch.where(counts, rec.hidden.reshape(-1, features), 0.0)
    return _LinearCrossEntropySum.apply(rows, rec.weight, rec.bias, rec.placeholder, targets)


def _options(rows: int, vocab: int) -> torch.nn.LinearCrossEntropyOptions:
    """On fp32 operands, "compact" adds each chunk's weight gradient straight into the whole one, where
    "accurate" and "balanced" keep a second vocabulary x hidden fp32 buffer to add from: the same sums
    (to 1e-6), and "accurate" took 1.13x compact's time (1819 against 1609 ms for 1024 rows x 512 ->
    32K forward and backward, best of 5, 1 thread, this CPU). Their other differences apply to bf16
    operands only, which this never passes. A fixed number of rows, not a `chunking_method`:
    "aspect_ratio" sizes a chunk's logits like the whole input's rows, which grow with the micro batch."""
    return torch.nn.LinearCrossEntropyOptions(
        acc_policy="compact",
        chunking_method=None,
        batch_chunk_size=max(1, min(rows, CHUNK_ELEMENTS // vocab)),
        acc_dtype=torch.float32,
    )


class _LinearCrossEntropySum(torch.autograd.Function):
    """Forward: torch's chunked kernel of F.linear_cross_entropy, which computes the loss sum and its
    gradients for the input, weight and bias a chunk of rows at a time. Backward: those gradients
    times the loss's own (1 / global loss tokens), and zeros for the logits' placeholder (hand_on).

    Not F.linear_cross_entropy itself: its autograd takes the three gradients as outputs of the op, and
    its backward, given none for them, makes zeros of each first (torch's Function default): one more
    vocabulary x hidden tensor at the backward's peak, and its fill. Measured (512 rows x 1024 -> 32K,
    fp32, the allocator's peak over forward and backward): 260 MiB through F.linear_cross_entropy,
    162 with the hand-written loss this replaced, 149 here, 194 unfused. Its time (1024 rows x 512 ->
    32K, best of 5, 1 thread): 1526 ms here, 1686 hand-written, 1716 unfused."""

    @staticmethod
    def forward(ctx, rows, weight, bias, placeholder, targets):
        wants = ctx.needs_input_grad
        wants_bias = bias is not None and wants[2]
        options = _options(rows.size(0), weight.size(0))
        # The memory estimate runs on fake tensors, where the kernel allocates only what it returns:
        # a chunk's logits, its one buffer of any size besides, stands in for its own.
        workspace = (
            torch.empty(options.batch_chunk_size, weight.size(0), device=rows.device)
            if runtime.is_simulated()
            else None
        )
        total, grad_rows, grad_weight, grad_bias = torch_compat.linear_cross_entropy_chunked(
            rows, weight, targets, bias, None, "sum", IGNORE_INDEX, 0.0, options.batch_chunk_size,
            options.acc_policy, options.acc_dtype, options.allow_retain_graph, wants[0], wants[1], wants_bias,
        )  # fmt: skip
        del workspace
        ctx.grads = (
            grad_rows if wants[0] else None,
            grad_weight if wants[1] else None,
            grad_bias if wants_bias else None,
        )
        ctx.placeholder = (placeholder.shape, placeholder.dtype, placeholder.device)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        return (*hand_on(ctx, grad_total), None)


class _Placeholder(torch.autograd.Function):
    """Zeros of the logits' shape in 4 bytes (every stride 0), not a view (FSDP2 warns of views),
    and in the graph: the loss hands it a zero gradient, so that the hooks FSDP2 puts on a unit's
    outputs run as they would for real logits (the root re-gathers its parameters there when it
    was resharded after the forward). No gradient goes on to the head's input from here. fp32 in
    every precision, as the probe saw it: a model's `logits.float()` stays a no-op under bf16."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
        return placeholder_zeros(((*hidden.shape[:-1], vocab), torch.float32, hidden.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None
