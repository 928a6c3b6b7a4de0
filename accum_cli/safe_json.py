"""JSON read back from disk, bounded: what accum-train reads of its own files (metrics.jsonl,
meta.json, ids.json, markers) may have been damaged or edited by anyone.

`json.loads` recurses once per level of nesting, so a line of ten thousand `[` raises
RecursionError, which no caller expects from a parser; here it is the ValueError every caller
already handles as "not JSON", and a document is refused above a size no file of ours reaches.
"""

from __future__ import annotations

import json
from typing import Any

MAX_BYTES = 16 << 20  # far above any file accum-train writes and reads back whole (metrics lines, meta.json)


def loads(text: str | bytes, max_bytes: int = MAX_BYTES) -> Any:
    if len(text) > max_bytes:
        raise ValueError(f"{len(text):,} bytes, more than the {max_bytes:,} expected")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to be one of accum-train's records") from None
