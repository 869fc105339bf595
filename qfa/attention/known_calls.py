"""Op calls like an earlier successful one, run on its plan without checking and planning again.

In a model the op runs between the layers' matmuls, which evict the interpreter's code and data
from the CPU's caches, so the Python around the kernel runs cold, at 10-20 times its warm cost.
On the Zen 4 EPYC the op's checks and planning took about 280 us a call right after SDPA against
60-80 us warm: at Sq = 16 with 4096 keys, a sixth of the call.

A call whose arguments are like those of an earlier call that succeeded passes the same static
checks and gets the same plan. Like means: the same operand types, dtypes, shapes, strides and
devices, the same options (with their types), and the same ``QFA_BACKEND``. Only values can
differ, and they are read after planning: :func:`run` runs the full path's code from there (the
descales read and checked, then the kernel). The op's full path remembers a call when it
succeeds.

Which calls: the HiF8 mode on the native CPU kernel, K/V not paged, uint8 codes, every tensor a
plain dense ``torch.Tensor`` (strided, not nested, no subclass, no negative bit), and none of metadata, length
tensors, ``p_scale``, a mask tensor, sinks, windows or length bounds. That is the form of the
drop-in's calls and of a model's direct ones. Any other call, or one unlike every remembered
call, takes the full path.
"""

from __future__ import annotations

import threading

import torch

from qfa import _environ, _plain_memory, backends
from qfa.attention.backends import cpu_kernel
from qfa.tiling.attention import PLAN_CACHE_SIZE, AttentionPlan
from qfa.tiling.attention_checks import check_scale_values
from qfa.tiling.spec import MaskMode, QuantMode

#: The types of the scalar options a known call may have; any other takes the full path.
_OPTION_TYPES = frozenset({int, float, bool, type(None), QuantMode, MaskMode})

_plans: dict[tuple, AttentionPlan] = {}
_lock = threading.Lock()


def key_of(q, k, v, q_descale, k_descale, v_descale, quant_mode, mask_mode, softmax_scale, return_softmax_lse,
           layouts: tuple, backend) -> tuple | None:
    """What the op's static checks and plan are a function of, for a call of the form this
    module runs (see the module doc; the caller has seen the other arguments at their defaults),
    or None for a call it leaves to the full path."""
    tensor, strided = torch.Tensor, torch.strided
    for t in (q, k, v, q_descale, k_descale, v_descale):  # (a CSR tensor has no strides, a nested one no shape)
        if type(t) is not tensor or t.is_nested or t.layout is not strided or t.is_neg():
            return None
    if q.dtype is not torch.uint8:
        return None
    for option in (*layouts, backend):
        if option is not None and type(option) is not str:
            return None
    for option in (quant_mode, mask_mode, softmax_scale, return_softmax_lse):
        if type(option) not in _OPTION_TYPES:  # (a list would not even hash)
            return None
    if not _plain_memory.now():  # tracing, a torch.func transform or a dispatch mode: the torch path's cases
        return None
    # types beside values: True == 1 and 1 == 1.0 hash alike, but the checks take only some of them
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), k.dtype, v.dtype, q.is_cpu, k.is_cpu,
            v.is_cpu, q_descale.dtype, q_descale.shape, q_descale.is_cpu, k_descale.dtype, k_descale.shape,
            k_descale.is_cpu, v_descale.dtype, v_descale.shape, v_descale.is_cpu, type(quant_mode), quant_mode,
            type(mask_mode), mask_mode, type(softmax_scale), softmax_scale, type(return_softmax_lse),
            return_softmax_lse, layouts, backend, _environ.read(backends.ENV_VAR, ""))


def plan_of(key: tuple) -> AttentionPlan | None:
    """The plan of the remembered call with this key, or None."""
    return _plans.get(key)


def remember(key: tuple, plan: AttentionPlan) -> None:
    """Remember a call that succeeded on the native kernel (at most PLAN_CACHE_SIZE: a new one
    evicts the oldest)."""
    with _lock:
        if key in _plans:  # (two threads' first calls alike: one entry, nothing evicted)
            return
        while len(_plans) >= PLAN_CACHE_SIZE:
            del _plans[next(iter(_plans))]
        _plans[key] = plan


def forget() -> None:
    """Forget every remembered call."""
    with _lock:
        _plans.clear()


def run(plan: AttentionPlan, q, k, v, q_descale, k_descale, v_descale,
        rotated: cpu_kernel.RotatedOutput | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The op's result for a call like the one that made ``plan``: the code the op's full path
    runs after planning (the descales' values read and checked as its plan checks them, then the
    kernel). None where the kernel is not available now (``QFA_NATIVE=0``): the full path then
    picks the backend."""
    if not cpu_kernel.available():
        return None
    check_scale_values(plan, q_descale, k_descale, v_descale, None)
    return cpu_kernel.forward(plan, q, k, v, q_descale, k_descale, v_descale, None, known_available=True,
                              rotated=rotated)
