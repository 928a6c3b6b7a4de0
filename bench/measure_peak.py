"""Measured peak tensor memory per rank of real training steps, to hold the estimate against.

Run under torchrun on real ranks (gloo on CPU); rank 0 prints one JSON line per case:

    torchrun --nproc-per-node 2 bench/measure_peak.py --model PATH --seq-len 128 --sync every last --micro-batch 1 4

Each case builds the model from its config with real weights (seeded), shards it with the run's
own `model.shard` on the real process group, and runs the same `estimate.tracked_steps` as the
estimate (two steps, the run's `microbatch_backward`, clipping, AdamW) with real tensors:
FSDPMemTracker in real mode counts the bytes of every live tensor. The figure is the largest
over the ranks. On CUDA, `torch.cuda.max_memory_allocated` of the same steps is printed as well.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
import torch.distributed as dist


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a folder with the model's config.json")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--sync", nargs="+", default=["every", "last"])
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--accum-steps", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, sync: str, micro_batch: int, rt) -> dict:
    from accum_cli import model as modeling
    from accum_cli import optim
    from accum_cli.config import TrainConfig
    from accum_cli.estimate import fake_microbatches, tracked_step
    from accum_cli.sharding import ShardSettings

    source = modeling.resolve_source(args.model)
    config = modeling.load_config(source, trust_remote_code=False)
    settings = ShardSettings(bf16=args.bf16, activation_checkpointing=args.activation_checkpointing)
    if rt.device.type == "cuda":  # initialised on the GPU: a 1B model's CPU init would take minutes
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        with torch.device(rt.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        model.train()
    else:
        model = modeling.load_model(source, config, False, seed=0)
    modeling.shard(model, rt.mesh(1), settings)
    optimizer, _ = optim.build(model, TrainConfig(lr=1e-3), total_steps=2)
    torch.manual_seed(rt.rank)
    microbatches = fake_microbatches(config.vocab_size, micro_batch, args.seq_len, args.accum_steps, rt.device)
    loss_tokens = micro_batch * args.seq_len * args.accum_steps * rt.world_size
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    peak, breakdown = tracked_step(model, optimizer, microbatches, sync, loss_tokens, rt.device)
    cuda_peak = torch.cuda.max_memory_allocated() if rt.device.type == "cuda" else 0
    peaks = torch.tensor([peak, cuda_peak], dtype=torch.int64, device=rt.device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    del model, optimizer, microbatches
    gc.collect()
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "sync": sync,
        "micro_batch": micro_batch,
        "peak": int(peaks[0]),
        "cuda_max_allocated": int(peaks[1]),
        "breakdown": breakdown,
    }


def main() -> None:
    from accum_cli import runtime

    args = parse_args()
    rt = runtime.start()
    for sync in args.sync:
        for micro_batch in args.micro_batch:
            row = measure(args, sync, micro_batch, rt)
            if rt.is_main:
                print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
