"""The sharded layout's vocabulary matrices used where they lie: never gathered for training.

Under FSDP2 each of W ranks holds rows [r*c, r*c + c) of the input embedding's and the output
projection's V x H matrices (c = ceil(V / W), the last rank's maybe fewer). Gathered for each
microbatch's forward, with a whole gradient of each reduced after, they were the sharded layout's
peak: for a 32K x 512 vocabulary, 62.5 MiB each. Here every rank instead applies its own rows of
the matrix to every rank's tokens, and only the tokens' rows travel:

- the input embedding: every rank's token ids are all-gathered; each rank looks up those in its
  shard (zeros for the others), and the sum over ranks, of which each keeps its own tokens', is
  the lookup. Backward: every rank's output gradients are all-gathered and each rank adds those
  of the tokens in its shard to its rows;
- the output projection with the loss (fused_loss.py): every rank's hidden rows and targets are
  all-gathered; a chunk of rows at a time, each rank computes its shard's logits and, per row,
  their log-sum-exp and the target's logit where the target is in its shard; those two numbers per
  row are all-gathered, so every rank has each row's log-sum-exp over the whole vocabulary; the
  softmax's gradient on the shard then gives this shard's weight gradient from every rank's rows,
  and each rank's part of every row's input gradient, summed over the ranks at the end.

Either way a shard's weight gradient is the whole sum, born reduced (no reduce-scatter), and autograd
accumulates it into the sharded parameter's own `.grad`. The same products and sums as one process,
grouped otherwise (fp32 reassociation only, tested against it). Every rank's rows are scaled by the
same 1 / (global loss tokens) (loop.py), so a rank may scale the gradient of the others' rows with its own.

Only where a microbatch's rows, over all ranks, are fewer than the vocabulary: then the buffers
(rows x hidden) are smaller than the matrix and its whole gradient. What travels is not always less:
an all-reduce of the rows moves about twice their bytes, so per matrix and microbatch ~3 x rows x
hidden against FSDP's gather and reduce-scatter, ~2 x vocabulary x hidden (and once per step under
`last-keep-params`); between two thirds of the vocabulary and all of it, more. A microbatch with
more rows goes through FSDP as before (decided on every rank alike from the rows' counts, which are
exchanged first: a host sync, with the id and label range checks, four per microbatch on CUDA).

The matrices stay FSDP units: checkpoints, the optimizer, clipping and evaluation see them as
before (an evaluation's forward gathers them). Only the step's training forward is diverted
(`diverted`): the model's attribute for each names our function while it runs, so FSDP's hooks
on the module do not run and do not gather it. One shard dimension only (not HSDP, whose replicas
would each need the weight gradient reduced), fp32 only (`qualifies` says why).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from accum_cli.cpu import linear as cpu_linear
from accum_cli.data.store import IGNORE_INDEX
from accum_cli.loss.tokens import add_projection_gradients, chunk_starts, hand_on
from accum_cli.parallel import runtime

ATTRIBUTE = "_accum_train_vocab_parallel"  # on the model: its Edges, where installed
# Every rank's tensor, concatenated along dim 0 (gloo takes no other form); torch < 2.13 names it so.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class Shard:
    """A vocabulary matrix's module, where the model reaches it (parent.<name>), the ranks its rows
    are split across and which of them this rank holds."""

    module: nn.Module
    path: str  # its name in the model
    parent: nn.Module
    name: str
    group: dist.ProcessGroup
    vocab: int
    offset: int  # this rank's first vocabulary row
    rows: int  # this rank's number of vocabulary rows


@dataclass(frozen=True, slots=True)
class Edges:
    embedding: Shard | None
    head: Shard | None
    head_forward: Callable | None  # the fused loss's recording forward for the head (fused_loss.py)


@dataclass(frozen=True, slots=True)
class Exchange:
    """One microbatch's rows, counted on every rank: how many each holds, in rank order."""

    shard: Shard
    sizes: list[int]

    @property
    def first(self) -> int:  # where this rank's rows begin among every rank's
        return sum(self.sizes[: dist.get_rank(self.shard.group)])


def qualifies(mesh, offload_params: bool, bf16: bool) -> bool:
    """A one-dimensional mesh (HSDP's replicas would each need the weight gradient all-reduced),
    parameters that stay on the device that computes, and fp32. Kept fp32-only, not for want of a
    bf16 GEMM: under mixed precision FSDP computes with bf16 copies of the matrices, made by the hooks
    this path bypasses. It reads the fp32 shards themselves, so it would have to make those copies
    itself (the embedding's too), round the rows it gathers as FSDP's would, hand back gradients in
    the dtype FSDP reduces from, and run its own chunked loop (a row's log-sum-exp combined over the
    ranks within each chunk, which fused_bf16.py's loop has no place for) with bf16 GEMMs and fp32
    sums: a second bf16 loss and embedding, each to be held against the unfused model on real ranks.
    Under bf16 the head goes through FSDP's gathered bf16 weight instead, fused (fused_loss.py) where
    a microbatch has the rows for it."""
    return mesh.ndim == 1 and not offload_params and not bf16


def plain_lookup(embedding: nn.Module) -> bool:
    """An nn.Embedding whose lookup is only that: no renormalising, no scaling by frequency, dense."""
    return (
        type(embedding).forward is nn.Embedding.forward
        and embedding.max_norm is None
        and not embedding.scale_grad_by_freq
        and not embedding.sparse
    )


def install(model: nn.Module, group, embedding=None, head=None, head_forward: Callable | None = None) -> None:
    """After fully_shard: use the given units' matrices where they lie from now on (each where every
    rank holds some of its rows); `edges(model)` says which were."""
    edges = Edges(_shard(model, embedding, group), _shard(model, head, group), head_forward)
    if edges.embedding is None and edges.head is None:
        return
    for shard in (edges.embedding, edges.head):
        # Its gradient no longer passes through FSDP: nothing of it to reduce, zeros included.
        if shard is not None and hasattr(shard.module, "set_reduce_scatter_unused_params"):  # torch >= 2.9
            shard.module.set_reduce_scatter_unused_params(False, recurse=False)
    object.__setattr__(model, ATTRIBUTE, edges)  # not nn.Module's: that would register the modules again


def _shard(model: nn.Module, module: nn.Module | None, group) -> Shard | None:
    if module is None:
        return None
    vocab = module.weight.shape[0]
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = -(-vocab // ranks)  # FSDP2 shards dim 0 as torch.chunk does
    if (ranks - 1) * per_rank >= vocab:  # a rank with no rows: leave it to FSDP
        return None
    local = module.weight.to_local().shape[0]
    if local != min(per_rank, vocab - rank * per_rank):  # another layout than torch.chunk's: leave it
        return None
    name = next(name for name, found in model.named_modules() if found is module)
    parent_name, _, attribute = name.rpartition(".")
    return Shard(module, name, model.get_submodule(parent_name), attribute, group, vocab, rank * per_rank, local)


def edges(model: nn.Module) -> Edges | None:
    return getattr(model, ATTRIBUTE, None)


def describe(model: nn.Module) -> str | None:
    """The header's line, where any matrix is used in place."""
    found = edges(model)
    if found is None:
        return None
    shards = [s for s in (found.embedding, found.head) if s is not None]
    names, lie = " and ".join(s.path for s in shards), "they lie" if len(shards) > 1 else "it lies"
    return (f"{names} used where {lie} (vocabulary-parallel), never gathered for training, while a "
            f"microbatch's rows over all ranks are fewer than its {shards[0].vocab} rows")  # fmt: skip


def modules(model: nn.Module) -> list[nn.Module]:
    """The units whose matrices are used in place."""
    found = edges(model)
    return [s.module for s in (found.embedding, found.head) if s is not None] if found is not None else []


def born_sharded(model: nn.Module) -> set[int]:
    """The ids of the parameters whose gradient is computed here, sharded and reduced (grad_use.py)."""
    return {id(p) for module in modules(model) for p in module.parameters()}


class _Diverted:
    """What the model finds at parent.<name> during the step's forward: calls go to `forward`, any
    attribute (`.weight`, say) to the module itself."""

    def __init__(self, module: nn.Module, forward: Callable) -> None:
        self._module, self._forward = module, forward

    def __call__(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


@contextlib.contextmanager
def diverted(model: nn.Module) -> Iterator[None]:
    """The step's forward inside finds our functions where the model holds its vocabulary matrices
    (instance attributes come before nn.Module's own lookup of its children)."""
    found = edges(model)
    diversions = []
    if found is not None:
        if found.embedding is not None:
            diversions.append((found.embedding, functools.partial(_lookup, found.embedding)))
        if found.head is not None and found.head_forward is not None:
            diversions.append((found.head, functools.partial(found.head_forward, found.head)))
    for shard, forward in diversions:
        shard.parent.__dict__[shard.name] = _Diverted(shard.module, forward)
    try:
        yield
    finally:
        for shard, _ in diversions:
            shard.parent.__dict__.pop(shard.name, None)


def release(model: nn.Module) -> None:
    """Free what a forward without gradient left gathered (the MoE step's expert choices, an
    evaluation: the head keeps its parameters after its forward), before the training forwards
    that do not use it. A no-op where nothing is gathered."""
    for module in modules(model):
        module.reshard()


def exchange(shard: Shard, rows: int) -> Exchange | None:
    """Every rank's number of rows in this microbatch (a collective, so on every rank alike), or None
    where they are as many as the vocabulary or more: then the matrix is no bigger than their buffers. The
    memory estimate's world (runtime.simulated) has no counts to exchange: every rank holds as many."""
    ranks, rank = dist.get_world_size(shard.group), dist.get_rank(shard.group)
    counts = torch.zeros(ranks, dtype=torch.int64, device=shard.module.weight.device)
    if runtime.is_simulated():
        sizes = [rows] * ranks
    else:
        counts[rank] = rows
        dist.all_reduce(counts, group=shard.group)
        sizes = counts.tolist()
    return Exchange(shard, sizes) if sum(sizes) < shard.vocab else None


def token_loss_sum(hidden, weight, bias, placeholder, targets, counted: Exchange, chunk_elements: int) -> torch.Tensor:
    """The sum of this rank's rows' cross-entropies; `weight` and `bias`: this rank's local shards,
    whose logits are computed chunk_elements at a time."""
    return _VocabularyParallelSum.apply(hidden, weight, bias, placeholder, targets, counted, chunk_elements)


def _lookup(shard: Shard, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The input embedding's training forward; any other (evaluation, no gradient), the module's."""
    module = shard.module
    if args or kwargs or not (module.training and torch.is_grad_enabled()):
        return module(ids, *args, **kwargs)
    rows = exchange(shard, ids.numel())
    if rows is None:
        return module(ids)
    module.reshard()  # kept gathered by a microbatch before it (last-keep-params): its shard is what is read
    return _VocabularyParallelLookup.apply(module.weight.to_local(), ids, rows)


def _gather(tensors: list[torch.Tensor], rows: Exchange) -> list[torch.Tensor]:
    """Every rank's tensors (rows along dim 0), concatenated in rank order. Ranks may hold different
    numbers of rows (a placeholder microbatch holds one): padded to the longest for the collective,
    the padding dropped after."""
    ranks, longest = len(rows.sizes), max(rows.sizes)
    gathered = []
    for tensor in tensors:
        padded = tensor.new_zeros(longest, *tensor.shape[1:])
        padded[: tensor.size(0)] = tensor
        every = tensor.new_empty(ranks * longest, *tensor.shape[1:])
        _all_gather(every, padded, group=rows.shard.group)
        if len(set(rows.sizes)) > 1:
            keep = [torch.arange(r * longest, r * longest + n, device=tensor.device) for r, n in enumerate(rows.sizes)]
            every = every[torch.cat(keep)]
        gathered.append(every)
    return gathered


def _refuse_outside(ids: torch.Tensor, vocab: int, what: str) -> None:
    """An id no shard holds would be looked up as zeros, or its logit taken as 0, where one process
    fails with an index error: the same error, on every rank alike (every rank sees every id)."""
    if not runtime.is_simulated() and ids.numel() and bool(((ids < 0) | (ids >= vocab)).any()):
        raise IndexError(f"a {what} outside the vocabulary's {vocab} rows")


class _VocabularyParallelLookup(torch.autograd.Function):
    """Forward: this rank's tokens' embeddings, from every rank's shard. Backward: this shard's
    weight gradient, from every rank's tokens."""

    @staticmethod
    def forward(ctx, weight, ids, rows: Exchange):
        shard = rows.shard
        (every_ids,) = _gather([ids.reshape(-1)], rows)
        _refuse_outside(every_ids, shard.vocab, "token id")
        local = every_ids - shard.offset
        here = (local >= 0) & (local < shard.rows)
        local = torch.where(here, local, 0)
        found = torch.where(here.unsqueeze(1), F.embedding(local, weight), 0.0)  # where: inf * 0 is not 0
        dist.all_reduce(found, group=shard.group)  # each row from the one rank that holds it, zeros added
        own = slice(rows.first, rows.first + ids.numel())
        ctx.save_for_backward(local, here)
        ctx.rows, ctx.weight_shape = rows, weight.shape
        return found[own].reshape(*ids.shape, weight.size(1)).clone()  # its own storage, not a view of every rank's

    @staticmethod
    def backward(ctx, grad):
        local, here = ctx.saved_tensors
        shard = ctx.rows.shard
        (every_grad,) = _gather([grad.reshape(-1, grad.size(-1)).contiguous()], ctx.rows)
        grad_weight = every_grad.new_zeros(ctx.weight_shape)
        # Another shard's tokens add zeros to row 0 (where, not a product: inf * 0 is not 0); no
        # boolean selection, whose size the memory estimate's fake tensors cannot know.
        grad_weight.index_add_(0, local, torch.where(here.unsqueeze(1), every_grad, 0.0))
        padding = shard.module.padding_idx  # its row takes no gradient, as in nn.Embedding
        if padding is not None and 0 <= padding - shard.offset < shard.rows:
            grad_weight[padding - shard.offset] = 0
        return grad_weight, None, None


class _VocabularyParallelSum(torch.autograd.Function):
    """Forward: this rank's loss sum, and the gradients of its rows and of its weight shard.
    Backward: those gradients times the loss's own (1 / global loss tokens)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, placeholder, targets, counted: Exchange, chunk_elements: int):
        shard, group = counted.shard, counted.shard.group
        own = hidden.reshape(-1, hidden.size(-1))
        rows, every_targets = _gather([own, targets], counted)
        ranks = dist.get_world_size(group)
        counts = every_targets != IGNORE_INDEX
        _refuse_outside(torch.where(counts, every_targets, 0), shard.vocab, "label")
        local_target = every_targets - shard.offset
        here = counts & (local_target >= 0) & (local_target < shard.rows)  # the target is in this shard
        local_target = torch.where(here, local_target, 0).unsqueeze(1)  # elsewhere: column 0, masked out
        wants = ctx.needs_input_grad
        grad_rows = torch.zeros_like(rows) if wants[0] else None
        grad_weight = torch.empty_like(weight) if wants[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and wants[2] else None
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        mine = slice(counted.first, counted.first + own.size(0))
        # Chunks of as many rows on every rank (each is a collective over the same rows): sized by
        # the largest shard, not this rank's, which is smaller on the last rank of an uneven split.
        step, starts = chunk_starts(rows, chunk_elements // -(-shard.vocab // len(counted.sizes)))
        if grad_weight is not None and not starts:  # no rows on any rank: no chunk writes it
            grad_weight.zero_()
        for start in starts:
            span = slice(start, start + step)
            h, mask, target, hit = rows[span], counts[span], local_target[span], here[span]
            logits = cpu_linear.linear(h, weight, bias)
            picked = torch.where(hit, logits.gather(1, target).squeeze(1), 0.0)
            stats = torch.stack([torch.logsumexp(logits, dim=-1), picked])
            everyone = stats.new_empty(ranks * 2, stats.size(1))
            _all_gather(everyone, stats, group=group)
            everyone = everyone.view(ranks, 2, -1)  # [rank, (log-sum-exp, picked logit), row]
            log_norm = torch.logsumexp(everyone[:, 0], dim=0)
            # where, not a product with the mask: an ignored row's non-finite logits must not count
            losses = torch.where(mask, log_norm - everyone[:, 1].sum(0), 0.0)
            lo, hi = max(mine.start, start) - start, min(mine.stop, start + h.size(0)) - start
            if hi > lo:
                total += losses[lo:hi].sum()
            probs = logits.sub_(log_norm.unsqueeze(1)).exp_()  # softmax - one-hot, in the logits' place
            probs.scatter_add_(1, target, torch.where(hit, -1.0, 0.0).unsqueeze(1))
            probs.mul_(mask.unsqueeze(1))
            add_projection_gradients(probs, h, weight, span, start == starts[0], (grad_rows, grad_weight, grad_bias))
            del logits, probs  # before the next chunk's: one chunk's logits alive, not two
        if grad_rows is not None:  # each rank's part of every row's gradient: summed, own rows kept
            dist.all_reduce(grad_rows, group=group)
            grad_rows = grad_rows[mine].reshape(hidden.shape)
        ctx.grads = (grad_rows, grad_weight, grad_bias)
        ctx.placeholder = (placeholder.shape, placeholder.dtype, placeholder.device)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        return (*hand_on(ctx, grad_total), None, None, None)
