#!/usr/bin/env bash
# accum-train against the peers a user would pick instead, side by side in one run: the HF
# Trainer, Accelerate's documented accumulate() loop (DDP) and hand-written FSDP2, on the
# project's reference workload (Llama 4 x 256, seq 256, G=32, m=4, 2 gloo ranks, 2 warm-up +
# 6 timed steps), alternating between contestants, medians of REPS runs.
#
#   make bench-peers                 # REPS=3, about 5 minutes on 2 idle cores
#   REPS=5 PEERS_DIR=/path/to/peers bash bench/peers.sh
#
# The harness itself lives in the shared peers folder (../shared/peers beside a checkout of
# this project); it runs accum-train through its own accum_train_peer.py with default flags.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$HERE/../shared/peers}"
if [ ! -f "$PEERS_DIR/run_all.sh" ]; then
  echo "bench/peers.sh: no peers harness at $PEERS_DIR; set PEERS_DIR to the folder holding run_all.sh" >&2
  exit 2
fi
export VENV="${VENV:-$HERE/.venv}" OUT="${OUT:-/tmp/accum-bench-peers}" REPS="${REPS:-3}"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" ACCUM_PEER_DIR="${ACCUM_PEER_DIR:-/tmp/accum-peer}"
export ONLY="${ONLY:-accelerate_ddp hf_trainer raw_fsdp2_sync_last accum_train accum_train_compile}"
# accum-train with its defaults, and with --compile (timed after the compile: steps 3-8)
export EXTRA_PEERS="accum_train|$PEERS_DIR/accum_train_peer.py;accum_train_compile|$PEERS_DIR/accum_train_peer.py --compile"
bash "$PEERS_DIR/run_all.sh"
