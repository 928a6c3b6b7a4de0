"""bench/replicate.py's arguments (the benchmark itself is run by hand: no timing here)."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_replicate", Path(__file__).resolve().parents[1] / "bench" / "replicate.py"
)
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def test_defaults_compare_all_four_in_fp32():
    args = bench.parse_args([])
    assert args.contestants == list(bench.CONTESTANTS)
    assert args.precision == "fp32" and args.nproc == 2 and args.child is None


def test_subset_and_bf16_are_accepted():
    args = bench.parse_args(["--contestants", "accum-train, ddp-no-sync", "--precision", "bf16", "--out", "x.json"])
    assert args.contestants == ["accum-train", "ddp-no-sync"]
    assert args.precision == "bf16" and args.out == Path("x.json")


def test_quick_shrinks_the_model():
    args = bench.parse_args(["--quick"])
    assert args.rounds == 1 and args.hidden == 64


@pytest.mark.parametrize(
    "argv",
    [["--contestants", "megatron"], ["--nproc", "1"], ["--hidden", "100"], ["--steps", "0"], ["--precision", "fp16"]],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
