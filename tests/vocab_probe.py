"""The sharded layout's vocabulary matrices used where they lie (accum_cli/loss/vocab_parallel.py), in a
real gloo run started by torchrun; each rank writes OUT_JSON.RANK.

Usage: torchrun --nproc_per_node=2 tests/vocab_probe.py OUT_JSON POLICY

A toy causal LM with an input embedding (a padding row) and an output projection with a bias, of
an odd vocabulary (37 rows: 19 on rank 0, 18 on rank 1), sharded by the run's own `model.shard`
and trained three steps by the run's own `loop.train_step` (AdamW, weight decay, fused loss). Step
1: two microbatches of 16 rows a rank (32 in all, fewer than the vocabulary: used in place). Step 2:
one of 24 rows a rank (48: more than the vocabulary, so FSDP gathers the matrices as before), then
a placeholder (one row) against 16 rows (ranks of different row counts, used in place). Step 3:
16 rows, then 24: the other order, which `last` reduces otherwise, after an evaluation's forward
that leaves the head gathered. Labels reach both shards and some are ignored; inputs hold the
padding token. The loss is computed in chunks of 5 rows (several per microbatch).

The reference: an unsharded copy on each rank, every gradient summed over ranks by its own
all-reduce, and the same AdamW steps; its loss beside each step's. Also counted: how often FSDP gathered each matrix in each
step, and whether a token id outside the vocabulary is refused as nn.Embedding refuses it.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers.modeling_outputs import CausalLMOutput

from accum_cli.data.batches import Microbatch, empty_microbatch
from accum_cli.data.store import IGNORE_INDEX
from accum_cli.loss import fused_loss, vocab_parallel
from accum_cli.loss.tokens import token_loss_sum
from accum_cli.model import wrap
from accum_cli.parallel import runtime
from accum_cli.parallel.sharding import ShardSettings
from accum_cli.step import loop

VOCAB, WIDTH, SEQ, PAD = 37, 16, 8, 0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.dense(x))


class Toy(nn.Module):
    _no_split_modules = ["Block"]  # what `shard` makes units of, as in a transformers model

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=PAD)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCAB)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return CausalLMOutput(logits=self.head(x))


def microbatch(generator: torch.Generator, rows: int) -> Microbatch:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)  # the padding token among them
    labels = ids.clone()
    labels[:, : SEQ // 4] = IGNORE_INDEX
    return Microbatch(ids, torch.ones_like(ids), labels)


def step_batches(rank: int, step: int) -> list[Microbatch]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    if step == 0:
        return [microbatch(generator, 2), microbatch(generator, 2)]
    if step == 1:
        last = empty_microbatch(pad_id=PAD) if rank == 1 else microbatch(generator, 2)
        return [microbatch(generator, 3), last]
    return [microbatch(generator, 2), microbatch(generator, 3)]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference_step(model: nn.Module, optimizer, batches: list[Microbatch], loss_tokens: int) -> float:
    """The step's token-mean loss; the gradients summed over ranks, then AdamW."""
    total = torch.zeros(())
    for mb in batches:
        if not mb.empty:  # one process has no placeholder
            loss = token_loss_sum(model(mb.input_ids).logits, mb.labels) / loss_tokens
            loss.backward()
            total += loss.detach()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    dist.all_reduce(total)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


def count_gathers(module: nn.Module, counts: dict[str, int], name: str) -> None:
    group = module._get_fsdp_state()._fsdp_param_group
    unshard = group.unshard

    def counted(*args, **kwargs):
        counts[name] += 1
        return unshard(*args, **kwargs)

    group.unshard = counted


def main() -> None:
    out_path, sync = sys.argv[1:]
    # Chunks of 108 // 19 = 5 rows, so several per microbatch: the last rank's 18 rows would make
    # them 6 there, and the ranks' per-chunk collectives would then differ.
    fused_loss.CHUNK_ELEMENTS = 108
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Toy()
    reference = copy.deepcopy(model)
    ref_optimizer = adamw(reference)
    wrap.shard(model, init_device_mesh("cpu", (dist.get_world_size(),)), ShardSettings())
    edges = vocab_parallel.edges(model)
    counts = {"embed": 0, "head": 0}
    count_gathers(model.embed, counts, "embed")
    count_gathers(model.head, counts, "head")
    optimizer = adamw(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    gathers, loss_errors = [], []
    # Whether the head's matrix is gathered when a training forward begins: an evaluation's forward
    # (before step 3) leaves it gathered, and the step must free it first, not only at the head.
    head_sharded = []
    model.layers[0].register_forward_pre_hook(
        lambda module, args: head_sharded.append(isinstance(model.head.weight, DTensor)) if watching else None
    )
    watching = False
    for step in range(3):
        batches = step_batches(rank, step)
        if step == 2:
            with torch.no_grad():
                model(batches[0].input_ids)
            watching = True
        result = loop.train_step(model, optimizer, schedule, batches, sync, 0.0, torch.device("cpu"), step + 1)
        want = reference_step(reference, ref_optimizer, batches, result.loss_tokens)
        loss_errors.append(abs(result.loss - want) / want)
        gathers.append(dict(counts))
        counts.update(embed=0, head=0)
    errors = {}
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            errors[name] = float((p.full_tensor() - q).abs().max() / q.abs().max().clamp_min(1e-30))
    try:
        bad = torch.full((1, SEQ), VOCAB)
        with vocab_parallel.diverted(model):
            model(bad).logits.sum()
        refused = ""
    except IndexError as exc:
        refused = str(exc)
    with open(f"{out_path}.{rank}", "w") as f:
        installed = {"embed": edges.embedding is not None, "head": edges.head is not None} if edges else {}
        json.dump(
            {
                "errors": errors,
                "loss_errors": loss_errors,
                "gathers": gathers,
                "head_sharded": head_sharded,
                "installed": installed,
                "refused": refused,
            },
            f,
        )
    runtime.exit_process(0)  # FSDP modules alive at interpreter exit can abort a gloo rank (docs/ARCHITECTURE.md)


if __name__ == "__main__":
    main()
