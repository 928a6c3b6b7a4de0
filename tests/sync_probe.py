"""Measures, in a real gloo run (started by torchrun), what one optimizer step of the real
`model.shard` + `loop.train_step` does under each sync policy; rank 0 writes JSON.

Usage: torchrun --nproc_per_node=W tests/sync_probe.py MODEL_DIR OUT_JSON REPLICAS POLICY:A [...]

Per case it records:
- the collectives of one decoder layer's FSDP group, counted with a TorchDispatchMode that
  sees every c10d op FSDP issues (forward and backward run on this thread on CPU) together
  with its process group and tensor sizes. A collective belongs to a decoder layer when its
  per-rank shard has that layer's size; counts are per layer, as `--plan` prints them.
- the bytes of live tensor storage on this rank between microbatches (at the start of every
  microbatch after the first), from every tensor the garbage collector tracks;
- the forward calls per microbatch of each decoder layer's first part (forward hooks), to
  see activation checkpointing recompute each layer in backward.
"""

from __future__ import annotations

import gc
import json
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from accum_cli.data.batches import Microbatch
from accum_cli.model import load as modeling
from accum_cli.model import wrap
from accum_cli.parallel import runtime
from accum_cli.parallel.sharding import ShardSettings
from accum_cli.step import loop

OPS = {"_allgather_base_": "all_gathers", "_reduce_scatter_base_": "reduce_scatters", "allreduce_": "all_reduces"}


class CollectiveLog(TorchDispatchMode):
    """Every c10d collective dispatched while active: (kind, process group name, smallest tensor size)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._opname in OPS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            group = next(ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject))
            self.calls.append((OPS[func._opname], group.group_name, min(t.numel() for t in tensors)))
        return func(*args, **(kwargs or {}))


def live_storage_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (freed FSDP buffers count 0)."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            local = obj._local_tensor if isinstance(obj, DTensor) else obj
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())


class ProbedMicrobatch(Microbatch):
    """train_step moves each microbatch to the device as it starts it: the moment between two
    microbatches, when only what the policy keeps is alive."""

    __slots__ = ("log",)

    def to(self, device: torch.device) -> Microbatch:
        self.log.append(live_storage_bytes())
        return super().to(device)


def microbatches(n: int, log: list[int]) -> list[Microbatch]:
    g = torch.Generator().manual_seed(dist.get_rank())
    out = []
    for _ in range(n):
        ids = torch.randint(3, 300, (2, 12), generator=g)
        mb = ProbedMicrobatch(ids, torch.ones_like(ids), ids.clone())
        mb.log = log
        out.append(mb)
    return out


def run_case(model_dir: str, mesh, replicas: int, sync: str, accum: int, checkpointing: bool) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    layers = modeling.decoder_layers(model)  # before sharding renames their classes
    wrap.shard(model, mesh, ShardSettings(activation_checkpointing=checkpointing))
    forwards = Counter()
    for layer in layers:
        # A layer's parts run inside its (checkpointed) forward, so a recompute calls them again;
        # hooks on the layer itself stay outside the checkpoint in transformers 5.
        part = next(layer.children())
        part.register_forward_hook(lambda module, args, output, layer=layer: forwards.update([id(layer)]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    layer_shard = sum(p.to_local().numel() for p in layers[0].parameters())
    # The untied input embedding and output projection: units of their own, of one size here.
    edge_shard = model.get_input_embeddings().weight.to_local().numel()
    assert edge_shard == model.get_output_embeddings().weight.to_local().numel() != layer_shard
    shard_group = mesh.get_group("shard").group_name
    across_group = mesh.get_group("replicate").group_name if replicas > 1 else None
    between: list[int] = []
    gc.collect()
    with CollectiveLog() as log:
        loop.train_step(model, optimizer, scheduler, microbatches(accum, between), sync, 1.0, torch.device("cpu"))
    counts = Counter()
    shards = mesh.size(mesh.mesh_dim_names.index("shard"))
    for kind, group, numel in log.calls:
        if kind == "all_reduces" and group == shard_group and numel == shards * layer_shard:
            # On gloo, FSDP's reduce-scatter is an all-reduce in place of the whole layer's
            # gradients on the shard group (runtime.InPlaceReduceScatter): a reduce-scatter.
            kind, numel = "reduce_scatters", layer_shard
            counts["in_place"] += 1
        if kind == "all_gathers" and group == shard_group and numel == edge_shard:
            counts["edge_all_gathers"] += 1
        wanted = across_group if kind == "all_reduces" else shard_group
        if group == wanted and numel == layer_shard:
            counts[kind] += 1
    per_layer = {kind: counts[kind] / len(layers) for kind in OPS.values()}
    return {
        "sync": sync,
        "accum": accum,
        "replicas": replicas,
        "checkpointing": checkpointing,
        "collectives": per_layer,
        "reduce_scatters_in_place": counts["in_place"] / len(layers),
        "edge_all_gathers_per_microbatch": counts["edge_all_gathers"] / accum,
        "bytes_between_microbatches": between[1:],  # the first is before any backward
        "layer_forwards_per_microbatch": [forwards[id(layer)] / accum for layer in layers],
    }


def main() -> None:
    model_dir, out, replicas, *cases = sys.argv[1:]
    replicas = int(replicas)
    rt = runtime.start()
    mesh = rt.mesh(replicas)
    results = []
    for case in cases:
        sync, accum, *flags = case.split(":")
        results.append(run_case(model_dir, mesh, replicas, sync, int(accum), "ac" in flags))
    if rt.is_main:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
