"""Measured peak tensor memory per rank of real training steps, to hold the estimate against.

Run under torchrun on real ranks (gloo on CPU); rank 0 prints one JSON line per case:

    torchrun --nproc-per-node 2 bench/measure_peak.py --model PATH [PATH ...] --seq-len 128 --sync every last replicated --micro-batch 1 4

The model is built once from its config with real weights (seeded) and sharded with the run's
own `model.shard` on the real process group (`replicated`: built whole, as the replicated layout
runs it, its gradients summed by the run's own bucketed all-reduce); each case runs the same `measure.tracked_step` as
the estimate (an untracked step creates AdamW's state once, then a tracked step of the run's
`microbatch_backward`, clipping and AdamW) with real tensors: FSDPMemTracker in real mode counts
the bytes of every live tensor. The figure is the largest over the ranks. On CUDA,
`torch.cuda.max_memory_allocated` of the same steps is printed as well.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import torch.distributed as dist

from accum_cli.model import wrap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", required=True, help="folders with the model's config.json, in turn")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--sync", nargs="+", default=["every", "last"], help="sync policies, or `replicated`")
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--accum-steps", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--lora-r", type=int, help="LoRA adapters of this rank on every linear layer (alpha 2r)")
    return parser.parse_args(argv)


def lora_spec(args: argparse.Namespace) -> dict | None:
    """--lora-r as the estimate's Query holds it (model/lora.py `spec`)."""
    if args.lora_r is None:
        return None
    return {"lora_r": args.lora_r, "lora_alpha": 2.0 * args.lora_r, "lora_dropout": 0.0,
            "lora_target_modules": "all-linear"}  # fmt: skip


def build(args: argparse.Namespace, model_dir: str, rt, replicated: bool = False):
    """The model with real weights (seeded), sharded by the run's own `model.shard`, and AdamW:
    built once for all cases, as the estimate builds its fake model once for all queries."""
    from accum_cli.config.settings import TrainConfig
    from accum_cli.model import load as modeling
    from accum_cli.model import lora
    from accum_cli.parallel.sharding import ShardSettings
    from accum_cli.step import optim

    source = modeling.resolve_source(model_dir)
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
    lora.apply(model, lora.settings_of(lora_spec(args)))  # before sharding, as the run
    if not replicated:
        wrap.shard(model, rt.mesh(1), settings)
    elif args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer, _ = optim.build(model, TrainConfig(lr=1e-3), total_steps=2)
    return model, optimizer, config


def measure(args: argparse.Namespace, built, sync: str, micro_batch: int, rt) -> dict:
    from accum_cli.memory.measure import fake_microbatches, tracked_step

    model, optimizer, config = built
    started = time.perf_counter()
    torch.manual_seed(rt.rank)
    microbatches = fake_microbatches(config.vocab_size, micro_batch, args.seq_len, args.accum_steps, rt.device)
    loss_tokens = micro_batch * args.seq_len * args.accum_steps * rt.world_size
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    replicated = sync == "replicated"
    peak, breakdown = tracked_step(
        model, optimizer, microbatches, "last" if replicated else sync, loss_tokens, rt.device, replicated
    )
    cuda_peak = torch.cuda.max_memory_allocated() if rt.device.type == "cuda" else 0
    peaks = torch.tensor([peak, cuda_peak], dtype=torch.int64, device=rt.device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    del microbatches
    gc.collect()
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "sync": sync,
        "micro_batch": micro_batch,
        "peak": int(peaks[0]),
        "cuda_max_allocated": int(peaks[1]),
        "breakdown": breakdown,
        "seconds": round(time.perf_counter() - started, 2),
    }


def main() -> None:
    from accum_cli.parallel import runtime

    args = parse_args()
    rt = runtime.start()
    for model_dir in args.model:  # one launch for several models: the launch costs more than a small model
        for replicated in (False, True):
            syncs = [s for s in args.sync if (s == "replicated") == replicated]
            built = build(args, model_dir, rt, replicated) if syncs else None
            for sync in syncs:
                for micro_batch in args.micro_batch:
                    row = measure(args, built, sync, micro_batch, rt)
                    if rt.is_main:
                        print(json.dumps({"model": model_dir, **row}), flush=True)
            del built
            gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
