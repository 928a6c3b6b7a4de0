"""The first hour with your own model (issue 38): a tokenizer that makes nothing of the text is refused naming
it, truncation is counted in loss tokens, and the warmup may be a share of the run. Real tiny models saved to a
folder, real dataset files, the real CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import read_metrics, run_cli, save_tiny_model
from typer.testing import CliRunner

from accum_cli.cli.main import app


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("first-hour")
    save_tiny_model(root / "model")
    rows = {  # ByT5 makes one token of each byte: 19 + 60 + EOS = 80 tokens, 61 of them in the loss
        "answers.jsonl": [{"prompt": f"question number {i:03d}", "completion": "an answer " * 6} for i in range(16)],
        "late-answers.jsonl": [
            {"prompt": "a long question " * 3 + f"{i:02d}", "completion": "x" * 60} for i in range(16)
        ],  # fmt: skip
        "text.jsonl": [{"text": f"some text to learn from, row {i}"} for i in range(16)],
    }
    for name, content in rows.items():
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in content))
    return root


def args(root: Path, out: Path, data: str, *extra: str) -> list[str]:
    return ["--model", str(root / "model"), "--dataset", str(root / data), "--global-batch", "4",
            "--micro-batch", "2", "--max-steps", "1", "--output-dir", str(out), *extra]  # fmt: skip


def one_line_error(result) -> str:
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_a_tokenizer_that_makes_no_tokens_of_the_text_is_refused_naming_its_class(root, tmp_path):
    """A Qwen2 config saved beside a ByT5 tokenizer loads as an empty Qwen2Tokenizer that turns text into []:
    refused before any work, naming it, where it used to end in a refusal that blamed the labels."""
    from transformers import ByT5Tokenizer, Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path / "qwen2-with-byt5-files"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)  # fmt: skip
    ByT5Tokenizer().save_pretrained(folder)
    for data in ("text.jsonl", "answers.jsonl"):
        out = tmp_path / data
        line = one_line_error(run_cli([*args(root, out, data), "--model", str(folder)]))
        assert line.startswith("accum-train: error: the tokenizer (Qwen2Tokenizer, vocabulary "), line
        assert "turns the dataset's text into no tokens; put the tokenizer files that belong to the model" in line
        assert not out.exists()


def test_truncation_is_counted_in_loss_tokens_warned_about_and_named_when_it_takes_every_one(root, tmp_path):
    result = run_cli(args(root, tmp_path / "cut", "answers.jsonl", "--seq-len", "40"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tokenizer         ByT5Tokenizer, vocabulary 384" in result.stdout
    # each row: 61 positions counted, 40 of them past the 40th token
    cut = "truncated         16 documents longer than --seq-len: 66% of the loss tokens cut away (640 of 976)"
    assert cut in result.stdout, result.stdout
    assert "warning           --seq-len cuts away 66% of what the loss counts, the ends of answers first; raise " \
           "--seq-len (the longest row holds 80 tokens)" in result.stdout  # fmt: skip
    kept = run_cli(args(root, tmp_path / "kept", "answers.jsonl", "--seq-len", "79"))  # only the EOS cut
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "longer than --seq-len: 2% of the loss tokens cut away (16 of 976)" in kept.stdout, kept.stdout
    assert "warning " not in kept.stdout
    # every answer starts past --seq-len: the refusal names --seq-len and the longest row, not the labels only
    line = one_line_error(run_cli(args(root, tmp_path / "none", "late-answers.jsonl", "--seq-len", "40")))
    assert "no position of the dataset counts in the loss once --seq-len 40 cuts the rows: every counted " \
           "position lies past it (the longest row holds 111 tokens); raise --seq-len" in line, line  # fmt: skip


def test_warmup_ratio_is_a_share_of_the_runs_steps_from_a_flag_or_a_recipe(root, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("warmup_ratio: 0.5\nlr: 1.0e-3\nlr_schedule: constant\n")
    out = tmp_path / "run"
    extra = ("--recipe", str(recipe), "--max-steps", "4", "--seq-len", "16")
    result = run_cli([*args(root, out, "text.jsonl"), *extra])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "constant, 2 warmup steps (--warmup-ratio 0.5)" in result.stdout, result.stdout
    assert [m["lr"] for m in read_metrics(out)] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])
    recorded = json.loads((out / "config.json").read_text())["config"]
    assert (recorded["warmup_ratio"], recorded["warmup_steps"]) == (0.5, None)
    for flags, message in ((["--warmup-ratio", "0.1", "--warmup-steps", "2"], "--warmup-steps and --warmup-ratio "
                            "both given; pick one"), (["--warmup-ratio", "1"], "--warmup-ratio must lie in [0, 1), got 1.0")):  # fmt: skip
        bad = CliRunner().invoke(app, [*args(root, tmp_path / "bad", "text.jsonl"), *flags])
        assert bad.exit_code == 2 and bad.output.strip() == f"accum-train: error: {message}", bad.output


def test_answers_without_eos_are_warned_about_and_chat_eos_ends_each_with_it(tmp_path):
    """A chat template that ends turns with a marker of its own (here a newline) never shows the model
    its EOS: the header warns and names --chat-eos, which adds the EOS after each answer that holds
    none, counted in the loss (one more loss token per answer); a template ending answers with the EOS
    gets no warning and nothing added."""
    from helpers import CHAT_TEMPLATE

    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                    {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": conversation}) + "\n" for _ in range(8)))
    with_eos = CHAT_TEMPLATE.replace("{{ m['content'] }}\n", "{{ m['content'] }}{{ eos_token }}")  # EOS for "\n"
    counted = {}
    for name, template, extra in [("marker", CHAT_TEMPLATE, ()), ("appended", CHAT_TEMPLATE, ("--chat-eos",)),
                                  ("eos", with_eos, ())]:  # fmt: skip
        model = save_tiny_model(tmp_path / f"model-{name}", chat_template=template)
        result = run_cli(["--model", str(model), "--dataset", str(data), "--global-batch", "4", "--micro-batch", "2",
                          "--max-steps", "1", "--output-dir", str(tmp_path / name), *extra])  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        warned = "8 of 8 conversations' answers hold no EOS" in result.stdout and "--chat-eos" in result.stdout
        assert warned == (name == "marker"), (name, result.stdout)
        counted[name] = int(result.stdout.split(" in the loss)")[0].rsplit("(", 1)[1].replace(",", ""))
    assert counted["appended"] == counted["marker"] + 8 * 2, counted  # an EOS after each of the two answers
    assert counted["eos"] == counted["marker"], counted  # its EOS in the newline's place: nothing added


def header(stdout: str) -> list[str]:
    """The lines printed before the first step, section rules included."""
    lines = stdout.splitlines()
    return lines[: next(i for i, line in enumerate(lines) if line.startswith("step 1/"))]


def test_the_header_fits_a_glance_and_verbose_has_every_detail(root, tmp_path):
    """About 12 lines by default: the plan, then one line per thing a user checks (model, tokenizer, data,
    training, device, layout, precision, output), nothing about wrapping or the heap; `--verbose` prints
    them all. Rows are not packed: tokens per step is a bound, and step 1 says what it held. The closing
    summary names every artefact the run wrote."""
    out = tmp_path / "short"
    result = run_cli(
        [*args(root, out, "answers.jsonl"), "--report-to", "tensorboard"], env_extra={"ACCUM_TRAIN_REPORT": "1"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    short = header(result.stdout)
    assert len(short) <= 13, "\n".join(short)
    labels = [line.split()[0] for line in short if not line.startswith("──")]
    for label in ("global", "accumulation", "model", "tokenizer", "data", "training", "device", "layout",
                  "precision", "output"):  # fmt: skip
        assert label in labels, "\n".join(short)
    for detail in ("host memory", "wrapped", "sharding", "tokenisation", "format   ", "attention   "):
        assert not [line for line in short if line.strip().startswith(detail)], detail
    assert "tokens at most 1,024 (4 x seq len 256): rows are as long as they are" in short[1]
    step_one = re.search(r"tokens per step   ([\d,]+) in step 1, of at most 1,024", result.stdout)
    assert step_one and int(step_one[1].replace(",", "")) == read_metrics(out)[0]["tokens"], result.stdout
    done = result.stdout.split("── done")[1]
    for artefact in ("final", "checkpoints/step-000001", "metrics.jsonl", "report.png", "config.json",
                     "trackers (tensorboard)"):  # fmt: skip
        assert f"{out}/{artefact}" in done, (artefact, done)

    verbose = run_cli(
        [*args(root, tmp_path / "verbose", "answers.jsonl"), "--verbose"], env_extra={"ACCUM_TRAIN_REPORT": "0"}
    )
    assert verbose.returncode == 0, verbose.stdout + verbose.stderr
    assert not (tmp_path / "verbose" / "report.png").exists() and "report.png" not in verbose.stdout  # not drawn
    full = "\n".join(header(verbose.stdout))
    for detail in ("wrapped ", "tokenisation ", "format            prompt-completion", "attention    "):
        assert detail in full, (detail, full)
    assert len(header(verbose.stdout)) > len(short) + 8


def test_a_zero_weight_pass_is_mentioned_only_where_a_microbatch_is_empty():
    from accum_cli.config.plan import Plan

    assert "zero-weight" not in "\n".join(Plan(11, 3, 2).describe())  # ranks of 6 and 5: 3 + 3 and 3 + 2
    assert "zero-weight" not in "\n".join(Plan(11, 2, 2).describe())  # 2 + 2 + 2 and 2 + 2 + 1
    assert "zero-weight" in "\n".join(Plan(9, 2, 2).describe())  # ranks of 5 and 4: 2+2+1 and 2+2+0
