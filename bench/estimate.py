"""The memory estimate against a measurement, and how long the estimate takes.

    .venv/bin/python bench/estimate.py            # both parts (~10 min on a busy 2-core machine)
    .venv/bin/python bench/estimate.py --timing   # only the --plan timings for a 1B Llama

Part 1, for the embedded model and a ~30M-parameter Llama, on 2 real gloo ranks, `every`,
`last` and `last-keep-params`, micro batch 1 and 4: the estimate (fake model, fake world,
estimate.py) next to the peak per rank measured by bench/measure_peak.py (the same steps on
real tensors under FSDPMemTracker).
Part 2: wall time of `accum-train --plan --micro-batch auto` for a 1B Llama-shaped config (bf16,
seq len 128 and 2048, 80 GiB) at W = 8 and 64 with an empty estimate cache, and again from the
cache. Exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from accum_cli.memory.query import Query

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SEQ_LEN = 128
SYNCS = ("every", "last", "last-keep-params", "replicated")  # replicated: the layout
CASES = [(sync, m) for sync in SYNCS for m in (1, 4)]


def llama_30m(folder: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
    ).save_pretrained(folder)  # fmt: skip
    return folder


def llama_1b(folder: Path) -> Path:
    """Llama-3.2-1B's shape: 1.24B parameters, 128K vocabulary, tied embeddings."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
        tie_word_embeddings=True,
    ).save_pretrained(folder)  # fmt: skip
    return folder


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for name in ("RANK", "WORLD_SIZE"):
        e.pop(name, None)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measured(model_dir: Path) -> dict:
    cmd = [
        str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", "--master_addr=127.0.0.1",
        str(REPO / "bench" / "measure_peak.py"), "--model", str(model_dir), "--seq-len", str(SEQ_LEN),
        "--sync", *SYNCS, "--micro-batch", "1", "4",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {(row["sync"], row["micro_batch"]): row["peak"] for row in rows}


def compare(name: str, model_dir: Path) -> None:
    from accum_cli.memory import estimate

    config = json.loads((model_dir / "config.json").read_text())
    queries = [
        Query(config, 2, 1, m, SEQ_LEN, "last" if sync == "replicated" else sync, False, False,
                       replicated=sync == "replicated")
        for sync, m in CASES
    ]  # fmt: skip
    started = time.perf_counter()
    found = estimate.estimate(queries)
    seconds = time.perf_counter() - started
    real = measured(model_dir)
    print(f"\n{name} (W=2, seq len {SEQ_LEN}, fp32; estimated in {seconds:.1f} s)")
    print(f"  {'sync':<16} {'m':>2} {'estimate MiB':>13} {'measured MiB':>13} {'error':>7}")
    for (sync, m), got in zip(CASES, found, strict=True):
        want = real[(sync, m)]
        print(f"  {sync:<16} {m:>2} {got.peak / 2**20:>13.2f} {want / 2**20:>13.2f} {(got.peak - want) / want:>+7.1%}")
    same = sorted(CASES, key=lambda c: found[CASES.index(c)].peak) == sorted(CASES, key=real.get)
    print(f"  same order of policies and micro batches: {'yes' if same else 'NO'}")


def timing(folder: Path) -> None:
    model = llama_1b(folder / "llama-1b")
    for seq_len in (128, 2048):
        print(f"\n--plan for a 1B Llama (seq len {seq_len}, bf16, --micro-batch auto, --device-memory-gib 80)")
        for world in (8, 64):
            cache = folder / f"cache-{world}-{seq_len}"
            for attempt in ("empty cache", "cached"):
                cmd = [sys.executable, "-m", "accum_cli", "--plan", "--model", str(model), "--global-batch", "2048",
                       "--micro-batch", "auto", "--seq-len", str(seq_len), "--world-size", str(world),
                       "--device-memory-gib", "80"]  # fmt: skip
                started = time.perf_counter()
                done = subprocess.run(
                    cmd, env=env() | {"ACCUM_TRAIN_CACHE": str(cache)}, capture_output=True, text=True
                )
                wall = time.perf_counter() - started
                lines = [x.strip() for x in done.stdout.splitlines()]
                took = next((x.split("(in ")[-1].rstrip(")") for x in lines if x.startswith("estimated at")), "")
                micro = next((x.split("(")[0].strip() for x in lines if x.startswith("micro batch") and "(" in x), "")
                chosen = next((x[:40] for x in lines if x.startswith("chosen:")), done.stderr.strip()[-200:])
                print(f"  W={world:<3} {attempt:<12} wall {wall:5.1f} s | estimates {took} | {micro} | {chosen}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing", action="store_true", help="only the --plan timings")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["ACCUM_TRAIN_CACHE"] = str(folder / "cache")
        if not args.timing:
            from accum_cli.model.load import EMBEDDED_MODEL_DIR

            compare("embedded model (3.4M params)", EMBEDDED_MODEL_DIR)
            compare("Llama ~30M params", llama_30m(folder / "llama-30m"))
        timing(folder)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
