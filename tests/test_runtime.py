"""What a rank sees when its peer dies or hangs mid-collective, on real gloo processes: the
failure must read as a lost peer (exit 76 with the last checkpoint named), and nothing else may."""

from __future__ import annotations

import json

import pytest
from helpers import launch

from accum_cli.parallel.runtime import peer_lost

PEER = """
import datetime, json, os, sys, time

import torch
import torch.distributed as dist

from accum_cli.parallel.runtime import peer_lost

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
dist.all_reduce(torch.ones(4))
if dist.get_rank() == 1:
    if sys.argv[1] == "hung":
        time.sleep(6)  # rank 0's next collective times out
    os._exit(0)  # gone mid-run, unannounced (exit 0: the warm parent would end rank 0 on a failing exit code)
try:
    dist.all_reduce(torch.ones(4))
    print(json.dumps(None))
except RuntimeError as exc:
    print(json.dumps([str(exc), peer_lost(exc)]))
sys.stdout.flush()
os._exit(0)  # no interpreter finalisation with a broken group (docs/ARCHITECTURE.md)
"""


@pytest.mark.parametrize("peer", ["died", "hung"])
def test_a_dead_or_hung_peer_reads_as_a_lost_peer(peer):
    done = launch(PEER, [peer], ranks=2, kind="code", timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen is not None, "the collective should have failed"
    message, lost = seen
    assert lost, message


@pytest.mark.parametrize(
    "message",
    ["ProcessGroupGloo::allgather: invalid tensor type", "the gloo backend is not available in this build",
     "CUDA out of memory"],
)  # fmt: skip
def test_other_errors_are_not_a_lost_peer(message):
    assert not peer_lost(RuntimeError(message))


@pytest.mark.distributed
def test_a_rendezvous_port_held_by_another_process_is_one_line_not_a_lost_peer(tmp_path):
    """Ranks given RANK and WORLD_SIZE with no launcher's agent to open the rendezvous (srun, a scheduler):
    rank 0 opens it. On a port another process holds, that failed as a DistError and read as a rank lost
    mid-run (exit 76, "start again"); it is the port, named, with the way to another."""
    import socket

    from helpers import message_lines, save_tiny_model, write_ragged_tokens

    save_tiny_model(tmp_path / "model")
    write_ragged_tokens(tmp_path / "data.jsonl", n_rows=8)
    args = ["--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.jsonl"), "--global-batch", "4",
            "--micro-batch", "2", "--max-steps", "1", "--output-dir", str(tmp_path / "run")]  # fmt: skip
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # Rank 0 alone, as node 0 of two: the rank that opens the rendezvous.
        done = launch("accum_cli", args, ranks=1, nnodes=2, node_rank=0, master_port=port, timeout=120)
    assert done.returncode == 2 and message_lines(done.stderr) == [
        f"accum-train: error: the rendezvous port 127.0.0.1:{port} is held by another process (another run on "
        "this machine?); set MASTER_PORT (--master-port with --nproc) to a free port"
    ], done.stderr
    assert not (tmp_path / "run").exists(), "nothing written"
