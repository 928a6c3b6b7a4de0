"""Packed rows against padded rows (issue 40): positions computed per loss token, real tokens/s, loss per token.

Corpus: `--rows` synthetic chat conversations (one user turn, one assistant turn) whose lengths in tokens are
drawn from a log-normal distribution, median `--median` tokens and sigma `--sigma` (defaults 300 and 1.0: mean
about 495, one in ten above about 1,080, about 1.5% above 2,048 and cut to `--seq-len` as rows are), seeded
(`--seed`, default 0); the user turn takes a uniform 20-60% of each conversation. The byte-level ByT5
tokenizer gives one token per character, so the lengths are what they were drawn as (plus the chat template's
markers). Only the answers count in the loss (the chat format's default).

Model: Llama, 2 layers x 256 (intermediate 688, 4 heads), vocabulary 384, random weights; fp32, sdpa, eager
(`--no-compile`), AdamW lr 1e-3, constant rate. Two layouts, each through the real CLI on 2 gloo ranks
(torchrun, OMP_NUM_THREADS=1), the same `--seq-len` and `--micro-batch` (what fits a device is m rows of up to
seq-len tokens, padded or packed):

- `padded`: `--no-packing`, today's default for chat rows: each microbatch padded to its longest row;
- `packed`: `--packing`, `--global-batch` packed sequences a step (`--packed-batch`, default 8), whole rows
  bin-packed into seq-len sequences, attention kept within each row.

The padded run's global batch is the rows an average packed step holds (from `--prepare-only --packing`'s
`packing` line), so both steps hold about the same rows and tokens; each run trains one epoch over the same
rows. The layouts alternate for `--reps` rounds. Per run, from its metrics.jsonl: positions computed per loss
token (the epoch's `positions` over its `loss_tokens`), real (non-pad) tokens/s (the `tokens` of the steps after
the first `--warmup` over their elapsed time) and the loss per token over the epoch (the steps' losses weighted
by their loss tokens). The table gives each layout's median over the rounds and packed's ratio to padded
within each round.

    make bench-packing                      # seq 2048, 2 rounds; see docs/BENCHMARKS.md for the time it takes
    .venv/bin/python bench/packing.py --quick   # seq 256, a tiny model and corpus: a smoke run (1.5 min on 2 shared cores)

A benchmark, not a test: it exits 0 whatever the figures are, non-zero only on a crash.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MARKERS = len("<|user|>\n<|assistant|>\n")  # the template's tokens around the two turns
LAYOUTS = {"padded": ["--no-packing"], "packed": ["--packing"]}
FULL = dict(seq_len=2048, rows=240, median=300, sigma=1.0, packed_batch=8, micro_batch=4, hidden=256, layers=2, reps=2)
QUICK = dict(seq_len=256, rows=160, median=40, sigma=1.0, packed_batch=4, micro_batch=4, hidden=64, layers=2, reps=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items())
    )
    parser.add_argument("--seq-len", type=int, help=f"default {FULL['seq_len']}")
    parser.add_argument("--rows", type=int, help=f"conversations in the corpus (default {FULL['rows']})")
    parser.add_argument("--median", type=float, help=f"median conversation length in tokens (default {FULL['median']})")
    parser.add_argument("--sigma", type=float, help=f"log-normal sigma of the lengths (default {FULL['sigma']})")
    parser.add_argument("--packed-batch", type=int, help=f"packed sequences a step (default {FULL['packed_batch']})")
    parser.add_argument("--micro-batch", type=int, help=f"both layouts (default {FULL['micro_batch']})")
    parser.add_argument("--hidden", type=int, help=f"the model's hidden size (default {FULL['hidden']})")
    parser.add_argument("--layers", type=int, help=f"the model's decoder layers (default {FULL['layers']})")
    parser.add_argument("--reps", type=int, help=f"rounds, the layouts alternating (default {FULL['reps']})")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the timing (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="the corpus's lengths and the runs' --seed (default 0)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("seq_len", "rows", "packed_batch", "micro_batch", "hidden", "layers", "reps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1")
    if args.median <= MARKERS or args.sigma < 0 or args.warmup < 0:
        parser.error(f"--median must exceed the template's {MARKERS} tokens; --sigma and --warmup at least 0")
    return args


def lengths(rows: int, median: float, sigma: float, seed: int):
    """Each conversation's length in tokens: log-normal, seeded; at least the template's markers plus 2."""
    import numpy as np

    drawn = np.random.default_rng([seed, 40]).lognormal(np.log(median), sigma, rows)
    return np.maximum(np.rint(drawn).astype(int), MARKERS + 2)


def write_corpus(path: Path, rows: int, median: float, sigma: float, seed: int) -> list[int]:
    """The chat corpus as JSON lines; returns each conversation's length in tokens (before any cut)."""
    import numpy as np

    rng = np.random.default_rng([seed, 41])
    sizes = lengths(rows, median, sigma, seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    with open(path, "w") as f:
        for size in sizes.tolist():
            content = size - MARKERS
            user = max(1, min(content - 1, int(content * rng.uniform(0.2, 0.6))))
            text = letters[rng.integers(0, len(letters), content)].tobytes().decode()
            turns = [{"role": "user", "content": text[:user]}, {"role": "assistant", "content": text[user:]}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return sizes.tolist()


def write_model(path: Path, hidden: int, layers: int, seq_len: int) -> Path:
    import torch
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=384, hidden_size=hidden, intermediate_size=hidden * 43 // 16,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         max_position_embeddings=seq_len, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer = ByT5Tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


PACKING_LINE = re.compile(r"packing\s+([\d,]+) rows whole into ([\d,]+) sequences")


def rows_and_sequences(header: str) -> tuple[int, int]:
    """The rows and the packed sequences they make, from a header's `packing` line."""
    found = PACKING_LINE.search(header)
    if found is None:
        raise SystemExit(f"no packing line in the header:\n{header[-2000:]}")
    return int(found[1].replace(",", "")), int(found[2].replace(",", ""))


def summarize(records: list[dict], warmup: int) -> dict:
    """One run's figures from its metrics.jsonl records."""
    loss_tokens = sum(r["loss_tokens"] for r in records)
    timed = [r for r in records if r["step"] > warmup]
    start = next((r["elapsed_s"] for r in records if r["step"] == warmup), 0.0)
    seconds = max(r["elapsed_s"] for r in timed) - start
    return {
        "steps": len(records),
        "rows": sum(r["rows"] for r in records),
        "positions_per_loss_token": sum(r["positions"] for r in records) / loss_tokens,
        "real_share": sum(r["tokens"] for r in records) / sum(r["positions"] for r in records),
        "real_tokens_per_s": sum(r["tokens"] for r in timed) / seconds,
        "loss_per_token": sum(r["loss"] * r["loss_tokens"] for r in records) / loss_tokens,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(args: argparse.Namespace, model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["-m", "accum_cli", "--model", str(model), "--dataset", str(data), "--output-dir", str(out),
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--epochs", "1",
            "--seed", str(args.seed), "--lr", "1e-3", "--lr-schedule", "constant", "--warmup-steps", "0",
            "--no-compile", "--log-every", "1000", *extra]  # fmt: skip


def run(cmd: list[str], env: dict, what: str) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", ACCUM_TRAIN_REPORT="0",
                   ACCUM_TRAIN_CACHE=str(root / "cache"), PYTHONPATH=f"{HERE.parent}:{os.environ.get('PYTHONPATH', '')}")  # fmt: skip
        model = write_model(root / "model", args.hidden, args.layers, args.seq_len)
        sizes = write_corpus(root / "chat.jsonl", args.rows, args.median, args.sigma, args.seed)
        header = run([sys.executable, *cli(args, model, root / "chat.jsonl", root / "prep", "--packing",
                                           "--global-batch", str(args.packed_batch), "--prepare-only")], env, "prepare")  # fmt: skip
        rows, sequences = rows_and_sequences(header)
        padded_batch = max(1, round(rows * args.packed_batch / sequences))
        batches = {"padded": padded_batch, "packed": args.packed_batch}
        print(f"corpus: {rows} chat rows, log-normal lengths (median {args.median:g}, sigma {args.sigma:g}, seed "
              f"{args.seed}): mean {statistics.mean(sizes):.0f} tokens, {sum(s > args.seq_len for s in sizes)} over "
              f"seq {args.seq_len}; packed into {sequences} sequences. Global batch: padded {padded_batch} rows, packed "
              f"{args.packed_batch} sequences; micro batch {args.micro_batch}; 2 gloo ranks", flush=True)  # fmt: skip
        results: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
        for rep in range(args.reps):
            for name, flags in LAYOUTS.items():  # alternating: a slow minute of the machine hits both alike
                out = root / f"{name}-{rep}"
                torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=2",
                            f"--master_port={free_port()}", "--master_addr=127.0.0.1"]  # fmt: skip
                run([*torchrun, *cli(args, model, root / "chat.jsonl", out, *flags, "--global-batch", str(batches[name]))],
                    env, name)  # fmt: skip
                records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                results[name].append(summarize(records, args.warmup))
                r = results[name][-1]
                print(f"round {rep + 1}/{args.reps}  {name:<7} {r['real_tokens_per_s']:8.0f} real tokens/s, "
                      f"{r['positions_per_loss_token']:.2f} positions per loss token, loss per token "
                      f"{r['loss_per_token']:.4f} ({r['steps']} steps, {r['rows']} rows)", flush=True)  # fmt: skip
    print(table(results, args))


def table(results: dict[str, list[dict]], args: argparse.Namespace) -> str:
    ratios = [
        p["real_tokens_per_s"] / q["real_tokens_per_s"]
        for p, q in zip(results["packed"], results["padded"], strict=True)
    ]
    lines = [f"\nseq {args.seq_len}, Llama {args.layers} x {args.hidden}, micro batch {args.micro_batch}, 2 gloo ranks, "
             f"{args.reps} rounds alternating (medians); {machine()}",
             f"{'layout':<8} {'real tokens/s':>14} {'positions/loss token':>21} {'real share':>11} {'loss/token':>11}"]  # fmt: skip
    for name, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        lines.append(f"{name:<8} {med['real_tokens_per_s']:14.0f} {med['positions_per_loss_token']:21.2f} "
                     f"{med['real_share']:11.1%} {med['loss_per_token']:11.4f}")  # fmt: skip
    lines.append(
        f"packed / padded real tokens/s: {statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}x)"
    )
    return "\n".join(lines)


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    return f"{model}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"


if __name__ == "__main__":
    main()
