"""The sharded layout (accum_cli/model/load.py `shard`) when ranks use different parameters, in a real
gloo run started by torchrun; each rank writes OUT_JSON.RANK.

Usage: torchrun --nproc_per_node=2 tests/shard_probe.py OUT_JSON POLICY|replicate [bf16]

A toy causal LM in decoder-layer units, as `shard` makes them, trained two steps by the run's own
`loop.train_step` (AdamW with weight decay). A `rare` layer (an expert) that only rank 0 uses, in
the first step only, and a `never` layer that no rank ever uses, and a frozen parameter. FSDP2 leaves a parameter without
a gradient out of its reduce-scatter, so without zeros in its place the ranks' collectives differ
in size and gloo aborts the run; with zeros, a parameter no rank had a gradient for would get a
zero gradient that AdamW moves (by its momentum, by weight decay), where one process leaves it
alone. The reference: an unsharded copy on each rank, each gradient summed over ranks by its own
all-reduce, None where no rank had one, and the same AdamW step (fp32). With bf16 (parameters in
bf16, gradients reduced in fp32, as on a GPU), FSDP accumulates a unit's gradients in fp32 between
microbatches, and the zeros for a parameter a rank did not use must be fp32 too.

In the second step each rank has a placeholder microbatch (a rank with fewer samples than
microbatches gets one: a pad token that counts nowhere), whose pad token goes through the rare
layer that no real token of that step uses: its zero gradient is no use, there as in one process.
`replicate` runs the same steps on the replicated layout (reduce.py) instead.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers.modeling_outputs import CausalLMOutput

from accum_cli.data.batches import Microbatch, empty_microbatch
from accum_cli.loss.tokens import token_loss_sum
from accum_cli.model import wrap
from accum_cli.parallel import runtime
from accum_cli.parallel.sharding import ShardSettings
from accum_cli.step import loop

VOCAB, WIDTH, SEQ = 32, 16, 8
USE_RARE = 1  # a microbatch whose first token is this one goes through the rare layer


class Block(nn.Module):
    def __init__(self, extra: str | None) -> None:
        super().__init__()
        self.dense = nn.Linear(WIDTH, WIDTH)
        self.extra_name = extra
        if extra is not None:
            self.add_module(extra, nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, use_rare: bool) -> torch.Tensor:
        x = torch.tanh(self.dense(x))
        return x + self.rare(x) if self.extra_name == "rare" and use_rare else x


class Toy(nn.Module):
    _no_split_modules = ["Block"]  # what `shard` makes units of, as in a transformers model

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Block("never"), Block("rare")])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.frozen = nn.Parameter(torch.full((WIDTH,), 1.5), requires_grad=False)  # as a fixed bias

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        x = self.embed(input_ids) * self.frozen
        use_rare = bool(input_ids[0, 0] == USE_RARE)
        for layer in self.layers:
            x = layer(x, use_rare)
        return CausalLMOutput(logits=self.head(x))  # FSDP finds its tensors for the backward's hooks


def step_batches(rank: int, step: int) -> list[Microbatch]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    batches = []
    for _ in range(2):
        ids = torch.randint(2, VOCAB, (2, SEQ), generator=generator)
        ids[:, 0] = USE_RARE if (rank == 0 and step == 0) else 2
        batches.append(Microbatch(ids, torch.ones_like(ids), ids.clone()))
    if step == 1:  # a placeholder whose pad token reaches the rare layer: first on rank 0, last on rank 1
        batches[0 if rank == 0 else 1] = empty_microbatch(pad_id=USE_RARE)
    return batches


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def reference_step(model: nn.Module, optimizer, batches: list[Microbatch], loss_tokens: int) -> None:
    for mb in batches:
        if mb.empty:  # one process has no placeholder
            continue
        (token_loss_sum(model(mb.input_ids).logits, mb.labels) / loss_tokens).backward()
    for p in model.parameters():
        if not p.requires_grad:
            continue
        had = torch.tensor([float(p.grad is not None)])
        dist.all_reduce(had)
        if had.item() == 0:
            continue  # no rank had one: it stays None, as in one process
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    out_path, sync, *precision = sys.argv[1:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Toy()
    reference = copy.deepcopy(model)
    ref_optimizer = adamw(reference)
    if sync != "replicate":
        settings = ShardSettings(bf16=precision == ["bf16"])
        wrap.shard(model, init_device_mesh("cpu", (dist.get_world_size(),)), settings)
    optimizer = adamw(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for step in range(2):
        batches = step_batches(rank, step)
        result = loop.train_step(model, optimizer, schedule, batches, sync, 0.0, torch.device("cpu"), step + 1)
        reference_step(reference, ref_optimizer, batches, result.loss_tokens)
    errors, moved, reference_moved = {}, {}, {}
    torch.manual_seed(0)
    initial = Toy()  # the same seed: the weights before training
    with torch.no_grad():
        for (name, p), q, p0 in zip(
            model.named_parameters(), reference.parameters(), initial.parameters(), strict=True
        ):
            got = p.full_tensor() if sync != "replicate" else p
            errors[name] = float((got - q).abs().max() / q.abs().max().clamp_min(1e-30))
            moved[name] = float((got - p0).abs().max())
            reference_moved[name] = float((q - p0).abs().max())
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"errors": errors, "moved": moved, "reference_moved": reference_moved}, f)
    runtime.exit_process(0)  # FSDP modules alive at interpreter exit can abort a gloo rank (docs/ARCHITECTURE.md)


if __name__ == "__main__":
    main()
