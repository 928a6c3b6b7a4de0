"""The speed bench's ratio to the best peer is taken round by round (bench/speed.py)."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("speed", Path(__file__).resolve().parents[1] / "bench" / "speed.py")
speed = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(speed)


def test_each_round_is_compared_with_that_rounds_best_peer():
    runs = {"accum-train": [10.0, 12.0], "accelerate": [9.0, 13.0], "trainer": [10.0, 11.0]}
    ratios = speed.round_ratios(runs)
    assert ratios["accum-train"] == pytest.approx([1.0, 12 / 13])
    assert ratios["trainer"] == pytest.approx([1.0, 11 / 13])
    assert ratios["accelerate"] == pytest.approx([0.9, 1.0])


def test_a_slow_round_cancels_out_of_the_ratio():
    # the machine at half speed in round 2: every contestant's tokens/s halves, the ratio does not
    runs = {"accum-train": [11.0, 5.5], "trainer": [10.0, 5.0]}
    assert speed.round_ratios(runs)["accum-train"] == pytest.approx([1.1, 1.1])


def test_no_peer_no_ratio():
    assert speed.round_ratios({"accum-train": [10.0]}) == {}
