"""What `accum-train verify` found, for a person and for a program: per step, the relative difference
of the loss, of the gradient norm and of the parameters after the step, each next to its tolerance,
and a verdict that names the first quantity and step that differ and what usually causes it.

Tolerances. The loss and the gradient norm: fp32 1e-5, the bound every layout meets in
tests/test_equivalence.py (measured there: about 1e-7); bf16 mixed precision 1e-3 and 1e-2, as
tests/test_equivalence_bf16.py measured and justifies (4.2e-5 and 3.6e-3 at worst; the classic
normalisation bug misses the gradient norm by 0.81).

The parameters, per tensor: ||run - reference|| / ||reference||, allowed a share of how far the
steps moved the tensor (||reference - initial|| / ||reference||), at least 1e-5. AdamW moves a weight
by about lr whatever the size of its gradient, so rounding that changes a gradient element near
zero (|g| ~ eps) moves that weight by up to 2 lr: noise that grows with lr, never with the weights.
A fixed 1e-5 of the weights fails a correct fp32 run at lr 1e-2 (measured 6.1e-5, one element of
8192 off by 1.2% of lr). Measured as a share of the movement, on the tiny models of
tests/test_verify.py at lr 1e-3 and 1e-2, W=1 and 2, both layouts, 3 steps: fp32 at most 1.5e-4;
over the 21 architectures of tests/test_architectures.py, up to 3.4e-3 (OPT's ReLU fc1, whose units
alive on few tokens have gradients that cancel to near zero): fp32 is held to 1e-2, which a quarter of
a thousandth of a tensor's elements flipping would reach; bf16 at most 0.25, one flipped element of a
64-element norm weight (held to 0.5). Tensors whose whole gradient is rounding noise (NOISE_FLOOR of
the step's gradient: an attention key's bias, which softmax cancels) are left out, by name.
The classic normalisation bug moves the weights otherwise by about 1.0 of the movement; in bf16 the
gradient norm catches it first (0.22, 22 times its tolerance).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

LOSS, GRAD_NORM, PARAMETERS = "loss", "grad_norm", "parameters"
QUANTITIES = (LOSS, GRAD_NORM, PARAMETERS)
LABELS = {LOSS: "loss", GRAD_NORM: "grad norm", PARAMETERS: "parameters"}
TOLERANCE = {
    "fp32": {LOSS: 1e-5, GRAD_NORM: 1e-5, PARAMETERS: 1e-5},
    "bf16": {LOSS: 1e-3, GRAD_NORM: 1e-2, PARAMETERS: 1e-5},
}
# The parameters may also differ by this share of how far the steps moved them (module docstring).
MOVEMENT = {"fp32": 1e-2, "bf16": 0.5}
# A tensor whose gradient norm is below this share of the step's whole gradient holds rounding noise
# (fp32's 6e-8 and bf16's 4e-3 units of rounding, with room): its parameters are left out of the check.
NOISE_FLOOR = {"fp32": 1e-7, "bf16": 1e-4}


def parameter_tolerance(precision: str, moved):
    """The relative differences allowed for tensors whose steps moved them by `moved` of their norm
    (||reference - initial|| / ||reference||, a tensor of them): a share of that, at least the floor."""
    return (moved * MOVEMENT[precision]).clamp_min(TOLERANCE[precision][PARAMETERS])


# What usually makes each quantity differ first (issue 39). A loss that differs comes from the
# forward; a gradient norm that differs under an equal loss, from how the loss was normalised or the
# gradients reduced; parameters that differ under both equal, from the update.
CAUSES = {
    LOSS: [
        "a forward that mixes the samples of a batch (a norm or statistic over the batch dimension, a model's "
        "own code): a sample's loss then depends on which samples share its microbatch",
        "dropout or other randomness that the config's *dropout*/*pdrop* settings do not switch off",
        "a mixture of experts whose capacity limit drops tokens depending on the batch, or --moe-aux-loss "
        "microbatch (approximate under accumulation by design)",
        "padding that changes the result: a model that ignores the attention mask",
    ],
    GRAD_NORM: [
        "a loss averaged per microbatch (each divided by its own token count) instead of by the step's global "
        "loss-token count",
        "gradients averaged over ranks where they must be summed (a divide factor left at the world size; "
        "torch's gloo summing where it should average, pytorch issue 162338)",
        "a sync flag that does nothing or drops a microbatch's gradient (NVIDIA cosmos-framework issue 161)",
    ],
    PARAMETERS: [
        "parameters not kept equal across ranks, or a gradient the optimizer never saw (a sync flag, an unused "
        "parameter's gradient)",
        "weights tied in one model and not in the other, or weight decay on other parameters",
    ],
}


@dataclass
class Difference:
    quantity: str
    run: float | None  # the configured run's value (None for the parameters: many tensors)
    reference: float | None
    relative: float  # |run - reference| / |reference|; for the parameters the largest over tensors
    tolerance: float
    parameter: str | None = None  # the tensor with the largest difference

    @property
    def ok(self) -> bool:
        return math.isfinite(self.relative) and self.relative <= self.tolerance


def relative(run: float, reference: float) -> float:
    if not (math.isfinite(run) and math.isfinite(reference)):
        return math.inf if run != reference else 0.0
    return abs(run - reference) / max(abs(reference), 1e-30)


@dataclass
class Report:
    steps: int
    precision: str  # fp32 or bf16
    run: str  # how the configured run split and reduced the batch
    reference: str  # how the reference did
    reference_kind: str  # "one-process" or "same-ranks"
    dropout: str
    seconds: dict[str, float]
    differences: list[list[Difference]] = field(default_factory=list)  # per step

    @property
    def tolerance(self) -> dict[str, float]:
        return TOLERANCE[self.precision]

    def first_failure(self) -> tuple[int, Difference] | None:
        for step, found in enumerate(self.differences, start=1):
            for difference in found:
                if not difference.ok:
                    return step, difference
        return None

    @property
    def passed(self) -> bool:
        return self.first_failure() is None

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def verdict(self) -> str:
        failure = self.first_failure()
        if failure is None:
            n = len(self.differences)
            return (
                f"verdict           PASS: loss, gradient norm and parameters within tolerance at {n} step"
                f"{'s' if n != 1 else ''}; accumulation and sharding changed nothing measurable"
            )
        step, d = failure
        where = f" ({d.parameter})" if d.parameter else ""
        return (
            f"verdict           FAIL: the {LABELS[d.quantity]}{where} "
            f"{'differ' if d.quantity == PARAMETERS else 'differs'} at step {step}: relative difference "
            f"{d.relative:.1e} > tolerance {d.tolerance:g}"
        )

    def lines(self) -> list[str]:
        out = [
            f"run               {self.run}",
            f"reference         {self.reference}",
            f"dropout           {self.dropout}",
            f"precision         {self.precision}; tolerance (relative) loss {self.tolerance[LOSS]:g}, grad norm "
            f"{self.tolerance[GRAD_NORM]:g}, parameters {MOVEMENT[self.precision]:g} of how far the steps moved "
            f"each tensor, at least {self.tolerance[PARAMETERS]:g}",
            f"{'step':<6}{'quantity':<12}{'run':>14}{'reference':>14}{'rel diff':>11}{'tolerance':>11}  result",
        ]
        for step, found in enumerate(self.differences, start=1):
            for d in found:
                run = "" if d.run is None else f"{d.run:.7g}"
                ref = "" if d.reference is None else f"{d.reference:.7g}"
                mark = "ok" if d.ok else "DIFFERS"
                tail = f" (worst: {d.parameter})" if d.parameter else ""
                out.append(
                    f"{step:<6}{LABELS[d.quantity]:<12}{run:>14}{ref:>14}{d.relative:>11.1e}{d.tolerance:>11.1e}  "
                    f"{mark}{tail}"
                )
        t = self.seconds
        out.append(
            f"time              run {t['run_step_s']:.2f} s per step (built in {t['run_build_s']:.2f} s), reference "
            f"{t['reference_step_s']:.2f} s per step (built in {t['reference_build_s']:.2f} s); {t['total_s']:.1f} s "
            "in all"
        )
        out.append(self.verdict())
        failure = self.first_failure()
        if failure is not None:
            out.append("usual causes      " + CAUSES[failure[1].quantity][0])
            out += [f"                  {cause}" for cause in CAUSES[failure[1].quantity][1:]]
        return out

    def as_json(self) -> str:
        failure = self.first_failure()
        document = {
            "verdict": "pass" if failure is None else "fail",
            "exit_code": self.exit_code,
            "first_difference": None
            if failure is None
            else {"step": failure[0], "quantity": failure[1].quantity, "parameter": failure[1].parameter},
            "causes": [] if failure is None else CAUSES[failure[1].quantity],
            "steps": [
                {"step": step, **{d.quantity: _finite(asdict(d) | {"ok": d.ok}) for d in found}}
                for step, found in enumerate(self.differences, start=1)
            ],
            "precision": self.precision,
            "tolerance": self.tolerance | {"parameters_share_of_movement": MOVEMENT[self.precision]},
            "run": self.run,
            "reference": self.reference,
            "reference_kind": self.reference_kind,
            "dropout": self.dropout,
            "seconds": self.seconds,
        }
        return json.dumps(document)


def _finite(record: dict) -> dict:
    """JSON has no inf or NaN: such a value is written as a string."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
