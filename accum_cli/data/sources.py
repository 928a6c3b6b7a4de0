"""Where the rows come from: the embedded corpus, local files, folders, globs, or the hub.

To be prepared, every source comes back as `Rows`: the rows, untouched, with their identity.
Local files are read as a stream (`datasets`' own readers, batch by batch), not converted into
an Arrow copy first: that conversion costs a second copy of the corpus on disk and memory that
grows with it. When streaming (--streaming), a `datasets.IterableDataset`. Formats are told
apart and tokenised in prepare.py (stream.py when streaming).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from accum_cli.errors import UserError, first_line

FILE_BUILDERS = {
    ".txt": "text",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows to prepare, read in order: what preparation must know before it reads them."""

    tables: Callable[[list[str], int], Iterator]  # (columns, rows per table) -> Arrow tables, in order
    fingerprint: str  # the rows' identity: a change of content (or of the files' size or time) changes it
    columns: list[str]
    features: object  # datasets.Features, or None where a stream of text files has no schema
    num_rows: int | None  # None where only reading them all would tell (JSON, CSV, text files)
    nbytes: int  # about: the Arrow table's, or the files'


def rows_of(dataset) -> Rows:
    """A datasets.Dataset (the embedded corpus, a hub split, one built in memory) as Rows."""
    return Rows(_tables_of(dataset), dataset._fingerprint, list(dataset.column_names), dataset.features,
                len(dataset), dataset.data.nbytes)  # fmt: skip


def _tables_of(dataset) -> Callable[[list[str], int], Iterator]:
    """A datasets.Dataset or IterableDataset read as Arrow tables."""
    return lambda columns, rows: dataset.select_columns(columns).with_format("arrow").iter(batch_size=rows)


def _parquet_tables(files: list[Path]) -> Callable[[list[str], int], Iterator]:
    """Parquet files read by pyarrow itself, row group by row group, without pre-buffering: read
    through `datasets`, even as a stream, the reader's memory grew with the file (measured:
    +225 MB from a 19 MB to a 74 MB file); read so, it stays flat."""

    def tables(columns: list[str], rows: int) -> Iterator:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for path in files:
            with pq.ParquetFile(path, pre_buffer=False) as parquet:
                for batch in parquet.iter_batches(batch_size=rows, columns=columns):
                    yield pa.Table.from_batches([batch])

    return tables


def embedded_documents() -> list[str]:
    """~465 KB of real English: the help topics every CPython ships (no download)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def is_local(dataset: str) -> bool:
    return dataset.startswith((".", "/", "~")) or Path(dataset).expanduser().exists() or _is_glob(dataset)


def _is_glob(dataset: str) -> bool:
    return any(ch in dataset for ch in "*?[")


def check_exists(dataset: str | None, flag: str = "--dataset") -> None:
    """The cheap check, before any process group: a local path that is not there."""
    if dataset is None or not is_local(dataset):
        return
    if _is_glob(dataset):
        if not glob.glob(str(Path(dataset).expanduser()), recursive=True):
            raise UserError(f"{flag} {dataset} matches no file; check the pattern")
    elif not Path(dataset).expanduser().exists():
        raise UserError(f"{flag} {dataset} does not exist; pass an existing file, folder, glob or hub id")
    else:
        path = Path(dataset).expanduser()
        if not (path.is_file() or path.is_dir()):  # a device, a pipe, a socket: nothing to read twice
            raise UserError(
                f"{flag} {dataset} is neither a regular file nor a folder; pass a data file "
                f"({', '.join(FILE_BUILDERS)}), a folder of them, a glob or a hub id"
            )
        if path.is_dir() and not any(
            p.suffix in FILE_BUILDERS and p.is_file() for p in path.rglob("*") if not _hidden(p.relative_to(path))
        ):
            raise UserError(f"{flag} {dataset} holds no {', '.join(FILE_BUILDERS)} files; pass a folder of data files")


def load_raw(
    dataset: str | None,
    config_name: str | None = None,
    split: str = "train",
    trust_remote_code: bool = False,
    flag: str = "--dataset",
    streaming: bool = False,
):
    """Rows to prepare, or with streaming a datasets.IterableDataset."""
    import datasets

    datasets.disable_progress_bars()
    if dataset is None:
        embedded = datasets.Dataset.from_dict({"text": embedded_documents()})
        return embedded.to_iterable_dataset() if streaming else rows_of(embedded)
    check_exists(dataset, flag)
    if is_local(dataset):
        files = local_files(dataset, flag, split if flag == "--dataset" else None)  # evaluation: no split to pick
        if all(f.stat().st_size == 0 for f in files):  # the parsers fail on these with no useful message
            raise UserError(f"{flag} {dataset} is empty; pass a dataset with at least one row")
        builder = FILE_BUILDERS[files[0].suffix]
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            stream = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                           streaming=True, **kwargs)  # fmt: skip
            if streaming:
                return stream
            rows = _local_rows(builder, files, stream)
        except UserError:
            raise
        except Exception as exc:  # a malformed file: name it, do not dump the parser's stack
            not_objects = _first_line_not_an_object(files) if builder == "json" else None
            raise UserError(
                f"{flag} {dataset}: {not_objects or f'cannot read it as {builder}: {first_line(exc)}'}"
            ) from None
        if rows.num_rows == 0:
            raise UserError(f"{flag} {dataset} is empty; pass a dataset with at least one row")
        return rows
    try:
        loaded = datasets.load_dataset(
            dataset, config_name, split=split, trust_remote_code=trust_remote_code, streaming=streaming
        )
        return loaded if streaming else rows_of(loaded)
    except Exception as exc:
        raise UserError(
            f"{flag} {dataset} is neither a local path nor a loadable hub dataset "
            f"(config {config_name!r}, split {split!r}): {first_line(exc)}"
        ) from None


def _first_line_not_an_object(files: list[Path]) -> str | None:
    """Where a JSON Lines file's first row is JSON but not an object (a bare list of token ids, a
    string), what its parser says ("Trailing data at position 7") names neither the row nor the fix."""
    for file in (f for f in files if f.suffix == ".jsonl"):
        with open(file, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(iter(lambda: handle.readline(2**20), ""), start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    return None  # not JSON at all: the parser's own words say more
                if isinstance(row, dict):
                    break
                kind = {list: "a list", str: "a string"}.get(type(row), "a single value")
                return (f"line {number} of {file.name} is {kind}, not an object; write one object per line, "
                        'e.g. {"input_ids": [...]} or {"text": "..."}')  # fmt: skip
    return None


def _local_rows(builder: str, files: list[Path], stream) -> Rows:
    """Local files as Rows, read as preparation goes. A malformed first row fails here, before any work."""
    from datasets import Features
    from datasets.fingerprint import Hasher

    fingerprint = Hasher.hash([builder, local_origin(files)])
    nbytes = sum(f.stat().st_size for f in files)
    if builder == "parquet":  # the footers tell the schema and the row count
        import pyarrow.parquet as pq

        schema = pq.read_schema(files[0])
        num_rows = sum(pq.read_metadata(f).num_rows for f in files)
        return Rows(_parquet_tables(files), fingerprint, schema.names, Features.from_arrow_schema(schema), num_rows,
                    nbytes)  # fmt: skip
    first = next(iter(stream), None)
    columns = stream.column_names or list(first or {})
    return Rows(_tables_of(stream), fingerprint, columns, stream.features, None if first else 0, nbytes)


def _named_splits(folder: Path) -> dict[str, list[Path]]:
    """{split: files} where names in the folder split it as `datasets` splits them; {} where
    nothing does (every file is then training data)."""
    from datasets.data_files import DEFAULT_PATTERNS_ALL, DataFilesDict, get_data_patterns

    patterns = get_data_patterns(str(folder))
    if patterns == DEFAULT_PATTERNS_ALL:
        return {}
    resolved = DataFilesDict.from_patterns(patterns, base_path=str(folder))
    return {str(name): [Path(f) for f in files] for name, files in resolved.items()}


def _split_files(dataset: str, flag: str, split: str | None, splits: dict, candidates: list[Path]) -> list[Path]:
    """The candidates of `split`; a file in no split, a split not there, or an evaluation folder
    (no split to pick) refused in one line."""
    path = Path(dataset).expanduser()
    names = ", ".join(sorted(splits))
    said = f"{flag} {dataset} is split by its file names into {names} (as `datasets` reads a folder)"
    in_a_split = {p.resolve() for files in splits.values() for p in files}
    stray = [p for p in candidates if p.is_file() and p.suffix in FILE_BUILDERS and p.resolve() not in in_a_split]
    if stray:
        raise UserError(
            f"{said}, but {stray[0].relative_to(path)} is in none of them; rename it into one, or pass the "
            "files to train on as a glob"
        )
    if split is None:
        example = sorted(splits.get("validation") or splits.get("test") or next(iter(splits.values())))[0]
        raise UserError(f"{said}; pass the evaluation files themselves, e.g. {example}")
    if split not in splits:
        raise UserError(f"{said}, none of them {split!r}; pass --split {' or '.join(sorted(splits))}")
    chosen = {p.resolve() for p in splits[split]}
    return [p for p in candidates if p.resolve() in chosen]


def local_origin(files: list[Path]) -> list:
    """The files as they are now: an edited file is other data."""
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _hidden(relative: Path) -> bool:
    return any(part.startswith((".", "__")) for part in relative.parts)


def local_files(dataset: str, flag: str = "--dataset", split: str | None = "train") -> list[Path]:
    """The files of a local dataset. A folder is read as `datasets` reads one: not what is hidden
    (.ipynb_checkpoints, .git, __pycache__), and where file or folder names split it (train.jsonl
    and test.jsonl, validation/...) only the files of `split`: never a test split trained on."""
    path = Path(dataset).expanduser()
    if _is_glob(dataset):
        candidates = [Path(p) for p in glob.glob(str(path), recursive=True)]
    elif path.is_file():
        candidates = [path]
    else:
        candidates = [p for p in path.rglob("*") if not _hidden(p.relative_to(path))]
        splits = _named_splits(path)
        if splits:
            candidates = _split_files(dataset, flag, split, splits, candidates)
    files = sorted(p for p in candidates if p.is_file() and p.suffix in FILE_BUILDERS)
    if not files:
        if path.is_file():
            raise UserError(
                f"{flag} {path}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_BUILDERS)}"
            )
        raise UserError(f"{flag} {dataset} holds no {', '.join(FILE_BUILDERS)} files")
    kinds = {FILE_BUILDERS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise UserError(f"{flag} {dataset} mixes file kinds ({', '.join(sorted(kinds))}); keep one kind per dataset")
    return files
