"""The replicated layout's gradient reduction (reduce.py) against torch's own data parallel machinery.

Four ways of doing the same replicated, accumulated optimizer step on 2 gloo ranks (issue 36):
the same Llama-shaped model from the same seed, the same tokens split into the same
microbatches, the loss divided by the global loss-token count, the project's fused AdamW, grad
clip 1.0. Every contestant's model gets the same CPU kernels and fused loss first (what
`wrap.prepare_replicated` and `wrap.shard` install), and every microbatch runs through
`loop.microbatch_backward`, so that only the gradient reduction differs:

- accum-train:     a plain module per rank, gradients accumulated locally, `reduce.summed_over_ranks`
                   around the last microbatch (as memory/measure.py's `tracked_step` drives it);
- fsdp2-replicate: `replicate` from torch.distributed._composable.replicate_with_fsdp on each decoder
                   layer, the embedding, the head and the root; `set_requires_gradient_sync(is_last)`;
                   divide factor 1 and forced SUM reductions (gloo has no AVG);
- hsdp-2x1:        `wrap.shard` (fully_shard per unit, as the sharded layout does) on a (replicate=2,
                   shard=1) mesh, which replicates; `set_requires_gradient_sync(is_last)`;
- ddp-no-sync:     DistributedDataParallel, `no_sync()` on all but the last microbatch; a comm hook that
                   sums instead of DDP's average, so the update is the same; gradient_as_bucket_view.

    OMP_NUM_THREADS=1 .venv/bin/python bench/replicate.py --out replicate.json
    .venv/bin/python bench/replicate.py --quick --out /tmp/r.json     # smoke run

Each contestant runs in launches of its own (2 fresh rank processes forked by a warm zygote,
with the environment torchrun gives its workers, one thread each: see Zygote), alternating in rounds, the order rotated each round: a launch does one warm-up step
(not timed) then --steps timed steps, each between barriers. Peak memory is each rank's VmHWM
(/proc/self/status) at the end of its launch: the process's resident high-water mark, imports and
gloo included (also given above the rank's VmRSS just before its model was built). Exactness:
after 2 steps, each rank's parameters against a one-process reference that runs all
W x accum x micro-batch sequences in one forward (plain transformers model, F.cross_entropy summed
over the loss tokens and divided by their count, the same AdamW and clip): the max over parameter
tensors of ||p - p_ref|| / ||p_ref||; the same for the first step's reduced gradients; and each
contestant's parameters against accum-train's. AdamW's first steps are sign-like (m / sqrt(v) is
+-1 where |g| >> eps), so a gradient element that fp32 reassociation moves across zero moves its
weight by up to 2 lr: one process accumulating the same microbatches lands ~1e-5 from the
one-big-batch reference too, and its figures are shown as the floor. bf16 (--precision bf16) is accepted: autocast over fp32
master weights for accum-train and DDP, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
for replicate and HSDP; its differences from the fp32 reference are shown, not judged.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTESTANTS = ("accum-train", "fsdp2-replicate", "hsdp-2x1", "ddp-no-sync")
BASELINE = "accum-train"
EXACT_TOLERANCE = 1e-5  # fp32: reassociation only
DATA_SEED = 1234
INIT_SEED = 0
LR = 1e-3
GRAD_CLIP = 1.0
EXACT_STEPS = 2  # parameters compared after this many steps
LAUNCH_TIMEOUT_S = 300
BUSY_SHARE = 0.05  # other processes' CPU share above which timings say more about them


sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks, as a script sees them
from overhead import busy_cpu_seconds  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="launches per contestant, alternating")
    p.add_argument("--steps", type=int, default=5, help="timed steps per launch (after one warm-up step)")
    p.add_argument("--layers", type=int, default=4, help="Llama decoder layers")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (head dim 64)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward")
    p.add_argument("--accum", type=int, default=4, help="microbatches per step per rank")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (one thread each)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--contestants", default=",".join(CONTESTANTS), help="comma-separated subset")
    p.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round of 2 steps: checks the script runs")
    # Internal: a launch of one contestant (set by the parent).
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.layers, args.hidden, args.vocab = 1, 2, 2, 64, 512
        args.seq_len, args.micro_batch, args.accum = 32, 2, 2
    args.contestants = [x.strip() for x in args.contestants.split(",") if x.strip()]
    unknown = [x for x in args.contestants if x not in CONTESTANTS]
    if unknown or not args.contestants:
        p.error(f"unknown --contestants {', '.join(unknown)}; use some of {', '.join(CONTESTANTS)}")
    if min(args.rounds, args.layers, args.micro_batch, args.accum) < 1 or args.nproc < 2:
        p.error("--rounds, --layers, --micro-batch, --accum must be >= 1 and --nproc >= 2")
    if args.steps < EXACT_STEPS - 1:
        p.error(f"--steps must be >= {EXACT_STEPS - 1}: the parameters are compared after step {EXACT_STEPS}")
    if args.hidden % 64 or args.seq_len < 2 or args.vocab < 8:
        p.error("--hidden must be a multiple of 64, --seq-len >= 2, --vocab >= 8")
    return args


# --------------------------------------------------------------------------- shared setup


def build_model(args: argparse.Namespace):
    """The Llama from its config, the same initial weights everywhere (seeded)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    heads = args.hidden // 64
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 688 // 256,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max(512, args.seq_len),
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(INIT_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


def global_batch(args: argparse.Namespace, step: int):
    """The step's W x accum x micro-batch sequences (two distinct batches, alternating), unpadded."""
    import torch

    g = torch.Generator().manual_seed(DATA_SEED + step % 2)
    rows = args.nproc * args.accum * args.micro_batch
    return torch.randint(0, args.vocab, (rows, args.seq_len), generator=g)


def rank_microbatches(args: argparse.Namespace, step: int, rank: int) -> list:
    import torch

    from accum_cli.data.batches import Microbatch

    ids = global_batch(args, step)
    per_rank = args.accum * args.micro_batch
    mine = ids[rank * per_rank : (rank + 1) * per_rank]
    return [Microbatch(x, torch.ones_like(x), x.clone()) for x in mine.split(args.micro_batch)]


def optimizer_for(model):
    """The project's AdamW (fused, decay on matrices), at a constant rate."""
    from accum_cli.config.settings import TrainConfig
    from accum_cli.step import optim

    optimizer, _ = optim.build(model, TrainConfig(lr=LR, warmup_steps=0, lr_schedule="constant"), total_steps=10)
    return optimizer


def vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


# --------------------------------------------------------------------------- contestants


class Contestant:
    """A model made data parallel one way; `sync(is_last)` wraps one microbatch's forward and backward."""

    def __init__(self, model, module, optimizer) -> None:
        self.model = model  # what is called (a wrapper, for DDP)
        self.module = module  # whose named parameters are the model's
        self.optimizer = optimizer

    def sync(self, is_last: bool):
        return contextlib.nullcontext()

    def whole(self, grads: bool = False) -> dict:
        """Every parameter (or its gradient) by name, as this rank holds it: whole, replicated."""
        from torch.distributed.tensor import DTensor

        found = {}
        for name, p in self.module.named_parameters():
            t = p.grad if grads else p
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.shape != p.shape:
                raise RuntimeError(f"{name}: the local tensor is not whole ({tuple(local.shape)} of {tuple(p.shape)})")
            found[name] = local.detach()
        return found


class AccumTrain(Contestant):
    """The replicated layout: prepare_replicated, then reduce.summed_over_ranks on the last microbatch."""

    def __init__(self, args, rt) -> None:
        from accum_cli.model import wrap
        from accum_cli.parallel.sharding import ShardSettings

        model = wrap.prepare_replicated(build_model(args), ShardSettings(bf16=args.precision == "bf16"), rt.device)
        super().__init__(model, model, optimizer_for(model))

    def sync(self, is_last: bool):
        from accum_cli.parallel.reduce import summed_over_ranks

        return summed_over_ranks(self.model) if is_last else contextlib.nullcontext()


def _sum_not_average(model) -> None:
    """FSDP2's reductions summed: the loss is already divided by the global loss-token count."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if dist.get_backend() == "gloo":  # no AVG or PREMUL_SUM in gloo
                module.set_force_sum_reduction_for_comms(True)


def _mp_policy(args):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if args.precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


class FSDP2Replicate(Contestant):
    """torch's FSDP2-based `replicate`, one unit per decoder layer and vocabulary matrix, then the root."""

    def __init__(self, args, rt) -> None:
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.device_mesh import init_device_mesh

        from accum_cli.model import wrap
        from accum_cli.model.load import decoder_layers

        model = build_model(args)
        wrap._eager_kernels_and_fused_loss(
            model, _settings(args), rt.device
        )  # what prepare_replicated adds, bar autocast
        mesh = init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("replicate",))
        kwargs = {"mesh": mesh, "mp_policy": _mp_policy(args)}
        for layer in decoder_layers(model):
            replicate(layer, **kwargs)
        for edge in wrap.edge_units(model):
            if edge is not None:
                replicate(edge, **kwargs)
        replicate(model, **kwargs)
        _sum_not_average(model)
        super().__init__(model, model, optimizer_for(model))
        # loop.microbatch_backward sets set_requires_gradient_sync(is_last) on an FSDPModule.


class HSDP2x1(Contestant):
    """fully_shard as the sharded layout applies it (wrap.shard), on a (replicate=W, shard=1) mesh."""

    def __init__(self, args, rt) -> None:
        from accum_cli.model import wrap

        model = wrap.shard(build_model(args), rt.mesh(replicas=rt.world_size), _settings(args))
        super().__init__(model, model, optimizer_for(model))


class DDPNoSync(Contestant):
    """DistributedDataParallel: no_sync() but on the last microbatch, its buckets summed by a comm hook."""

    def __init__(self, args, rt) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from accum_cli.loss import fused_loss
        from accum_cli.model import wrap

        module = wrap.prepare_replicated(build_model(args), _settings(args), rt.device)  # autocast in bf16, as DDP+AMP
        ddp = DistributedDataParallel(module, gradient_as_bucket_view=True)

        def summed(state, bucket):
            work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])

        ddp.register_comm_hook(None, summed)
        head = getattr(module, fused_loss.ATTRIBUTE, None)
        if head is not None:  # microbatch_backward finds the recording head on the model it is given
            object.__setattr__(ddp, fused_loss.ATTRIBUTE, head)
        super().__init__(ddp, module, optimizer_for(module))

    def sync(self, is_last: bool):
        return contextlib.nullcontext() if is_last else self.model.no_sync()


def _settings(args):
    from accum_cli.parallel.sharding import ShardSettings

    return ShardSettings(bf16=args.precision == "bf16")


CLASSES = {"accum-train": AccumTrain, "fsdp2-replicate": FSDP2Replicate, "hsdp-2x1": HSDP2x1, "ddp-no-sync": DDPNoSync}


def train_step(c: Contestant, microbatches: list, device, grads_to: str | None = None) -> float:
    """One optimizer step, the same for every contestant but for `c.sync`; the gradient norm.
    `grads_to`: a file to save the reduced gradients in, before clipping."""
    import torch
    from torch.distributed.tensor import DTensor

    from accum_cli.config import policy
    from accum_cli.step.loop import global_counts, microbatch_backward

    loss_tokens, _ = global_counts(microbatches, device)
    for index, mb in enumerate(microbatches):
        is_last = index == len(microbatches) - 1
        with c.sync(is_last):
            microbatch_backward(c.model, mb, policy.LAST, is_last, loss_tokens, device)
    if grads_to is not None:
        torch.save(c.whole(grads=True), grads_to)
    norm = torch.nn.utils.clip_grad_norm_(c.module.parameters(), GRAD_CLIP, foreach=True)
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


# --------------------------------------------------------------------------- one launch (child)


def import_everything() -> None:
    """What any contestant imports, imported before the memory baseline is read (transformers imports lazily)."""
    import torch.distributed._composable.replicate_with_fsdp  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    from accum_cli.model import wrap  # noqa: F401
    from accum_cli.parallel import reduce  # noqa: F401
    from accum_cli.step import loop, optim  # noqa: F401


def run_child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from accum_cli.parallel import runtime

    torch.set_num_threads(1)
    rt = runtime.start()
    if rt.world_size != args.nproc:
        raise RuntimeError(f"launched with {rt.world_size} ranks; expected {args.nproc}")
    import_everything()
    rss_before_model = vm_kib("VmRSS")  # after every import: the model's, the wrappers' and the step's
    c = CLASSES[args.child](args, rt)
    stem = args.child_dir / f"r{args.round}-{args.child}-rank{rt.rank}"
    norms, seconds = [], []
    for step in range(1 + args.steps):
        microbatches = rank_microbatches(args, step, rt.rank)
        gc.collect()
        dist.barrier()
        started = time.perf_counter()
        norms.append(train_step(c, microbatches, rt.device, f"{stem}.grads.pt" if step == 0 else None))
        dist.barrier()  # the step ends when every rank is done with it
        if step > 0:  # step 0 is the warm-up
            seconds.append(time.perf_counter() - started)
        if step == EXACT_STEPS - 1:
            torch.save(c.whole(), f"{stem}.pt")  # written from the tensors' own storage
    result = {
        "rank": rt.rank,
        "seconds": seconds,
        "grad_norms": norms[:EXACT_STEPS],
        "vm_hwm_kib": vm_kib("VmHWM"),
        "rss_before_model_kib": rss_before_model,
        "params": f"{stem}.pt",
        "grads": f"{stem}.grads.pt",
        "round": args.round,
        "param_dtypes": sorted({str(p.dtype) for p in c.module.parameters()}),  # the master weights
    }
    Path(f"{stem}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the parent


FLOORS = {
    "1-proc accum (plain)": False,  # the same microbatches, accumulated in one process: torch's kernels
    "1-proc accum (kernels)": True,  # ... with the kernels and fused loss every contestant runs
}


def one_process(args: argparse.Namespace, microbatched: bool, kernels: bool = False) -> tuple[dict, dict, list[float]]:
    """One process, EXACT_STEPS steps: the parameters after them, the first step's gradients (before
    clipping) and the grad norms. The reference (not microbatched): all W x accum x micro-batch
    sequences in one forward, F.cross_entropy summed over the loss tokens and divided by their
    count. Microbatched: the same step as the contestants' in one process (loop.microbatch_backward
    per microbatch, no reduction), which shows how far from the reference reassociation alone goes."""
    import torch
    import torch.nn.functional as F

    from accum_cli.step.loop import microbatch_backward

    model = build_model(args)
    if kernels:
        from accum_cli.model import wrap

        wrap.prepare_replicated(model, _settings(args), torch.device("cpu"))
    optimizer = optimizer_for(model)
    norms, grads = [], {}
    for step in range(EXACT_STEPS):
        if microbatched:
            microbatches = [mb for rank in range(args.nproc) for mb in rank_microbatches(args, step, rank)]
            loss_tokens = sum(mb.loss_tokens for mb in microbatches)
            for mb in microbatches:
                microbatch_backward(model, mb, "last", False, loss_tokens, torch.device("cpu"))
        else:
            ids = global_batch(args, step)
            logits = model(input_ids=ids, use_cache=False).logits
            targets = ids[:, 1:]
            loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="sum")
            (loss_sum / targets.numel()).backward()
            del logits
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP, foreach=True)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads, norms


def param_diffs(params: dict, ref: dict) -> tuple[float, float]:
    """(max over tensors of ||p - ref|| / ||ref||, max elementwise |p - ref|)."""
    if params.keys() != ref.keys():
        raise RuntimeError(f"parameter names differ: {sorted(params.keys() ^ ref.keys())[:4]}")
    rel, absolute = 0.0, 0.0
    for name, r in ref.items():
        d = params[name].double() - r.double()
        rel = max(rel, float(d.norm() / r.double().norm().clamp_min(1e-30)))
        absolute = max(absolute, float(d.abs().max()))
    return rel, absolute


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Zygote:
    """A warm process (`--zygote`) that has imported everything once, started no thread and computed
    nothing, and forks W fresh rank processes per launch, each with the environment torchrun gives
    its workers and a gloo group of its own: a launch then costs no imports (~20 s of a loaded 2-core
    machine's time each). A forked rank's VmHWM starts at its RSS at the fork, the imports' pages,
    as a fresh process's would after its imports (tests/zygote.py does the same for the suite)."""

    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--precision", args.precision]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen(
            [*cmd, "--zygote"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def launch(self, name: str, round_: int, child_dir: Path) -> tuple[int, str]:
        """One launch of one contestant: (exit code, the ranks' output tails)."""
        request = {"name": name, "round": round_, "dir": str(child_dir), "port": free_port()}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the zygote ended (exit {self.proc.wait()})")
        code = json.loads(answer)["code"]
        logs = sorted(child_dir.glob(f"r{round_}-{name}-rank*.log"))
        return code, "".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in logs)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def run_zygote(args: argparse.Namespace) -> None:
    """Serve launch requests, one JSON line each on stdin, one JSON line {code} each on stdout."""
    import signal

    import_everything()
    for line in sys.stdin:
        request = json.loads(line)
        args.child, args.round, args.child_dir = request["name"], request["round"], Path(request["dir"])
        pids = []
        for rank in range(args.nproc):
            pid = os.fork()
            if pid == 0:
                _rank_process(args, rank, request["port"])  # never returns
            pids.append(pid)
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        codes: dict[int, int] = {}
        while len(codes) < len(pids):
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            if any(codes.values()) or time.monotonic() > deadline:  # the others would wait in gloo forever
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            time.sleep(0.1)
        code = next((codes[pid] for pid in pids if codes[pid] != 0), 0)
        print(json.dumps({"code": code}), flush=True)


def _rank_process(args: argparse.Namespace, rank: int, port: int) -> None:
    """In a forked rank: its output to its own log, torchrun's environment, the contestant; then exit."""
    log = os.open(args.child_dir / f"r{args.round}-{args.child}-rank{rank}.log", os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.nproc),
        LOCAL_WORLD_SIZE=str(args.nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    code = 0
    try:
        run_child(args)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def exactness(params: dict, grads: dict, norms: list[float], ref: tuple) -> dict:
    ref_params, ref_grads, ref_norms = ref
    rel, absolute = param_diffs(params, ref_params)
    return {
        "max_rel_param_diff": rel,
        "max_abs_param_diff": absolute,
        "max_rel_grad_diff_step1": param_diffs(grads, ref_grads)[0],
        "grad_norm_rel_diff": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)),
    }


def summarize(args, runs: dict, ref: tuple, floors: dict, errors: dict) -> list[dict]:
    """One row per contestant, then the one-process floors (exactness only)."""
    import torch

    # The verdict: gradients within fp32 reassociation of the reference, and parameters no further from
    # it than one process that accumulates the same microbatches with the same kernels.
    floor = floors.get("1-proc accum (kernels)", {}).get("max_rel_param_diff", EXACT_TOLERANCE)
    baseline_params = {}
    for ranks in runs.get(BASELINE, []):
        baseline_params.setdefault(ranks[0]["round"], torch.load(ranks[0]["params"]))
    rows = []
    for name in args.contestants:
        launches = runs.get(name, [])
        if not launches:
            rows.append({"contestant": name, "error": errors.get(name, "no launch finished")})
            continue
        seconds = [s for ranks in launches for s in ranks[0]["seconds"]]
        per_round = [statistics.median(ranks[0]["seconds"]) for ranks in launches if ranks[0]["seconds"]]
        peaks = [max(r["vm_hwm_kib"] for r in ranks) / 1024 for ranks in launches]
        above = [max(r["vm_hwm_kib"] - r["rss_before_model_kib"] for r in ranks) / 1024 for ranks in launches]
        worst: dict[str, float] = {}
        replica, vs_baseline, compared = 0.0, 0.0, False
        for ranks in launches:
            loaded = [torch.load(r["params"]) for r in ranks]
            for r, params in zip(ranks, loaded, strict=True):
                for key, value in exactness(params, torch.load(r["grads"]), r["grad_norms"], ref).items():
                    worst[key] = max(worst.get(key, 0.0), value)
            replica = max(replica, max(param_diffs(p, loaded[0])[1] for p in loaded[1:]))
            same_round = baseline_params.get(ranks[0]["round"])
            if same_round is not None:
                vs_baseline, compared = max(vs_baseline, param_diffs(loaded[0], same_round)[1]), True
        rows.append(
            {
                "contestant": name,
                "s_per_step_median": statistics.median(seconds) if seconds else None,
                "s_per_step_round_medians": per_round,
                "peak_mib": statistics.median(peaks),
                "peak_mib_rounds": peaks,
                "peak_above_model_build_mib": statistics.median(above),
                **worst,
                "replicas_max_abs_diff": replica,
                "master_weight_dtypes": launches[0][0]["param_dtypes"],
                "max_abs_param_diff_vs_accum_train": vs_baseline if compared else None,
                "param_diff_below_1e-5": worst["max_rel_param_diff"] < EXACT_TOLERANCE,
                "exact": args.precision != "fp32"
                or (worst["max_rel_grad_diff_step1"] < EXACT_TOLERANCE and worst["max_rel_param_diff"] <= 1.5 * floor),
                **({"error": errors[name]} if name in errors else {}),
            }
        )
    base = next((r for r in rows if r["contestant"] == BASELINE and r.get("s_per_step_median")), None)
    for r in rows:
        if base and r.get("s_per_step_median"):
            r["ratio_vs_accum_train"] = r["s_per_step_median"] / base["s_per_step_median"]
    return rows + [{"contestant": name, **figures} for name, figures in floors.items()]


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'contestant':<24}{'s/step':>8}{'ratio':>7}{'peak MiB':>10}{'(+model)':>10}"
        f"{'param diff':>12}{'grad diff':>11}{'|dp| vs a':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r and r.get("s_per_step_median") is None:
            print(f"{r['contestant']:<24}FAILED: {r['error'][-300:]}")
            continue
        timed = r.get("s_per_step_median") is not None
        vs_a = r.get("max_abs_param_diff_vs_accum_train")
        print(
            f"{r['contestant']:<24}"
            + (
                f"{r['s_per_step_median']:>8.3f}{r.get('ratio_vs_accum_train', float('nan')):>7.3f}"
                f"{r['peak_mib']:>10.0f}{r['peak_above_model_build_mib']:>10.0f}"
                if timed
                else f"{'-':>8}{'-':>7}{'-':>10}{'-':>10}"
            )
            + f"{r['max_rel_param_diff']:>12.2e}{r['max_rel_grad_diff_step1']:>11.1e}"
            + (f"{vs_a:>11.1e}" if vs_a is not None else f"{'-':>11}")
            + ("" if r.get("exact", True) else "  NOT EXACT")
        )


def run_parent(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    busy0, own0, t0 = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter()
    zygote = Zygote(args)  # imports while the reference is computed
    ref = one_process(args, microbatched=False)
    floors = {}
    if args.precision == "fp32":  # emulated bf16 is too slow on this CPU for floors that nothing judges
        floors = {name: exactness(*one_process(args, True, kernels), ref) for name, kernels in FLOORS.items()}
    runs: dict[str, list] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-replicate-") as tmp:
        child_dir = Path(tmp)
        for round_ in range(args.rounds):
            k = round_ % len(args.contestants)
            for name in args.contestants[k:] + args.contestants[:k]:  # the order rotates round by round
                rc, tail = zygote.launch(name, round_, child_dir)
                files = [child_dir / f"r{round_}-{name}-rank{rank}.json" for rank in range(args.nproc)]
                if rc != 0 or not all(f.exists() for f in files):
                    errors[name] = f"launch exited {rc}: {tail}"
                    print(f"{name} round {round_}: FAILED (exit {rc})\n{tail}", file=sys.stderr)
                    continue
                runs.setdefault(name, []).append([json.loads(f.read_text()) for f in files])
                print(
                    f"round {round_} {name}: done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True
                )
        zygote.close()  # its CPU time, and its ranks', counts as this process's children's once it is waited for
        wall, busy1, own1 = time.perf_counter() - t0, busy_cpu_seconds(), children_cpu_seconds()
        rows = summarize(args, runs, ref, floors, errors)
    others = None
    if busy0 is not None and busy1 is not None:
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall * (os.cpu_count() or 1))
    n_params = sum(p.numel() for p in ref[0].values())
    print(
        f"\n{when}: Llama {args.layers} x {args.hidden}, vocab {args.vocab} ({n_params / 1e6:.1f}M params), "
        f"seq {args.seq_len}, micro batch {args.micro_batch} x {args.accum} microbatches x {args.nproc} gloo ranks "
        f"(1 thread each), {args.precision}; {args.rounds} rounds x {args.steps} timed steps per contestant\n"
    )
    print_table(rows)
    print(
        "\ns/step: median over all timed steps (rank 0, between barriers); ratio: / accum-train's\n"
        "peak MiB: VmHWM (/proc/self/status), max over ranks, median over launches; (+model): VmHWM above the\n"
        "  rank's VmRSS before its model was built (every import done)\n"
        f"param diff: after {EXACT_STEPS} AdamW steps, max over tensors of ||p - ref|| / ||ref|| against the one-process\n"
        "  one-big-batch reference, max over ranks and launches; grad diff: the same for step 1's reduced\n"
        "  gradients (before clipping); |dp| vs a: max |p - p_accum-train| after the same steps, same round\n"
        "1-proc accum rows: the same microbatches accumulated in one process, no reduction: the floor that\n"
        "  fp32 reassociation (amplified by AdamW's first, sign-like steps) leaves against the reference\n"
        f"NOT EXACT: grad diff >= {EXACT_TOLERANCE:g}, or param diff above 1.5x the kernels' floor"
    )
    if others is not None:
        note = " (noisy: rerun on an idle machine)" if others > BUSY_SHARE else ""
        print(f"other processes used {others:.0%} of the CPUs while measuring{note}")
    elapsed = time.perf_counter() - started
    print(f"bench took {elapsed:.0f} s")
    if args.out:
        report = {
            "measured_at": when,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child_dir"},
            "n_params": n_params,
            "reference_grad_norms": ref[2],
            "other_processes_cpu_share": others,
            "elapsed_s": elapsed,
            "memory": "VmHWM from /proc/self/status at the end of each launch, one launch per contestant per round",
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.zygote:
        run_zygote(args)
        return 0
    if args.child:  # one launch by hand: torchrun --nproc-per-node 2 bench/replicate.py --child NAME --child-dir DIR
        run_child(args)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
