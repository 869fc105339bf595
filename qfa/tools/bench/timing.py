"""Timing and table helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence


def median_seconds(fn: Callable[[], object], *, min_runs: int = 5, min_total: float = 0.2, max_runs: int = 50) -> float:
    """Median wall time of ``fn()`` after one warm-up call (which also absorbs compilation)."""
    fn()
    times: list[float] = []
    while len(times) < min_runs or (sum(times) < min_total and len(times) < max_runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; floats are printed as given (pre-format them)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def human_count(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
