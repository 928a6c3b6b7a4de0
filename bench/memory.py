"""Peak resident memory per rank where the training state dominates: accum-train sharding vs DDP.

Workload (issue 11): Llama, vocab 32000, hidden 512, intermediate 1376, 4 layers, 8 heads,
untied (45M parameters, 16 B each of training state: 727 MB), fp32, seq 128, G=8, m=2,
2 gloo ranks, 3 optimizer steps of AdamW. Contestants, alternating, REPS rounds (default 3: DDP's
own peak moves by 100 MiB from run to run); the table gives each one's median and range:

- `ddp`: Accelerate's documented `accumulate()` loop (Accelerator(cpu=True), which wraps the
  model in torch DDP; no_sync on all but the last microbatch), the loop a user writes instead;
- `accum-train --layout shard --sync every|last`, and `--layout replicate` for comparison;
- the same with `--lora-r 8` (sharded `last`, replicated): LoRA against full fine-tuning (docs/LORA.md).

Per contestant and rank: VmHWM (the peak resident set) at the end of training (before accum-train
writes final/, which the DDP loop does not do), and the RSS just before the
model is built (the libraries: torch, transformers and the model's own module, accelerate), so the table shows the whole
peak and the part above that floor, which is what the training costs.

    .venv/bin/python bench/memory.py          # about 6 minutes on 2 cores (--reps 1: 2 minutes)

A benchmark, not a test: it exits 0 whatever the ratios are, non-zero only on a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from speed import finish  # bench/ is this script's own folder

HERE = Path(__file__).resolve().parent
VOCAB, HIDDEN, INTER, LAYERS, HEADS, SEQ, G, M, W, STEPS = 32000, 512, 1376, 4, 8, 128, 8, 2, 2, 3


def rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def report(name: str, floor: float, peak: float, seconds: float) -> None:
    """Every rank's floor, peak and seconds in optimizer steps, printed by rank 0 as one JSON line."""
    import torch.distributed as dist

    mine = {"floor": floor, "peak": peak, "seconds": seconds}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"name": name, "ranks": every}), flush=True)


def write_workload(root: Path) -> tuple[Path, Path]:
    import torch
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    ByT5Tokenizer().save_pretrained(root / "model")
    g = torch.Generator().manual_seed(1)
    with open(root / "data.jsonl", "w") as f:
        for row in torch.randint(3, VOCAB, (G * STEPS, SEQ), generator=g).tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    return root / "model", root / "data.jsonl"


def ddp(model_dir: str, data: str) -> None:
    """Accelerate's documented gradient-accumulation loop (its DDP on CPU)."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=G // (M * W))
    import transformers.models.llama.modeling_llama  # noqa: F401  (in accum-train's floor too: ~117 MiB)

    floor = rss_mib("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    rows = [json.loads(line)["input_ids"] for line in Path(data).read_text().splitlines()]
    loader = torch.utils.data.DataLoader(torch.tensor(rows), batch_size=M)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    started = time.perf_counter()
    for ids in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    report("ddp (Accelerate accumulate)", floor, rss_mib("VmHWM"), time.perf_counter() - started)
    accelerator.end_training()
    finish()  # past gloo's exit crash, as bench/speed.py's peers


def accum_train(model_dir: str, data: str, name: str, *flags: str) -> None:
    """The real CLI in this process; the floor is taken when it starts building the model."""
    import torch.distributed as dist

    from accum_cli.cli import main as cli
    from accum_cli.model import wrap
    from accum_cli.run import train

    floor, peak = {}, {"seconds": 0.0}
    step = train.train_step

    def measured_step(*args, **kwargs):  # the peak of training, before the run writes final/
        started = time.perf_counter()
        result = step(*args, **kwargs)
        peak["seconds"] += time.perf_counter() - started
        peak["hwm"] = rss_mib("VmHWM")
        return result

    train.train_step = measured_step
    for build in ("build_sharded", "build_replicated"):
        original = getattr(wrap, build)

        def measured(*args, _original=original, **kwargs):
            floor.setdefault("rss", rss_mib("VmRSS"))
            return _original(*args, **kwargs)

        setattr(wrap, build, measured)
    out = Path(data).parent / name.replace(" ", "-")  # the same folder on every rank
    sys.argv = ["accum-train", "--model", model_dir, "--dataset", data, "--seq-len", str(SEQ), "--global-batch", str(G),
                "--micro-batch", str(M), "--max-steps", str(STEPS), "--lr", "1e-4", "--weight-decay", "0",
                "--output-dir", str(out), "--overwrite", "--log-every", "100", *flags]  # fmt: skip
    exit_process = cli.exit_process

    def exit_with_report(code: int) -> None:
        if code == 0 and dist.is_initialized():
            report(name, floor["rss"], peak["hwm"], peak["seconds"])
        exit_process(code)

    cli.exit_process = exit_with_report
    cli.entry()


CONTESTANTS = {
    "ddp": ["ddp"],
    "shard-every": ["accum", "accum-train shard every", "--layout", "shard", "--sync", "every"],
    "shard-last": ["accum", "accum-train shard last", "--layout", "shard", "--sync", "last"],
    "replicate": ["accum", "accum-train replicate", "--layout", "replicate"],
    # LoRA (docs/LORA.md): r 8 on every linear layer of the decoder blocks; the base frozen
    "lora-shard-last": ["accum", "accum-train LoRA r8 shard last", "--layout", "shard", "--sync", "last",
                        "--lora-r", "8"],
    "lora-replicate": ["accum", "accum-train LoRA r8 replicate", "--layout", "replicate", "--lora-r", "8"],
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if os.environ.get("BENCH_MEMORY_ROLE"):  # a rank
        kind, *rest = sys.argv[1:]
        if kind == "ddp":
            ddp(*rest)
        else:
            accum_train(*rest)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=int(os.environ.get("REPS", "3")))
    parser.add_argument("--only", help="the contestants whose key matches this regular expression (ddp always runs)")
    args = parser.parse_args()
    chosen = {k: v for k, v in CONTESTANTS.items() if k == "ddp" or not args.only or re.search(args.only, k)}
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", BENCH_MEMORY_ROLE="rank",
               PYTHONPATH=f"{HERE.parent}:{os.environ.get('PYTHONPATH', '')}")  # fmt: skip
    torchrun = Path(sys.executable).with_name("torchrun")
    peaks: dict[str, list[float]] = {}  # per contestant and round: the larger rank's peak
    above: dict[str, list[float]] = {}  # and the larger rank's peak above its floor
    speed: dict[str, list[float]] = {}  # tokens/s over the optimizer steps (the slower rank's time)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = write_workload(Path(tmp))
        for rep in range(args.reps):
            for key, (kind, *flags) in chosen.items():  # alternating, as bench/speed.py does
                cmd = [str(torchrun), f"--nproc_per_node={W}", f"--master_port={free_port()}", __file__,
                       kind, str(model_dir), str(data), *flags]  # fmt: skip
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                if done.returncode != 0 or line is None:
                    sys.exit(f"{key} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
                result = json.loads(line[len("RESULT ") :])
                name = result["name"]
                peaks.setdefault(name, []).append(max(r["peak"] for r in result["ranks"]))
                above.setdefault(name, []).append(max(r["peak"] - r["floor"] for r in result["ranks"]))
                speed.setdefault(name, []).append(G * SEQ * STEPS / max(r["seconds"] for r in result["ranks"]))
                print(f"rep {rep + 1}/{args.reps}  {name:<32} peak {peaks[name][-1]:6.0f} MiB", flush=True)
    n_params = 2 * VOCAB * HIDDEN + LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN) + HIDDEN
    print(f"\nLlama vocab {VOCAB}, hidden {HIDDEN}, {LAYERS} layers, untied: {n_params / 1e6:.1f}M parameters "
          f"({16 * n_params / 2**20:.0f} MiB of fp32 training state); seq {SEQ}, G={G}, m={M}, {W} gloo ranks; "
          f"medians of {args.reps} rounds")  # fmt: skip
    print(
        f"{'contestant':32} {'peak MiB (max rank)':>20} {'min-max':>11} {'vs ddp':>7} {'above floor':>12} {'vs ddp':>7}"
        f" {'tokens/s':>9}"
    )
    ddp_name = next(iter(peaks))
    base, base_above = statistics.median(peaks[ddp_name]), statistics.median(above[ddp_name])
    for name in peaks:
        peak, over = statistics.median(peaks[name]), statistics.median(above[name])
        spread = f"{min(peaks[name]):.0f}-{max(peaks[name]):.0f}"
        print(f"{name:32} {peak:20.0f} {spread:>11} {peak / base:7.2f} {over:12.0f} {over / base_above:7.2f}"
              f" {statistics.median(speed[name]):9.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
