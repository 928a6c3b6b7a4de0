# accum-train: small phony targets. `make setup` is idempotent (a stamp tracks pyproject.toml).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The tested torch build. Installed first and pinned, so no range pulls a multi-GB CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: setup run test test-fast lint format bench bench-overhead bench-peers bench-memory bench-replicate bench-fused-memory bench-packing gpu-check verify-sweep mutants clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The main job on the embedded default: tiny Llama, byte-level tokenizer, CPython's own docs.
run: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(BIN)/accum-train --output-dir runs/demo --overwrite

# Two workers on two cores, a test file each at a time (its module fixtures built once), each computing on one
# thread (tests/conftest.py). The cores are busy throughout, so more workers only add switching: a fresh clone
# of 3db15e1 (1041 tests, quiet Intel Xeon, cold caches, 7 Dec 2026) took 12:36 at -n 2 and 13:18 at -n 3;
# with a thread per worker, 10:06 and 10:17 (900fbde, e95bf8f). Figures: docs/DEVELOPMENT.md.
test: setup
	$(BIN)/pytest -q -n 2 --dist loadfile --durations=20

test-fast: setup
	$(BIN)/pytest -q -m "not distributed"

lint: setup
	$(BIN)/ruff check accum_cli tests bench
	$(BIN)/ruff format --check accum_cli tests bench

format: setup
	$(BIN)/ruff format accum_cli tests bench
	$(BIN)/ruff check --fix accum_cli tests bench

# accum-train (defaults and --compile) vs the HF Trainer and Accelerate's accumulate() loop, side by side (~6 min),
# then packed against padded rows (bench-packing, ~8 min).
bench: setup
	$(BIN)/python bench/speed.py
	$(BIN)/python bench/packing.py

# accum-train's step against a minimal hand-written FSDP2 loop, in the same processes.
bench-overhead: setup
	$(BIN)/python bench/overhead.py

# The same comparison through the shared peers harness (../shared/peers, or PEERS_DIR), hand-written FSDP2 too.
bench-peers: setup
	bash bench/peers.sh

# Peak resident memory per rank and tokens/s: accum-train sharded and replicated, full and LoRA r8, vs Accelerate's DDP loop (~9 min).
bench-memory: setup
	$(BIN)/python bench/memory.py

# The replicated layout's hand-written gradient sum vs FSDP2 replicate, HSDP 2x1 and DDP no_sync: speed, memory, exactness (~5 min).
bench-replicate: setup
	$(BIN)/python bench/replicate.py

# The loss step's peak, the output projection fused with the loss or not, 32K and 128K vocabularies, fp32 and both
# bf16 forms, a GPU's and a CPU's bf16 products, and where fused starts to hold less (~9 min on 2 shared cores).
bench-fused-memory: setup
	$(BIN)/python bench/fused_memory.py --crossover

# Packed rows (--packing) against padded rows on a long-tailed synthetic chat corpus, seq 2048, 2 gloo ranks:
# positions computed per loss token, real tokens/s, loss per token (~8 min on 2 shared cores; --quick for a smoke run).
bench-packing: setup
	$(BIN)/python bench/packing.py

# One CUDA GPU: the memory estimate vs the GPU, then accum-train vs hand-written FSDP2 and the HF Trainer on a
# 1B Llama (~5.5 min on an H100, 7 at most). No setup (it would install the CPU torch): the machine's own
# python and CUDA torch run this checkout uninstalled; PYTHON=... picks another interpreter.
gpu-check:
	$${PYTHON:-python3} bench/gpu_check.py

# `accum-train verify` on every architecture of tests/test_architectures.py, W=1 and 2, both layouts (~45 min on 2 shared cores).
verify-sweep: setup
	OMP_NUM_THREADS=1 $(BIN)/python bench/verify_sweep.py

# Hand-written mutants, each against the tests that should catch it (bench/MUTANTS.md). Slow; not CI.
mutants: setup
	$(BIN)/python bench/mutants.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
