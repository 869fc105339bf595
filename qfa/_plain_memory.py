"""When native code may take tensors: plain CPU memory, read and written by address.

The native passes and the kernel work on tensors through their data pointers, behind torch's
dispatcher. That is right only for a plain dense tensor with memory of its own, and only while
nothing intercepts torch's operations. Where something does, the torch paths run instead: they
compute the same bits through torch's own operations, which every mode and subclass sees.

* **torch.compile tracing**: dynamo traces the torch paths.
* **A torch.func transform** (``functionalize``, ``vmap``, ...): every tensor, a fresh output
  too, is a wrapper whose data pointer is 0.
* **A TorchDispatchMode** (``FakeTensorMode``, a FLOP counter, a logging mode): a fake tensor has
  no memory, and any mode expects to see the work.
* **A tensor subclass**: a wrapper subclass (``_make_wrapper_subclass``) has data pointer 0, and
  any subclass defines what its operations mean.
* **A negative or conjugate view** (``x.conj().imag``, ``torch._neg_view``): its memory holds
  the values before the flip, which torch applies lazily.

Native code that allocates an output names ``device="cpu"``: under a default-device context
(``with torch.device("meta")``, ``torch.set_default_device("cuda")``) a bare ``torch.empty``
would allocate elsewhere. Constants made once and kept (lookup tables, the Hadamard matrix) are
made inside :func:`host_constant`, so that the first caller's mode or device context does not
decide what every later call reads.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils import _python_dispatch

#: The tensor types whose memory native code may use (a Parameter is a plain tensor, flagged).
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode is active (``torch.compile`` cannot compile under one either)."""
    return torch._C._len_torch_dispatch_stack() > 0


def now() -> bool:
    """Whether nothing intercepts torch's operations at this moment: no ``torch.compile``
    tracing, no ``torch.func`` transform and no TorchDispatchMode active."""
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
                or dispatch_mode_active())


def tensors(*ts: torch.Tensor | None) -> bool:
    """Whether native code may take these tensors now (None entries are skipped): :func:`now`,
    and each one a plain (not subclassed, not nested) strided tensor on the CPU whose memory holds
    its values (no negative or conjugate bit)."""
    if not now():
        return False
    for t in ts:
        if t is not None and (type(t) not in PLAIN_TYPES or t.layout is not torch.strided or t.is_nested
                              or t.device.type != "cpu" or t.is_neg() or t.is_conj()):
            return False
    return True


def address(t: torch.Tensor, name: str) -> int:
    """``t``'s data pointer for native code; a RuntimeError naming ``name`` where ``t`` has
    elements but no memory, or memory that does not hold its values (a negative or conjugate
    view). The routing above should never let either through."""
    pointer = t.data_ptr()
    if not pointer and t.numel():
        raise RuntimeError(f"{name}: a tensor with memory of its own, got one without (a {type(t).__name__} on "
                           f"{t.device}: a wrapper, a fake tensor or a torch.func transform's?)")
    if t.is_neg() or t.is_conj():
        raise RuntimeError(f"{name}: a tensor whose memory holds its values, got a negative or conjugate view "
                           f"(resolve_neg() it)")
    return pointer


@contextlib.contextmanager
def host_constant() -> Iterator[None]:
    """Make a constant that is kept for later calls: real host memory, whatever the caller is
    inside (a TorchDispatchMode such as FakeTensorMode is set aside, and the default device is
    the CPU)."""
    with _python_dispatch._disable_current_modes(), torch.device("cpu"):
        yield
