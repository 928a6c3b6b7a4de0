"""`accum-train verify`: the proof, on the user's own model and data, that accumulation and sharding
changed nothing (issue 39).

The first K optimizer steps of the configured run are run twice, from the same initial weights on the
same samples: once exactly as configured, through the run's own path (run/setup.py, run/train.py's
`build` and `readers`, step/loop.py's `train_step`, step/optim.py); once as a reference that differs
only in how the global batch is split and reduced:

- where the run's state fits one process (one rank, or the replicated layout, chosen because it
  fits), rank 0 alone runs the whole global batch through the plain Hugging Face model
  (verify_reference.py), in one forward; where the run itself takes the step in one forward, one
  sample per forward instead, so that the split still differs;
- else (sharded over several ranks), the same ranks through accum-train itself with micro batch 1
  (or one microbatch per rank where the run already uses 1) and the `every` sync policy.

Dropout is switched off in both (a config field whose name holds "dropout" or "pdrop" set to 0):
its masks differ by design. Nothing is written to --output-dir: the run's setup holds a scratch
folder instead, removed at the end; no checkpoint is made. verify_report.py judges and prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from accum_cli.config import policy
from accum_cli.config.plan import Plan
from accum_cli.config.settings import REPLICATE, TrainConfig
from accum_cli.errors import UserError
from accum_cli.memory import estimate, fit
from accum_cli.model import moe
from accum_cli.parallel import runtime
from accum_cli.run import planning, verify_report
from accum_cli.run.header import with_default_lr
from accum_cli.run.setup import Setup, setup
from accum_cli.run.train import build, readers
from accum_cli.run.verify_reference import one_process, plain_name
from accum_cli.run.verify_report import GRAD_NORM, LOSS, PARAMETERS, TOLERANCE, Difference, Report, relative
from accum_cli.step import optim
from accum_cli.step.loop import train_step

ONE_PROCESS, SAME_RANKS = "one-process", "same-ranks"


@contextlib.contextmanager
def scratch_output_dir(cfg: TrainConfig):
    """The config with --output-dir pointed at a new folder of this process's, removed afterwards:
    the run's setup locks and checks an output dir, and the user's must stay untouched."""
    folder = Path(tempfile.mkdtemp(prefix="accum-verify-"))
    try:
        yield dataclasses.replace(cfg, output_dir=str(folder / "run"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def dropout_off(config) -> list[str]:
    """Every dropout probability in the model's config (and its sub-configs) set to 0; the ones that were not."""
    from transformers import PretrainedConfig

    changed = []

    def visit(node, prefix: str) -> None:
        for key, value in list(vars(node).items()):
            if isinstance(value, PretrainedConfig):
                visit(value, f"{prefix}{key}.")
            elif (
                ("dropout" in key or "pdrop" in key) and isinstance(value, int | float) and not isinstance(value, bool)
            ):
                if value:
                    changed.append(f"{prefix}{key} {value:g}")
                setattr(node, key, 0.0)

    visit(config, "")
    return changed


@contextlib.contextmanager
def stdout_to_stderr(active: bool):
    """--json: everything but the JSON document goes to stderr, that of child processes too."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def verify(cfg: TrainConfig, steps: int = 1, as_json: bool = False) -> int:
    """Collective: the report printed by rank 0; the exit code (0 all within tolerance, 1 not), alike on every rank."""
    from transformers.utils import logging as hf_logging

    if cfg.streaming:
        raise UserError(
            "verify reads the same samples twice, which a stream cannot give back; verify on the data prepared "
            "(drop --streaming), or on a file of its first rows"
        )
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    with stdout_to_stderr(as_json), scratch_output_dir(cfg) as scratch:
        s = setup(scratch, None)
        try:
            report = check(s, with_default_lr(cfg, s.source.has_weights), steps, started)
        finally:
            if s.lock is not None:
                s.lock.release()
    verdict = None
    if s.rt.is_main:
        if as_json:
            print(report.as_json(), flush=True)
        else:
            print_report(report)
        verdict = str(report.exit_code)
    return int(runtime.broadcast_text(verdict or "", s.rt.device))


def print_report(report: Report) -> None:
    from accum_cli.rundir.metrics import print_lines

    print_lines(report.lines(), f"verify: {report.steps} step{'s' if report.steps != 1 else ''}")


def check(s: Setup, cfg: TrainConfig, steps: int, started: float) -> Report:
    """Collective: both sides' steps, compared on rank 0 (the report is complete there only)."""
    if steps > s.total_steps:
        raise UserError(f"--verify-steps {steps} is more than the run's {s.total_steps} optimizer steps")
    changed = dropout_off(s.model_config)
    dropout = "off in both for the check (its masks differ by design): " + (
        "set to 0: " + ", ".join(changed) if changed else "the model's config sets none above 0"
    )
    precision = "bf16" if s.settings.bf16 else "fp32"
    kind, per_forward, reference_plan, reference_text = choose_reference(s, cfg)
    seconds: dict[str, float] = {}
    local = kind == SAME_RANKS  # the same sharding on both sides: each rank compares its own shards
    run_side, _ = accum_steps(s, cfg, steps, local, seconds, "run")
    rt = s.rt
    if kind == ONE_PROCESS:
        reference, initial = [], {}
        if rt.is_main:
            timer = time.perf_counter()
            initial, take_step = one_process(s, cfg, per_forward, s.settings.bf16)
            seconds["reference_build_s"] = time.perf_counter() - timer
            timer = time.perf_counter()
            reference = [take_step(step) for step in range(steps)]
            seconds["reference_step_s"] = (time.perf_counter() - timer) / steps
        dist.barrier()  # the other ranks wait for rank 0's reference
    else:
        same = dataclasses.replace(s, plan=reference_plan, decision=policy.Decision(policy.EVERY, "verify"))
        reference, initial = accum_steps(same, cfg, steps, local, seconds, "reference")
    report = Report(steps, precision, describe_run(s, precision), reference_text, kind, dropout, seconds)
    tolerance = TOLERANCE[precision]
    for (loss, norm, params, _), (ref_loss, ref_norm, ref_params, ref_grads) in zip(
        run_side, reference or run_side, strict=True
    ):
        if not reference:  # ranks > 0 of a one-process reference: rank 0 judges
            continue
        noise = rounding_noise(ref_grads, precision)
        name, worst, allowed = parameter_difference(params, ref_params, initial, precision, local, rt.device, noise)
        if noise:
            name = f"{name}; left out, their gradient is rounding noise that AdamW turns into +-lr steps: " + (
                ", ".join(noise[:3]) + (f" and {len(noise) - 3} more" if len(noise) > 3 else "")
            )
        report.differences.append(
            [
                Difference(LOSS, loss, ref_loss, relative(loss, ref_loss), tolerance[LOSS]),
                Difference(GRAD_NORM, norm, ref_norm, relative(norm, ref_norm), tolerance[GRAD_NORM]),
                Difference(PARAMETERS, None, None, worst, allowed, name),
            ]
        )
    seconds["total_s"] = time.perf_counter() - started
    return report


def choose_reference(s: Setup, cfg: TrainConfig) -> tuple[str, int, Plan | None, str]:
    """(kind, samples per forward of the one-process reference, the same-ranks reference's plan, its description).
    Collective: the one-process reference's forwards are sized by rank 0's memory estimate."""
    plan, world = s.plan, s.rt.world_size
    g = plan.global_batch
    router = moe.aux_loss_coef(s.model_config) > 0
    why_not = "that needs the replicated layout or one rank"
    if world == 1 or s.layout.layout == REPLICATE:
        if world == 1 and plan.accum_steps == 1 and g > 1 and not router:
            # The run takes its step in one forward: the reference splits it otherwise.
            return (
                ONE_PROCESS,
                1,
                None,
                one_process_text(s, f"the global batch of {g} one sample per forward (the run takes it in one)"),
            )
        sized = one_process_size(s, cfg) if s.rt.is_main else None
        per_forward, how = json.loads(runtime.broadcast_text(json.dumps(sized), s.rt.device))
        if per_forward == g:
            return ONE_PROCESS, g, None, one_process_text(s, f"the whole global batch of {g} in one forward ({how})")
        if per_forward and not router:  # a router's balancing loss is the model's own over the whole batch
            split = f"the global batch of {g} in {-(-g // per_forward)} forwards of up to {per_forward} samples ({how})"
            return ONE_PROCESS, per_forward, None, one_process_text(s, split)
        why_not = how if not per_forward else "the model's balancing loss needs the whole batch in one forward: " + how
        if world == 1:
            raise UserError(f"verify has no reference for this run: {why_not}; verify it at a smaller --global-batch")
    micro = 1 if plan.micro_batch > 1 else plan.max_rank_samples
    reference = Plan(g, micro, world)
    text = (
        f"the same {world} ranks through accum-train itself, as the run (layout {s.layout.layout}, "
        f"{s.layout.reason}; not one process: {why_not}): micro batch {micro} ({reference.accum_steps} microbatch"
        f"{'es' if reference.accum_steps != 1 else ''} per rank), sync every"
    )
    return SAME_RANKS, micro, reference, text


def one_process_text(s: Setup, split: str) -> str:
    why = "one rank" if s.rt.world_size == 1 else "the replicated layout: the run's state fits one process"
    return (
        f"one process (rank 0; {why}): the plain Hugging Face model{' with the same LoRA adapters (peft)' if s.lora else ''} "
        f"from the same initial weights, {split}, each "
        "forward's summed token loss divided by the step's loss-token count, AdamW and the run's schedule"
        + (", under bf16 autocast over fp32 weights" if s.settings.bf16 else "")
    )


def one_process_size(s: Setup, cfg: TrainConfig) -> dict:
    """Rank 0: [samples per forward, how they were chosen] for the one-process reference: the most the memory
    estimate of a one-process replicated step fits, plus the reference's own whole logits (an fp32 copy,
    log-softmax and their gradient), which the estimate may not count; 0 where even one does not fit.
    Never raises: the other ranks wait for the answer."""
    target = planning.fit_target(cfg, s.model_config, s.seq_len, 1, s.settings, s.rt.device.type)
    vocab = int(getattr(s.model_config, "vocab_size", 0) or 0)
    logits = s.seq_len * vocab * ((2 if s.settings.bf16 else 4) + 12)
    budget = planning.budget_for(cfg, s.rt)
    try:
        m, peak = fit.one_process_forward(target, budget, logits)
    except estimate.EstimateFailed as exc:
        return [s.plan.global_batch, f"not sized: the memory estimate failed: {exc}"]
    except UserError as exc:
        return [0, f"one sample does not fit one process by the memory estimate: {exc}"]
    return [m, f"sized by the memory estimate: {fit.gib(peak)} against a budget of {budget.describe()}"]


def describe_run(s: Setup, precision: str) -> str:
    plan = s.plan
    return (
        f"{plan.world_size} rank{'s' if plan.world_size != 1 else ''}, layout {s.layout.layout}, micro batch "
        f"{plan.micro_batch} ({plan.accum_steps} microbatch{'es' if plan.accum_steps != 1 else ''} per rank), sync "
        f"{s.decision.policy}, {precision}, global batch {plan.global_batch}"
    )


def accum_steps(s: Setup, cfg: TrainConfig, steps: int, local: bool, seconds: dict, side: str):
    """Collective: accum-train's own steps as `s` plans them: (loss, grad norm, parameters) after each,
    and the initial parameters; whole on rank 0 (each rank's own shards where `local`), fp32 CPU copies."""
    timer = time.perf_counter()
    model = build(s, cfg)
    optimizer, scheduler = optim.build(model, cfg, s.total_steps)
    read_step, _ = readers(s, cfg)
    torch.manual_seed((cfg.seed + s.rt.rank) % 2**64)  # as train() does: what a model still draws is seeded alike
    seconds[f"{side}_build_s"] = time.perf_counter() - timer
    initial = parameters(model, local, s.rt.is_main)
    step_gradients = capture_gradient_norms(model, optimizer, s.rt.device)
    timer = time.perf_counter()
    measured = []
    for step in range(steps):
        microbatches = read_step(step, step * s.plan.global_batch)
        result = train_step(
            model, optimizer, scheduler, microbatches, s.decision.policy, cfg.grad_clip, s.rt.device, step + 1,
            cfg.on_nonfinite, cfg.moe_aux_loss,
        )  # fmt: skip
        measured.append((result.loss, result.grad_norm, parameters(model, local, s.rt.is_main), dict(step_gradients)))
    seconds[f"{side}_step_s"] = (time.perf_counter() - timer) / steps
    del model, optimizer, scheduler
    gc.collect()  # the next side builds its own model: this one's memory first goes back
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return measured, initial


def capture_gradient_norms(model, optimizer, device: torch.device) -> dict[str, float]:
    """Collective (inside each optimizer.step): every parameter's gradient norm as the optimizer receives
    it, whole (sharded gradients' squares summed over the ranks); returned dict, refilled at each step."""
    found: dict[str, float] = {}
    real_step = optimizer.step

    def step_and_capture(*args, **kwargs):
        named = [(plain_name(n), p.grad) for n, p in model.named_parameters() if p.grad is not None]
        sharded = [isinstance(g, DTensor) for _, g in named]
        squares = torch.stack(
            [(g.to_local() if isinstance(g, DTensor) else g).detach().float().pow(2).sum() for _, g in named]
        ) if named else torch.zeros(0, device=device)  # fmt: skip
        if any(sharded) and dist.is_initialized() and dist.get_world_size() > 1:
            mask = torch.tensor(sharded, device=squares.device)
            summed = squares.where(mask, torch.zeros_like(squares))
            dist.all_reduce(summed)  # each rank holds its shard of a sharded gradient, all of a replicated one
            squares = torch.where(mask, summed, squares)
        found.clear()
        found.update(zip((n for n, _ in named), squares.sqrt().tolist(), strict=True))
        return real_step(*args, **kwargs)

    optimizer.step = step_and_capture
    return found


def parameters(model, local: bool, is_main: bool) -> dict[str, torch.Tensor]:
    """Collective unless `local`: fp32 CPU copies of the parameters, whole on rank 0 (full_tensor()
    gathers a sharded one), or each rank's own shard where `local`."""
    copies = {}
    for name, param in model.named_parameters():
        value = (param.to_local() if local else param.full_tensor()) if isinstance(param, DTensor) else param
        if local or is_main:
            copies[plain_name(name)] = value.detach().float().cpu().clone()
    return copies


def rounding_noise(gradients: dict[str, float], precision: str) -> list[str]:
    """The tensors whose gradient is rounding noise against the step's whole gradient (an attention key's
    bias, which softmax cancels exactly: OPT's measured 2e-11 of the total): AdamW's first steps move
    every element by about lr whatever the gradient's size, so there two correct runs part by up to 2 lr."""
    total = sum(g * g for g in gradients.values()) ** 0.5
    return [name for name, g in gradients.items() if g <= verify_report.NOISE_FLOOR[precision] * total]


def parameter_difference(
    run: dict,
    reference: dict,
    initial: dict,
    precision: str,
    local: bool,
    device: torch.device,
    noise: list[str] = (),
) -> tuple[str | None, float, float]:
    """Collective where `local`: (name, ||run - reference|| / ||reference||, its tolerance) of the
    parameter furthest beyond its tolerance (verify_report.parameter_tolerance: a share of the weights
    or of how far the steps moved them, ||reference - initial||); inf where the two models'
    parameters differ in name or shape (named then)."""
    names = list(reference)
    if set(run) != set(reference):
        odd = sorted(set(run) ^ set(reference))[0]
        return f"{odd} (in one model only)", float("inf"), TOLERANCE[precision][PARAMETERS]
    for name in names:
        if run[name].shape != reference[name].shape:
            shapes = f"{tuple(run[name].shape)} and {tuple(reference[name].shape)}"
            return f"{name} (shapes {shapes})", float("inf"), TOLERANCE[precision][PARAMETERS]
    sums = torch.tensor(
        [
            [float((run[n].double() - reference[n].double()).pow(2).sum()), float(reference[n].double().pow(2).sum()),
             float((reference[n].double() - initial[n].double()).pow(2).sum())]
            for n in names
        ],
        dtype=torch.float64,
    )  # fmt: skip
    if local:
        sums = runtime.all_reduce_sum(sums.to(device)).cpu()
    norms = sums.sqrt()
    rel = norms[:, 0] / norms[:, 1].clamp_min(1e-30)
    rel = torch.where(torch.isnan(rel), torch.full_like(rel, float("inf")), rel)
    rel[[names.index(name) for name in noise if name in names]] = 0.0  # judged by nothing: rounding noise
    allowed = verify_report.parameter_tolerance(precision, norms[:, 2] / norms[:, 1].clamp_min(1e-30))
    worst = int((rel / allowed).argmax())
    return names[worst], float(rel[worst]), float(allowed[worst])
