"""Property tests of the pure batch arithmetic (docs/ARCHITECTURE.md, invariants 1 and 2)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accum_cli.config.plan import Plan
from accum_cli.errors import UserError

layouts = st.tuples(st.integers(1, 4096), st.integers(1, 64), st.integers(1, 256)).filter(lambda t: t[0] >= t[2])


@settings(max_examples=300, deadline=None)
@given(layouts, st.integers(0, 5))
def test_every_sample_of_a_step_is_used_exactly_once(layout, step):
    g, m, w = layout
    plan = Plan(g, m, w)
    seen = [i for r in range(w) for j in range(plan.accum_steps) for i in plan.microbatch_range(step, r, j)]
    assert sorted(seen) == list(range(step * g, (step + 1) * g))


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_ranks_differ_by_at_most_one_sample_and_run_the_same_microbatches(layout):
    g, m, w = layout
    plan = Plan(g, m, w)
    counts = [plan.rank_samples(r) for r in range(w)]
    assert sum(counts) == g
    assert max(counts) - min(counts) <= 1
    assert {len(plan.microbatch_sizes(r)) for r in range(w)} == {plan.accum_steps}
    for r in range(w):
        sizes = plan.microbatch_sizes(r)
        assert all(0 <= s <= m for s in sizes)
        assert all(s == m for s in sizes[:-1]), "only the last microbatch may be smaller"
        assert sum(sizes) == counts[r]
    # no microbatch is wasted: the fullest rank needs every one of them
    assert (plan.accum_steps - 1) * m < max(counts) <= plan.accum_steps * m


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_divisible_layouts_have_full_microbatches(layout):
    g, m, w = layout
    plan = Plan(g, m, w)
    if plan.divisible:
        assert all(s == m for r in range(w) for s in plan.microbatch_sizes(r))
        assert plan.accum_steps == g // (m * w)
        plan.require_divisible()
    else:
        with pytest.raises(UserError, match="--global-batch"):
            plan.require_divisible()


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_strict_mode_suggestions_are_valid(layout):
    g, m, w = layout
    plan = Plan(g, m, w)
    below, above = plan.nearest_valid_global_batches()
    assert below <= max(g, m * w) and above >= g
    for suggestion in {below, above}:
        assert suggestion >= w and Plan(suggestion, m, w).divisible
    for micro in plan.valid_micro_batches():
        assert Plan(g, micro, w).divisible


def test_the_issue_example():
    plan = Plan(2048, 4, 8)
    assert plan.accum_steps == 64
    assert plan.rank_samples(0) == 256


def test_ragged_example_has_an_empty_last_microbatch():
    plan = Plan(13, 2, 2)
    assert plan.microbatch_sizes(0) == [2, 2, 2, 1]
    assert plan.microbatch_sizes(1) == [2, 2, 2, 0]
    assert plan.microbatch_range(1, 1, 0) == range(13 + 7, 13 + 9)
    assert plan.microbatch_range(1, 1, 3) == range(13 + 13, 13 + 13)
    assert "microbatch sizes [2, 2, 2, 1] / [2, 2, 2, 0]" in "\n".join(plan.describe())


def test_a_huge_plan_is_described_at_once():
    """A billion microbatches per rank: the plan's arithmetic and its description are O(1), the
    sizes shortened (the header once printed them all; building them ran out of memory)."""
    assert "microbatch sizes [4 x 833, 4] / [4 x 833, 3]" in "\n".join(Plan(10**4 + 7, 4, 3).describe())
    plan = Plan(10**12 + 7, 4, 3)
    last = plan.accum_steps - 1
    assert plan.microbatch_range(0, 2, last) == range(plan.rank_offset(2) + 4 * last, 10**12 + 7)
    assert "microbatch sizes [4 x 83333333333, 4] / [4 x 83333333333, 3]" in "\n".join(plan.describe())


@pytest.mark.parametrize(
    "g, m, w, message",
    [
        (0, 4, 1, "--global-batch must be a positive integer"),
        (8, 0, 1, "--micro-batch must be a positive integer"),
        (8, 4, 0, "--world-size must be a positive integer"),
        (-5, 4, 1, "--global-batch"),
        (2.5, 4, 1, "--global-batch"),
        (True, 4, 1, "--global-batch"),
        (3, 1, 4, "smaller than the world size"),
    ],
)
def test_impossible_inputs_are_refused(g, m, w, message):
    with pytest.raises(UserError, match=message):
        Plan(g, m, w)


def test_plan_module_is_pure():
    import subprocess
    import sys

    code = "import sys, accum_cli.config.plan, accum_cli.config.policy; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
