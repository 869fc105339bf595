"""Errors in the caller's words: a function that builds the op's arguments itself reports the op's
refusals under the names its own caller used.

``quant_flash_attn`` names its own parameters (``v_descale``, ``seqused_kv``, ...). When the
drop-in or a cache makes the call, those tensors are its own work (a scale computed from ``v``,
lengths from a list of sequence ids), so an error naming them points the caller at an argument
it never passed. :func:`callers_words` rewrites such names, whole words only, in the ValueError
and TypeError raised inside it, and appends a note saying what each renamed thing is. The op
stays the one source of its rules and their numbers; only the names change.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Mapping

#: The exception types whose messages are rewritten (exactly these: a subclass may take other
#: constructor arguments, and is left as it is).
_REWORDED = (ValueError, TypeError)


@contextlib.contextmanager
def callers_words(names: Mapping[str, str], notes: Mapping[str, str] | None = None) -> Iterator[None]:
    """Inside the block, a ValueError / TypeError naming a key of ``names`` (a name, or a phrase
    such as ``"quant_mode 6"``) is raised again with each such name replaced by its value, plus ``notes[key]`` (once each) for every key found,
    keeping the original traceback. Other exceptions, and messages naming none of the keys,
    pass unchanged."""
    try:
        yield
    except _REWORDED as err:
        if type(err) not in _REWORDED or not names:
            raise
        message = str(err)
        found: list[str] = []

        def rename(match: re.Match) -> str:
            if match.group(0) not in found:
                found.append(match.group(0))
            return names[match.group(0)]

        pattern = r"\b(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")\b"
        renamed = re.sub(pattern, rename, message)
        if not found:
            raise
        extra = list(dict.fromkeys(notes[n] for n in found if notes and n in notes))
        if extra:
            renamed += " (" + "; ".join(extra) + ")"
        raise type(err)(renamed).with_traceback(err.__traceback__) from None
