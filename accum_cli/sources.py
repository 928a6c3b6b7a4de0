"""Where the rows come from: the embedded corpus, local files, folders, globs, or the hub.

Every source comes back as a `datasets.Dataset` (a `datasets.IterableDataset` when streaming),
untouched: formats are told apart and tokenised in prepare.py (stream.py when streaming).
"""

from __future__ import annotations

import glob
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


def load_raw(
    dataset: str | None,
    config_name: str | None = None,
    split: str = "train",
    trust_remote_code: bool = False,
    flag: str = "--dataset",
    streaming: bool = False,
):
    import datasets

    datasets.disable_progress_bars()
    if dataset is None:
        embedded = datasets.Dataset.from_dict({"text": embedded_documents()})
        return embedded.to_iterable_dataset() if streaming else embedded
    check_exists(dataset, flag)
    if is_local(dataset):
        files = local_files(dataset, flag)
        if all(f.stat().st_size == 0 for f in files):  # the parsers fail on these with no useful message
            raise UserError(f"{flag} {dataset} is empty; pass a dataset with at least one row")
        builder = FILE_BUILDERS[files[0].suffix]
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            return datasets.load_dataset(
                builder, data_files=[str(f) for f in files], split="train", streaming=streaming, **kwargs
            )
        except Exception as exc:  # a malformed file: name it, do not dump the parser's stack
            raise UserError(f"{flag} {dataset}: cannot read it as {builder}: {first_line(exc)}") from None
    try:
        return datasets.load_dataset(
            dataset, config_name, split=split, trust_remote_code=trust_remote_code, streaming=streaming
        )
    except Exception as exc:
        raise UserError(
            f"{flag} {dataset} is neither a local path nor a loadable hub dataset "
            f"(config {config_name!r}, split {split!r}): {first_line(exc)}"
        ) from None


def local_files(dataset: str, flag: str = "--dataset") -> list[Path]:
    path = Path(dataset).expanduser()
    if _is_glob(dataset):
        candidates = [Path(p) for p in glob.glob(str(path), recursive=True)]
    elif path.is_file():
        candidates = [path]
    else:
        candidates = list(path.rglob("*"))
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
