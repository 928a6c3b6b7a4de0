"""--sample-prompts: the prompts a run completes as it trains, read and checked before any work.

A file named *.jsonl or *.json holds one JSON object a line, `{"messages": [{"role": ..., "content":
...}, ...]}`, rendered by the tokenizer's chat template with the generation prompt (the answer's
header), as an assistant turn is asked for. Any other file holds one prompt a line, plain text,
tokenised as the training's text is (no special tokens added). Blank lines are skipped. The file is
only read: never executed, moved or removed.

`read` needs no tokenizer (the preflight, before any worker starts); `load` renders the prompts to
token ids once the tokenizer is there, and checks that each prompt and its completion fit the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accum_cli import safe_json
from accum_cli.errors import UserError, first_line

FLAG = "--sample-prompts"
CHAT_SUFFIXES = (".jsonl", ".json")
MAX_BYTES = 1 << 20  # every prompt is completed at every sample step: a bigger file is a dataset passed by mistake
EXAMPLE = '{"messages": [{"role": "user", "content": "Hello"}]}'


@dataclass(frozen=True, slots=True)
class Prompt:
    line: int  # in the file, counting from 1
    text: str | None  # a plain-text prompt
    messages: list | None  # chat turns

    def shown(self) -> str | list:
        """The prompt as the user wrote it: for samples.jsonl."""
        return self.text if self.messages is None else self.messages


@dataclass(frozen=True, slots=True)
class Prompts:
    path: str
    prompts: list[Prompt]
    ids: list[list[int]]  # each prompt's tokens, as the model reads it


def read(path_text: str) -> list[Prompt]:
    """The file's prompts; one line naming the problem and the fix otherwise."""
    path = Path(path_text).expanduser()
    fix = f"pass a text file of prompts, one per line, or a .jsonl file of lines like {EXAMPLE}"
    if not path.exists():
        raise UserError(f"{FLAG} {path_text} does not exist; {fix}")
    if not path.is_file():  # a folder, a pipe: nothing to read again at every sample step
        raise UserError(f"{FLAG} {path_text} is not a regular file; {fix}")
    if path.stat().st_size > MAX_BYTES:
        raise UserError(
            f"{FLAG} {path_text} is {path.stat().st_size:,} bytes, more than the {MAX_BYTES:,} a file of prompts "
            "needs (each is completed at every sample step); pass a few prompts"
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{FLAG} {path_text} is not UTF-8 text; save it as UTF-8") from None
    except OSError as exc:
        raise UserError(f"{FLAG} {path_text} cannot be read ({exc.strerror}); {fix}") from None
    chat = path.suffix.lower() in CHAT_SUFFIXES
    prompts = []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: a prompt may hold a form feed
        line = line.removesuffix("\r")
        if line.strip():
            prompts.append(_chat(line, number, path_text) if chat else Prompt(number, line, None))
    if not prompts:
        raise UserError(f"{FLAG} {path_text} holds no prompt; {fix}")
    return prompts


def _chat(line: str, number: int, path_text: str) -> Prompt:
    where = f"{FLAG} {path_text}, line {number}"
    try:
        row = safe_json.loads(line)
    except ValueError as exc:
        raise UserError(
            f"{where} is not JSON ({first_line(exc)[:120]}); write one object per line, e.g. {EXAMPLE} "
            "(or name the file .txt for plain-text prompts)"
        ) from None
    messages = row.get("messages") if isinstance(row, dict) else None
    if not (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise UserError(f'{where} is not a list of turns, each with a role, under "messages"; write e.g. {EXAMPLE}')
    return Prompt(number, None, messages)


def load(path_text: str | None, tokenizer, tokens: int, max_positions: int | None, vocab_size: int | None):
    """The prompts as token ids (None without --sample-prompts): each one a token at least, every id
    in the model's vocabulary, and room for `tokens` more within its positions."""
    if path_text is None:
        return None
    prompts = read(path_text)
    if tokenizer is None:
        raise UserError(f"{FLAG}: the model folder has no tokenizer to tokenise the prompts; add one")
    chat = any(p.messages is not None for p in prompts)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{FLAG} {path_text} holds chat turns but the model's tokenizer has no chat template; add one "
            "(tokenizer_config.json's chat_template) or write the prompts as plain text, one per line, in a .txt file"
        )
    ids = []
    for p in prompts:
        where = f"{FLAG} {path_text}, line {p.line}"
        if p.messages is None:
            row = tokenizer(p.text, add_special_tokens=False)["input_ids"]
        else:
            try:
                out = tokenizer.apply_chat_template(p.messages, tokenize=True, add_generation_prompt=True)
            except Exception as exc:  # the template's own raise_exception (roles must alternate, ...), jinja errors
                raise UserError(
                    f"{where}: the chat template cannot render it ({first_line(exc)[:200]}); fix the turns"
                ) from None
            row = out["input_ids"] if hasattr(out, "keys") else out
        row = [int(i) for i in row]
        if not row:
            raise UserError(f"{where} gives no tokens; write some text, or remove the line")
        if vocab_size and not all(0 <= i < vocab_size for i in row):
            raise UserError(
                f"{where} has a token id outside the model's {vocab_size} embeddings; use the model's tokenizer"
            )
        if max_positions and len(row) + tokens > max_positions:
            raise UserError(
                f"{where} has {len(row)} tokens: with --sample-tokens {tokens} more, above the model's "
                f"{max_positions} positions; shorten the prompt or lower --sample-tokens"
            )
        ids.append(row)
    return Prompts(path_text, prompts, ids)
