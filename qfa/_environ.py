"""Environment switches read on every call of the hot paths (``QFA_NATIVE``, ``QFA_BF16_DOT``,
...), without the cost ``os.environ.get`` has for an unset name: it raises and catches a
KeyError inside, about a microsecond, and a vLLM layer's step read such switches seven times.

``read`` looks the name up in the mapping ``os.environ`` keeps in step with its changes (its
``_data``: CPython's, bytes keys on POSIX), so a switch set or removed at run time (a test's
monkeypatch, a user's ``os.environ[...] = ...``) is seen by the next call, as with
``os.environ.get``. Where that mapping is not there, it is ``os.environ.get``. (A program that
replaces the ``os.environ`` object itself is not followed: none of qfa's does.)
"""

from __future__ import annotations

import os

_data = getattr(os.environ, "_data", None)
_encode_key = getattr(os.environ, "encodekey", None)
_decode_value = getattr(os.environ, "decodevalue", None)
_keys: dict[str, object] = {}


def read(name: str, default: str) -> str:
    """``os.environ.get(name, default)``."""
    if _data is None or _encode_key is None or _decode_value is None:
        return os.environ.get(name, default)
    key = _keys.get(name)
    if key is None:
        key = _keys[name] = _encode_key(name)
    value = _data.get(key)
    return default if value is None else _decode_value(value)
