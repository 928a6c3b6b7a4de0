"""On one CUDA GPU, for a ~1B Llama in bf16: the estimate next to torch.cuda.max_memory_allocated,
then accum-train's own tokens/s and MFU, eager and with --compile.

    python bench/gpu_check.py                       # seq len 2048, m in {1, 2}, every and last (< 5 min on an H200)
    python bench/gpu_check.py --micro-batch 1 4 --seq-len 1024 --no-speed

For each sync policy and micro batch it prints the estimate (estimate.py: fake model, fake world
of 1, CPU) and, from bench/measure_peak.py run on the GPU (one rank, NCCL), the peak that
FSDPMemTracker counts and torch.cuda.max_memory_allocated of the same step. CI never runs it
(no GPU); a CPU test imports it and parses its arguments. Exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from accum_cli.memory.query import Query

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sync", nargs="+", default=["every", "last"])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of the Llama-3.2-1B shape")
    parser.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True,
                        help="also time accum-train itself (8 steps of G=16, eager and compiled)")  # fmt: skip
    return parser.parse_args(argv)


def speed(model_dir: Path, seq_len: int, micro_batch: int, tmp: Path) -> None:
    """accum-train's CLI as a user runs it, bf16 on this GPU: median tokens/s and MFU (metrics.jsonl,
    whose MFU uses the GPU's bf16 peak) of steps 3-8, eager and compiled."""
    import torch

    data = tmp / "tokens.jsonl"
    g = torch.Generator().manual_seed(0)
    with open(data, "w") as f:
        for row in torch.randint(3, 128000, (128, seq_len), generator=g).tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    print(f"accum-train, bf16, seq len {seq_len}, G=16, m={micro_batch}, steps 3-8")
    for compiled in (False, True):
        out = tmp / f"run-{compiled}"
        cmd = [sys.executable, "-m", "accum_cli", "--model", str(model_dir), "--dataset", str(data),
               "--seq-len", str(seq_len), "--global-batch", "16", "--micro-batch", str(micro_batch),
               "--max-steps", "8", "--precision", "bf16", "--lr", "1e-4", "--output-dir", str(out),
               "--compile" if compiled else "--no-compile"]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
        if done.returncode:
            print(f"compile={compiled}: exit {done.returncode}\n{done.stderr[-3000:]}")
            continue
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]
        tps = sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2]
        mfu = sorted(r.get("mfu", float("nan")) for r in rows)[len(rows) // 2]
        print(f"compile={compiled!s:<5} {tps:>10,.0f} tokens/s  MFU {mfu:.1%}  "
              f"(run {time.perf_counter() - started:.0f} s, peak memory {rows[-1]['peak_mem_gib']:.1f} GiB)")  # fmt: skip


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import LlamaConfig

    from accum_cli.memory import estimate

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to measure")
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama-1b"
        LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=args.layers,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
            tie_word_embeddings=True,
        ).save_pretrained(model_dir)  # fmt: skip
        os.environ["ACCUM_TRAIN_CACHE"] = str(Path(tmp) / "cache")
        config = json.loads((model_dir / "config.json").read_text())
        cases = [(sync, m) for sync in args.sync for m in args.micro_batch]
        started = time.perf_counter()
        found = estimate.estimate([Query(config, 1, 1, m, args.seq_len, sync, True, False) for sync, m in cases])
        print(f"estimated {len(cases)} cases in {time.perf_counter() - started:.1f} s", flush=True)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port=29533",
            str(REPO / "bench" / "measure_peak.py"), "--model", str(model_dir), "--seq-len", str(args.seq_len),
            "--bf16", "--sync", *args.sync, "--micro-batch", *map(str, args.micro_batch),
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-4000:])
            return
        rows = {(r["sync"], r["micro_batch"]): r for r in map(json.loads, done.stdout.splitlines()[-len(cases) :])}
        print(f"1B Llama, bf16, seq len {args.seq_len}, one GPU ({torch.cuda.get_device_name()})")
        print(f"{'sync':<6} {'m':>2} {'estimate GiB':>13} {'tracker GiB':>12} {'max_alloc GiB':>14} {'est/alloc':>9}")
        for (sync, m), got in zip(cases, found, strict=True):
            row = rows[(sync, m)]
            alloc = row["cuda_max_allocated"]
            print(
                f"{sync:<6} {m:>2} {got.peak / 2**30:>13.2f} {row['peak'] / 2**30:>12.2f} {alloc / 2**30:>14.2f} "
                f"{got.peak / alloc:>9.2f}"
            )
        if args.speed:
            from transformers import ByT5Tokenizer

            ByT5Tokenizer().save_pretrained(model_dir)
            speed(model_dir, args.seq_len, max(args.micro_batch), Path(tmp))


if __name__ == "__main__":
    main()
