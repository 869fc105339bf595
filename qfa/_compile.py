"""TorchInductor for the torch paths' elementwise hot loops, with an eager fallback.

The torch paths are written as plain torch functions; on CPU, compiling them fuses a chain of
memory-bound passes into one C++ loop. The compiled and eager versions run the same function,
so they agree bit for bit except for exp's last ulp (inductor's vectorised exp). Compiling
is skipped where it is unavailable (no C++ compiler) or disabled with ``QFA_COMPILE=0``.

A failed compile must not change what later calls compute (a call that happened to fail would
otherwise change the LSE bits of every later, good call), so failures are remembered by what
caused them:

* a failure tied to the inputs (a dtype, rank or ``requires_grad`` the graph does not take) is
  remembered for that input *signature* (:func:`signature`): calls with that signature run in
  eager torch, every other signature still runs compiled, exactly as before the failure;
* a call under a TorchDispatchMode (a FLOP counter, ``FakeTensorMode``) is not compiled at all:
  dynamo refuses every frame there, whatever the inputs, so it runs eagerly and leaves no mark;
* an environmental failure (no working C++ compiler, a missing tool or library: the exception
  or one of its causes is an ``OSError``, ``ImportError`` or one of inductor's compiler errors,
  see :func:`is_environmental`) marks the function broken for the rest of the process: no input
  could compile it, so every call runs in eager torch, consistently.

The compiled functions must not modify their arguments (they return their results), so the
eager retry after a failed compiled call cannot apply an update twice.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
from typing import Callable, Hashable

import torch

from qfa import _environ, _plain_memory

ENV_VAR = "QFA_COMPILE"
#: Graphs one function may compile (shapes of size 1, and sizes that happen to be equal, each
#: specialise a dynamic graph); applied only around qfa's own calls, not to the user's code.
RECOMPILE_LIMIT = 64
_lock = threading.Lock()
_compiled: dict[Callable, Callable] = {}
#: Functions broken for good (an environmental failure): they always run eagerly.
_failed: set[Callable] = set()
#: Per function, the input signatures whose compile failed: those calls run eagerly.
_failed_signatures: dict[Callable, set[Hashable]] = {}
_scope = threading.local()
#: Serialises the first compile of each (function, signature): dynamo and inductor import much
#: of themselves lazily, and two threads importing a circular group at once see a partially
#: initialised module (ImportError / AttributeError). Later calls run without it.
_first_compile = threading.RLock()
#: Per function, the signatures that compiled and ran once.
_warm: dict[Callable, set[Hashable]] = {}
_imported = False


def _dynamo():
    """``torch._dynamo``, imported once under :data:`_first_compile` (see there)."""
    global _imported
    if not _imported:
        with _first_compile:
            importlib.import_module("torch._dynamo")
            importlib.import_module("torch._inductor.utils")
            _imported = True
    return torch._dynamo


@contextlib.contextmanager
def limits():
    """qfa's recompile limit, set once around a stretch of :func:`call`s (patching dynamo's
    config costs about 20 us, as much as the compiled call itself). Dynamo's config is
    per thread, so a scope changes only its own thread's setting."""
    if getattr(_scope, "active", False):
        yield
        return
    with _dynamo().config.patch(recompile_limit=RECOMPILE_LIMIT):
        _scope.active = True
        try:
            yield
        finally:
            _scope.active = False


def signature(args) -> tuple:
    """What a compile failure is remembered by: per argument, a tensor's type (a subclass that
    dynamo cannot trace fails for itself alone), dtype, rank, device type and ``requires_grad``
    (the properties a graph specialises on; sizes are dynamic), or the type of anything else
    (None, a Python number ...)."""
    return tuple(
        (type(a), a.dtype, a.dim(), a.device.type, a.requires_grad) if isinstance(a, torch.Tensor) else type(a)
        for a in args
    )


def is_environmental(exc: BaseException) -> bool:
    """Whether a compile failure comes from the environment rather than from the inputs: the
    exception or any of its causes is an ``OSError`` (a missing compiler or tool), an
    ``ImportError``, or inductor's C++ compiler errors."""
    from torch._inductor import exc as inductor_exc

    kinds = (OSError, ImportError, inductor_exc.InvalidCxxCompiler, inductor_exc.CppCompileError)
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, kinds):
            return True
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return False


def enabled(fn: Callable, device: torch.device, args: tuple = ()) -> bool:
    """Whether ``fn(*args)`` runs compiled: on CPU, unless ``QFA_COMPILE=0``, a TorchDispatchMode
    is active (dynamo refuses to compile under one: that call runs eagerly, and nothing is
    remembered, since the mode and not the inputs stood in the way), ``fn`` is broken for good,
    or its compile failed before for this :func:`signature` of ``args``."""
    if device.type != "cpu" or _environ.read(ENV_VAR, "1") == "0" or fn in _failed or \
            _plain_memory.dispatch_mode_active():
        return False
    failed = _failed_signatures.get(fn)
    return not failed or signature(args) not in failed


def call(fn: Callable, *args, device: torch.device):
    """``fn(*args)``, through its compiled twin when :func:`enabled`."""
    if enabled(fn, device, args):
        with _lock:
            compiled = _compiled.get(fn)
            if compiled is None:
                _dynamo()
                compiled = _compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
        sig = signature(args)
        try:
            with limits():
                if sig in _warm.get(fn, ()):
                    return compiled(*args)
                with _first_compile:  # one thread at a time through a first compile
                    result = compiled(*args)
                with _lock:
                    _warm.setdefault(fn, set()).add(sig)
                return result
        except Exception as exc:  # no C++ compiler, unsupported platform, an input it cannot take ...
            environmental = is_environmental(exc)
            with _lock:
                if environmental:
                    _failed.add(fn)
                else:
                    _failed_signatures.setdefault(fn, set()).add(sig)
            scope = "from now on" if environmental else "for inputs like these (other inputs still compile)"
            warnings.warn(f"qfa: torch.compile of {fn.__name__} failed ({exc!r}); it runs in eager torch {scope}",
                          stacklevel=2)
    return fn(*args)
