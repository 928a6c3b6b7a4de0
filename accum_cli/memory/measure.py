"""The memory estimate's child process (`python -m accum_cli.memory.measure`, started by estimate.Session):
the model built in FakeTensorMode on a fake process group, one step tracked by FSDPMemTracker."""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
from dataclasses import asdict

from accum_cli import torch_compat
from accum_cli.errors import first_line
from accum_cli.memory.query import Estimate, Query
from accum_cli.parallel import runtime


def fake_store():
    """PyTorch's in-memory store for a fake process group. It lives in a private testing
    module; this is the one place that imports it (a test fails loudly if torch moves it)."""
    return torch_compat.FakeStore()


class _StepPeakOnly:
    """torch's trackers, keeping the step's peak alone. After every op they also update each tracked
    module's own peak (a loop over every module, a deep copy of the snapshot at each module's new peak),
    which the estimate never reads (it reads `get_tracker_snapshot("peak")`): the same peaks and
    breakdowns (tests/test_estimate.py), and a replicated estimate's tracked step twice as fast (embedded
    model, m = 8: 1.93 s -> 0.96 s; a sharded one 10-25% faster; 6 Dec 2026). The method and the three
    attributes are torch's private ones (torch_compat: MemTracker._update_peak_stats)."""

    def _update_peak_stats(self, peak_state) -> None:
        total = torch_compat.MEM_TRACKER_TOTAL_KEY
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap[total]:
                self._peak_mem[device] = snap[total]
                self._peak_mem_snap[device] = copy.deepcopy(snap)


def step_peak_tracker(base: type) -> type:
    """`base` (torch's MemTracker or FSDPMemTracker) keeping the step's peak alone (_StepPeakOnly)."""
    return type(f"StepPeak{base.__name__}", (_StepPeakOnly, base), {})


def breakdown_of(snapshot: dict) -> dict:
    """One device's peak snapshot from the tracker, grouped into our six kinds (bytes).

    The tracker's kinds are named by its own enum, so a torch that renames one fails here
    loudly instead of silently counting zero; anything it adds is counted as temporaries."""
    Kind = torch_compat.FSDPRefType

    groups = {
        "sharded_params": (Kind.SHARDED_PARAM, Kind.BUFFER),
        "unsharded_params": (Kind.UNSHARDED_PARAM, Kind.ALL_GATHER),
        "gradients": (Kind.SHARDED_GRAD, Kind.UNSHARDED_GRAD, Kind.REDUCE_SCATTER),
        "optimizer": (Kind.OPT,),
        "activations": (Kind.ACT, Kind.INP),
        "temporaries": (Kind.TEMP,),
    }
    return _grouped(snapshot, groups)


def tracked_step(
    model, optimizer, microbatches, sync: str, loss_tokens: int, device, replicated: bool = False
) -> tuple[int, dict]:
    """One training step under FSDPMemTracker (MemTracker for a replicated model): its peak bytes
    per rank, and the breakdown at it.

    The run's own pieces: `loop.microbatch_backward` per microbatch, the replicated layout's
    bucketed gradient reduction (its collective left out, its buffers counted), clipping, AdamW. AdamW's
    moments are created first (zero gradients, one step: no forward needed), so the peak is the
    steady state's. The tracker's per-module statistics are reset between microbatches (it
    refuses a second forward of a module in one iteration otherwise)."""
    import torch

    from accum_cli.loss import vocab_parallel
    from accum_cli.parallel.reduce import summed_over_ranks
    from accum_cli.step.loop import microbatch_backward

    if not optimizer.state:
        for p in model.parameters():
            if p.requires_grad:  # LoRA's frozen base has none
                p.grad = torch.zeros_like(p)
        # In FakeTensorMode, DTensor's sharding propagation builds fake tensors of each operand's
        # *global* shape under the active fake mode, and the tracker counts them: clipping's norm
        # over all gradients would add the whole model in fp32 to the first step's peak (4.6 GiB
        # for a 1B model, whatever W). Propagation results are cached per op and shapes, so one
        # clip here, untracked, keeps every tracked step free of it (and the order of queries
        # on one fake model from changing their peaks).
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    inputs = tuple(t for mb in microbatches for t in (mb.input_ids, mb.attention_mask, mb.labels))
    frozen = contextlib.nullcontext()
    if replicated:
        tracker = step_peak_tracker(torch_compat.MemTracker)()
        tracker.track_external(model, optimizer, *inputs)
        frozen = _frozen_without_grad_hooks(model)
    else:
        # entered with the params and AdamW moments already there
        tracker = step_peak_tracker(torch_compat.FSDPMemTracker)(model, optimizer)
        tracker.track_inputs(inputs)
    with frozen, tracker:
        # The tracker wraps every unit's post-backward with its statistics of the unit's forward and
        # unsharded parameters; a matrix used in place (vocab_parallel.py) has neither, as FSDP never
        # gathered it: its own post-backward, which finds nothing to reduce, runs unwrapped.
        for module in vocab_parallel.modules(model):
            module._get_fsdp_state()._fsdp_param_group.__dict__.pop("post_backward", None)
        # Fake tensors cannot meet a real collective: the estimate leaves it out, not its buffers.
        all_reduce = (lambda flat: None) if torch_compat.is_fake(next(model.parameters())) else None
        for index, mb in enumerate(microbatches):
            is_last = index == len(microbatches) - 1
            with summed_over_ranks(model, all_reduce) if replicated and is_last else contextlib.nullcontext():
                microbatch_backward(model, mb, sync, is_last, loss_tokens, device)
            if not replicated:
                _label_accumulated_gradients(tracker, model)
            tracker.reset_mod_stats()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    snapshot = tracker.get_tracker_snapshot("peak")
    snap = max(snapshot.values(), key=lambda per_kind: per_kind.get("Total", 0))  # the one device in use
    return int(snap["Total"]), (replicated_breakdown_of(snap) if replicated else breakdown_of(snap))


class _NoHook:
    def remove(self) -> None:
        pass


@contextlib.contextmanager
def _frozen_without_grad_hooks(model):
    """MemTracker hooks every parameter's gradient, and torch refuses a hook on a tensor that takes none
    (LoRA's frozen base): around the tracked step, a frozen parameter's hook registration does nothing
    (it never has a gradient to count)."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    for param in frozen:
        param.register_hook = param.register_post_accumulate_grad_hook = lambda hook: _NoHook()
    try:
        yield
    finally:
        for param in frozen:
            del param.register_hook, param.register_post_accumulate_grad_hook


def replicated_breakdown_of(snapshot: dict) -> dict:
    """MemTracker's peak snapshot in our kinds: a replicated model's parameters are all whole."""
    Kind = torch_compat.MemRefType

    groups = {
        "sharded_params": (),
        "unsharded_params": (Kind.PARAM, Kind.BUFFER),
        "gradients": (Kind.GRAD,),
        "optimizer": (Kind.OPT,),
        "activations": (Kind.ACT,),
        "temporaries": (Kind.TEMP,),
    }
    return _grouped(snapshot, groups)


def _grouped(snapshot: dict, groups: dict) -> dict:
    """The tracker's bytes per kind summed into ours; what no group names counts as temporaries."""
    named = {str(getattr(kind, "value", kind)): int(n) for kind, n in snapshot.items()}
    result = {ours: sum(named.get(kind.value, 0) for kind in kinds) for ours, kinds in groups.items()}
    result["temporaries"] += named["Total"] - sum(result.values())
    return result


def _label_accumulated_gradients(tracker, model) -> None:
    """Deferred reduction with a reduce dtype other than the parameters' (bf16 with fp32 reduce)
    keeps the unreduced gradients in FSDP2's `unsharded_accumulated_grad`, which the tracker files
    under temporaries; they are gradients, held until the last microbatch. Relabelled after each
    microbatch (no byte changes), so a peak inside the first one still counts them as temporaries."""
    Kind = torch_compat.FSDPRefType
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for param in group.fsdp_params if group else ():
            if param.unsharded_accumulated_grad is not None:
                tracker._update_and_maybe_create_winfos(param.unsharded_accumulated_grad, Kind.UNSHARDED_GRAD)


def fake_microbatches(vocab_size: int, micro_batch: int, seq_len: int, accum_steps: int, device):
    import torch

    from accum_cli.data.batches import Microbatch

    shape = (micro_batch, seq_len)
    return [
        Microbatch(
            input_ids=torch.randint(0, vocab_size, shape, device=device),
            attention_mask=torch.ones(shape, dtype=torch.long, device=device),
            labels=torch.randint(0, vocab_size, shape, device=device),
        )
        for _ in range(accum_steps)
    ]


def _build_key(query: Query) -> str:
    """Queries that differ only in sync policy and micro batch share one fake model."""
    return json.dumps([asdict(query) | {"sync": None, "micro_batch": None}], sort_keys=True)


def _fake_model(query: Query, fake_mode):
    """The model from its config in FakeTensorMode, sharded by the run's shard() on a fake world
    (replicated: whole, as the replicated layout builds it)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from accum_cli.config.settings import TrainConfig
    from accum_cli.model import lora, wrap
    from accum_cli.parallel.runtime import Runtime
    from accum_cli.parallel.sharding import ShardSettings
    from accum_cli.step import optim

    config_dict = dict(query.model_config)
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    config.use_cache = False
    adapters = lora.adapters_where_built() if query.lora else contextlib.nullcontext()
    if query.replicated:  # a plain model: no process group, fake or real, is needed or touched
        with fake_mode, adapters:
            model = lora.apply(
                AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"),
                lora.settings_of(query.lora),
            )
            model.train()
            settings = ShardSettings(bf16=query.bf16, activation_checkpointing=query.activation_checkpointing)
            wrap.prepare_replicated(model, settings, torch.device("cpu"))  # as the run's build_replicated
            optimizer, _ = optim.build(model, TrainConfig(lr=1e-3), total_steps=1)
        return model, optimizer, config
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=query.world_size, store=fake_store())
    settings = ShardSettings(
        bf16=query.bf16,
        reshard_after_forward=query.reshard_after_forward,
        activation_checkpointing=query.activation_checkpointing,
    )
    rt = Runtime(0, 0, query.world_size, query.world_size, torch.device("cpu"))
    mesh = rt.mesh(query.replicas)  # outside fake mode: the mesh reads its rank layout
    with fake_mode, adapters:
        model = lora.apply(
            AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"),
            lora.settings_of(query.lora),
        )
        model.train()
        wrap.shard(model, mesh, settings)
        optimizer, _ = optim.build(model, TrainConfig(lr=1e-3), total_steps=1)  # the rate does not change memory
    return model, optimizer, config


class Measurer:
    """In the child: each query's peak; the fake model is kept for the next queries that share it."""

    def __init__(self) -> None:

        self.fake_mode = torch_compat.FakeTensorMode(
            allow_non_fake_inputs=True
        )  # one mode: the model and its inputs share it
        self.built: tuple[str, object, object, object] | None = None

    def measure(self, queries: list[Query]) -> list[Estimate]:
        # Sharing a fake model needs the queries that share it next to each other.
        order = sorted(range(len(queries)), key=lambda i: _build_key(queries[i]))
        results = {}
        for i in order:  # fake tensors on the CPU, standing for the run's device
            with runtime.simulated(queries[i].device_type):
                results[i] = self._one(queries[i])
        return [results[i] for i in range(len(queries))]

    def _one(self, query: Query) -> Estimate:
        import torch

        device = torch.device("cpu")
        started = time.perf_counter()
        if self.built is None or self.built[0] != _build_key(query):
            self.built = None  # free the previous fake model first
            self.built = (_build_key(query), *_fake_model(query, self.fake_mode))
        _, model, optimizer, config = self.built
        with self.fake_mode:
            microbatches = fake_microbatches(
                config.vocab_size, query.micro_batch, query.seq_len, query.accum_steps, device
            )
            loss_tokens = query.micro_batch * query.seq_len * query.accum_steps * query.world_size
            peak, breakdown = tracked_step(
                model, optimizer, microbatches, query.sync, loss_tokens, device, query.replicated
            )
        return Estimate(peak, breakdown, time.perf_counter() - started)


def serve(requests, answers) -> None:
    """One JSON list of queries per line of `requests`, one JSON list of results per line of `answers`,
    until the end of the requests (the child's protocol, spawned or forked: memory/child.py)."""
    sys.stdout = sys.stderr  # whatever a library prints must not pass for an answer
    measurer = Measurer()
    for line in requests:
        queries = [Query(**row) for row in json.loads(line)]
        try:
            measured = measurer.measure(queries)
        except Exception as exc:  # reported in one line by the parent
            print(f"{type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
            raise SystemExit(1) from None
        rows = [{"peak": r.peak, "breakdown": r.breakdown, "seconds": r.seconds} for r in measured]
        print(json.dumps(rows), file=answers, flush=True)


def main() -> None:
    serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
