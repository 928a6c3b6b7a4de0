"""Hand-written mutants: does the test suite notice when a promise is broken?

Each mutant replaces one snippet of one module with a plausible mistake, in a copy of the
repository, and runs only the tests that should catch it, with -x, so a kill is fast. A
mutant is KILLED when those tests fail (or hang past the timeout), SURVIVED when they pass
or select nothing, and STALE when its original snippet is no longer in the code (edit the
mutant, do not ignore it). Mutants marked `equivalent` cannot change what a user sees; each
says why, and they are left out of the score.

    make mutants                                  # all, against this checkout's tests
    python bench/mutants.py -k "checkpoint|loop"  # the mutants whose name matches a regular expression
    python bench/mutants.py --tests-from REF      # against the tests of git commit REF (a baseline)

Why hand-written and not mutmut: mutmut would rerun a minutes-long multi-process suite per
mutant; these name their tests, and each is a mistake someone could make.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COPY_IGNORE = shutil.ignore_patterns(
    ".venv", "runs", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info"
)
TIMEOUT_S = 600
DATA_MODULES = (
    "accum_cli/data/prepare.py",
    "accum_cli/data/formats.py",
    "accum_cli/data/sources.py",
    "accum_cli/data/batches.py",
    "accum_cli/data/store.py",
)

EQ = "tests/test_equivalence.py"
CK = "tests/test_checkpoint.py"
ORDER = "tests/test_checkpoint_order.py"
SYNC = "tests/test_sync_policies.py"
BAD = "tests/test_bad_input.py"
PROMISES = "tests/test_promises.py"
TRUST = "tests/test_trust.py"
ESTIMATE = "tests/test_estimate.py"
STREAM = "tests/test_streaming.py"
LOSS = "tests/test_loss.py"


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]  # pytest arguments selecting the tests that should kill it
    equivalent: str = ""  # why it cannot change behaviour, if it cannot
    timeout_s: int = TIMEOUT_S  # past it the tests have not passed: a kill


SCHEDULE = (f"{PROMISES}::test_lr_schedule_warms_up_to_the_peak_and_decays_to_the_floor",
            "tests/test_end_to_end.py::test_torchrun_two_ranks_trains_writes_metrics_and_a_loadable_model")  # fmt: skip


def eq_case(case: str, layout: str = "shard") -> tuple[str, ...]:
    """One case of the equivalence test, by its id: model-WORLD-MICRO-SYNC and its --layout."""
    return (f"{EQ}::test_accumulated_sharded_training_equals_one_big_batch[{case}---layout {layout}]",)


MUTANTS = [
    # --- plan: the batch arithmetic ---------------------------------------------------------
    Mutant("plan: accumulation steps rounded down", "accum_cli/config/plan.py",
           "return -(-self.max_rank_samples // self.micro_batch)", "return self.max_rank_samples // self.micro_batch",
           ("tests/test_plan.py",)),
    Mutant("plan: the extra sample goes to one rank too many", "accum_cli/config/plan.py",
           "return base + (1 if rank < extra else 0)", "return base + (1 if rank <= extra else 0)",
           ("tests/test_plan.py",)),
    Mutant("plan: rank offsets ignore the extra samples", "accum_cli/config/plan.py",
           "return rank * base + min(rank, extra)", "return rank * base", ("tests/test_plan.py",)),
    Mutant("plan: divisible by m only", "accum_cli/config/plan.py",
           "return self.global_batch % (self.micro_batch * self.world_size) == 0",
           "return self.global_batch % self.micro_batch == 0", ("tests/test_plan.py",)),
    Mutant("plan: a resumed run ignores its saved data position", "accum_cli/config/plan.py",
           "step_start = step * self.global_batch if first_sample is None else first_sample",
           "step_start = step * self.global_batch", (PROMISES, "-k", "data_position")),
    Mutant("plan: nearest larger batch as floor + 1 unit", "accum_cli/config/plan.py",
           "above = -(-self.global_batch // unit) * unit", "above = (self.global_batch // unit + 1) * unit",
           ("tests/test_plan.py",),
           equivalent="only called for a G that is not a multiple of the unit, where ceil = floor + 1"),
    Mutant("train: a real run ignores --strict-batch", "accum_cli/run/planning.py",  # the preflight's check
           "    if cfg.strict_batch:\n        plan.require_divisible()\n    policy.shard_size(plan, cfg.replicas)",
           "    policy.shard_size(plan, cfg.replicas)", (PROMISES, "-k", "strict_batch")),
    # --- policy: the sync policies ----------------------------------------------------------
    Mutant("policy: last-keep-params gathers 2A like the others", "accum_cli/config/policy.py",
           "return Collectives(a + 1, 1, 1 if across else 0)", "return Collectives(2 * a, 1, 1 if across else 0)",
           (SYNC, "-k", "collectives")),
    Mutant("policy: hsdp-defer all-reduces every microbatch", "accum_cli/config/policy.py",
           "return Collectives(2 * a, a, 1)", "return Collectives(2 * a, a, a)", (SYNC, "-k", "collectives")),
    Mutant("policy: every all-reduces across replicas once", "accum_cli/config/policy.py",
           "return Collectives(2 * a, a, a if across else 0)", "return Collectives(2 * a, a, 1 if across else 0)",
           (SYNC, "-k", "collectives")),
    Mutant("policy: last all-reduces across replicas every microbatch", "accum_cli/config/policy.py",
           "return Collectives(2 * a, 1, 1 if across else 0)", "return Collectives(2 * a, 1, a if across else 0)",
           (SYNC, "-k", "collectives and x2")),
    Mutant("policy: last-keep-params holds no more than last", "accum_cli/step/loop.py",
           "    if sync == policy.LAST_KEEP_PARAMS:\n        model.set_reshard_after_backward(is_last)\n", "",
           (SYNC, "-k", "collectives and keep")),
    Mutant("policy: auto keeps last when memory is tight", "accum_cli/config/policy.py",
           "        if peak <= budget:\n", "        if peak <= budget or name == LAST:\n",
           (ESTIMATE, "-k", "auto_policy")),
    Mutant("plan: --plan prints one microbatch's collectives", "accum_cli/memory/fit.py",
           "policy.collectives_per_step(name, plan.accum_steps, target.replicas)",
           "policy.collectives_per_step(name, 1, target.replicas)", (SYNC, "-k", "collectives and last:3")),
    Mutant("policy: one rank is not a reason for last", "accum_cli/config/policy.py",
           "if plan.world_size == 1 or plan.accum_steps == 1:", "if plan.accum_steps == 1:",
           (PROMISES, "-k", "one_rank")),
    # --- loop: one optimizer step -------------------------------------------------------------
    Mutant("loop: set_sync_flags is a no-op", "accum_cli/step/loop.py",
           '    """Apply the sync policy before a microbatch\'s forward (the flags recurse to every layer)."""\n',
           '    """Apply the sync policy before a microbatch\'s forward (the flags recurse to every layer)."""\n'
           "    return\n", (SYNC, "-k", "collectives or memory")),
    Mutant("loop: gradients synced on the first microbatch", "accum_cli/step/loop.py",
           "is_last = index == len(microbatches) - 1", "is_last = index == 0", eq_case("model-2-3-last")),
    Mutant("loop: per-microbatch mean loss", "accum_cli/step/loop.py",
           "microbatch_backward(model, mb, sync, is_last, loss_tokens, device, share, router)",
           "microbatch_backward(model, mb, sync, is_last, max(mb.loss_tokens, 1) * len(microbatches), device, "
           "share, router)", eq_case("model-2-3-every")),
    Mutant("loop: counts swapped", "accum_cli/step/loop.py",
           "loss_tokens, tokens = (int(c) for c in counts.tolist())",
           "tokens, loss_tokens = (int(c) for c in counts.tolist())", eq_case("model-2-3-every")),
    Mutant("loop: the reported loss is rank 0's own", "accum_cli/step/loop.py",
           "    ce_sum, aux = sums[:2].tolist()",
           "    ce_sum, aux = torch.stack([torch.stack(mb_losses).sum(), torch.stack(mb_aux).sum()]).tolist()",
           eq_case("model-2-3-every")),
    Mutant("loop: no gradient clipping", "accum_cli/step/loop.py",
           "max_norm = grad_clip if grad_clip > 0 else math.inf", "max_norm = math.inf", eq_case("model-1-3-last")),
    Mutant("loop: gradients kept across steps", "accum_cli/step/loop.py",
           "    scheduler.step()\n    optimizer.zero_grad(set_to_none=True)\n", "    scheduler.step()\n",
           eq_case("model-1-3-last")),
    Mutant("loop: skip does not advance the schedule", "accum_cli/step/loop.py",
           "            scheduler.step()  # the schedule follows the step count, applied or not\n", "",
           (CK, "-k", "skip")),
    Mutant("loop: the failing microbatch is misnamed", "accum_cli/step/loop.py",
           "first = int(bad[0, 0]) + 1 if len(bad) else 0", "first = int(bad[0, 0]) if len(bad) else 0",
           (CK, "-k", "abort")),
    # --- checkpoint ---------------------------------------------------------------------------
    Mutant("checkpoint: latest is the oldest", "accum_cli/rundir/checkpoint_meta.py",
           "return complete[-1] if complete else None", "return complete[0] if complete else None",
           (ORDER,)),
    Mutant("checkpoint: sorted by name", "accum_cli/rundir/checkpoint_meta.py",
           "return sorted(found, key=step_of)", "return sorted(found)", (ORDER,)),
    Mutant("checkpoint: prune keeps one too few", "accum_cli/rundir/checkpoint.py",
           "complete[: max(len(complete) - keep, 0)]", "complete[: max(len(complete) - keep + 1, 0)]",
           (ORDER, f"{CK}::test_checkpoints_are_complete_and_pruned")),
    Mutant("checkpoint: a save without meta.json is not called incomplete", "accum_cli/rundir/checkpoint_meta.py",
           "    if not meta_file.is_file():\n", "    if False:\n", (BAD, "-k", "export_of and incomplete")),
    Mutant("checkpoint: torn shards accepted", "accum_cli/rundir/checkpoint_meta.py",
           'if file.stat().st_size != entry["bytes"]:', "if False:", (BAD, "-k", "torn")),
    Mutant("checkpoint: .metadata not verified", "accum_cli/rundir/safe_dcp.py",  # read unverified, still safely
           'path = verify_file(folder, ".metadata", files)', 'path = folder / ".metadata"',
           (BAD, TRUST, "-k", "tampered or flipped_bytes or same_size_shard"), timeout_s=240),
    Mutant("checkpoint: the schedule restarts on resume", "accum_cli/run/train.py",  # no scheduler state is saved now
           "        scheduler = optim.schedule(optimizer, cfg, s.total_steps, done_steps=start_step)\n", "",
           (CK, "-k", "resume_continues")),
    Mutant("checkpoint: export writes the initial weights", "accum_cli/rundir/export.py",
           '    dcp_load(state, meta, "checkpoint", no_dist=True)\n', "", (CK, "-k", "export")),
    Mutant("checkpoint: export skips load_state_dict", "accum_cli/rundir/export.py",
           '    model.load_state_dict(state["model"])\n', "", (CK, "-k", "export"),
           equivalent="dcp.load fills the tensors of model.state_dict() in place, and those share the "
           "parameters' storage, so the load_state_dict after it copies each tensor onto itself"),
    Mutant("checkpoint: RNG state not restored", "accum_cli/rundir/checkpoint.py",
           '        torch.set_rng_state(rng["cpu"])\n', "        pass\n", (PROMISES, "-k", "random_state")),
    Mutant("train: dropout draws from an unseeded RNG", "accum_cli/run/train.py",
           "    torch.manual_seed((cfg.seed + rt.rank) % 2**64)\n", "", (PROMISES, "-k", "random_state")),
    Mutant("model: final/ loses a layer", "accum_cli/rundir/export.py",
           "model.save_pretrained(tmp, state_dict=state, safe_serialization=True)",
           'model.save_pretrained(tmp, state_dict={k: v for k, v in state.items() if ".1." not in k}, '
           "safe_serialization=True)", eq_case("model-2-3-every")),
    Mutant("model: activation checkpointing is a no-op", "accum_cli/model/wrap.py",
           "    if settings.activation_checkpointing:\n        # Inside each layer's forward",
           "    if False:\n        # Inside each layer's forward", (SYNC, "-k", "checkpointing")),
    Mutant("model: replicated activation checkpointing is a no-op", "accum_cli/model/wrap.py",
           "        prepare_compile(model)\n    if settings.activation_checkpointing:\n        model.gradient_checkpointing_enable",
           "        prepare_compile(model)\n    if False:\n        model.gradient_checkpointing_enable",
           (SYNC, "-k", "checkpointing and replicated")),
    # --- optim --------------------------------------------------------------------------------
    Mutant("optim: warmup starts at zero", "accum_cli/step/optim.py",
           "return (step + 1) / warmup_steps", "return step / warmup_steps", SCHEDULE),
    Mutant("optim: cosine overshoots the peak", "accum_cli/step/optim.py",
           "0.5 * (1.0 + math.cos(math.pi * progress))", "(1.0 + math.cos(math.pi * progress))",
           SCHEDULE),
    Mutant("optim: weight decay on vectors", "accum_cli/step/optim.py",
           '{"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}',
           '{"params": [p for p in params if p.ndim < 2], "weight_decay": cfg.weight_decay}',
           eq_case("model-1-3-last")),
    Mutant("optim: Adam betas swapped", "accum_cli/step/optim.py",
           "betas=(cfg.adam_beta1, cfg.adam_beta2)", "betas=(cfg.adam_beta2, cfg.adam_beta1)",
           eq_case("model-1-3-last")),
    # --- data -----------------------------------------------------------------------------------
    Mutant("data: every epoch in the same order", "accum_cli/data/batches.py",
           "np.random.default_rng([self.seed, epoch])", "np.random.default_rng([self.seed, 0])",
           (f"{PROMISES}::test_every_epoch_is_a_fresh_shuffle_of_every_row",
            "tests/test_data.py::test_the_order_depends_only_on_seed_and_global_batch")),
    Mutant("data: labels ignored, inputs used as labels", "accum_cli/data/batches.py",
           "target[i, : len(ids)] = torch.from_numpy(labels)", "target[i, : len(ids)] = torch.from_numpy(ids)",
           eq_case("model-2-3-every")),
    Mutant("data: loss tokens counted before the shift", "accum_cli/data/batches.py",
           "return int((self.labels[:, 1:] != IGNORE_INDEX).sum())", "return int((self.labels != IGNORE_INDEX).sum())",
           eq_case("model-2-3-every")),
    Mutant("data: padding counted as tokens", "accum_cli/data/batches.py",
           "mask[i, : len(ids)] = 1", "mask[i, :] = 1", (PROMISES, "-k", "padding")),
    Mutant("data: the empty microbatch's label counts", "accum_cli/data/batches.py",
           "torch.full_like(one, IGNORE_INDEX), empty=True)", "one.clone(), empty=True)", eq_case("model-2-2-every"),
           equivalent="its one label is at position 0, which the one-token shift never scores"),
    # --- evaluate --------------------------------------------------------------------------------
    Mutant("evaluate: the remainder rows are dropped", "accum_cli/step/evaluate.py",
           "return range(start, start + base + (1 if rank < extra else 0))", "return range(start, start + base)",
           ("tests/test_data.py", "-k", "cache_is_reused")),
    Mutant("evaluate: eval in training mode", "accum_cli/step/evaluate.py", "    model.eval()\n", "",
           (PROMISES, "-k", "without_dropout")),
    # --- prepare -----------------------------------------------------------------------------------
    Mutant("prepare: a dataset with no rows is not refused up front", "accum_cli/data/formats.py",
           "    if rows.num_rows == 0:\n", "    if False:\n", (PROMISES, "-k", "no_rows")),
    Mutant("sources: an empty file reaches the parser", "accum_cli/data/sources.py",
           "        if all(f.stat().st_size == 0 for f in files):", "        if False:", (BAD, "-k", "empty")),
    Mutant("prepare: the chat header counts in the loss", "accum_cli/data/formats.py",
           "start = len(_template(tokenizer, messages[:i], row, add_generation_prompt=True)) if i else 0",
           "start = len(_template(tokenizer, messages[:i], row, add_generation_prompt=False)) if i else 0",
           ("tests/test_data.py", "-k", "assistant")),
    Mutant("prepare: the prompt counts in the loss", "accum_cli/data/formats.py",
           "[IGNORE_INDEX] * len(p) + c + eos", "p + c + eos", ("tests/test_data.py", "-k", "prompt_completion")),
    Mutant("prepare: a partial last block is packed", "accum_cli/data/store.py",  # packing is cut in the store's Writer
           "samples = self.n_tokens // self.seq_len", "samples = -(-self.n_tokens // self.seq_len)",
           ("tests/test_data.py", "-k", "packed")),
    Mutant("prepare: the cache ignores the options", "accum_cli/data/cache.py",
           "Hasher.hash([PREP_VERSION, fingerprint, fmt, asdict(options),",
           "Hasher.hash([PREP_VERSION, fingerprint, fmt, None,", (PROMISES, "-k", "cache")),
    # --- stream: --streaming ----------------------------------------------------------------------
    Mutant("stream: every rank reads rank 0's slice", "accum_cli/data/stream.py",
           "plan.microbatch_range(step, rank, j", "plan.microbatch_range(step, 0, j", (STREAM, "-k", "whatever_w")),
    Mutant("stream: a resume restarts the stream instead of skipping to its position", "accum_cli/data/stream.py",
           "itertools.islice(self._samples, first - self.position)", "itertools.islice(self._samples, 0)",
           (STREAM, "-k", "resume")),
    Mutant("stream: the shuffle buffer ignores --seed", "accum_cli/data/stream.py",
           "default_rng([seed, SHUFFLE_STREAM])", "default_rng([0, SHUFFLE_STREAM])", (STREAM, "-k", "shuffle")),
    Mutant("stream: the packed block carried between chunks is dropped", "accum_cli/data/stream.py",
           "        ids = ids[whole:].copy()", "        ids = ids[:0].copy()", (STREAM, "-k", "prepared_samples")),
    Mutant("stream: the loss mask is lost", "accum_cli/data/stream.py",
           "    if chunk.mask is not None:\n        return np.where", "    if False:\n        return np.where",
           (STREAM, "-k", "prepared_samples")),
    Mutant("stream: the end of the stream is not seen ahead", "accum_cli/run/train.py",
           "if cfg.streaming and step + 1 < end and not", "if False and not", (STREAM, "-k", "clean_end")),
    # --- safe_dcp: nothing runs from a checkpoint, every byte read is verified --------------------
    Mutant("safe_dcp: the metadata unpickler admits any class", "accum_cli/rundir/safe_dcp.py",
           '        raise UnsafeCheckpoint(f"its .metadata asks to load {module[:60]}.{name[:60]}, which DCP never writes")',
           "        return super().find_class(module, name)",
           (TRUST, "-k", "payload_in_dcp_metadata or payload_in_resume_metadata")),
    Mutant("safe_dcp: non-tensor items unpickled with weights_only=False", "accum_cli/rundir/safe_dcp.py",
           "obj = torch.load(value, weights_only=True)", "obj = torch.load(value, weights_only=False)",
           (TRUST, "-k", "payload_in_a_shard_item")),
    Mutant("safe_dcp: a file's checksum is not compared", "accum_cli/rundir/safe_dcp.py",
           'if sha256_file(path) != expected["sha256"]:', "if False:",
           (TRUST, "-k", "flipped_bytes or same_size_shard")),
    # --- outdir: only what accum-train wrote is ever deleted --------------------------------------
    Mutant("outdir: a folder with a run's record files but no marker is ours", "accum_cli/rundir/outdir.py",
           "if not names or MARKER in names:", 'if not names or MARKER in names or "metrics.jsonl" in names:',
           (TRUST, "-k", "someone_elses")),
    Mutant("outdir: --overwrite removes unmarked checkpoint folders", "accum_cli/rundir/outdir.py",
           "            if entry.is_dir() and is_marked(entry):\n", "            if entry.is_dir():\n",
           (TRUST, "-k", "overwrite_removes")),
    # --- layout: the replicated layout sums each step's gradients over ranks ----------------------
    Mutant("layout: replicated gradients never reduced", "accum_cli/step/loop.py",
           "reduce.summed_over_ranks(model) if replicated and is_last else contextlib.nullcontext(),",
           "contextlib.nullcontext(),", eq_case("model-2-3-last", "replicate")),
    Mutant("layout: replicated gradients averaged, not summed", "accum_cli/parallel/reduce.py",
           "            work.wait()\n", "            work.wait()\n            flat /= dist.get_world_size()\n",
           eq_case("model-2-3-last", "replicate")),
    Mutant("reduce: every bucket waits for the end of backward (no overlap)", "accum_cli/parallel/reduce.py",
           "        while self.launched < len(self.buckets) and self.waiting[self.launched] == 0:\n",
           "        while False:\n", ("tests/test_reduce.py", "-k", "gloo")),
    Mutant("reduce: buckets in flight unbounded", "accum_cli/parallel/reduce.py",
           "        if len(self.in_flight) > MAX_IN_FLIGHT:\n", "        if False:\n",
           ("tests/test_reduce.py", "-k", "in_flight")),
    Mutant("kernels: every norm-shaped module gets the closed-form RMSNorm", "accum_cli/cpu/kernels.py",
           "            _verdicts[kind] = _agrees(module)\n", "            _verdicts[kind] = True\n",
           ("tests/test_kernels.py", "-k", "only_norms")),
    Mutant("kernels: one verdict per class, whatever its instances' settings", "accum_cli/cpu/kernels.py",
           "        kind = _kind(module)\n", "        kind = type(module)\n",
           ("tests/test_kernels.py", "-k", "verdict")),
    Mutant("kernels: the RMSNorm backward without its mean term", "accum_cli/cpu/kernels.py",
           "grad_x = r * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))", "grad_x = r * gw",
           ("tests/test_kernels.py", "-k", "closed_form or trains_the_same")),
    Mutant("reduce: a gradient accumulated twice in the last backward goes unnoticed", "accum_cli/parallel/reduce.py",
           "        if id(param) in self.arrived:", "        if False:", ("tests/test_reduce.py", "-k", "twice")),
    Mutant("reduce: a parameter no rank had a gradient for gets zeros (the optimizer moves it)",
           "accum_cli/parallel/reduce.py", "                    bucket[i].grad = None\n", "                    pass\n",
           ("tests/test_reduce.py",)),
    Mutant("kernels: a norm with more inputs than the hidden states is swapped", "accum_cli/cpu/kernels.py",
           "        and _takes_one_input(type(module).forward)\n", "", ("tests/test_kernels.py", "-k", "only_norms")),
    Mutant("kernels: the probe only at rows far larger than the epsilon", "accum_cli/cpu/kernels.py",
           "        for probe_x in (x, tiny):", "        for probe_x in (x,):", ("tests/test_kernels.py", "-k", "only_norms")),
    Mutant("kernels: the weight's gradient summed over the leading dimensions only", "accum_cli/cpu/kernels.py",
           "(g * x_hat).reshape(-1, g.shape[-1]).sum(0)", "(g * x_hat).sum(dim=tuple(range(g.dim() - 1)))",
           ("tests/test_kernels.py", "-k", "one_dimensional")),
    Mutant("kernels: a dtype setting left out of a verdict's key", "accum_cli/cpu/kernels.py",
           "bool | int | float | str | torch.dtype", "bool | int | float | str", ("tests/test_kernels.py", "-k", "verdict")),
    Mutant("sharding: a parameter one rank has no gradient for left out of its reduce-scatter",
           "accum_cli/model/wrap.py", "        model.set_reduce_scatter_unused_params(True)\n", "        pass\n",
           ("tests/test_reduce.py", "-k", "sharded")),
    Mutant("grad_use: a parameter no rank had a gradient for in a sharded step keeps zeros (AdamW moves it)",
           "accum_cli/parallel/grad_use.py", "            self.fsdp_params[index].sharded_param.grad = None\n", "            pass\n",
           ("tests/test_reduce.py", "-k", "sharded")),
    Mutant("grad_use: a step's marks carried into the next", "accum_cli/parallel/grad_use.py",
           "        self.marks = [False] * len(self.fsdp_params)\n        return marks\n", "        return marks\n",
           ("tests/test_reduce.py", "-k", "sharded")),
    Mutant("grad_use: bf16 zeros beside a unit's fp32 accumulated gradients (FSDP refuses mixed dtypes)",
           "accum_cli/step/loop.py", "            use.before_last_backward()\n", "            pass\n",
           ("tests/test_reduce.py", "-k", "sharded and bf16")),
    Mutant("grad_use: a frozen parameter hooked like a trained one", "accum_cli/parallel/grad_use.py",
           "            elif unsharded.requires_grad:\n", "            else:\n",
           ("tests/test_reduce.py", "-k", "sharded")),
    Mutant("checkpoint: a resume asks for optimizer state the checkpoint never held", "accum_cli/rundir/checkpoint.py",
           "            _only_saved_optimizer_state(state[\"optim\"], metadata)\n", "            pass\n",
           ("tests/test_checkpoint.py", "-k", "never_uses")),
    Mutant("grad_use: a placeholder's zero gradients mark the experts its pad token reaches", "accum_cli/parallel/grad_use.py",
           "        if self.marking:\n            self.marks[index] = True\n", "        self.marks[index] = True\n",
           ("tests/test_reduce.py", "-k", "different_parameters and not replicate")),
    Mutant("loop: a replicated placeholder trained like a real microbatch", "accum_cli/step/loop.py",
           "        if mb.empty and replicated:\n", "        if False:\n",
           ("tests/test_reduce.py", "-k", "different_parameters and replicate")),
    Mutant("checkpoint: a save after only skipped steps keeps the AdamW step get_state_dict ran", "accum_cli/rundir/checkpoint.py",
           "        optimizer.state.clear()\n", "        pass\n", ("tests/test_checkpoint.py", "-k", "only_skipped")),
    Mutant("checkpoint: a save after only skipped steps writes the state get_state_dict made up", "accum_cli/rundir/checkpoint.py",
           "        optim_state[\"state\"] = {}\n", "        pass\n", ("tests/test_checkpoint.py", "-k", "only_skipped")),
    Mutant("outdir: a link among the run folder's own names followed", "accum_cli/rundir/outdir.py",
           "    if links:\n", "    if False:\n", ("tests/test_trust.py", "-k", "link_among")),
    Mutant("outdir: the lock file opened through a link", "accum_cli/rundir/outdir.py",
           " | os.O_NOFOLLOW, 0o644)", ", 0o644)", ("tests/test_trust.py", "-k", "never_opened_through")),
    Mutant("checkpoint: --resume auto starts a finished run afresh when its checkpoints are gone",
           "accum_cli/rundir/checkpoint_meta.py", "            if finished:  # starting", "            if False:  # starting",
           ("tests/test_trust.py", "-k", "resume_auto_on_a_finished")),
    Mutant("checkpoint: an export removes a staging folder of the user's", "accum_cli/rundir/export.py",
           "    if outdir.someone_elses(tmp):\n        raise UserError", "    if False:\n        raise UserError", ("tests/test_trust.py", "-k", "export_never_deletes")),
    Mutant("checkpoint: a save removes a staging folder of the user's", "accum_cli/rundir/checkpoint.py",
           "            if is_main and not outdir.someone_elses(tmp):", "            if is_main:",
           ("tests/test_trust.py", "-k", "save_never_deletes")),
    Mutant("loop: a step without loss tokens aborts under --on-nonfinite skip", "accum_cli/step/loop.py",
           '        if on_nonfinite == "skip":  # dropped on every rank alike', "        if False:",
           ("tests/test_checkpoint.py", "-k", "without_loss_tokens")),
    Mutant("train: --epochs resumed at another global batch counted in steps of the new one from the start",
           "accum_cli/run/data_setup.py", "    if meta is None or meta.global_batch == global_batch:\n", "    if True:\n",
           ("tests/test_checkpoint.py", "-k", "another_global_batch")),
    Mutant("metrics: a torn metrics line read as a record on resume", "accum_cli/rundir/metrics.py",
           "    except (ValueError, TypeError, KeyError):\n        return None\n", "    finally:\n        pass\n",
           ("tests/test_trust.py", "-k", "torn_metrics")),
    Mutant("reduce: buckets in the parameters' order, not the gradients'", "accum_cli/parallel/reduce.py",
           "        order = params[::-1]\n", "        order = params\n", ("tests/test_reduce.py", "-k", "gloo")),
    Mutant("layout: auto replicates whatever the estimate says", "accum_cli/memory/layout.py",
           "    fits = found.peak <= budget.bytes\n", "    fits = True\n", (ESTIMATE, "-k", "auto_layout")),
    Mutant("model: an untied embedding and output projection left in the root", "accum_cli/model/wrap.py",
           "    return own(pair[0]), own(pair[1])\n", "    return None, None\n", (ESTIMATE, "-k", "untied")),
    # --- compile: decided from the measured steps ---------------------------------------------------
    Mutant("compile: decided but the layers never switched", "accum_cli/model/compiling.py",
           "            forward.compiled = torch.compile(forward.eager)\n", "            pass\n",
           (EQ, "-k", "compile_decided")),
    Mutant("compile: the threshold ignored", "accum_cli/parallel/sharding.py",
           "    return remaining_steps * step_seconds >= threshold_s\n", "    return True\n",
           (EQ, "-k", "compile_decided")),
    # --- memory: the loss, the gloo reduce-scatter and malloc hold no more than they must -------------
    Mutant("loss: the textbook cross-entropy on sliced logits", "accum_cli/loss/tokens.py",
           "    return _CrossEntropySum.apply(logits.reshape(-1, vocab), shifted_targets(labels).reshape(-1))\n",
           "    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(),\n"
           "        labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction='sum')\n", (LOSS, "-k", "hold")),
    Mutant("loss: the gradient forgets the one-hot", "accum_cli/loss/tokens.py",
           "            probs.scatter_add_(1, safe[rows].unsqueeze(1), torch.full_like(probs[:, :1], -1.0))\n", "",
           (LOSS, "-k", "cross_entropys")),
    Mutant("loop: the model's output held through backward", "accum_cli/step/loop.py",
           "    del out  # the logits are then held by the loss's graph alone, freed as soon as its backward ran\n",
           "", (LOSS, "-k", "frees")),
    Mutant("model: gloo reduce-scatters left to gloo's own", "accum_cli/model/wrap.py",
           "                module.set_custom_reduce_scatter(InPlaceReduceScatter())\n", "",
           (SYNC, "-k", "collectives and every")),
    Mutant("hostmem: the mmap threshold left to glibc", "accum_cli/cpu/hostmem.py",
           "    return _set((M_MMAP_THRESHOLD, LEAN_THRESHOLD_BYTES))\n", "    return True\n",
           ("tests/test_hostmem.py",)),
    Mutant("hostmem: the replicated heap's top still trimmed", "accum_cli/cpu/hostmem.py",
           "    return _set((M_MMAP_THRESHOLD, HEAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, HEAP_TRIM_BYTES))\n",
           "    return _set((M_MMAP_THRESHOLD, HEAP_THRESHOLD_BYTES))\n", ("tests/test_hostmem.py",)),
    Mutant("hostmem: the user's MALLOC_TRIM_THRESHOLD_ overridden", "accum_cli/cpu/hostmem.py",
           'USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")',
           'USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_",)', ("tests/test_hostmem.py",)),
    Mutant("prepare: chat turns typed as JSON left as text", "accum_cli/data/formats.py",
           "            messages = [_turn(m) for m in messages]", "            messages = list(messages)",
           ("tests/test_data.py", "-k", "differing_keys")),
    Mutant("prepare: a chat template's refusal escapes as a traceback", "accum_cli/data/formats.py",
           "    except Exception as exc:  # the template's own raise_exception",
           "    except ZeroDivisionError as exc:  # the template's own raise_exception",
           ("tests/test_data.py", "-k", "cannot_render")),
    Mutant("prepare: an empty conversation left to the template", "accum_cli/data/formats.py",
           "        if not messages:\n", "        if False:\n", ("tests/test_data.py", "-k", "cannot_render")),
    Mutant("prepare: a full cache disk left as a traceback", "accum_cli/data/prepare.py",
           "        if exc.errno not in FULL:", "        if True:", ("tests/test_data.py", "-k", "full_disk")),
    Mutant("sources: a folder's splits all trained on", "accum_cli/data/sources.py",
           "        if splits:\n            candidates = _split_files(", "        if False:\n            candidates = _split_files(",
           ("tests/test_data.py", "-k", "split_by_file")),
    Mutant("sources: a file in no split trained on unsaid", "accum_cli/data/sources.py",
           "    if stray:\n", "    if False:\n", ("tests/test_data.py", "-k", "split_by_file")),
    Mutant("checkpoint: a rewind leaves the later checkpoints in place", "accum_cli/rundir/checkpoint.py",
           "        if step_of(path) > step and outdir.is_marked(path):", "        if False:",
           ("tests/test_checkpoint.py", "-k", "rewind")),
    Mutant("outdir: a checkpoint taken as a run folder", "accum_cli/rundir/outdir.py",
           '    if kind not in (None, "run"):', "    if False:", ("tests/test_checkpoint.py", "-k", "rewind")),
    Mutant("checkpoint: a model folder called an unfinished save", "accum_cli/rundir/checkpoint_meta.py",
           '    if not meta_file.is_file() and (path / "config.json").is_file()', "    if False",
           ("tests/test_checkpoint.py", "-k", "rewind")),
    Mutant("train: an exported final/ refused only after training", "accum_cli/run/setup.py",
           "    if meta is not None and final.is_dir() and not outdir.is_marked(final)", "    if False",
           ("tests/test_checkpoint.py", "-k", "rewind")),
    Mutant("recipe: a YAML key written twice keeps the last", "accum_cli/config/recipe.py",
           "                if key in first_line:\n", "                if False:\n",
           ("tests/test_config.py", "-k", "bad_recipes")),
    Mutant("recipe: a JSON key written twice keeps the last", "accum_cli/config/recipe.py",
           "        if key in seen:\n", "        if False:\n", ("tests/test_config.py", "-k", "json_recipe")),
    Mutant("cli: launch flags without --nproc ignored", "accum_cli/cli/main.py",
           "        if not wants_launch and (nnodes != 1", "        if False and (nnodes != 1", ("tests/test_launchers.py", "-k", "refuses_bad_launch")),
    Mutant("launcher: an empty --master-addr taken for 127.0.0.1", "accum_cli/cli/launcher.py",
           "        if self.master_addr is not None and not self.master_addr.strip():",
           "        if False:", ("tests/test_launchers.py", "-k", "refuses_bad_launch")),
    Mutant("launcher: several nodes without an address", "accum_cli/cli/launcher.py",
           "        if self.nnodes > 1 and self.master_addr is None and not self.accelerate_config:",
           "        if False:", ("tests/test_launchers.py", "-k", "refuses_bad_launch")),
    Mutant("launcher: an empty --accelerate-config dropped", "accum_cli/cli/launcher.py",
           "        if self.accelerate_config is not None and not self.accelerate_config.strip():",
           "        if False:", ("tests/test_launchers.py", "-k", "refuses_bad_launch")),
    Mutant("launcher: the user's default accelerate config read", "accum_cli/cli/launcher.py",
           "    if not launch.accelerate_config:\n        # Accelerate would read",
           "    if False:\n        # Accelerate would read", ("tests/test_launchers.py", "-k", "default_accelerate")),
    Mutant("config: an empty --report-to taken for none", "accum_cli/config/settings.py",
           '            "report_to",\n        ):', "        ):", ("tests/test_bad_input.py", "-k", "report")),
    Mutant("model: the final write replaces a final/ of someone else's", "accum_cli/rundir/export.py",
           "    if out_dir.is_dir() and not outdir.is_marked(out_dir) and any(out_dir.iterdir()):",
           "    if False:", ("tests/test_trust.py", "-k", "never_replaces")),
    Mutant("launcher: a worker the agent stopped named as the one lost", "accum_cli/cli/launcher.py",
           "    by_another_signal = {rank: code for rank, code in killed.items() if code != -signal.SIGTERM}",
           "    by_another_signal = {}", ("tests/test_launchers.py", "-k", "killed_first")),
    Mutant("train: a replicated CPU run leaves malloc as it is", "accum_cli/run/train.py",
           'if rt.device.type == "cpu" and replicated and hostmem.keep_the_heap():',
           'if rt.device.type == "cpu" and replicated and False:',
           ("tests/test_architectures.py", "-k", "header")),
    Mutant("model: the embedding re-gathered for its backward", "accum_cli/model/wrap.py",
           "            embedding.set_unshard_in_backward(False)", "            pass",
           (SYNC, "-k", "gathered_once")),
    Mutant("isolate: the child collects garbage made before the fork", "accum_cli/data/isolate.py",
           "    gc.freeze()\n", "", ("tests/test_isolate.py", "-k", "dead_process_group")),
    Mutant("train: a stopped preparation's folder left behind", "accum_cli/run/setup.py",
           "                cache.remove_abandoned(cache.cache_root())\n", "                pass\n",
           ("tests/test_isolate.py", "-k", "ctrl_c")),
    Mutant("isolate: the data work done in the trainer", "accum_cli/data/isolate.py",
           "    if not available():\n        return fn(*args)\n", "    return fn(*args)\n",
           ("tests/test_isolate.py", "-k", "never_imports")),
    # --- checkpoint: meta.json is validated, field by field -----------------------------------------
    Mutant("checkpoint: meta.json's samples not checked against its steps", "accum_cli/rundir/checkpoint_meta.py",
           '    if fields["samples"] != implied:', "    if False:", (TRUST, "-k", "edited_meta")),
    # --- data review, 4 Dec: the cache's bytes, rows that are not data ---------------------------
    Mutant("store: a sample read without checking its block", "accum_cli/data/store.py",
           "            self._check(name, array, start, stop)\n", "            pass\n",
           ("tests/test_data.py", "-k", "changed_byte")),
    Mutant("sources: hidden files of a dataset folder read as data", "accum_cli/data/sources.py",
           'candidates = [p for p in path.rglob("*") if not _hidden(p.relative_to(path))]',
           'candidates = list(path.rglob("*"))', ("tests/test_data.py", "-k", "hidden_files")),
    Mutant("stream: a buffered row is a view of its chunk", "accum_cli/data/stream.py",
           "yield chunk.ids[start:stop].copy(), None if labels is None else labels[start:stop].copy()",
           "yield chunk.ids[start:stop], None if labels is None else labels[start:stop]",
           (STREAM, "-k", "buffered")),
    Mutant("prepare: a null in an attention mask drops its token", "accum_cli/data/formats.py",
           "            if not all(m in (0, 1) for m in mask):", "            if False:",
           (BAD, "-k", "null-mask")),
    Mutant("prepare: a null among the ids is a traceback", "accum_cli/data/prepare.py",
           "        except (TypeError, ValueError, OverflowError):  # a null or a nested list among the ids",
           "        except ZeroDivisionError:", (BAD, "-k", "null-id")),
    Mutant("prepare: chat rows that are not turns reach the template", "accum_cli/data/formats.py",
           '            raise BadRow(row, "messages is not a list of turns, each with a role")', "            pass",
           ("tests/test_data.py", "-k", "chat_rows_that")),
    Mutant("prepare: another host's preparation taken for an abandoned one", "accum_cli/data/cache.py",
           '    for folder in root.glob(f"{TMP_PREFIX}{glob.escape(host)}@*-*"):\n'
           '        pid = folder.name[len(TMP_PREFIX) + len(host) + 1 :].split("-", 1)[0]',
           '    for folder in root.glob(f"{TMP_PREFIX}{glob.escape(host)}*@*-*"):\n'
           '        pid = folder.name.split("@", 1)[1].split("-", 1)[0]',
           ("tests/test_data.py", "-k", "killed_preparation")),
    Mutant("train: the evaluation's rows not held to the model's positions", "accum_cli/run/setup.py",
           "pretokenised = [x for x in (stats, eval_stats) if x is not None", "pretokenised = [x for x in (stats,) if x is not None",
           (BAD, "-k", "long-eval")),
    # --- CLI and model review, 4 Dec: values, the wrapper's address, weights, the unpickler -------
    Mutant("safe_dcp: .metadata's BUILD may set attributes of an admitted class", "accum_cli/rundir/safe_dcp.py",
           "    dispatch = pickle._Unpickler.dispatch | {pickle.BUILD[0]: _build_instances_only}",
           "    dispatch = pickle._Unpickler.dispatch", (TRUST, "-k", "patch_a_class")),
    Mutant("model: tensors the weights files lack start from random values", "accum_cli/model/load.py",
           "        if missing:\n", "        if False:\n", (BAD, "-k", "random_values")),
    Mutant("model: the empty model of ranks > 0 in the dtype the config declares", "accum_cli/model/load.py",
           "        copy.deepcopy(config),\n        dtype=torch.float32,\n", "        copy.deepcopy(config),\n",
           ("tests/test_end_to_end.py", "-k", "rank_0_alone")),
    Mutant("model: an encoder family's causal head attends both ways", "accum_cli/model/load.py",
           "        config.is_decoder = True\n", "        pass\n", ("tests/test_architectures.py", "-k", "encoder")),
    Mutant("recipe: integers read as YAML 1.1 (064 is octal)", "accum_cli/config/recipe.py",
           "Yaml12Loader.add_constructor(INT_TAG, _yaml12_int)\n", "", ("tests/test_config.py", "-k", "yaml_1_2")),
    Mutant("launcher: the accelerate config's address replaced by this machine's", "accum_cli/cli/launcher.py",
           'addr = launch.master_addr or (None if launch.accelerate_config else "127.0.0.1")',
           'addr = launch.master_addr or "127.0.0.1"', ("tests/test_sharding.py", "-k", "address_alone")),
    Mutant("launcher: the accelerate config left for the workers to read", "accum_cli/cli/launcher.py",
           "            return dataclasses.replace(self, config_processes=_config_processes(self.accelerate_config))",
           "            return self", (BAD, "-k", "nproc or cpu-2proc")),
    Mutant("cli: --world-size checked only after the wrapper started its workers", "accum_cli/cli/main.py",
           "        if world_size is not None and not plan:  # before a launch: the workers would each refuse it\n"
           '            raise UserError("--world-size only applies with --plan; a training run takes it from the launcher")\n',
           "", (BAD, "-k", "nproc and world")),
    Mutant("checkpoint: export reads the checkpoint folder, unlisted files too", "accum_cli/rundir/export.py",
           "AutoTokenizer.from_pretrained(listed, trust_remote_code=trust_remote_code)",
           "AutoTokenizer.from_pretrained(meta.path, trust_remote_code=trust_remote_code)",
           (TRUST, "-k", "only_the_files")),
    Mutant("train: a micro batch above a rank's share planned and estimated as given", "accum_cli/run/planning.py",
           "    return usable_micro_batch(cfg.micro_batch, cfg.global_batch, world_size)", "    return cfg.micro_batch",
           ("tests/test_cli.py", "-k", "share")),
    Mutant("fit: auto's candidate micro batches listed one by one", "accum_cli/memory/fit.py",
           "        return range(1, cap + 1)\n", "        return list(range(1, cap + 1))\n",
           (ESTIMATE, "-k", "few_estimates")),
    Mutant("config: an empty --dataset taken for the default", "accum_cli/config/settings.py",
           "            if isinstance(value, str) and not value.strip():", "            if False:",
           (BAD, "-k", "test_bad_input and dataset")),
    Mutant("train: config.json records --overwrite", "accum_cli/run/record.py",
           '"seq_len": s.seq_len, "overwrite": False}', '"seq_len": s.seq_len}',
           ("tests/test_end_to_end.py", "-k", "not_clobbered")),
    Mutant("model: a refused pickle reported with torch's advice", "accum_cli/model/load.py",
           "            if _refused_unpickling(exc):", "            if False:",
           ("tests/test_bad_input.py", "-k", "random_values")),
    Mutant("model: the run's use_cache=False published", "accum_cli/model/load.py",
           "        config.is_decoder = True\n    return config\n", "        config.is_decoder = True\n    config.use_cache = False\n    return config\n",
           ("tests/test_end_to_end.py", "-k", "torchrun_two_ranks")),
    Mutant("runtime: any message naming gloo is a lost peer", "accum_cli/parallel/runtime.py",
           '"gloo/transport/")', '"gloo")', ("tests/test_runtime.py",)),
    Mutant("runtime: a hung peer is not a lost peer", "accum_cli/parallel/runtime.py",
           '"gloo/transport/")', '"gloo/transport/tcp/pair")', ("tests/test_runtime.py",)),
    Mutant("train: config.json leaves the accelerate config's settings unrecorded", "accum_cli/run/record.py",
           '"overwrite": False} | s.settings.as_flags(),', '"overwrite": False},',
           ("tests/test_launchers.py", "-k", "cpu_fsdp")),
    Mutant("train: the preemption checkpoint records the data position a step behind", "accum_cli/run/train.py",
           "path = save_checkpoint(done, samples, draw=False)",
           "path = save_checkpoint(done, samples - plan.global_batch, draw=False)",
           (CK, "-k", "sigterm_stops_every_rank")),
    # 5 Dec 2026 (seventh session): fixes from four reviews, and oneDNN's GEMMs.
    Mutant("outdir: a resume rewrites metrics.jsonl in place", "accum_cli/rundir/outdir.py",
           "        os.replace(tmp, path)\n    finally:\n        tmp.unlink(missing_ok=True)",
           "        os.replace(tmp, path)\n    finally:\n        tmp.unlink(missing_ok=True)\n    path.write_text('')",
           ("tests/test_metrics.py", "-k", "half_written")),
    Mutant("checkpoint: a re-save removes the old one before the new takes its name", "accum_cli/rundir/checkpoint.py",
           "    final.rename(aside)\n    tmp.rename(final)", "    shutil.rmtree(final)\n    final.mkdir()\n    tmp.rename(aside)\n    aside.rename(final)",
           (TRUST, "-k", "resave")),
    Mutant("checkpoint: the start does not put back a set-aside checkpoint", "accum_cli/rundir/checkpoint.py",
           "    if entry.name.startswith(REPLACED) and outdir.is_marked(entry) and not original.exists():",
           "    if False:", (TRUST, "-k", "resave")),
    Mutant("metrics: NaN written as JSON's non-standard NaN", "accum_cli/rundir/metrics.py",
           "    return json.dumps(finite, allow_nan=False)", "    return json.dumps(record)",
           (CK, "-k", "nonfinite_skip")),
    Mutant("tracking: a rewind forgets how far the trackers were sent", "accum_cli/run/record.py",
           "        tracking.remember_sent(out)\n", "", ("tests/test_see_the_run.py", "-k", "rewound_attempt")),
    Mutant("tracking: a fresh run keeps the replaced run's sent mark", "accum_cli/rundir/tracking.py",
           "    if ids.pop(SENT, None) is not None:", "    if False:",
           ("tests/test_see_the_run.py", "-k", "outlives_a_rewind")),
    Mutant("train: --eval-split-ratio on one sequence holds out none", "accum_cli/run/data_setup.py",
           "    if n < 2:\n", "    if n < 1:\n", (BAD, "-k", "one-row")),
    Mutant("cli: a SIGTERM during an export leaves its folder", "accum_cli/cli/main.py",
           "    previous = signal.signal(signal.SIGTERM, _terminated)", "    previous = signal.getsignal(signal.SIGTERM)",
           (TRUST, "-k", "sigterm_during_an_export")),
    Mutant("report: --out's suffix ignored (PNG bytes in a .svg)", "accum_cli/rundir/report.py",
           "format=out.suffix[1:].lower()", 'format="png"', ("tests/test_see_the_run.py", "-k", "report_png")),
    Mutant("train: the warmup note missing from a run shorter than its warmup", "accum_cli/run/header.py",
           "    if warmup > total_steps:", "    if warmup > 10 * total_steps:",
           ("tests/test_see_the_run.py", "-k", "report_png")),
    Mutant("launcher: torch's 30 s shutdown timeout kept", "accum_cli/cli/launcher.py",
           "    os.environ.setdefault(SHUTDOWN_TIMEOUT_ENV, str(WORKER_STOP_GRACE_S))", "    pass",
           ("tests/test_launchers.py", "-k", "longer_than_torchs")),
    Mutant("train: a SIGTERM before the first step kills the run", "accum_cli/run/train.py",
           "    previous = signal.signal(signal.SIGTERM, _stop_before_training)",
           "    previous = signal.getsignal(signal.SIGTERM)", ("tests/test_launchers.py", "-k", "before_the_first_step")),
    Mutant("launcher: a run stopped before its first step counts as lost", "accum_cli/cli/launcher.py",
           "    saved = checkpoint_meta.step_of(newest) if newest is not None else 0",
           "    saved = checkpoint_meta.step_of(newest) if newest is not None else -1",
           ("tests/test_launchers.py", "-k", "before_the_first_step and wrapper")),
    Mutant("loss: every chunk run in the estimate", "accum_cli/loss/tokens.py",
           "    if len(starts) > 2 and runtime.is_simulated():", "    if False:",
           (LOSS, "-k", "fake")),
    Mutant("loss: a bf16 chunk's working copy alive into the next", "accum_cli/loss/tokens.py",
           "            del probs  # before the next chunk's", "            pass  # before the next chunk's",
           (LOSS, "-k", "fake")),
    Mutant("config: a bound's message names the other side", "accum_cli/config/settings.py",
           '    low = (f"[{ge}", f">= {ge}") if ge is not None else (f"({gt}", f"> {gt}") if gt is not None else None',
           '    low = (f"[{ge}", f">= {ge}") if ge is not None else None', (BAD, "-k", "epochs")),
    Mutant("plan: the header lists every microbatch", "accum_cli/config/plan.py",
           "        if self.accum_steps <= 8:", "        if True:", ("tests/test_plan.py", "-k", "huge")),
    Mutant("train: a capped micro batch said to be as requested", "accum_cli/run/planning.py",
           "    if used == fit.AUTO or used == cfg.micro_batch:", "    if True:",
           (ESTIMATE, "-k", "capped")),
    Mutant("metrics: logged lines replaced by the progress bar on a terminal", "accum_cli/rundir/metrics.py",
           "            if logged:  # above the bar", "            if False:  # above the bar",
           ("tests/test_metrics.py", "-k", "terminal")),
    Mutant("launcher: a tilde in --accelerate-config=~/x not expanded", "accum_cli/cli/launcher.py",
           '        if self.accelerate_config and self.accelerate_config.startswith("~"):', "        if False:",
           ("tests/test_launchers.py", "-k", "equals_sign")),
    Mutant("recipe: a python tag called invalid YAML", "accum_cli/config/recipe.py",
           "    except yaml.constructor.ConstructorError as exc:", "    except KeyError as exc:",
           (BAD, "-k", "evil")),
    Mutant("train: a streamed run's eval rows not checked against the positions", "accum_cli/run/setup.py",
           "            eval_dataset, eval_stats, _ = prepare.prepare(", "            eval_dataset, _x, _ = prepare.prepare(",
           (STREAM, "-k", "bad_streaming")),
    Mutant("train: a pad id outside the vocabulary used", "accum_cli/run/data_setup.py",
           "        if isinstance(candidate, int) and candidate >= 0 and (not isinstance(vocab, int) or candidate < vocab):",
           "        if isinstance(candidate, int):", ("tests/test_data.py", "-k", "pad_id")),
    Mutant("train: --resume auto after a stream's end is an error", "accum_cli/run/setup.py",
           "            if resume == RESUME_AUTO and finished(out, meta):", "            if False:",
           (STREAM, "-k", "clean_end")),
    Mutant("model: a tokenizer that ships code read as none", "accum_cli/model/load.py",
           '        if "custom code" in str(exc) or "trust_remote_code" in str(exc):  # there', "        if False:",
           ("tests/test_safety.py", "-k", "tokenizer")),
    Mutant("cpu_linear: oneDNN's input gradient transposed wrongly", "accum_cli/cpu/linear.py",
           "_onednn(grad, weight.t(), None)", "_onednn(grad, weight.t().flip(1), None)",
           ("tests/test_cpu_linear.py",)),
    Mutant("cpu_linear: the bias gradient dropped", "accum_cli/cpu/linear.py",
           "        grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None",
           "        grad_b = None", ("tests/test_cpu_linear.py",)),
    Mutant("cpu_linear: fake tensors sent to oneDNN", "accum_cli/cpu/linear.py",
           "        type(x) is torch.Tensor  # not a FakeTensor (the estimate) nor a DTensor\n        and type(weight) in (torch.Tensor, nn.Parameter)\n",
           "        True\n",
           ("tests/test_cpu_linear.py",)),
    Mutant("cpu_linear: a probe that accepts anything", "accum_cli/cpu/linear.py",
           "bool((a - b).abs().max() <= PROBE_TOLERANCE * b.abs().max())", "True",
           ("tests/test_cpu_linear.py",)),
    Mutant("fused_loss: later chunks left out of the weight's gradient", "accum_cli/loss/tokens.py",
           "grad_weight.addmm_(probs.t(), h)", "pass",
           ("tests/test_fused_loss.py",)),
    Mutant("fused_loss: ignored positions given a gradient", "accum_cli/loss/fused_loss.py",
           "probs.mul_(mask.unsqueeze(1))", "pass",
           ("tests/test_fused_loss.py",)),
    Mutant("fused_loss: the loss's own gradient (1 / loss tokens) not applied", "accum_cli/loss/tokens.py",
           "grad.mul_(grad_total)", "pass",
           ("tests/test_fused_loss.py",)),
    Mutant("fused_loss: whole logits in one chunk", "accum_cli/loss/fused_loss.py",
           "chunk_starts(rows, CHUNK_ELEMENTS // weight.size(0))", "chunk_starts(rows, rows.size(0))",
           ("tests/test_fused_loss.py",)),
    Mutant("fused_loss: a probe that accepts any logits", "accum_cli/loss/fused_loss.py",
           "return recorded is not None and _is_placeholder(", "return recorded is not None or _is_placeholder(",
           ("tests/test_fused_loss.py",)),
    Mutant("fused_loss: logits other than the placeholder taken as it", "accum_cli/loss/fused_loss.py",
           "    return logits is placeholder or (", "    return True or (",
           ("tests/test_fused_loss.py",)),
    Mutant("fused_loss: the head's own forward lost after the probe", "accum_cli/loss/fused_loss.py",
           "            head.forward = own_forward", "            del head.forward",
           ("tests/test_fused_loss.py",)),
    Mutant("fused_loss: the head registered as a module of the model", "accum_cli/loss/fused_loss.py",
           "object.__setattr__(model, ATTRIBUTE, head)", "setattr(model, ATTRIBUTE, head)",
           ("tests/test_fused_loss.py",)),
    Mutant("fused_loss: every forward in training records, not only the step's", "accum_cli/loss/fused_loss.py",
           'armed = head.__dict__.get("_accum_train_armed", False) and head.training',
           "armed = head.training",
           ("tests/test_fused_loss.py",)),
    Mutant("model: the fused loss's probe after compiling (the probe compiles the layers)", "accum_cli/model/wrap.py",
           "    _eager_kernels_and_fused_loss(model, settings, device)\n    if settings.bf16:\n        compute_in_bf16(model, device)\n    if settings.compile:\n        compile_layers(model)\n",
           "    if settings.bf16:\n        compute_in_bf16(model, device)\n    if settings.compile:\n        compile_layers(model)\n    _eager_kernels_and_fused_loss(model, settings, device)\n",
           ("tests/test_fused_loss.py",)),
    Mutant("fused_loss: the root resharded after the forward (the tied head's weight freed)", "accum_cli/model/wrap.py",
           'kwargs | {"reshard_after_forward": False} if fused else kwargs', "kwargs",
           ("tests/test_equivalence.py",)),
    Mutant("hostmem: the give-back hook returns malloc_trim's result (the forward's arguments replaced)",
           "accum_cli/cpu/hostmem.py", "    def give_back(_module, _args) -> None:  # None: the forward's arguments stay as they are\n        trim(0)",
           "    def give_back(_module, _args) -> None:  # None: the forward's arguments stay as they are\n        return trim(0)",
           ("tests/test_hostmem.py",)),
    Mutant("hostmem: the heap's free pages never given back", "accum_cli/cpu/hostmem.py",
           "        module.register_forward_pre_hook(give_back, prepend=True)", "        pass",
           ("tests/test_hostmem.py",)),
    Mutant("vocabulary gathers: a matrix at the threshold left out", "accum_cli/model/wrap.py",
           "matrix_bytes(matrix) >= min_bytes", "matrix_bytes(matrix) > min_bytes", ("tests/test_hostmem.py",)),
    Mutant("fused_loss: a rank on meta (rank-0 loading) runs the probe, fails it, and unfuses every rank",
           "accum_cli/loss/fused_loss.py", "(on_meta or _passes_placeholder_through(model, head))",
           "_passes_placeholder_through(model, head)", ("tests/test_fused_loss.py", "-k", "meta")),
    Mutant("fused_loss: no positions leave the weight gradient unwritten", "accum_cli/loss/fused_loss.py",
           "            grad_weight.zero_()", "            pass", ("tests/test_fused_loss.py", "-k", "positions")),
    Mutant("fused_loss: rows and labels of different counts paired", "accum_cli/loss/fused_loss.py",
           "    if rec.hidden.shape[:-1].numel() != targets.numel():", "    if False:",
           ("tests/test_fused_loss.py", "-k", "positions")),
    Mutant("fused_loss: a second backward reaches None", "accum_cli/loss/tokens.py",
           "    if grads is None:", "    if False:", ("tests/test_fused_loss.py", "-k", "second_backward")),
    Mutant("model: a stale model.safetensors beside a sharded index loaded", "accum_cli/model/load.py",
           '    if (folder / "model.safetensors").is_file() and (folder / "model.safetensors.index.json").is_file():',
           "    if False:", ("tests/test_bad_input.py", "-k", "stale")),
    Mutant("sources: a JSON Lines file of lists gets the parser's words, not the row and the fix", "accum_cli/data/sources.py",
           'not_objects = _first_line_not_an_object(files) if builder == "json" else None', "not_objects = None",
           ("tests/test_bad_input.py", "-k", "arrays")),
    Mutant("vocabulary gathers: the input embedding's left out", "accum_cli/model/wrap.py",
           "gathers = [(own_embedding or model, embedding), (head, head)]", "gathers = [(head, head)]",
           ("tests/test_hostmem.py",)),
    Mutant("vocab_parallel: the padding row takes a gradient", "accum_cli/loss/vocab_parallel.py",
           "        if padding is not None and 0 <= padding - shard.offset < shard.rows:", "        if False:",
           ("tests/test_vocab_parallel.py", "-k", "one_process")),
    Mutant("vocab_parallel: every rank's rows counted in this rank's loss", "accum_cli/loss/vocab_parallel.py",
           "                total += losses[lo:hi].sum()", "                total += losses.sum()",
           ("tests/test_vocab_parallel.py", "-k", "one_process")),
    Mutant("vocab_parallel: a target in another shard picks this shard's column 0", "accum_cli/loss/vocab_parallel.py",
           "picked = torch.where(hit, logits.gather(1, target).squeeze(1), 0.0)",
           "picked = logits.gather(1, target).squeeze(1)", ("tests/test_vocab_parallel.py", "-k", "one_process")),
    Mutant("vocab_parallel: the input's gradient not summed over ranks", "accum_cli/loss/vocab_parallel.py",
           "            dist.all_reduce(grad_rows, group=group)", "            pass",
           ("tests/test_vocab_parallel.py", "-k", "one_process")),
    Mutant("vocab_parallel: ranks' rows of different counts kept with their padding", "accum_cli/loss/vocab_parallel.py",
           "        if len(set(rows.sizes)) > 1:", "        if False:",
           ("tests/test_vocab_parallel.py", "-k", "one_process")),
    Mutant("vocab_parallel: used in place however many rows", "accum_cli/loss/vocab_parallel.py",
           "    return Exchange(shard, sizes) if sum(sizes) < shard.vocab else None",
           "    return Exchange(shard, sizes)", ("tests/test_vocab_parallel.py", "-k", "one_process")),
    Mutant("vocab_parallel: never diverted (FSDP gathers as before)", "accum_cli/loss/vocab_parallel.py",
           "        shard.parent.__dict__[shard.name] = _Diverted(shard.module, forward)", "        pass",
           ("tests/test_vocab_parallel.py", "-k", "one_process")),
    Mutant("grad_use: a gradient born sharded dropped as unused", "accum_cli/parallel/grad_use.py",
           "        groups = [[p for p in group if id(p.sharded_param) not in born_sharded] for group in groups]",
           "        pass", ("tests/test_vocab_parallel.py", "-k", "one_process")),
    Mutant("vocab_parallel: an id outside the vocabulary looked up as zeros", "accum_cli/loss/vocab_parallel.py",
           "bool(((ids < 0) | (ids >= vocab)).any())", "False",
           ("tests/test_vocab_parallel.py", "-k", "one_process")),
    Mutant("vocab_parallel: the loss's chunks sized by this rank's shard (uneven ranks' collectives differ)",
           "accum_cli/loss/vocab_parallel.py", "chunk_elements // -(-shard.vocab // len(counted.sizes))",
           "chunk_elements // weight.size(0)", ("tests/test_vocab_parallel.py", "-k", "one_process and every")),
    Mutant("vocab_parallel: what a forward without gradient gathered kept through the step's forwards",
           "accum_cli/step/loop.py", "    vocab_parallel.release(model)  # what", "    pass  # what",
           ("tests/test_vocab_parallel.py", "-k", "one_process and every")),
    # --- the house and the bf16 path (issues 35, 36) ------------------------------------------
    Mutant("bf16: the replicated layout computes in fp32", "accum_cli/model/wrap.py",
           "    model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)", "    pass",
           ("tests/test_equivalence_bf16.py",)),
    Mutant("bf16: the sharded layout without FSDP2's mixed precision", "accum_cli/model/wrap.py",
           '    if settings.bf16:\n        kwargs["mp_policy"]', '    if False:\n        kwargs["mp_policy"]',
           ("tests/test_equivalence_bf16.py", "-k", "shard")),
    Mutant("bf16: --precision bf16 on CPU trains in fp32", "accum_cli/parallel/sharding.py",
           '        return cfg.precision == "bf16"', '        return cfg.precision == "bf16" and device_type == "cuda"',
           ("tests/test_sharding.py",)),
    Mutant("cpu: the CPU's kernels installed on a CUDA run", "accum_cli/model/wrap.py",
           '    if device.type == "cpu" and not settings.compile and not settings.bf16:',
           "    if not settings.compile:", ("tests/test_kernels.py", "-k", "only_on")),
    Mutant("estimate: the simulated world left undeclared", "accum_cli/memory/measure.py",
           "        with runtime.simulated():", "        with contextlib.nullcontext():",
           ("tests/test_estimate.py", "-k", "matches_real_ranks or untied")),
    Mutant("layers: a torch symbol moved without a word", "accum_cli/torch_compat.py",
           "raise MovedError(f\"{path}: not found in this torch ({exc})\") from None", "return None",
           ("tests/test_torch_compat.py",)),
    Mutant("isolate: a process holding CUDA forks its data child", "accum_cli/data/isolate.py",
           "    if cuda_initialized():\n        return in_spawned_child(fn, *args)\n", "",
           ("tests/test_isolate.py", "-k", "spawns")),
    # --- trust, round three (issue 37): paths, empty values, deep JSON ------------------------
    Mutant("sources: a device or a pipe taken for a dataset", "accum_cli/data/sources.py",
           "        if not (path.is_file() or path.is_dir()):", "        if False:",
           ("tests/test_trust_inputs.py", "-k", "dataset_path")),
    Mutant("sources: a folder without data files reaches datasets", "accum_cli/data/sources.py",
           "        if path.is_dir() and not any(", "        if False and not any(",
           ("tests/test_trust_inputs.py", "-k", "dataset_path")),
    Mutant("cli: an empty --resume taken for a path", "accum_cli/cli/main.py",
           "        if resume is not None and not resume.strip():", "        if False:",
           ("tests/test_trust_inputs.py", "-k", "empty_resume")),
    Mutant("safe_json: a line nested too deep is a RecursionError", "accum_cli/safe_json.py",
           "    except RecursionError:", "    except ZeroDivisionError:",
           ("tests/test_trust_inputs.py", "-k", "nested")),
    Mutant("planning: a model whose weights cannot fit is built anyway", "accum_cli/run/planning.py",
           "    if need > budget.bytes:", "    if False:",
           ("tests/test_trust_inputs.py", "-k", "cannot_fit")),
    Mutant("launcher: a worker's refusal reported as the SIGTERM the agent sent the others", "accum_cli/cli/launcher.py",
           "    if exited:\n        return exited[min(exited)], None\n", "",
           ("tests/test_launchers.py", "-k", "killed_first")),
    Mutant("launcher: a signal after the run finished reported as a preemption", "accum_cli/cli/launcher.py",
           "    if _finished(output_dir):", "    if False:",
           ("tests/test_trust_inputs.py", "-k", "finished")),
    Mutant("checkpoint: a stop during the load reported as a damaged checkpoint", "accum_cli/rundir/checkpoint.py",
           "        if stopped is not None:", "        if False:",
           ("tests/test_trust_inputs.py", "-k", "stop_during")),
    Mutant("estimate: torch's warnings above a replicated refusal", "accum_cli/memory/estimate.py",
           '                warnings.simplefilter("ignore")', "                pass",
           ("tests/test_trust_inputs.py", "-k", "torchs_warnings")),
    # --- trust, round three (issue 37), part B -------------------------------------------------
    Mutant("weights: a checkpoint and final/ saved without the finiteness check", "accum_cli/run/train.py",
           "        check_finite_parameters(model, step, rt.device)\n", "",
           ("tests/test_trust_weights.py", "-k", "overflows_ends or one_ranks_shard")),
    Mutant("weights: each rank decides on its own shard (no agreement)", "accum_cli/step/loop.py",
           "    dist.all_reduce(first, op=dist.ReduceOp.MIN)\n", "",
           ("tests/test_trust_weights.py", "-k", "one_ranks_shard"), timeout_s=300),
    Mutant("weights: a parameter counts as finite when any of its values is", "accum_cli/step/loop.py",
           "~torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()",
           "~torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).any()",
           ("tests/test_trust_weights.py", "-k", "one_ranks_shard")),
    Mutant("adam-eps: 0 and subnormal values accepted again", "accum_cli/config/settings.py",
           "OPTIMISATION, ge=FP32_TINY,", "OPTIMISATION, ge=0,",
           ("tests/test_trust_weights.py", "-k", "adam_eps")),
    Mutant("fp32: a float option past fp32's largest accepted", "accum_cli/config/settings.py",
           "abs(value) > FP32_MAX", "abs(value) > sys.float_info.max",
           ("tests/test_trust_weights.py", "-k", "past_fp32")),
    Mutant("remote code: a known type's auto_map dropped unsaid", "accum_cli/model/load.py",
           "    check_remote_code(source, config, trust_remote_code)\n", "",
           ("tests/test_trust_weights.py", "-k", "known_model_type")),
    Mutant("remote code: refused even with --trust-remote-code", "accum_cli/model/load.py",
           "    if trust_remote_code or not isinstance(auto_map, dict) or not auto_map:",
           "    if not isinstance(auto_map, dict) or not auto_map:",
           ("tests/test_trust_weights.py", "-k", "known_model_type")),
    Mutant("recipe: a run's config.json ignores its other top-level keys", "accum_cli/config/settings.py",
           "            if key not in RUN_RECORD_KEYS:", "            if False:",
           ("tests/test_trust_weights.py", "-k", "top_level_key")),
    # --- trust, round three (issue 37), part C -------------------------------------------------
    Mutant("folders: a link at one of our names (trackers/) written through", "accum_cli/rundir/outdir.py",
           "    names = [name for name in OWN_NAMES if (out / name).is_symlink()]", "    names = []",
           ("tests/test_trust_folders.py", "-k", "trackers_link")),
    Mutant("folders: a link at the top of trackers/ (a tracker's folder) written through", "accum_cli/rundir/outdir.py",
           '            linked = [f"{TRACKERS}/{p.name}" for p in sorted(trackers.iterdir()) if p.is_symlink()]',
           "            linked = []", ("tests/test_trust_folders.py", "-k", "trackers_link")),
    Mutant("folders: a folder at trackers/ids.json reaches the rename over it", "accum_cli/rundir/outdir.py",
           "    wrong = _wrong_kind(out)\n", "    wrong = None\n",
           ("tests/test_trust_folders.py", "-k", "ids_json_that_is_a_folder")),
    Mutant("folders: a sent_until past every step of the run believed", "accum_cli/rundir/tracking.py",
           "if type(stored) is not int or not 0 <= stored <= max(logged, _run_steps(output_dir)):",
           "if type(stored) is not int:", ("tests/test_trust_folders.py", "-k", "sent_until")),
    Mutant("folders: a checkpoint's step edited away from its folder's name believed",
           "accum_cli/rundir/checkpoint_meta.py", "    if named is not None and named != meta.step:", "    if False:",
           ("tests/test_trust_folders.py", "-k", "edited_together and folder")),
    Mutant("folders: a checkpoint's step below its optimizer state's steps believed", "accum_cli/rundir/checkpoint.py",
           "    if taken.item() > meta.step:", "    if False:",
           ("tests/test_trust_folders.py", "-k", "edited_together and optimizer")),
    Mutant("folders: samples consumed before a run's step 0 believed", "accum_cli/rundir/checkpoint_meta.py",
           " or (origin_step == 0 and origin_samples != 0):", ":",
           ("tests/test_trust_folders.py", "-k", "edited_together and origin")),
    Mutant("folders: a cache's seq_len believed over --seq-len", "accum_cli/data/cache.py",
           '    if meta.get("seq_len") != options.seq_len:', "    if False:",
           ("tests/test_trust_folders.py", "-k", "edited_data_cache and seq_len")),
    Mutant("folders: a cache's dtype believed over the vocabulary's", "accum_cli/data/cache.py",
           '    if meta.get("dtype") != dtype.name:', "    if False:",
           ("tests/test_trust_folders.py", "-k", "edited_data_cache and dtype")),
    Mutant("folders: a cache's sample count believed over its files' sizes", "accum_cli/data/cache.py",
           "        if size != count * element.itemsize:", "        if False:",
           ("tests/test_trust_folders.py", "-k", "edited_data_cache and samples")),
    Mutant("folders: a cache's ids outside the vocabulary reach the model", "accum_cli/data/cache.py",
           "    if vocab_size is None:  # unknown", "    if True:  # unknown",
           ("tests/test_trust_folders.py", "-k", "edited_data_cache and ids")),
    # --- the first hour with your own model (issue 38) ---------------------------------------
    Mutant("formats: a tokenizer that makes no tokens of the text is let through", "accum_cli/data/formats.py",
           "    if texts and not any(tokenizer(texts, add_special_tokens=False)[\"input_ids\"]):",
           "    if False:", ("tests/test_first_hour.py", "-k", "no_tokens")),
    Mutant("formats: the loss tokens --seq-len cuts are not counted", "accum_cli/data/formats.py",
           "        cut = [sum(label != IGNORE_INDEX for label in row[options.seq_len :]) for row in labels]",
           "        cut = [0] * len(ids)", ("tests/test_first_hour.py", "-k", "truncation")),
    Mutant("formats: --chat-eos adds no EOS after an answer", "accum_cli/data/formats.py",
           "        if eos not in ids[start:end]:", "        if False:", ("tests/test_first_hour.py", "-k", "chat_eos")),
    Mutant("formats: chat answers without EOS are not counted", "accum_cli/data/formats.py",
           "    eos = tokenizer.eos_token_id if fmt == \"chat\" and not options.train_on_prompt else None",
           "    eos = None", ("tests/test_first_hour.py", "-k", "chat_eos")),
    Mutant("settings: --warmup-ratio ignored", "accum_cli/config/settings.py",
           "            return math.ceil(self.warmup_ratio * total_steps)", "            return DEFAULT_WARMUP_STEPS",
           ("tests/test_first_hour.py", "-k", "warmup_ratio")),
]  # fmt: skip


def baseline_tests(ref: str, dest: Path) -> None:
    """Replace dest/tests with the tests of git commit `ref`."""
    archive = subprocess.run(["git", "archive", ref, "tests"], cwd=REPO, capture_output=True, check=True).stdout
    shutil.rmtree(dest / "tests")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")


def exists(root: Path, selection: str) -> bool:
    """A test file, or file::test, present in this copy (a baseline's tests may lack it)."""
    file, _, test = selection.partition("::")
    path = root / file
    return path.is_file() and (not test or f"def {test.split('[')[0]}(" in path.read_text())


def run(mutant: Mutant, tests_from: str | None) -> tuple[str, float]:
    source = (REPO / mutant.path).read_text()
    if source.count(mutant.original) != 1:
        return "STALE", 0.0
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(REPO, copy, ignore=COPY_IGNORE)
        if tests_from:
            baseline_tests(tests_from, copy)
        (copy / mutant.path).write_text(source.replace(mutant.original, mutant.mutated))
        args = [a for a in mutant.tests if not a.startswith("tests/") or exists(copy, a)]
        if not any(a.startswith("tests/") for a in args):
            return "SURVIVED (no such tests)", 0.0
        env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
        if mutant.path in DATA_MODULES:  # its prepared data must not land in the cache normal runs read
            env["ACCUM_TRAIN_CACHE"] = f"{tmp}/cache"
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
        started = time.monotonic()
        try:
            result = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=mutant.timeout_s)
        except subprocess.TimeoutExpired:
            return "KILLED (timeout)", time.monotonic() - started
        seconds = time.monotonic() - started
    if result.returncode == 0:
        return "SURVIVED", seconds
    if result.returncode in (4, 5):  # no tests selected, or the selection does not exist
        return "SURVIVED (no such tests)", seconds
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED tests/", "ERROR tests/"))]
    return f"KILLED by {failed[0] if failed else 'exit code ' + str(result.returncode)}", seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="run only the mutants whose name matches this regular expression")
    parser.add_argument("--tests-from", help="git commit whose tests/ to run instead of this checkout's")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    opts = parser.parse_args()
    chosen = [m for m in MUTANTS if re.search(opts.k, m.name, re.IGNORECASE)]
    if opts.list:
        for m in chosen:
            print(f"{m.name:<55} {m.path:<26} {' '.join(m.tests)}{'  [equivalent]' if m.equivalent else ''}")
        return
    outcomes = {}
    for m in chosen:
        outcome, seconds = run(m, opts.tests_from)
        outcomes[m.name] = outcome
        tag = "  [equivalent]" if m.equivalent else ""
        verdict, _, why = outcome.partition(" by ")
        print(
            f"{verdict:<26} {seconds:6.1f} s  {m.name}{tag}" + (f"\n{'':35}by {why[:150]}" if why else ""), flush=True
        )
    scored = [m for m in chosen if not m.equivalent and outcomes[m.name] != "STALE"]
    killed = sum(outcomes[m.name].startswith("KILLED") for m in scored)
    survivors = [m for m in scored if not outcomes[m.name].startswith("KILLED")]
    stale = [m.name for m in chosen if outcomes[m.name] == "STALE"]
    print()
    for m in survivors:
        print(f"survived: {m.name} ({m.path}: {m.original.strip()[:60]!r} -> {m.mutated.strip()[:60]!r})")
    for name in stale:
        print(f"stale (its original snippet is gone; update the mutant): {name}")
    equivalent = sum(1 for m in chosen if m.equivalent)
    score = f"{killed}/{len(scored)} killed ({100 * killed / max(len(scored), 1):.0f}%)"
    print(f"score: {score}; {equivalent} equivalent mutants not scored; {len(stale)} stale")
    sys.exit(1 if stale else 0)


if __name__ == "__main__":
    main()
