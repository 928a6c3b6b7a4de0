"""Reading a DCP checkpoint without running anything from it, and verifying every byte it reads.

A checkpoint may come from someone else, and whoever can write its folder can rewrite every
file in it, meta.json included: a checksum alone detects accidents, not attackers. Stock DCP
executes code from a checkpoint in two places: `FileSystemReader.read_metadata` unpickles
`.metadata`, and `DefaultLoadPlanner.load_bytes` calls `torch.load(weights_only=False)` on every
non-tensor item (the optimizer's hyper-parameters). So here:

- `.metadata` is read by an unpickler that admits only DCP's own metadata classes and the
  torch types they hold; any other global is refused before it is looked up, and its BUILD
  (which sets attributes) applies to instances only: on an admitted class itself it would patch
  that class for the whole process (`PosixPath.is_file` made always true turns every folder
  into one of accum-train's own, to be deleted);
- non-tensor items are read with `torch.load(weights_only=True)` (tensors already are);
- every file is checked against the size and SHA-256 recorded at save before it is read, by
  the rank that reads it (~1 s per GiB per rank on a 2-core Xeon), and a file the metadata
  points to that the record does not list is refused.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from accum_cli.errors import UserError

HASH_BLOCK = 1 << 22
# What DCP 2.x pickles into .metadata: its dataclasses, torch.Size, dtypes, layouts and paths.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}  # fmt: skip
_FILE_NAME = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.-]{1,200}$")


class UnsafeCheckpoint(Exception):
    """The checkpoint holds something that would run code, or bytes that do not match its record."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def record_files(folder: Path, names: list[str]) -> dict[str, dict]:
    """Size and SHA-256 of each named file, as stored in meta.json."""
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)} for name in names}


def valid_file_name(name: object) -> bool:
    """A plain file name inside the checkpoint folder: no separators, no '..'."""
    return isinstance(name, str) and bool(_FILE_NAME.match(name))


def verify_file(folder: Path, name: str, files: dict[str, dict]) -> Path:
    """The file's path once its size and content match the record; UnsafeCheckpoint otherwise."""
    expected = files.get(name)
    if expected is None or not valid_file_name(name):
        raise UnsafeCheckpoint(f"it refers to a file {name[:80]!r} that its meta.json does not list")
    path = folder / name
    try:
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise UnsafeCheckpoint(f"file {name} is {size} bytes, {expected['bytes']} were written")
        if sha256_file(path) != expected["sha256"]:
            raise UnsafeCheckpoint(f"file {name} does not match the checksum written with it (damaged or altered)")
    except OSError as exc:
        raise UnsafeCheckpoint(f"file {name} cannot be read ({exc.strerror or exc})") from None
    return path


def _build_instances_only(unpickler: pickle._Unpickler) -> None:
    target = unpickler.stack[-2]  # BUILD pops the state; the object it applies to is below it
    if isinstance(target, type):
        raise UnsafeCheckpoint(
            f"its .metadata sets attributes of the class {target.__name__[:60]}, which DCP never does"
        )
    pickle._Unpickler.dispatch[pickle.BUILD[0]](unpickler)


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler: its opcodes can be overridden one by one (the C one's cannot)."""

    dispatch = pickle._Unpickler.dispatch | {pickle.BUILD[0]: _build_instances_only}

    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"its .metadata asks to load {module[:60]}.{name[:60]}, which DCP never writes")

    def persistent_load(self, pid):
        raise UnsafeCheckpoint("its .metadata holds a persistent reference, which DCP never writes")


def read_metadata(folder: Path, files: dict[str, dict]) -> Metadata:
    """DCP's .metadata, verified and unpickled with only DCP's own classes allowed."""
    path = verify_file(folder, ".metadata", files)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # a truncated or malformed pickle: no code has run
        raise UnsafeCheckpoint(f"its .metadata cannot be read ({type(exc).__name__})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpoint("its .metadata is not DCP metadata")
    for info in metadata.storage_data.values():
        if not valid_file_name(getattr(info, "relative_path", None)) or info.relative_path not in files:
            raise UnsafeCheckpoint("its .metadata points to a file that its meta.json does not list")
    return metadata


class VerifiedReader(FileSystemReader):
    """FileSystemReader over pre-verified metadata; each file is verified before it is read."""

    def __init__(self, folder: Path, files: dict[str, dict], metadata: Metadata):
        super().__init__(folder)
        self._folder = folder
        self._files = files
        self._metadata = metadata
        self._verified: set[str] = set()

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpoint("per-rank metadata is never written by accum-train")
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan, planner):
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            if name not in self._verified:
                verify_file(self._folder, name, self._files)
                self._verified.add(name)
        return super().read_data(plan, planner)


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor items are unpickled with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint("an item holds objects that would run code when unpickled") from None
        # The stock planner unpickles with weights_only=False; hand it our re-serialised copy
        # of an object that passed the weights-only check, so only public API is used.
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def problem_in(exc: BaseException) -> str | None:
    """The UnsafeCheckpoint message inside an exception that DCP wrapped, if there is one."""
    seen: list[BaseException] = [exc]
    failures = getattr(exc, "failures", None) or {}
    for pair in failures.values():
        seen.append(pair[0] if isinstance(pair, tuple) else pair)
    for candidate in seen:
        while candidate is not None:
            if isinstance(candidate, UnsafeCheckpoint):
                return str(candidate)
            candidate = candidate.__cause__ or candidate.__context__
    return None


def as_user_error(exc: UnsafeCheckpoint, path: Path, flag: str) -> UserError:
    return UserError(f"{flag} {path} is refused: {exc}; use a checkpoint you trust or an earlier one")
