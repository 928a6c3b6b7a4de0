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
