"""Data preparation at pretraining scale: accum-train's prepare against a plain datasets.map.

A corpus of CPython's help topics (pydoc_data.topics, ~465 KB of English) repeated until it holds
the asked number of byte-level tokens is written as Parquet. Each measurement runs in a fresh
process with a fresh cache, on the same loaded rows, with the same tokenizer (ByT5's bytes) and
the same number of worker processes:

- accum-train: prepare.prepare (packed text, the product's path), then the cache's bytes per token;
- plain: `raw.map(tokenizer, batched=True, num_proc=N)`, what a user would write by hand;
- before (--before DIR): the same through another checkout of accum-train (say the main branch),
  for the figures of the old Arrow cache.

Reported per corpus size: tokens/s of the tokenisation alone (rows already loaded), the peak
resident memory of the main process and of the largest worker, and the cache's bytes per token.
Then the training-time cost of reading one global batch from the memory-mapped cache.

    python bench/data.py --tokens 40e6 400e6 --num-proc 2

Measured 2026-12-03 13:05-13:20 UTC on the 2-core machine (load ~1-2), num_proc 2, seq_len 1024.
accum-train's seconds include reading the Parquet file (it reads as it tokenises); plain's do not:

    40M tokens   accum-train   10.3-12.3 s  3.25-3.89M tok/s  main 0.43-0.44 GiB, largest worker 0.34  2.00 B/token
                 plain map     12.1 s       3.31M tok/s       main 0.18, largest worker 0.52             5.00 B/token
    400M tokens  accum-train   173.7 s      2.31M tok/s       main 0.45 GiB, largest worker 0.37         2.00 B/token
    reading a global batch of 512 x 1024 tokens: 10-18 ms (40M corpus), 13 ms (400M corpus)

Before local files were read as a stream (same day, load ~10): loading the Parquet file through
`datasets.load_dataset` alone peaked at 198, 254 and 480 MiB for 40M, 160M and 400M tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from accum_cli.data import formats

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 1024


def write_corpus(path: Path, tokens: int) -> int:
    """Parquet with a `text` column: the help topics repeated; returns the byte-level token count."""
    from pydoc_data.topics import topics

    import pyarrow as pa
    import pyarrow.parquet as pq

    documents = [topics[key] for key in sorted(topics)]
    per_pass = sum(len(d.encode()) + 1 for d in documents)  # + EOS
    passes = -(-tokens // per_pass)
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for _ in range(passes):
            writer.write_table(pa.table({"text": documents}))
    return passes * per_pass


def measure(mode: str, corpus: str, num_proc: int, cache: str) -> dict:
    """Runs in a fresh process: load the rows, then time their tokenisation (for accum-train,
    reading the files too: it reads them as it tokenises)."""
    import datasets
    from transformers import ByT5Tokenizer

    os.environ["ACCUM_TRAIN_CACHE"] = cache
    datasets.disable_progress_bars()
    started = time.perf_counter()
    if mode == "accum":  # the product's path: the files read as preparation goes, no Arrow copy first
        from accum_cli.data import sources

        raw = sources.load_raw(corpus)
    else:
        raw = datasets.load_dataset("parquet", data_files=[corpus], split="train")
    loaded_s = time.perf_counter() - started
    tokenizer = ByT5Tokenizer()
    before_rss = _rss_self()
    sampler = RssSampler()
    sampler.start()
    started = time.perf_counter()
    if mode == "plain":
        out = raw.map(lambda b: tokenizer(b["text"], add_special_tokens=False), batched=True, num_proc=num_proc,
                      remove_columns=["text"], cache_file_name=str(Path(cache) / "map.arrow"))  # fmt: skip
        tokens = _count(out)
    else:
        from accum_cli.data import prepare

        if mode == "accum":
            call = [raw, tokenizer, formats.Options(SEQ_LEN, vocab_size=384), True, True, lambda: None, num_proc]
        else:  # the old code: Options without a vocabulary, prepare(raw, tokenizer, options, is_main, barrier)
            call = [raw, tokenizer, formats.Options(SEQ_LEN), True, lambda: None]
        _, stats, _ = prepare.prepare(*call)
        tokens = stats.tokens
    seconds = time.perf_counter() - started
    sampler.stop.set()
    sampler.join()
    stored = sum(p.stat().st_size for p in Path(cache).rglob("*") if p.is_file())
    return {"mode": mode, "load_s": loaded_s, "tokenise_s": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "rss_before_gib": before_rss, "peak_rss_gib": _rss_self(),
            "tokenise_rss_gib": sampler.main_peak / 2**30, "tokenise_tree_rss_gib": sampler.tree_peak / 2**30,
            "peak_worker_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
            "cache_bytes": stored, "bytes_per_token": stored / tokens,
            "cache_files": sorted({p.name for p in Path(cache).rglob("*") if p.is_file()})[:8]}  # fmt: skip


class RssSampler(threading.Thread):
    """Resident memory while tokenising, every 50 ms: this process, and it with its workers."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.main_peak = self.tree_peak = 0

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.stop.wait(0.05):
            try:
                main = me.memory_info().rss
                tree = main + sum(child.memory_info().rss for child in me.children(recursive=True))
            except psutil.Error:  # a worker ended between the listing and the reading
                continue
            self.main_peak, self.tree_peak = max(self.main_peak, main), max(self.tree_peak, tree)


def _count(dataset) -> int:
    import pyarrow.compute as pc

    return int(
        sum(pc.sum(pc.list_value_length(chunk)).as_py() or 0 for chunk in dataset.data.column("input_ids").chunks)
    )


def _rss_self() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def reading_cost(cache: str, global_batch: int, steps: int = 20) -> dict:
    """Seconds to read one global batch of seq_len samples in the seeded order, as training does."""
    from accum_cli.data import batches as data
    from accum_cli.data import store

    (folder,) = [p for p in Path(cache).iterdir() if (p / "meta.json").is_file()]
    meta = store.read_meta(folder)
    prepared = store.Prepared.load(folder, meta, folder.name)
    reader = data.MicrobatchReader(prepared, data.SampleOrder(len(prepared), seed=0), pad_id=0)
    reader.read(range(global_batch))
    started = time.perf_counter()
    for step in range(1, steps + 1):
        reader.read(range(step * global_batch, (step + 1) * global_batch))
    return {"samples": len(prepared), "read_s_per_step": (time.perf_counter() - started) / steps,
            "global_batch": global_batch}  # fmt: skip


def run_child(args: list[str], pythonpath: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(pythonpath), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, nargs="+", default=[40e6, 400e6])
    parser.add_argument("--num-proc", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--modes", nargs="+", default=["accum", "plain"])
    parser.add_argument("--before", type=Path, help="another checkout of accum-train to measure too")
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "accum-bench-data")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--read", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, corpus, num_proc, cache = args.child
        print(json.dumps(measure(mode, corpus, int(num_proc), cache)))
        return
    if args.read:
        print(json.dumps(reading_cost(args.read[0], int(args.read[1]))))
        return

    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"free disk: {shutil.disk_usage(args.workdir).free / 2**30:.0f} GiB in {args.workdir}; "
          f"num_proc {args.num_proc}; seq_len {SEQ_LEN}; byte-level tokenizer", flush=True)  # fmt: skip
    modes = [*args.modes, *(["before"] if args.before else [])]
    for target in args.tokens:
        corpus = args.workdir / f"corpus-{int(target / 1e6)}M.parquet"
        tokens = write_corpus(corpus, int(target))
        print(f"\ncorpus {corpus.name}: {tokens / 1e6:.0f}M tokens", flush=True)
        for mode in modes:
            cache = args.workdir / f"cache-{mode}"
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir()
            os.environ["HF_DATASETS_CACHE"] = str(args.workdir / "hf")  # the Parquet->Arrow copy, shared
            code = args.before if mode == "before" else REPO
            r = run_child(["--child", mode, str(corpus), str(args.num_proc), str(cache)], code)
            print(f"  {mode:7s} tokenise {r['tokenise_s']:7.1f} s  {r['tokens_per_s'] / 1e6:6.2f}M tokens/s  "
                  f"RSS while tokenising: main {r['tokenise_rss_gib']:.2f} GiB, with workers "
                  f"{r['tokenise_tree_rss_gib']:.2f} GiB; peak main {r['peak_rss_gib']:.2f} (after loading "
                  f"{r['rss_before_gib']:.2f}), largest worker {r['peak_worker_rss_gib']:.2f} GiB  cache {r['bytes_per_token']:.2f} B/token "
                  f"{r['cache_files']}", flush=True)  # fmt: skip
            if mode == "accum":
                read = run_child(["--read", str(cache), str(args.global_batch)], REPO)
                print(f"          reading a global batch of {read['global_batch']} x {SEQ_LEN} tokens: "
                      f"{read['read_s_per_step'] * 1e3:.1f} ms per step ({read['samples']:,} samples)", flush=True)  # fmt: skip
            shutil.rmtree(cache, ignore_errors=True)
        corpus.unlink()
    shutil.rmtree(args.workdir / "hf", ignore_errors=True)


if __name__ == "__main__":
    main()
