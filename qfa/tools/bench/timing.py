"""Timing and table helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping, Sequence


def median_seconds(fn: Callable[[], object], *, min_runs: int = 5, min_total: float = 0.2, max_runs: int = 50) -> float:
    """Median wall time of ``fn()`` after one warm-up call (which also absorbs compilation)."""
    fn()
    times: list[float] = []
    while len(times) < min_runs or (sum(times) < min_total and len(times) < max_runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fns: Mapping[str, Callable[[], object]], *, min_runs: int = 5, min_total: float = 0.2,
                        max_runs: int = 50, before: Callable[[], object] | None = None) -> dict[str, float]:
    """Median wall time of each call, timed in turns (one call of each per round, after one
    warm-up call of each): a shared host's slow minutes then fall on every call alike, so the
    ratios of the medians hold even where the absolute times drift. Rounds run until there are
    ``min_runs`` and the rounds took ``min_total`` seconds, or ``max_runs``. ``before``, when
    given, runs untimed before each timed call (what the call should follow, as in a model)."""
    if not fns:
        raise ValueError("expected at least one call to time, got none")
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    total = 0.0
    rounds = 0
    while rounds < min_runs or (total < min_total and rounds < max_runs):
        for name, fn in fns.items():
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            times[name].append(elapsed)
            total += elapsed
        rounds += 1
    return {name: statistics.median(t) for name, t in times.items()}


def set_threads(threads: int | None) -> None:
    """A bench's ``--threads``: torch's thread count for every measured call (None: torch's own)."""
    if threads is not None:
        if threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; floats are printed as given (pre-format them)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


#: Binary suffixes of element counts, as the tables print them.
_UNITS = {"M": 1 << 20, "K": 1 << 10}


def human_count(n: int) -> str:
    """``65536`` -> ``"64K"``: the largest suffix that divides ``n``, else the plain integer."""
    for unit, size in _UNITS.items():
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def parse_count(text: str) -> int:
    """``"64K"`` -> ``65536`` (K = 2^10, M = 2^20, either case) or a plain positive integer:
    the inverse of :func:`human_count`. Anything else is a ValueError naming the text."""
    body = text.strip()
    size = _UNITS.get(body[-1:].upper(), 1)
    digits = body[:-1] if size != 1 else body
    if not (digits.isascii() and digits.isdigit()) or int(digits) == 0:
        raise ValueError(f"expected a positive element count like 4096, 64K or 4M, got {text!r}")
    return int(digits) * size
