"""Tokens/s of accum-train against the peers a user would pick instead, side by side in one run.

Workload (issue 11): LlamaConfig(vocab 512, hidden 256, intermediate 688, 4 layers, 4 heads,
untied), fp32, sdpa, seq 256, G=32 sequences per optimizer step, m=4, 2 gloo ranks (4
microbatches per rank), AdamW lr 1e-3, weight decay 0, constant rate, clip 1.0; 2 warm-up and 6
timed optimizer steps. Contestants, each launched by torchrun on 2 ranks, OMP_NUM_THREADS=1:

- `accum-train`: the real CLI with its defaults (and `--compile`: the compile itself falls in
  the warm-up steps; and `--layout shard`, the FSDP2 layout a model too big to replicate gets);
- `accelerate`: Accelerate's documented `accumulate()` loop (`Accelerator(cpu=True)`: DDP on gloo);
- `trainer`: `transformers.Trainer`, everything at its defaults but what makes it this workload
  (constant rate, `adamw_torch`, weight decay 0, sequential sampling).

A run's figure is the median over its timed steps of global tokens per second, each step timed
on rank 0 from the end of the step before to the end of its own optimizer step: data reading,
logging and anything else between steps included (accum-train's from the `elapsed_s` its
metrics.jsonl records at the end of each step). The contestants alternate, REPS rounds; the table gives each
one's median over the rounds, its range, and its ratio to the best peer (accelerate or trainer) taken
within each round, as the median and range of those per-round ratios: a contestant and the peers of one
round ran minutes apart on the same machine, so a slow spell of the machine (which moves every
contestant's tokens/s by several percent here) cancels out of the ratio. The header names the machine
(CPU model, cores): the ratios differ from one CPU to another.

    make bench                                    # REPS=3, about 6 minutes on 2 idle cores
    .venv/bin/python bench/speed.py --reps 1 --only accum-train accelerate
    .venv/bin/python bench/speed.py --precision fp32 bf16

bf16 rows (`--precision bf16`): every contestant in its own documented bf16 mode, the path every GPU
run takes: accum-train `--precision bf16`, `Accelerator(mixed_precision="bf16")`, the Trainer with
`bf16=True`; ratios are taken within a precision. By default they run where the CPU computes bf16
natively (avx512_bf16 or amx_bf16 in /proc/cpuinfo); elsewhere bf16 is emulated and every contestant
crawls (a 1024x1024 bf16 matmul 65x slower than fp32 on an AVX2-only EPYC), so the table says so.

A benchmark, not a test: it exits 0 whatever the ratios are, non-zero only on a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB, HIDDEN, INTER, LAYERS, HEADS, SEQ, G, M, W, LR, CLIP = 512, 256, 688, 4, 4, 256, 32, 4, 2, 1e-3, 1.0
WARMUP, TIMED = 2, 6
STEPS = WARMUP + TIMED
ACCUM = G // (M * W)
PEERS = ("accelerate", "trainer")


def write_workload(root: Path) -> tuple[Path, Path]:
    import torch
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=512,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    ByT5Tokenizer().save_pretrained(root / "model")  # accum-train asks for one; the ids are given
    g = torch.Generator().manual_seed(1234)
    with open(root / "data.jsonl", "w") as f:
        for row in torch.randint(3, VOCAB, (G * STEPS, SEQ), generator=g).tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    return root / "model", root / "data.jsonl"


def rows(data: str):
    import torch

    return torch.tensor([json.loads(line)["input_ids"] for line in Path(data).read_text().splitlines()])


def report(step_seconds: list[float]) -> None:
    """Rank 0: the timed steps' global tokens/s, one JSON line."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        rates = [G * SEQ / s for s in step_seconds[WARMUP:]]
        print("RESULT " + json.dumps({"tokens_per_s": rates}), flush=True)


def finish() -> None:
    """End a peer's rank without interpreter finalization: a gloo worker thread that drops its last
    Work during it aborts the process (or hangs it) after the result was printed (../shared/peers
    README, "the gloo exit crash"); nothing useful happens after the report anyway."""
    import torch.distributed as dist

    if dist.is_initialized():  # Accelerate's end_training() has destroyed it already
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def bf16() -> bool:
    return os.environ.get("BENCH_SPEED_PRECISION") == "bf16"


def accelerate_loop(model_dir: str, data: str) -> None:
    """Accelerate's documented gradient-accumulation loop; each rank reads its share of each step."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    precision = "bf16" if bf16() else "no"
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, mixed_precision=precision)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(rows(data), batch_size=M)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seconds, started = [], time.perf_counter()
    for ids in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
    report(seconds)
    accelerator.end_training()
    finish()


def trainer(model_dir: str, data: str) -> None:
    """transformers.Trainer, timed by a callback from one step's start to the next one's."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    ids = rows(data)
    dataset = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    args = TrainingArguments(
        output_dir=str(Path(data).parent / "trainer"), per_device_train_batch_size=M,
        gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=LR, weight_decay=0.0,
        lr_scheduler_type="constant", max_grad_norm=CLIP, optim="adamw_torch", use_cpu=True, ddp_backend="gloo",
        save_strategy="no", report_to=[], disable_tqdm=True, train_sampling_strategy="sequential", bf16=bf16(),
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Clock()]).train()
    report([b - a for a, b in zip(ends, ends[1:], strict=False)])
    finish()


def accum_train_flags(model_dir: Path, data: Path, out: Path) -> list[str]:
    return ["--model", str(model_dir), "--dataset", str(data), "--global-batch", str(G), "--micro-batch", str(M),
            "--max-steps", str(STEPS), "--lr", str(LR), "--weight-decay", "0", "--lr-schedule", "constant",
            "--warmup-steps", "0", "--grad-clip", str(CLIP), "--output-dir", str(out), "--log-every", "100"]  # fmt: skip


CONTESTANTS = {  # name -> extra accum-train flags, or the peer's role
    "accum-train": [],
    "accum-train --compile": ["--compile"],
    "accum-train --layout shard": ["--layout", "shard"],  # what a model too big to replicate gets
    "accelerate": "accelerate",
    "trainer": "trainer",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, model_dir: Path, data: Path, tmp: Path, env: dict, precision: str = "fp32") -> list[float]:
    torchrun = [
        str(Path(sys.executable).with_name("torchrun")),
        f"--nproc_per_node={W}",
        f"--master_port={free_port()}",
    ]
    what = CONTESTANTS[name]
    if isinstance(what, str):
        cmd = [*torchrun, __file__, what, str(model_dir), str(data)]
    else:
        out = tmp / f"run-{time.monotonic_ns()}"
        cmd = [*torchrun, "-m", "accum_cli", *accum_train_flags(model_dir, data, out), *what]
        cmd += ["--precision", "bf16"] if precision == "bf16" else []  # else accum-train's default: fp32 on a CPU
    done = subprocess.run(cmd, env=env | {"BENCH_SPEED_PRECISION": precision}, capture_output=True, text=True,
                          timeout=1200)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"{name} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    if isinstance(what, str):
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        return json.loads(line[len("RESULT ") :])["tokens_per_s"]
    # Step to step, as the peers are timed: the work between two steps (metrics, the stop check) counts too.
    elapsed = {m["step"]: m["elapsed_s"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    return [G * SEQ / (elapsed[step] - elapsed[step - 1]) for step in range(WARMUP + 1, STEPS + 1)]


def main() -> None:
    if os.environ.get("BENCH_SPEED_ROLE"):  # a rank of a peer
        role, model_dir, data = sys.argv[1:]
        {"accelerate": accelerate_loop, "trainer": trainer}[role](model_dir, data)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=int(os.environ.get("REPS", "3")))
    parser.add_argument("--only", nargs="+", choices=list(CONTESTANTS), default=list(CONTESTANTS))
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=default_precisions(),
                        help="fp32, bf16 or both (default: bf16 too where this CPU computes it natively)")  # fmt: skip
    args = parser.parse_args()
    for precision in args.precision:
        table(args, precision)
    if "bf16" not in args.precision:
        print("\nbf16 rows: not run, this CPU has no native bf16 (no avx512_bf16 or amx_bf16): "
              "every contestant would run emulated bf16; --precision bf16 runs them anyway")  # fmt: skip


def default_precisions() -> list[str]:
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return ["fp32", "bf16"] if ("avx512_bf16" in flags or "amx_bf16" in flags) else ["fp32"]


def table(args: argparse.Namespace, precision: str) -> None:
    """One precision: the contestants alternating for --reps rounds, then the table."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", BENCH_SPEED_ROLE="",
               PYTHONPATH=f"{HERE.parent}:{os.environ.get('PYTHONPATH', '')}")  # fmt: skip
    runs: dict[str, list[float]] = {name: [] for name in args.only}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = write_workload(Path(tmp))
        for rep in range(args.reps):
            for name in args.only:  # alternating: a slow minute of the machine hits every contestant alike
                role = {"BENCH_SPEED_ROLE": "rank"} if name in PEERS else {}
                rates = run(name, model_dir, data, Path(tmp), env | role, precision)
                runs[name].append(statistics.median(rates))
                print(f"rep {rep + 1}/{args.reps}  {precision}  {name:<22} {runs[name][-1]:8.0f} tokens/s", flush=True)
    ratios = round_ratios(runs)
    print(f"\nLlama 4 x {HIDDEN}, vocab {VOCAB}, {precision}, seq {SEQ}, G={G}, m={M}, {W} gloo ranks; median of steps "
          f"{WARMUP + 1}-{STEPS}, {args.reps} rounds alternating; {machine()}")  # fmt: skip
    print(f"{'contestant':<24} {'tokens/s':>9} {'min-max':>15} {'vs best peer':>13} {'min-max':>11}")
    for name, rates in runs.items():
        spread = f"{min(rates):.0f}-{max(rates):.0f}"
        if name in ratios:
            ratio = f"{statistics.median(ratios[name]):.2f}x"
            ratio_spread = f"{min(ratios[name]):.2f}-{max(ratios[name]):.2f}"
        else:
            ratio, ratio_spread = "-", "-"
        print(f"{name:<24} {statistics.median(rates):9.0f} {spread:>15} {ratio:>13} {ratio_spread:>11}")


def round_ratios(runs: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each contestant's tokens/s over the best peer's of the same round; empty without a peer."""
    peers = [runs[p] for p in PEERS if p in runs]
    if not peers:
        return {}
    best = [max(round_rates) for round_rates in zip(*peers, strict=True)]
    return {name: [rate / b for rate, b in zip(rates, best, strict=True)] for name, rates in runs.items()}


def machine() -> str:
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"


if __name__ == "__main__":
    main()
