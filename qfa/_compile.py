"""TorchInductor for the torch paths' elementwise hot loops, with an eager fallback.

The torch paths are written as plain torch functions; on CPU, compiling them fuses a chain of
memory-bound passes into one C++ loop. The compiled and eager versions run the same function,
so they agree bit for bit except for exp's last ulp (inductor's vectorised exp). Compiling
is skipped where it is unavailable (no C++ compiler) or disabled with ``QFA_COMPILE=0``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Callable

import torch

ENV_VAR = "QFA_COMPILE"
#: Graphs one function may compile (shapes of size 1, and sizes that happen to be equal, each
#: specialise a dynamic graph); applied only around qfa's own calls, not to the user's code.
RECOMPILE_LIMIT = 64
_lock = threading.Lock()
_compiled: dict[Callable, Callable] = {}
_failed: set[Callable] = set()
_scope = threading.local()


@contextlib.contextmanager
def limits():
    """qfa's recompile limit, set once around a stretch of :func:`call`s (patching dynamo's
    config costs about 20 us, as much as the compiled call itself)."""
    if getattr(_scope, "active", False):
        yield
        return
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        _scope.active = True
        try:
            yield
        finally:
            _scope.active = False


def enabled(fn: Callable, device: torch.device) -> bool:
    return device.type == "cpu" and os.environ.get(ENV_VAR, "1") != "0" and fn not in _failed


def call(fn: Callable, *args, device: torch.device):
    """``fn(*args)``, through its compiled twin when :func:`enabled`."""
    if enabled(fn, device):
        with _lock:
            compiled = _compiled.get(fn)
            if compiled is None:
                compiled = _compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            with limits():
                return compiled(*args)
        except Exception as exc:  # no C++ compiler, unsupported platform, ...
            _failed.add(fn)
            warnings.warn(f"qfa: torch.compile of {fn.__name__} failed ({exc!r}); it runs in eager torch from now on",
                          stacklevel=2)
    return fn(*args)
