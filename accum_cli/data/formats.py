"""The row formats (tokens, chat, prompt-completion, text), told apart by their columns and checked
before any work; each turns a batch of raw rows into token ids and labels (-100 where a position
does not count in the loss)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from accum_cli.data.sources import Rows, rows_of
from accum_cli.data.store import IGNORE_INDEX
from accum_cli.errors import UserError, first_line


@dataclass(frozen=True, slots=True)
class Options:
    seq_len: int
    text_column: str = "text"
    packing: bool | None = None  # None: pack text, keep rows for the other formats
    train_on_prompt: bool = False
    vocab_size: int | None = None  # the model's: ids must lie below it; picks the storage type
    chat_eos: bool = False  # chat: an assistant turn without the tokenizer's EOS gets one


def stream_packed(options: Options, fmt: str) -> bool:
    """Text packed as one stream of documents cut into --seq-len blocks (the default for text)."""
    return fmt == "text" and options.packing is not False


def rows_packed(options: Options, fmt: str) -> bool:
    """--packing of chat, prompt-completion or pre-tokenised rows: stored as rows, then whole rows are
    bin-packed into --seq-len sequences with position ids of their own (packing.py)."""
    return fmt != "text" and options.packing is True


def detect_format(columns: list[str], text_column: str) -> str:
    if "input_ids" in columns:
        return "tokens"
    if "messages" in columns:
        return "chat"
    if "prompt" in columns and "completion" in columns:
        return "prompt-completion"
    if text_column in columns:
        return "text"
    raise UserError(
        f"the dataset has no column {text_column!r} (columns: {', '.join(columns)}); pass --text-column NAME, "
        "or give input_ids, messages, or prompt and completion columns"
    )


def as_rows(raw) -> Rows:
    """sources.Rows, or a datasets.Dataset made into them."""
    return raw if isinstance(raw, Rows) else rows_of(raw)


def check(raw, tokenizer, options: Options) -> str:
    """The cheap checks, on every rank before any collective, so all ranks fail alike."""
    rows = as_rows(raw)
    if rows.num_rows == 0:
        raise UserError("the dataset is empty; pass a dataset with at least one row")
    fmt = check_columns(rows.columns, rows.features, tokenizer, options)
    if fmt != "tokens":
        columns = [c for c in ("messages", "prompt", "completion", options.text_column) if c in rows.columns]
        try:
            first = next(rows.tables(columns, SAMPLE_ROWS), None)
        except Exception:  # a row that cannot be read: the preparation names it, by its index
            first = None
        if first is not None:
            check_tokenizer(tokenizer, sample_texts(first.slice(0, SAMPLE_ROWS).to_pydict(), fmt, options.text_column))
    return fmt


SAMPLE_ROWS = 8  # the rows whose text the tokenizer is tried on before any work


def sample_texts(batch: dict, fmt: str, text_column: str) -> list[str]:
    """The text of some rows (column -> values) that the format tokenises: chat turns' contents included."""
    if fmt == "chat":
        turns = [_turn(t) for messages in batch["messages"] if isinstance(messages, list) for t in messages]
        values = [t.get("content") for t in turns if isinstance(t, dict)]
    else:
        names = [text_column] if fmt == "text" else ["prompt", "completion"]
        values = [value for name in names for value in batch[name]]
    return [v for v in values if isinstance(v, str) and v.strip()]


def check_tokenizer(tokenizer, texts: list[str]) -> None:
    """A tokenizer that makes no tokens of the data's text is refused: every row would be empty, and the run would
    end blaming the labels. A model folder holding another model's tokenizer files loads so (transformers builds an
    empty tokenizer of the config's class)."""
    if texts and not any(tokenizer(texts, add_special_tokens=False)["input_ids"]):
        raise UserError(
            f"the tokenizer ({type(tokenizer).__name__}, vocabulary {len(tokenizer):,}) turns the dataset's text "
            "into no tokens; put the tokenizer files that belong to the model in the --model folder"
        )


def check_columns(columns: list[str], features, tokenizer, options: Options) -> str:
    """The format and what it needs, from the columns (and their types, when the schema is known)."""
    fmt = detect_format(columns, options.text_column)
    if fmt != "tokens" and tokenizer is None:
        raise UserError("the model folder has no tokenizer to tokenise text; add one or pass a dataset with input_ids")
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UserError("the dataset has a messages column but the tokenizer has no chat template; add one")
    if features is not None:  # a stream of text files has no schema: its rows are checked as they come
        _check_column_types(features, fmt, options.text_column)
    return fmt


def _check_column_types(features, fmt: str, text_column: str) -> None:
    """Column types, from the schema alone: a text column of numbers, token ids that are strings."""
    text_columns = {"text": [text_column], "prompt-completion": ["prompt", "completion"]}.get(fmt, [])
    for name in text_columns:
        dtype = getattr(features[name], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise UserError(
                f"column {name!r} holds {_type_name(features[name])}, not text; pass --text-column NAME of a text column"
            )
    if fmt == "tokens":
        for name in ("input_ids", "labels", "attention_mask"):
            if name in features:
                inner = getattr(features[name], "feature", None)
                # "null": every list is empty (refused later, as data with nothing to learn)
                if not str(getattr(inner, "dtype", "")).startswith(("int", "uint", "bool", "null")):
                    raise UserError(
                        f"column {name!r} holds {_type_name(features[name])}; it must hold lists of integer token ids"
                    )


def _type_name(feature) -> str:
    inner = getattr(feature, "feature", None)
    if inner is not None:
        return f"lists of {getattr(inner, 'dtype', type(inner).__name__)}"
    return str(getattr(feature, "dtype", type(feature).__name__))


class BadRow(Exception):
    """A row that cannot be trained on: its index in the batch and the problem."""

    def __init__(self, index: int, problem: str):
        super().__init__(problem)
        self.index, self.problem = index, problem


def _texts(batch, column: str) -> list[str]:
    values = batch[column]
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise BadRow(i, f"column {column!r} is {'null' if value is None else type(value).__name__}, not text")
    return values


def _tokens(batch, tokenizer, options: Options):
    ids = batch["input_ids"]
    labels = batch.get("labels")
    masks = batch.get("attention_mask")
    for i, row in enumerate(ids):
        if row is None:
            raise BadRow(i, "input_ids is null")
        for name, other in (("labels", labels), ("attention_mask", masks)):
            if other is not None and (other[i] is None or len(other[i]) != len(row)):
                size = "null" if other[i] is None else f"{len(other[i])} long"
                raise BadRow(i, f"{name} is {size} but input_ids holds {len(row)} tokens")
    if masks is not None:  # positions the data itself masks out are padding: drop them
        for i, mask in enumerate(masks):
            if not all(m in (0, 1) for m in mask):  # a null would drop its token silently
                raise BadRow(i, "attention_mask holds a value other than 0 and 1")
        ids = [[t for t, m in zip(row, mask, strict=True) if m] for row, mask in zip(ids, masks, strict=True)]
        if labels is not None:
            labels = [[t for t, m in zip(row, mask, strict=True) if m] for row, mask in zip(labels, masks, strict=True)]
    return ids, labels


def _text(batch, tokenizer, options: Options):
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = tokenizer(_texts(batch, options.text_column), add_special_tokens=False)["input_ids"]
    for row in ids:  # in place: a copy per document costs as much as converting it
        row.extend(eos)
    return ids, None


def _template(tokenizer, messages, row: int, **kwargs) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    except Exception as exc:  # the template's own raise_exception (roles must alternate, ...), jinja errors
        raise BadRow(row, f"the chat template cannot render it ({first_line(exc)})") from None
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _turn(turn):
    """A turn as a dict. Where the turns of a file have differing keys (a `name`, tool calls),
    `datasets` types them as JSON, and Arrow hands each over as its JSON text: decoded here, as
    streaming already gives them."""
    if isinstance(turn, str):
        try:
            return json.loads(turn)
        except ValueError:
            return turn  # plain text, not a turn: refused below
    return turn


def _chat(batch, tokenizer, options: Options):
    eos = tokenizer.eos_token_id if options.chat_eos else None
    all_ids, all_labels = [], []
    for row, messages in enumerate(batch["messages"]):
        if isinstance(messages, list):
            messages = [_turn(m) for m in messages]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise BadRow(row, "messages is not a list of turns, each with a role")
        if not messages:
            raise BadRow(row, "messages is empty: a conversation needs at least one turn")
        ids = _template(tokenizer, messages, row)
        if options.train_on_prompt:
            labels = list(ids)
        else:
            # The tokens an assistant turn adds: the conversation up to and including it, minus
            # the conversation before it with the generation prompt (so the header is not counted).
            labels, answers = [IGNORE_INDEX] * len(ids), []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                start = len(_template(tokenizer, messages[:i], row, add_generation_prompt=True)) if i else 0
                end = len(_template(tokenizer, messages[: i + 1], row))
                if _template(tokenizer, messages[: i + 1], row) != ids[:end]:
                    raise UserError(
                        "the chat template does not render conversations prefix by prefix; use --train-on-prompt"
                    )
                labels[start:end] = ids[start:end]
                answers.append((start, end))
            if eos is not None:
                ids, labels = _answers_end_with(eos, ids, labels, answers)
        all_ids.append(ids)
        all_labels.append(labels)
    return all_ids, all_labels


def _answers_end_with(eos: int, ids: list[int], labels: list[int], answers: list[tuple[int, int]]):
    """--chat-eos: the tokenizer's EOS after each answer (the tokens spans [start, end) of the assistant
    turns) that holds none, counted in the loss as the answer's own last token: what teaches a model
    to stop where its chat template ends a turn with a marker of its own."""
    out_ids, out_labels, at = [], [], 0
    for start, end in answers:
        out_ids += ids[at:end]
        out_labels += labels[at:end]
        if eos not in ids[start:end]:
            out_ids.append(eos)
            out_labels.append(eos)
        at = end
    return out_ids + ids[at:], out_labels + labels[at:]


def _prompt_completion(batch, tokenizer, options: Options):
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    prompts = tokenizer(_texts(batch, "prompt"), add_special_tokens=False)["input_ids"]
    completions = tokenizer(_texts(batch, "completion"), add_special_tokens=False)["input_ids"]
    ids, labels = [], []
    for p, c in zip(prompts, completions, strict=True):
        ids.append(p + c + eos)
        labels.append(p + c + eos if options.train_on_prompt else [IGNORE_INDEX] * len(p) + c + eos)
    return ids, labels


BUILDERS = {"tokens": _tokens, "text": _text, "chat": _chat, "prompt-completion": _prompt_completion}


def row_error(row: int, problem: str, fix: str = "fix or remove that row") -> UserError:
    """The one-line refusal of a dataset row, by its index in the dataset."""
    return UserError(f"row {row} of the dataset (counting from 0): {problem}; {fix}")


def make_rows(batch, tokenizer, options: Options, fmt: str, packed: bool, first_row: int = 0):
    """Raw rows -> token ids and labels per row, truncated to seq_len unless they will be packed; what the truncation
    cut (which rows, the loss tokens past seq_len) and each row's length before it."""
    try:
        ids, labels = BUILDERS[fmt](batch, tokenizer, options)
    except BadRow as exc:
        raise row_error(first_row + exc.index, exc.problem) from None
    labels = ids if labels is None else labels
    # A conversation whose answers hold no EOS teaches a model that never stops (the header warns).
    eos = tokenizer.eos_token_id if fmt == "chat" and not options.train_on_prompt else None
    no_eos = [eos is not None and any(x != IGNORE_INDEX for x in row) and eos not in row for row in labels]
    truncated, cut, lengths = [False] * len(ids), [0] * len(ids), [len(row) for row in ids]
    if not packed and (fmt != "tokens" or options.packing is False):
        truncated = [length > options.seq_len for length in lengths]
        # the positions past seq_len that counted in the loss: what the truncation takes from the training
        cut = [sum(label != IGNORE_INDEX for label in row[options.seq_len :]) for row in labels]
        ids = [row[: options.seq_len] for row in ids]
        labels = [row[: options.seq_len] for row in labels]
    return {"input_ids": ids, "labels": labels, "truncated": truncated, "cut_loss_tokens": cut, "lengths": lengths,
            "without_eos": no_eos}  # fmt: skip
