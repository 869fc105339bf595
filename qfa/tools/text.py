"""Reading the text files the tools score or run a model on."""

from __future__ import annotations

import gzip
import os

_GZIP_MAGIC = b"\x1f\x8b"


def read_text(path: os.PathLike | str) -> str:
    """The file's text as UTF-8, undecodable bytes replaced.

    Gzip is recognised by its magic bytes, not the name: Debian ships ``.gz`` docs, and a
    decompressed copy that kept its name (or a compressed one without it) reads the same.
    """
    with open(path, "rb") as f:
        compressed = f.read(2) == _GZIP_MAGIC
    with (gzip.open if compressed else open)(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")
