"""samples.jsonl: what the model wrote for the --sample-prompts as it trained.

One record per prompt per sample step: {"step", "samples" (sequences trained on), "tokens"
(tokens trained on, padding excluded), "prompt" (as the file holds it: a line of text, or the
chat turns), "completion" (the decoded tokens, special ones included), "completion_ids"}. Rank 0
appends the records, prints a short block and sends the trackers the same as text (tracking.py).

On resume: the records up to the checkpoint's step stay, the later ones go (`keep_until`), and
the resumed run writes those steps again, as metrics.jsonl does. A sample step is written before
that step's checkpoint (or a preemption's), so a checkpoint's own samples are never lost, and no
step is there twice. A redone step gives the same completions from the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from accum_cli import safe_json
from accum_cli.rundir.metrics import keep_records_until, print_lines

FILE = "samples.jsonl"
SHOWN_CHARS = 70  # of a prompt and of its completion, in the console's block


def keep_until(output_dir: Path, step: int) -> None:
    """On resume from a checkpoint after `step` steps: drop the later records (about to be redone) and any torn line."""
    keep_records_until(output_dir / FILE, step)


def tokens_before(output_dir: Path) -> int:
    """The tokens metrics.jsonl counts so far: those a resumed run trained on before this attempt."""
    path = output_dir / "metrics.jsonl"
    total = 0
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            tokens = safe_json.loads(line).get("tokens")
        except (ValueError, AttributeError):
            continue
        total += tokens if type(tokens) is int else 0
    return total


class SampleLog:
    """Rank 0's samples.jsonl, console block and tracker text; `write` does nothing on other ranks."""

    def __init__(self, output_dir: Path, prompts, tokenizer, enabled: bool):
        self.path, self.prompts, self.tokenizer, self.enabled = output_dir / FILE, prompts, tokenizer, enabled
        self.tokens_before = tokens_before(output_dir) if enabled else 0

    def write(self, step: int, samples: int, tokens: int, completions: list[list[int]], trackers) -> None:
        """The completions after optimizer step `step`, `samples` sequences and `tokens` tokens of this attempt."""
        if not self.enabled:
            return
        records = []
        for prompt, ids in zip(self.prompts.prompts, completions, strict=True):
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            records.append({"step": step, "samples": samples, "tokens": self.tokens_before + tokens,
                            "prompt": prompt.shown(), "completion": text, "completion_ids": ids})  # fmt: skip
        try:
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        except OSError as exc:  # a full disk: samples are a view of the training, never worth stopping it for
            # (a torn last line is dropped on resume, keep_records_until)
            print(
                f"note: samples.jsonl not written at step {step} ({exc.strerror or exc}); training goes on", flush=True
            )
        lines = []
        for r in records:
            lines += [f"> {_short(r['prompt'])}", f"  {_short(r['completion'])}"]
        print_lines(lines, f"samples after step {step}")
        trackers.log_samples(step, [(_text(r["prompt"]), r["completion"]) for r in records])


def _text(prompt: str | list) -> str:
    """A prompt as one text: a chat's turns as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{turn.get('role')}: {turn.get('content', '')}" for turn in prompt)


def _short(value: str | list) -> str:
    """One line of at most SHOWN_CHARS (JSON-quoted: newlines and control characters stay visible); a
    chat prompt shows its last turn."""
    text = json.dumps(_text(value[-1:]) if isinstance(value, list) else value, ensure_ascii=False)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
