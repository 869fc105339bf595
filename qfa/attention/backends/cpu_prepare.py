"""The native preparation and cast: ``csrc/cpu_prepare.cpp``, loaded like the attention kernel.

What it computes, per row of 128 values (a head vector):

* ``rotate_rows``: ``H x`` by the Walsh-Hadamard butterfly (:mod:`qfa.dropin.rotation` holds
  the definition: levels h = 1, 2, ..., 64 of ``x[i] + x[i+h]``, ``x[i] - x[i+h]``, then one
  multiply by fl(1/sqrt(128))), converted to the output's dtype (finite values beyond a narrower
  dtype saturate);
* ``prep_stats`` (pass 1 of a tensor): over the valid rows, the float64 sum of squares and the
  absolute maximum of ``H (x - mu)`` (rotation and K mean optional), and whether a value is NaN
  or Inf; optionally the K means first (per segment and head, see :func:`key_means`);
* ``prep_encode`` (pass 2): the HiF8 codes of ``H (x - mu) / scale`` for every row, and the count
  of finite values that reached the overflow threshold (saturated to +-MAX);
* ``encode_flat`` / ``quantize_flat``: the plain cast of a contiguous tensor (and of ``x / scale``);
* ``encode_token_rows`` / ``write_token_rows``: pass 2 alone for a step's token rows (T, N, 128)
  with a known scale, into new codes or straight into the slots of a paged cache (a serving
  engine's queries and cache writes: one call, checked before anything is written);
  ``token_encoder`` / ``kv_writer`` bind them to everything but the step's tokens, for an
  engine's layer that checks its tokens' geometry against the last step's instead.

The encoder rounds the 16-bit word of each value (a bf16 pattern, or an fp32 pattern's upper
half: HiF8 rounding reads nothing below it). On AVX-512 (F/BW/DQ/VL) 32 words a register, the
rounding and the code by 64-entry word tables in registers (vpermi2w, no memory gather); without
it (AVX2, scalar) a lookup in a 65536-entry code table, 8 lookups a store. The level is chosen at
run time from the CPU's flags (the source is compiled without ``-m`` flags; its SIMD functions
carry their ISA); the tables are built at load from the source's one scalar rule, from this
package's format constants. Every level gives the same bits (the tests run each level the CPU
has against the host table, on every pattern). The rows are read in place: any strides along batch, head and position, the last
stride 1; nothing is copied to fp32 first.

The prepare passes split their rows into fixed chunks of 64: on the calling thread below 512 rows
(a decode step), else on torch's OpenMP team (``torch.get_num_threads()``), each thread taking the
next chunk; partial statistics are added in chunk order, so no bit depends on the thread count.
A region whose caller waited for a late thread at its end (another process busy on its core)
sends the passes of the next 200 ms to the library's own pool (``csrc/item_pool.h``, the attention
kernel's design), where the caller waits only for chunks a thread has taken. ``encode_flat`` and
``quantize_flat`` are parallel above 2^18 elements; a forked child runs the passes on the pool
and the flat casts on its calling thread (libgomp's team does not survive fork).

Built on first use with the attention kernel's build helpers (:mod:`qfa.attention.backends.cpu_kernel`:
its compiler flags, the CPU-flags hash in the build name, ``QFA_NATIVE=0`` to turn native code
off). Where it cannot be built, :func:`available` says False (and warns once) and callers use
their torch paths, which compute the same bits.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import warnings
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch

from qfa import _plain_memory, csrc
from qfa.attention.backends import cpu_kernel
from qfa.cast import format as fmt
from qfa.cast import rounding

SOURCE = Path(csrc.__file__).resolve().parent / "cpu_prepare.cpp"
#: SIMD levels the source has (``isa=`` of the entry points; -1 is the best the CPU runs).
ISA_NAMES = ("scalar", "AVX2", "AVX-512")
#: The CPU flags each level needs (what a test that skips a level names).
ISA_FLAGS = ((), ("avx2", "f16c", "popcnt"), ("avx512f", "avx512bw", "avx512dq", "avx512vl"))
#: The level the entry points run when none is passed: -1, the best the CPU has (tests set a
#: lower one to check that every level gives the same bits).
ISA = -1

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
#: The C entry points: name -> (result, arguments); see the source for each.
_SIGNATURES = {
    "qfa_set_constants": (None, [_P]),
    "qfa_isa_level": (_I, []),
    "qfa_prep_tensor_size": (_I, []),
    "qfa_last_team": (_I, []),
    "qfa_set_team": (None, [_I]),
    "qfa_set_huge_pages": (None, [_I]),
    "qfa_huge_pages": (_I, []),
    "qfa_prep_stats": (_I, [_I, _P, _D, _I, _I, _P]),
    "qfa_key_means": (_I, [_P, _I, _P, _P, _I, _I, _P, _I]),
    "qfa_prep_encode": (_I, [_I, _P, _D, _I, _I, _P]),
    "qfa_rotate_rows": (_I, [_P, _I, _P, _I, _I, _D, _I, _I]),
    "qfa_encode_flat": (_I, [_P, _I, _P, _I, _I, _I, _I]),
    "qfa_quantize_flat": (_I, [_P, _I, _P, _I, _D, _I, _I]),
    "qfa_encode_tokens": (_I, [_P, _I, _I, _I, _I, _I, _P, _I, _D, _D, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _P, _P]),
    "qfa_encode_kv_tokens": (_I, [_P, _P, _I, _I, _I, _I, _I, _I, _I, _P, _I, _D, _D, _D, _P, _P, _P, _I, _I, _I, _I,
                                  _I, _I, _I, _I, _P, _P]),
}

_lock = threading.Lock()  # held for the build: a second caller waits for it
_module: ctypes.CDLL | None = None
_failed = False
#: A failed build's exception until available() has warned of it (as cpu_kernel's).
_error: Exception | None = None
_start_lock = threading.Lock()
#: The background build start_build() started in this process, if any.
_builder: threading.Thread | None = None


def build_name() -> str:
    """The extension's name: a hash of the CPU flags, the torch version and the shared headers
    (torch's loader itself rebuilds when the source or the flags change)."""
    digest = hashlib.sha1()
    digest.update(cpu_kernel._cpu_flags().encode())
    digest.update(torch.__version__.encode())
    digest.update(cpu_kernel.headers_digest())
    return f"qfa_cpu_prepare_{digest.hexdigest()[:12]}"


def _word(value: float) -> int:
    """The upper 16 bits of ``value``'s fp32 pattern (the encoder's word)."""
    return (rounding._bits(value) >> 16) & 0xFFFF


def constants() -> list[int]:
    """The format's constants as the source takes them (``set_constants``)."""
    return [_word(fmt.MAX), _word(fmt.OVERFLOW_THRESHOLD), _word(fmt.MIN_DENORMAL), _word(fmt.UNDERFLOW_THRESHOLD),
            fmt.NAN_CODE, fmt.POS_INF_CODE, *rounding.BAND_LIMITS]


def _build() -> ctypes.CDLL:
    from torch.utils import cpp_extension

    if not SOURCE.is_file():
        raise FileNotFoundError(f"{SOURCE} (the native preparation's source, package data of qfa.csrc)")
    name = build_name()
    # torch's loader: its cache, its lock against concurrent builds, its rebuild on a changed
    # source or flags. The library is plain C (no Python module), opened with ctypes below.
    directory = cpp_extension._get_build_directory(name, verbose=False)
    cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=list(cpu_kernel._COMMON_FLAGS),
                       extra_ldflags=["-lgomp"], build_directory=directory, is_python_module=False, verbose=False)
    lib = ctypes.CDLL(str(Path(directory) / f"{name}.so"))
    for fn, (restype, argtypes) in _SIGNATURES.items():
        getattr(lib, fn).restype = restype
        getattr(lib, fn).argtypes = argtypes
    if lib.qfa_prep_tensor_size() != ctypes.sizeof(_Tensor):
        raise RuntimeError(f"{name}: its PrepTensor is {lib.qfa_prep_tensor_size()} bytes, _Tensor "
                           f"{ctypes.sizeof(_Tensor)}: the source and this module disagree")
    consts = constants()
    lib.qfa_set_constants((ctypes.c_int64 * len(consts))(*consts))
    lib.qfa_set_huge_pages(int(not free_page_reporting()))
    return lib


#: Where Linux lists virtio devices, and what marks a balloon that reports free pages: its
#: device id and the feature bit (VIRTIO_BALLOON_F_REPORTING) in its ``features`` string of
#: '0'/'1', bit 0 first.
VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
_BALLOON_ID, _REPORTING_BIT = 5, 5


def free_page_reporting(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether this machine is a guest whose balloon reports free pages to its host. There a
    2 MiB block left free for a few seconds goes back to the host, and a huge page fault on it
    waits for the host to back it again, so the large casts' huge-page hint (``csrc``'s
    ``prefer_huge_pages``) costs more than it saves and is left off. Unreadable entries count as
    no such device."""
    try:
        entries = list(devices.iterdir())
    except OSError:
        return False
    for entry in entries:
        try:
            if int((entry / "device").read_text().strip(), 16) != _BALLOON_ID:
                continue
            features = (entry / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        if len(features) > _REPORTING_BIT and features[_REPORTING_BIT] == "1":
            return True
    return False


def huge_pages() -> bool:
    """Whether the large casts ask for huge pages for their outputs (see :func:`free_page_reporting`)."""
    return bool(module().qfa_huge_pages())


def _load() -> None:
    global _module, _failed, _error
    with _lock:
        if _module is None and not _failed:
            try:
                _module = _build()
            except Exception as exc:  # no compiler, no ninja, a build error, ...
                _failed, _error = True, exc


def start_build() -> None:
    """Start building the preparation on a background thread (as :func:`cpu_kernel.start_build
    <qfa.attention.backends.cpu_kernel.start_build>`: the kernel's build starts it, so that the
    two compile at once); :func:`available` waits for it."""
    global _builder
    with _start_lock:
        if cpu_kernel.enabled() and _module is None and not _failed and _builder is None:
            _builder = cpu_kernel.start_thread(_load, "qfa-build-cpu-prepare")


def available() -> bool:
    """Whether the native preparation runs: built (once, thread-safe) and native code not turned
    off (``QFA_NATIVE=0``)."""
    if not cpu_kernel.enabled():
        return False
    if _module is None and not _failed:
        _load()
    if _error is not None:
        _warn_once()
    return _module is not None


def _warn_once() -> None:
    global _error
    with _start_lock:
        exc, _error = _error, None
    if exc is not None:
        warnings.warn(f"qfa: the native CPU preparation is unavailable ({exc!r}); the torch paths run instead",
                      stacklevel=3)


def _after_fork_in_child() -> None:
    # As cpu_kernel's: fresh locks, and no build thread in the child.
    global _lock, _start_lock, _builder
    _lock, _start_lock, _builder = threading.Lock(), threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork_in_child)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the native code can take these tensors: plain CPU memory with nothing intercepting
    torch's operations (:func:`qfa._plain_memory.tensors`),
    and the extension available. Called with no tensors, the same for tensors the caller has
    checked itself."""
    return _plain_memory.tensors(*tensors) and available()


def module() -> ctypes.CDLL:
    """The loaded extension (call :func:`available` first)."""
    if _module is None and not available():
        raise RuntimeError("the native CPU preparation is not available (see qfa.attention.backends.cpu_prepare.available)")
    return _module


#: ``set_team`` modes: the calling thread for small passes, the OpenMP team for large ones and
#: the library's own pool for a while after a late OpenMP thread (the default); always the
#: calling thread; always the OpenMP team, or always the own pool, for passes large enough.
TEAMS = ("automatic", "caller", "openmp", "pool")


def set_team(mode: str) -> None:
    """Pin how the prepare passes run (:data:`TEAMS`; for tests and benchmarks)."""
    if mode not in TEAMS:
        raise ValueError(f"mode must be one of {TEAMS}, got {mode!r}")
    module().qfa_set_team(TEAMS.index(mode))


def last_team() -> str:
    """Who ran the last pass: ``"caller"`` (alone), ``"pool"`` (the library's own pool beside the
    caller) or ``"openmp"`` (torch's team); for the tests."""
    return ("caller", "pool", "openmp")[module().qfa_last_team()]


def isa_level() -> int:
    """The SIMD level the CPU runs (an index into :data:`ISA_NAMES`)."""
    return module().qfa_isa_level()


#: The element types the source takes, by its codes.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _ints(values) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def _check_rows(x: torch.Tensor, strides, segments, heads: int, name: str = "x") -> None:
    """ValueError unless every row the plan names lies inside ``x``'s storage (the source reads
    what it is told: a wrong plan must not read or write out of bounds)."""
    if len(strides) != 3 or len(segments) % 4:
        raise ValueError(f"a row plan needs 3 strides and quadruples of segments, got {len(strides)} and "
                         f"{len(segments)} values")
    if min(strides) < 0 or heads < 0 or (len(segments) and min(segments) < 0):
        raise ValueError(f"a row plan's strides, heads and segments must be >= 0, got {strides}, {heads}, {segments}")
    if x.stride(-1) != 1 and x.numel():
        raise ValueError(f"{name}'s rows must be contiguous (last stride 1), got strides {x.stride()}")
    size = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
    s_a, s_n, s_s = strides
    for a, s0, valid, rows in zip(segments[0::4], segments[1::4], segments[2::4], segments[3::4]):
        if valid > rows:
            raise ValueError(f"a segment's valid rows {valid} exceed its rows {rows}")
        if rows and heads and a * s_a + (heads - 1) * s_n + (s0 + rows - 1) * s_s + 128 > size:
            raise ValueError(f"the row plan reaches past {name}'s storage ({size} elements)")


def _isa(isa: int | None) -> int:
    return ISA if isa is None else isa


_addr = _plain_memory.address


def _checked(result: int, what: str) -> int:
    if result < 0:
        raise RuntimeError(f"qfa cpu_prepare.{what}: the SIMD level asked for is not supported by this CPU")
    return result


def rotate_rows(x: torch.Tensor, out_dtype: torch.dtype, c: float, isa: int | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``H x`` per row of 128 of a contiguous float ``x`` (..., 128), as a new ``out_dtype``
    tensor of x's shape, or into ``out`` (contiguous, that dtype and shape; it must not overlap
    x) (finite values beyond a narrower dtype's range saturate)."""
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device="cpu")
    elif out.dtype != out_dtype or out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {out_dtype} tensor of shape {tuple(x.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if x.numel():
        _checked(module().qfa_rotate_rows(_addr(x, "x"), DTYPE_CODES[x.dtype], _addr(out, "out"), DTYPE_CODES[out_dtype],
                                          x.numel() // 128, c, torch.get_num_threads(), _isa(isa)), "rotate_rows")
    return out


def encode_flat(x: torch.Tensor, inf_mode: bool = False, isa: int | None = None) -> torch.Tensor:
    """HiF8 codes (uint8, x's shape) of a contiguous float ``x``: overflow ``"saturate"``, or
    ``"inf"`` with ``inf_mode``."""
    out = torch.empty(x.shape, dtype=torch.uint8, device="cpu")
    if x.numel():
        _checked(module().qfa_encode_flat(_addr(x, "x"), DTYPE_CODES[x.dtype], _addr(out, "out"), x.numel(), int(inf_mode),
                                          torch.get_num_threads(), _isa(isa)), "encode_flat")
    return out


def _token_args(x: torch.Tensor, mean: torch.Tensor | None) -> tuple:
    """The C arguments of token rows ``x`` (T, N, 128) and their K means (fp32 (N, 128))."""
    if x.dim() != 3 or x.shape[-1] != 128 or x.dtype not in DTYPE_CODES or (x.numel() and x.stride(-1) != 1) or \
            not x.is_cpu:
        raise ValueError(f"token rows must be float (tokens, heads, 128) with contiguous rows on the CPU, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()} on {x.device}")
    if mean is not None and (mean.dtype != torch.float32 or not mean.is_contiguous() or not mean.is_cpu
                             or tuple(mean.shape) != (x.shape[1], 128)):
        raise ValueError(f"mean must be a contiguous fp32 (heads, 128) = {(x.shape[1], 128)} tensor, got "
                         f"{mean.dtype} {tuple(mean.shape)}")
    return (_addr(x, "x"), DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], x.stride(0), x.stride(1),
            None if mean is None else _addr(mean, "mean"))


def encode_token_rows(x: torch.Tensor, scale: float, c: float, *, mean: torch.Tensor | None = None,
                      rotate: bool = True, isa: int | None = None) -> tuple[torch.Tensor, int]:
    """``(codes, saturated)``: the uint8 codes (T, N, 128), contiguous, of ``H (x - mean) / scale``
    per row of the token rows ``x`` (T, N, 128) (the bits of :func:`encode_rows`), and how many
    finite values reached the overflow threshold."""
    _token_args(x, mean)
    return token_encoder(x.dtype, x.shape[1], x.stride(), scale, c, mean=mean, rotate=rotate, isa=isa)(x)


def token_encoder(dtype: torch.dtype, heads: int, strides: Sequence[int], scale: float, c: float, *,
                  mean: torch.Tensor | None = None, rotate: bool = True,
                  isa: int | None = None) -> Callable[[torch.Tensor], tuple[torch.Tensor, int]]:
    """:func:`encode_token_rows` with everything but the rows fixed: a function of token rows
    ``x`` that the caller has checked are CPU ``dtype`` (T, ``heads``, 128) with ``strides``
    (what :func:`encode_token_rows` checks; a serving engine's step checks only that its queries
    are like the last step's). ``mean`` is checked by the first call's caller, and kept alive by
    it: the function holds its address."""
    fn, dt, isa = module().qfa_encode_tokens, DTYPE_CODES[dtype], _isa(isa)
    st, sh = strides[0], strides[1]
    mu = None if mean is None else _addr(mean, "mean")
    row_bytes = heads * 128

    def encode(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        tokens = x.shape[0]
        out = torch.empty((tokens, heads, 128), dtype=torch.uint8, device="cpu")
        sat, bad = ctypes.c_int64(0), ctypes.c_int64(-1)
        if tokens:
            _checked(fn(_addr(x, "x"), dt, tokens, heads, st, sh, mu, int(rotate), c, scale, _addr(out, "out"), None, 0,
                        tokens, 1, 0, 128, row_bytes, torch.get_num_threads(), isa, ctypes.byref(sat),
                        ctypes.byref(bad)), "encode_token_rows")
        return out, sat.value
    return encode


class SlotRefused(NamedTuple):
    """Why :func:`write_token_rows` wrote nothing: ``token``'s slot is beyond the cache, or
    (``repeated``) names a slot an earlier token of the call names too."""

    token: int
    repeated: bool


def _check_cache(cache: torch.Tensor, heads: int, name: str = "cache") -> None:
    if cache.dtype != torch.uint8 or cache.dim() != 4 or tuple(cache.shape[1::2]) != (heads, 128) or \
            (cache.numel() and cache.stride(-1) != 1) or not cache.is_cpu:
        raise ValueError(f"{name} must be uint8 (blocks, {heads}, block_size, 128) with contiguous rows on the CPU, "
                         f"got {cache.dtype} {tuple(cache.shape)} strides {cache.stride()} on {cache.device}")


def _check_slots(slots: torch.Tensor, tokens: int) -> None:
    if slots.dtype not in (torch.int32, torch.int64) or tuple(slots.shape) != (tokens,) or \
            (slots.numel() and slots.stride(0) != 1) or not slots.is_cpu:
        raise ValueError(f"slots must be a contiguous int32 / int64 ({tokens},) CPU tensor, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")


def _slot_result(result: int, bad: ctypes.c_int64, sat: ctypes.c_int64, what: str) -> int | SlotRefused:
    if result in (-2, -3):
        return SlotRefused(bad.value, result == -3)
    _checked(result, what)
    return sat.value


def write_token_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: float, c: float, *,
                     mean: torch.Tensor | None = None, rotate: bool = True,
                     isa: int | None = None) -> int | SlotRefused:
    """The codes of :func:`encode_token_rows` written into ``cache`` (uint8 (blocks, N,
    block_size, 128), contiguous rows: a paged cache's K or V view) at ``slots`` (int32 / int64
    (T,), contiguous): token t's rows go to block ``slots[t] // block_size``, offset ``slots[t] %
    block_size``; a negative slot skips its token. Returns the saturated count, or, having
    written nothing, the :class:`SlotRefused` of a slot beyond the cache or named twice."""
    args = _token_args(x, mean)
    _check_cache(cache, x.shape[1])
    _check_slots(slots, x.shape[0])
    if x.shape[0] == 0:
        return 0
    sat, bad = ctypes.c_int64(0), ctypes.c_int64(-1)
    blocks, _, block_size, _ = cache.shape
    result = module().qfa_encode_tokens(*args, int(rotate), c, scale, _addr(cache, "cache"), _addr(slots, "slots"),
                                        int(slots.dtype == torch.int32), block_size, blocks, cache.stride(0),
                                        cache.stride(1), cache.stride(2), torch.get_num_threads(), _isa(isa),
                                        ctypes.byref(sat), ctypes.byref(bad))
    return _slot_result(result, bad, sat, "write_token_rows")


def write_kv_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor, k_scale: float, v_scale: float, c: float, *,
                  mean: torch.Tensor | None = None, rotate: bool = True,
                  isa: int | None = None) -> int | SlotRefused:
    """:func:`write_token_rows` of keys ``k`` (with ``mean`` and ``k_scale``) into ``k_cache``
    and of values ``v`` (``v_scale``, no mean) into ``v_cache`` at the same ``slots``, in one
    pass: k and v alike in dtype and shape, the caches alike in shape and strides (a paged
    cache's K and V views). The slots are checked once, before a byte of either is written.
    Returns the saturated count of both, or the :class:`SlotRefused`."""
    _token_args(k, mean)
    _token_args(v, None)
    if v.dtype != k.dtype or v.shape != k.shape:
        raise ValueError(f"v must be k's dtype and shape {k.dtype} {tuple(k.shape)}, got {v.dtype} {tuple(v.shape)}")
    _check_cache(k_cache, k.shape[1], "k_cache")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or v_cache.dtype != torch.uint8 or \
            not v_cache.is_cpu:
        raise ValueError(f"v_cache must be uint8 of k_cache's shape {tuple(k_cache.shape)} and strides "
                         f"{k_cache.stride()}, got {v_cache.dtype} {tuple(v_cache.shape)} {v_cache.stride()}")
    _check_slots(slots, k.shape[0])
    writer = kv_writer(k_cache, v_cache, k.dtype, k.stride(), v.stride(), k_scale, v_scale, c, mean=mean,
                       rotate=rotate, isa=isa)
    return writer(k, v, slots)


def kv_writer(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, k_strides: Sequence[int],
              v_strides: Sequence[int], k_scale: float, v_scale: float, c: float, *,
              mean: torch.Tensor | None = None, rotate: bool = True,
              isa: int | None = None) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], int | SlotRefused]:
    """:func:`write_kv_rows` into these caches with everything but the step's tokens fixed: a
    function of ``(k, v, slots)`` that the caller has checked as :func:`write_kv_rows` does,
    with k and v in ``dtype`` and their ``k_strides`` / ``v_strides`` (a serving engine checks
    its caches and scales once, and each step only that its tokens are like the last step's).
    The slots' values are checked in the pass, before anything is written. The function holds
    the caches' and the mean's addresses: the caller keeps them alive."""
    fn, dt, isa = module().qfa_encode_kv_tokens, DTYPE_CODES[dtype], _isa(isa)
    heads, (k_st, k_sh), (v_st, v_sh) = k_cache.shape[1], k_strides[:2], v_strides[:2]
    blocks, _, block_size, _ = k_cache.shape
    s_block, s_head, s_slot = k_cache.stride()[:3]
    k_ptr, v_ptr = _addr(k_cache, "k_cache"), _addr(v_cache, "v_cache")
    mu = None if mean is None else _addr(mean, "mean")

    def write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> int | SlotRefused:
        tokens = k.shape[0]
        if tokens == 0:
            return 0
        sat, bad = ctypes.c_int64(0), ctypes.c_int64(-1)
        result = fn(_addr(k, "k"), _addr(v, "v"), dt, tokens, heads, k_st, k_sh, v_st, v_sh, mu, int(rotate), c,
                    k_scale, v_scale, k_ptr, v_ptr, _addr(slots, "slots"), int(slots.dtype == torch.int32), block_size,
                    blocks, s_block, s_head, s_slot, torch.get_num_threads(), isa, ctypes.byref(sat),
                    ctypes.byref(bad))
        return _slot_result(result, bad, sat, "write_kv_rows")
    return write


def quantize_flat(x: torch.Tensor, scale: float, isa: int | None = None) -> tuple[torch.Tensor, int]:
    """``(codes, saturated)``: the codes of ``x / scale`` (fp32 division, saturating) of a
    contiguous float ``x`` and the number of finite quotients at or beyond the overflow threshold."""
    out = torch.empty(x.shape, dtype=torch.uint8, device="cpu")
    sat = 0
    if x.numel():
        sat = _checked(module().qfa_quantize_flat(_addr(x, "x"), DTYPE_CODES[x.dtype], _addr(out, "out"), x.numel(), scale,
                                                  torch.get_num_threads(), _isa(isa)), "quantize_flat")
    return out, sat


class _Tensor(ctypes.Structure):
    """One tensor of a batched pass: the source's PrepTensor, field for field."""

    _fields_ = [("x", _P), ("dt", _I), ("strides", _P), ("segs", _P), ("nseg", _I), ("heads", _I), ("rotate", _I),
                ("mean", _P), ("compute_mean", _I), ("out", _P), ("out_strides", _P), ("scale", _D)]


class RowPass(NamedTuple):
    """One tensor of :func:`stats_many` / :func:`encode_many`: ``x`` seen as (A, N, S, 128) with
    element ``strides`` (sA, sN, sS), its rows by ``segments`` (flat (a, s0, valid, all)
    quadruples), ``heads`` = N; rotated or not; ``mean`` the K means to subtract (contiguous fp32
    (segments, N, 128)) or None, and with ``compute_mean`` (pass 1) written there first; for pass
    2 the uint8 ``out`` with ``out_strides`` and the ``scale``."""

    x: torch.Tensor
    strides: Sequence[int]
    segments: Sequence[int]
    heads: int
    rotate: bool
    mean: torch.Tensor | None = None
    compute_mean: bool = False
    out: torch.Tensor | None = None
    out_strides: Sequence[int] = (0, 0, 0)
    scale: float = 1.0


def _check_mean(mean: torch.Tensor | None, segments, heads: int, name: str = "mean") -> None:
    if mean is not None and (mean.dtype != torch.float32 or not mean.is_contiguous()
                             or mean.numel() != len(segments) // 4 * heads * 128):
        raise ValueError(f"{name} must be a contiguous fp32 (segments, heads, 128) tensor")


def _structs(passes: Sequence[RowPass], encode: bool) -> tuple[ctypes.Array, list]:
    """The passes as the source's array of PrepTensor, and the ctypes arrays its pointers point
    into (the caller holds them until the call returns)."""
    keep: list = []
    arr = (_Tensor * len(passes))()
    for t, p in zip(arr, passes):
        _check_rows(p.x, p.strides, p.segments, p.heads)
        _check_mean(p.mean, p.segments, p.heads)
        if encode:
            if p.out is None or p.out.dtype != torch.uint8:
                raise ValueError(f"out must be uint8, got {None if p.out is None else p.out.dtype}")
            _check_rows(p.out, p.out_strides, p.segments, p.heads, "out")
        strides, segs, out_strides = _ints(p.strides), _ints(p.segments), _ints(p.out_strides)
        keep += [strides, segs, out_strides]
        t.x, t.dt, t.nseg, t.heads, t.rotate = _addr(p.x, "x"), DTYPE_CODES[p.x.dtype], len(p.segments) // 4, p.heads, \
            int(p.rotate)
        t.strides, t.segs, t.out_strides = ctypes.addressof(strides), ctypes.addressof(segs), ctypes.addressof(out_strides)
        t.mean = None if p.mean is None else _addr(p.mean, "mean")
        t.compute_mean = int(p.compute_mean)
        t.out = None if p.out is None else _addr(p.out, "out")
        t.scale = float(p.scale)
    return arr, keep


def stats_many(passes: Sequence[RowPass], c: float, isa: int | None = None) -> list[tuple[float, float, bool]]:
    """Pass 1 of several tensors in one parallel region: per pass, ``(sum of squares, amax,
    nonfinite)`` of ``H (x - mu)`` over the valid rows (each pass's result the same as alone)."""
    if not passes:
        return []
    arr, alive = _structs(passes, encode=False)
    result = (ctypes.c_double * (3 * len(passes)))()
    _checked(module().qfa_prep_stats(len(passes), arr, c, torch.get_num_threads(), _isa(isa), result), "stats")
    return [(result[3 * i], result[3 * i + 1], result[3 * i + 2] != 0.0) for i in range(len(passes))]


def stats(x: torch.Tensor, strides, segments, heads: int, rotate: bool, c: float,
          mean: torch.Tensor | None = None, compute_mean: bool = False,
          isa: int | None = None) -> tuple[float, float, bool]:
    """Pass 1 over the valid rows of ``segments`` (flat (a, s0, valid, all) quadruples) of ``x``
    seen as (A, N, S, 128) with element ``strides`` (sA, sN, sS): ``(sum of squares, amax,
    nonfinite)`` of ``H (x - mu)``, ``mu`` from ``mean`` (contiguous fp32 (segments, N, 128)) or
    none; with ``compute_mean`` the K means are written into ``mean`` first."""
    return stats_many([RowPass(x, strides, segments, heads, rotate, mean, compute_mean)], c, isa)[0]


def key_means(x: torch.Tensor, strides, segments, heads: int, mean_out: torch.Tensor) -> None:
    """The K means of the valid rows per segment and head into ``mean_out`` (contiguous fp32
    (segments, N, 128)): the float64 sum over the rows in order, divided by their count, rounded
    to fp32 (0 where a segment has no valid row)."""
    _check_rows(x, strides, segments, heads)
    if mean_out is None:
        raise ValueError("mean_out must be a contiguous fp32 (segments, heads, 128) tensor, got None")
    _check_mean(mean_out, segments, heads, "mean_out")
    module().qfa_key_means(_addr(x, "x"), DTYPE_CODES[x.dtype], _ints(strides), _ints(segments), len(segments) // 4,
                           heads, _addr(mean_out, "mean_out"), torch.get_num_threads())


def encode_many(passes: Sequence[RowPass], c: float, isa: int | None = None) -> list[int]:
    """Pass 2 of several tensors in one parallel region: per pass, the codes of ``H (x - mu) /
    scale`` for every row of its segments into its ``out``; returns each pass's saturated count."""
    if not passes:
        return []
    arr, alive = _structs(passes, encode=True)
    sat = (ctypes.c_int64 * len(passes))()
    _checked(module().qfa_prep_encode(len(passes), arr, c, torch.get_num_threads(), _isa(isa), sat), "encode_rows")
    return list(sat)


class Passes:
    """Pass 1 and pass 2 of several tensors over one array of the source's PrepTensor, built and
    checked once (half the host work of :func:`stats_many` then :func:`encode_many`, which build
    it per pass): :meth:`stats` runs pass 1 over the first ``count`` of them, :meth:`encode` pass
    2 over all, each one parallel region. Every pass needs its ``out``; a pass whose
    ``compute_mean`` is set writes its means in pass 1 and reads them in pass 2. The tensors
    must stay alive and unchanged between the two."""

    def __init__(self, passes: Sequence[RowPass]):
        self._arr, self._alive = _structs(passes, encode=True)
        self.n = len(passes)
        # pass 1 must run over every pass that computes its means before pass 2 reads them
        self._means_due = max((i + 1 for i, p in enumerate(passes) if p.compute_mean), default=0)

    def stats(self, count: int, c: float, isa: int | None = None) -> list[tuple[float, float, bool]]:
        """Pass 1 of the first ``count`` tensors: as :func:`stats_many`."""
        if not self._means_due <= count <= self.n:
            raise ValueError(f"count must be in [{self._means_due}, {self.n}] (every pass computing its means "
                             f"included), got {count}")
        result = (ctypes.c_double * (3 * count))()
        if count:
            _checked(module().qfa_prep_stats(count, self._arr, c, torch.get_num_threads(), _isa(isa), result), "stats")
        self._means_due = 0
        return [(result[3 * i], result[3 * i + 1], result[3 * i + 2] != 0.0) for i in range(count)]

    def encode(self, scales: Sequence[float], c: float, isa: int | None = None) -> list[int]:
        """Pass 2 of every tensor with ``scales`` (one per tensor): as :func:`encode_many`."""
        if len(scales) != self.n:
            raise ValueError(f"scales must hold one value per tensor ({self.n}), got {len(scales)}")
        if self._means_due:
            raise ValueError("pass 2 would read K means that pass 1 has not computed: call stats first")
        for t, s in zip(self._arr, scales):
            t.scale, t.compute_mean = float(s), 0  # pass 1 wrote the means; pass 2 reads them
        sat = (ctypes.c_int64 * self.n)()
        _checked(module().qfa_prep_encode(self.n, self._arr, c, torch.get_num_threads(), _isa(isa), sat), "encode_rows")
        return list(sat)


def encode_rows(x: torch.Tensor, strides, out: torch.Tensor, out_strides, segments, heads: int, rotate: bool, c: float,
                mean: torch.Tensor | None, scale: float, isa: int | None = None) -> int:
    """Pass 2: the codes of ``H (x - mu) / scale`` for every row of ``segments`` into the uint8
    ``out`` (element strides ``out_strides``); returns the saturated count."""
    return encode_many([RowPass(x, strides, segments, heads, rotate, mean, False, out, out_strides, scale)], c, isa)[0]