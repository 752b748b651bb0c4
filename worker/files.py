"""Files other processes read while this one writes them."""

from __future__ import annotations

import os
from pathlib import Path


def replace_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file, no file, or the whole
    new text: never an empty or half-written one (a supervisor polls for a ready file and
    reads it as soon as it exists). A temporary sibling is renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
