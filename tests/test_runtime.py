"""What a rank sees when its peer dies or hangs mid-collective, on real gloo processes: the
failure must read as a lost peer (exit 76 with the last checkpoint named), and nothing else may."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers import free_port

from accum_cli.parallel.runtime import peer_lost


def _rank(rank: int, port: int, peer: str, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3))
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        if peer == "died":
            os._exit(1)
        time.sleep(6)  # hung: rank 0's next collective times out
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(4))
        errors.put(None)
    except RuntimeError as exc:
        errors.put((str(exc), peer_lost(exc)))
    errors.close()
    errors.join_thread()  # the item is written before os._exit, which skips the queue's flush
    os._exit(0)  # no interpreter finalisation with a broken group (docs/ARCHITECTURE.md)


@pytest.mark.parametrize("peer", ["died", "hung"])
def test_a_dead_or_hung_peer_reads_as_a_lost_peer(peer):
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, peer, errors)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        seen = errors.get(timeout=60)
    finally:
        for process in ranks:
            process.join(15)
            process.kill()
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
