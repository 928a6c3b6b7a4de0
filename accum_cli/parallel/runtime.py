"""Processes and devices: the process group, the device mesh, and a safe exit.

One code path for every launcher: torchrun and `accelerate launch` both export RANK,
WORLD_SIZE and LOCAL_RANK; a plain `accum-train` is a world of one. CPU ranks talk over
gloo, CUDA ranks over NCCL (with gloo beside it for CPU-side collectives).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from accum_cli.errors import UserError

# Set by the --nproc wrapper (cli/launcher.py) for its workers where it chose OMP_NUM_THREADS itself, to
# "CORES/RANKS" (what it divided), so the header can say who chose the thread count and how.
WRAPPER_THREADS = "ACCUM_TRAIN_WRAPPER_THREADS"


def available_cores() -> int:
    """The cores this process may run on: its affinity mask (a batch system's share), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_rank(local_ranks: int) -> int:
    """Each of `local_ranks` processes on one machine gets its share of the cores, at least one: a rank
    taking every core (OpenMP's default) makes the ranks fight over them (several times slower)."""
    return max(1, available_cores() // max(1, local_ranks))


def describe_threads() -> str:
    """Where this rank's thread count comes from, for the header."""
    return f"threads           {threads_used()}"


def threads_used() -> str:
    """This rank's thread count and where it comes from."""
    threads = f"{torch.get_num_threads()} per rank"
    chosen = os.environ.get(WRAPPER_THREADS)
    if chosen is not None:
        cores, ranks = chosen.split("/")
        return f"{threads} (--nproc: {cores} cores / {ranks} ranks here; set OMP_NUM_THREADS to choose)"
    if "OMP_NUM_THREADS" in os.environ:
        return f"{threads} (OMP_NUM_THREADS)"
    return threads


# The memory estimate (memory/measure.py) runs the run's own step on fake tensors (shapes, no
# values) over a fake process group. There the training code leaves out what needs values that a
# fake world does not have: it reads no flags or counts back from a collective, runs no agreement
# between ranks, and computes only the first and last chunk of a chunked loss (a chunk allocates
# what the one before it freed). The estimate says so by `simulated()`; nothing else sets it. Its
# fake tensors lie on the CPU whatever device the run will train on, which it names (`device_type`).
_simulated: str | None = None  # the device type the estimate stands for, while it runs


@contextlib.contextmanager
def simulated(device_type: str = "cpu"):
    """The memory estimate's fake world, for the code run inside (a module flag, not a context
    variable: autograd may run a backward on a thread of its own), standing for a run on `device_type`."""
    global _simulated
    before, _simulated = _simulated, device_type
    try:
        yield
    finally:
        _simulated = before


def is_simulated() -> bool:
    return _simulated is not None


def device_type(tensor: torch.Tensor) -> str:
    """The type of the device the run computes on: the tensor's own, or in the estimate the one it stands for."""
    return _simulated if _simulated is not None else tensor.device.type


@dataclass(frozen=True, slots=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return dist.get_backend()

    def mesh(self, replicas: int = 1) -> DeviceMesh:
        """1-D for FSDP; (replicas, shards) for HSDP: sharded inside a replica, replicated across."""
        if replicas == 1:
            return init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("shard",))
        shape = (replicas, self.world_size // replicas)
        return init_device_mesh(self.device.type, shape, mesh_dim_names=("replicate", "shard"))


def env_rank() -> int:
    """This process's rank as the launcher set it, before any process group exists."""
    return int(os.environ.get("RANK", "0"))


def start(timeout_s: float = 1800.0) -> Runtime:
    """Join (or create) the process group and pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = env_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # set by torchrun, accelerate launch
            try:
                dist.init_process_group(backend, timeout=timeout)
            except dist.DistNetworkError as exc:
                taken = port_taken(exc)
                if taken is None:
                    raise
                raise taken from None
        else:
            # A world of one still needs a process group: fully_shard works on a device mesh.
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return Runtime(rank, local_rank, world_size, local_world_size, device)


def port_taken(exc: BaseException) -> UserError | None:
    """The rendezvous port already held by another process, as rank 0 finds it where no launcher's agent
    opened it (srun or a scheduler setting RANK itself): said as that, not as a lost rank (a DistError)."""
    if "EADDRINUSE" not in str(exc):  # torch's DistNetworkError carries no errno, only the store's message
        return None
    where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    return UserError(
        f"the rendezvous port {where} is held by another process (another run on this machine?); "
        "set MASTER_PORT (--master-port with --nproc) to a free port"
    )


def device_memory_bytes(rt: Runtime) -> int:
    """Memory one rank may plan with: the GPU's total, or this machine's free RAM shared by its ranks."""
    if rt.device.type == "cuda":
        return torch.cuda.get_device_properties(rt.device).total_memory
    return available_ram_bytes() // max(rt.local_world_size, 1)


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def all_ok(ok: bool, device: torch.device) -> bool:
    """Collective: True when every rank says ok, so that all ranks fail alike."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def broadcast_text(text: str, device: torch.device) -> str:
    """Collective: rank 0's text on every rank (JSON, never pickle)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).decode()


# gloo's transport raises a peer's death as "Connection closed/reset by peer" and a hung peer as
# "Timed out waiting ...", both from its source folder gloo/transport/ (tests/test_runtime.py).
PEER_LOST_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout",
                   "NCCL communicator was aborted", "ProcessGroupNCCL", "gloo/transport/")  # fmt: skip
EXIT_PEER_LOST = 76  # another rank died mid-run; the last checkpoint is intact


def peer_lost(exc: BaseException) -> bool:
    """A collective failed because another rank's process died or hung."""
    return isinstance(exc, dist.DistError) or any(sign in str(exc) for sign in PEER_LOST_SIGNS)


def exit_process(code: int) -> None:
    """End the process without running interpreter finalisation.

    A multi-rank gloo process can abort (SIGABRT, "terminate called without an active
    exception") or hang at interpreter exit: a gloo worker thread drops the last reference to
    a finished collective while Python is finalising, and the device mesh and FSDP modules
    keep the group alive until then (docs/ARCHITECTURE.md). So after a successful run every rank meets
    at a barrier (no rank leaves while another still needs the store), the group is
    destroyed, output is flushed, and os._exit skips finalisation. On failure there is no
    barrier: the other ranks may never arrive.
    """
    if dist.is_initialized() and code == 0:
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception as exc:  # a peer died after our work was done: report it, honestly
            print(f"accum-train: shutdown barrier failed: {exc}", file=sys.stderr)
            code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe must not turn success into failure
            stream.flush()
    os._exit(code)
