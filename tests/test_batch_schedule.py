"""--batch-schedule: the grammar, the refusals (one line, exit 2), and the stages as they run."""

from __future__ import annotations

import pytest
from helpers import run_cli

from accum_cli.config import batch_schedule as bs
from accum_cli.config.settings import MAX_GLOBAL_BATCH, as_recipe, build_config
from accum_cli.errors import UserError


def error_line(result) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("accum-train: error: "), result.stderr
    return lines[0]


def test_the_bound_is_the_configs():
    assert bs.MOST == MAX_GLOBAL_BATCH


@pytest.mark.parametrize(
    "text, unit, stages",
    [("0:256,2B:512,4B:1024", bs.TOKENS, [(0, 256), (2 * 10**9, 512), (4 * 10**9, 1024)]),
     ("0:768 250B:1536", bs.TOKENS, [(0, 768), (250 * 10**9, 1536)]),  # Megatron-LM's spaces
     (" 0:4 , 1.5K:8 ", bs.TOKENS, [(0, 4), (1500, 8)]),
     ("0:4,500s:8,1000S:16", bs.STEPS, [(0, 4), (500, 8), (1000, 16)]),
     ("0s:4,3s:8", bs.STEPS, [(0, 4), (3, 8)]),
     ("0:256K,1M:512K", bs.TOKENS, [(0, 2000), (10**6, 4000)]),  # batches in tokens: / seq len 128
     ("0:64", bs.TOKENS, [(0, 64)])],
)  # fmt: skip
def test_grammar(text, unit, stages):
    schedule = bs.parse(text, 128, MAX_GLOBAL_BATCH)
    assert schedule.unit == unit
    assert [(s.threshold, s.global_batch) for s in schedule.stages] == stages


@pytest.mark.parametrize(
    "text, message",
    [("", "is empty"), ("  ,", "is empty"), ("256", "not THRESHOLD:BATCH"),
     ("1K:4,2K:8", "the first stage must start at 0"),
     ("0:8,1K:4", "'1K:4' has a batch of 4 sequences, smaller than the 8 before it"),
     ("0:8,1K:8", "the same as the 8 before it"),
     ("0:4,2K:8,1K:16", "'1K:16' starts before the stage before it"),
     ("0:4,1K:8,1K:16", "'1K:16' starts where the stage before it"),
     ("0:4,1K:8,5s:16", "mixes thresholds in tokens and in steps"),
     ("0:1000", "batch 1000 must be between"),  # fine; see the next
     ("0:3K", "batch 3K (3,000 tokens) is not a whole number of --seq-len 128 sequences (23.4375); use 2944 or 3072"),
     ("0:0", "must be between 1 and"), ("0:4,xs:8", "threshold 'xs' is neither tokens"),
     ("0:4,1K:8X", "batch '8X' is neither sequences"), ("0:4,-1:8", "threshold '-1' is neither")],
)  # fmt: skip
def test_bad_schedules_are_refused(text, message):
    if text == "0:1000":
        bs.parse(text, 128, 1000)  # at the bound: taken
        with pytest.raises(UserError, match=message):
            bs.parse(text, 128, 999)
        return
    with pytest.raises(UserError) as caught:
        bs.parse(text, 128, MAX_GLOBAL_BATCH)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_tokens_need_a_seq_len():
    with pytest.raises(UserError, match="batch 4M is in tokens and needs --seq-len"):
        bs.parse("0:4M", None, MAX_GLOBAL_BATCH)
    assert bs.parse("0:4,2K:8", None, MAX_GLOBAL_BATCH).largest == 8  # token thresholds use the run's seq len


def test_a_stage_starts_at_the_first_step_at_or_after_its_threshold():
    schedule = bs.parse("0:4,1K:8,2K:16", None, MAX_GLOBAL_BATCH)  # seq len 100: 1,000 tokens are 10 samples
    segments = schedule.segments(100, max_steps=6)
    # steps begin at samples 0, 4, 8 (stage 0), 12 (>= 10: stage 1), 20 (>= 20: stage 2), 36
    assert [(g.first_step, g.first_sample, g.global_batch, g.steps) for g in segments] == [
        (0, 0, 4, 3), (3, 12, 8, 1), (4, 20, 16, 2)]  # fmt: skip
    for g in segments:
        for k in range(g.steps):
            assert schedule.batch_at(g.first_step + k, g.first_sample + k * g.global_batch, 100) == g.global_batch


def test_a_stage_a_step_jumps_over_never_runs():
    schedule = bs.parse("0:10,1050:20,1100:40", None, MAX_GLOBAL_BATCH)  # seq len 100: 10.5 and 11 samples
    segments = schedule.segments(100, max_steps=3)  # steps begin at samples 0, 10 (< 10.5), 20 (>= 11)
    assert [(g.stage, g.global_batch, g.steps) for g in segments] == [(0, 10, 2), (2, 40, 1)]


def test_the_length_in_samples_takes_whole_steps_only():
    schedule = bs.parse("0:4,2s:8", None, MAX_GLOBAL_BATCH)
    assert [(g.global_batch, g.steps) for g in schedule.segments(10, max_samples=30)] == [(4, 2), (8, 2)]
    assert [(g.global_batch, g.steps) for g in schedule.segments(10, max_samples=31)] == [(4, 2), (8, 2)]
    assert schedule.segments(10, max_samples=3) == []
    # resumed mid-stage: the same stages from there
    assert [(g.first_step, g.global_batch, g.steps) for g in schedule.segments(10, 1, 4, max_steps=4)] == [
        (1, 4, 1), (2, 8, 2)]  # fmt: skip
    assert schedule.segments(10)[-1].steps is None  # no length: the last stage runs on


def test_lr_scale_is_the_square_root_of_the_increase():
    schedule = bs.parse("0:256,1B:1024", None, MAX_GLOBAL_BATCH)
    assert schedule.lr_scale(1024, bs.LR_SQRT) == 2.0 and schedule.lr_scale(256, bs.LR_SQRT) == 1.0
    assert schedule.lr_scale(1024, bs.LR_NONE) == 1.0


def test_the_config_plans_for_the_largest_stage_and_prints_the_schedule():
    cfg = build_config(None, {"batch_schedule": "0:4,1K:8", "seq_len": 64, "max_tokens": "4K"})
    assert cfg.global_batch == 8
    text = as_recipe(cfg, "# head")
    assert "batch_schedule: 0:4,1K:8" in text and "global_batch:" not in text and "max_tokens: 4K" in text


@pytest.mark.parametrize(
    "args, message",
    [(["--batch-schedule", "0:4,1K:8", "--global-batch", "8"], "--batch-schedule and --global-batch both given"),
     (["--batch-schedule", "0:4,1K:8", "--global-batch-tokens", "1K"], "--batch-schedule and --global-batch-tokens"),
     (["--batch-schedule", "0:8,1K:4"], "each stage must raise the global batch"),
     (["--batch-schedule", ""], "--batch-schedule is empty"),
     (["--batch-schedule-lr", "sqrt"], "--batch-schedule-lr sqrt needs --batch-schedule"),
     (["--max-tokens", "1K", "--max-steps", "3"], "--max-steps and --max-tokens both given"),
     (["--max-tokens", "1.5"], "--max-tokens 1.5 is 1.5 tokens, not a whole number"),
     (["--batch-schedule", "0:4,1K:64", "--world-size", "8"],
      "--batch-schedule stage 1 (4 sequences): --global-batch 4 is smaller than the world size 8"),
     (["--batch-schedule", "0:12,1K:64", "--world-size", "8", "--strict-batch", "--micro-batch", "2"],
      "--batch-schedule stage 1 (12 sequences): --strict-batch: global batch 12 is not a multiple")],
)  # fmt: skip
def test_refused_in_one_line(args, message):
    result = run_cli([*args, "--seq-len", "64", "--plan"])
    assert message in error_line(result) and result.stdout == ""  # before any plan or estimate


def test_recipe_layers(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("batch_schedule: 0:4,1K:8\nglobal_batch: 16\n")
    with pytest.raises(UserError, match="keys batch_schedule and global_batch both given; keep one"):
        build_config(str(recipe), {})
    recipe.write_text("batch_schedule: 0:4,1K:8\n")
    assert build_config(str(recipe), {}).global_batch == 8
    assert build_config(str(recipe), {"global_batch": 32}).batch_schedule is None  # a flag replaces the recipe's
    recipe.write_text("global_batch: 16\n")
    assert build_config(str(recipe), {"batch_schedule": "0:4,1K:8"}).global_batch == 8


def test_the_length_from_epochs_or_max_tokens_is_whole_steps_of_the_stages():
    from accum_cli.config.plan import Plan
    from accum_cli.run.planning import run_length

    cfg = build_config(None, {"batch_schedule": "0:5,2s:9"})
    schedule, plan = bs.of_config(cfg), Plan(9, 4, 1)
    steps, segments = run_length(cfg, schedule, None, 38, 40, plan)  # one epoch of 40: 5+5+9+9+9 = 37
    assert steps == 5 and [(g.global_batch, g.steps) for g in segments] == [(5, 2), (9, 3)]
    cfg = build_config(None, {"batch_schedule": "0:5,2s:9", "max_tokens": "1K"})  # 1000 // 38 = 26 samples
    assert run_length(cfg, schedule, None, 38, 40, plan)[0] == 3
    with pytest.raises(UserError, match=r"--max-tokens 100 \(2 sequences of 38 tokens\) holds no whole step"):
        run_length(
            build_config(None, {"batch_schedule": "0:5,2s:9", "max_tokens": "100"}), schedule, None, 38, 40, plan
        )
    cfg = build_config(None, {"global_batch": 8, "max_tokens": "1K"})  # no schedule: whole steps of the batch
    assert run_length(cfg, None, None, 38, 40, Plan(8, 4, 1)) == (3, [])


def test_verify_refuses_a_schedule():
    line = error_line(run_cli(["verify", "--batch-schedule", "0:4,1K:8", "--seq-len", "64"]))
    assert "verify checks the first steps at one global batch; drop --batch-schedule" in line
