"""The torch backend's CPU work as one native kernel: ``csrc/cpu_attention.cpp``.

Same contract and numerics as :func:`qfa.attention.backends.torch_path.forward` (the golden reference):
for each query row, its visible keys in 256-key blocks in ascending order, P rounded to HiF8
relative to the running max, exact HiF8 products with fp32 accumulation. The work is organised
the way ATen's own CPU flash attention is: work items of (batch, kv head, query tile), handed
out by an atomic counter, costliest first, to the threads of one region per call; each worker
runs its item alone on cache-resident blocks: the two GEMMs of a block, and one fused pass per
block for max, exp, row sum and alpha with P's HiF8 rounding in 8- or 16-lane integer ops (the table's
bit rule, no 65536-entry gather). The region runs on torch's own OpenMP team: after each of
torch's parallel ops its worker spins for about 10 ms, so in a model a thread of the kernel's
own would share a core with it, where the spinning worker itself joins within microseconds.
When a worker arrives late (another process busy on its core: an OpenMP region's closing
barrier then waits a scheduler slice), the calls of the next 200 ms run on the kernel's own
pool of ``torch.get_num_threads() - 1`` threads instead, whose caller waits only for items a
thread has taken, and whose threads keep off the caller's CPU (``QFA_POOL=omp|own`` pins the
choice; a forked child always uses the pool, since libgomp's team does not survive fork).
Only blocks that cross the causal diagonal are masked. Prefill decodes each batch's K and V
once (fp32, or bf16 on the AVX512_BF16 build); decode reads the 1-byte codes of each block
directly. A call is one parallel region whatever its batch holds: the blocks to decode are its
first items, then everything else costliest first (a split item as its chunks in key order), and
an item waits only for items already running, so a mixed batch (vLLM's chunked prefill beside decodes)
is balanced over the threads as one piece of work. Paged K/V (a block table, PA_BBND / PA_BNBD)
is read in place, each key's codes addressed through the table (vLLM's CPU cache view, K and V
the two halves of each token's 256 bytes, is such a PA_BNBD pair).

On AVX2 / AVX-512 builds the GEMMs are the kernel's own: register tiles of 6 rows x 16 columns
(12 accumulators, 12 FMAs per 2 loads and 6 broadcasts), K decoded into panels of 16 keys
(dims major) and V into slices of 16 dims (keys major), so each operand a tile reads is
contiguous and stays in L1; every element is one FMA chain over the summed index in ascending
order. Per-block MKL calls spent about a tenth of the time packing operands and scaling C, and
the kernel runs 14-17 % less CPU time without them (measured single-threaded on the AVX2 EPYC).
On the AVX512_BF16 build (torch's AVX512 capability and the CPU's avx512_bf16 flag) the
many-row blocks run both GEMMs as bf16 dot products (vdpbf16ps) instead: HiF8 values and
HiF8-rounded P are exact in bf16 and the product of two is exact in fp32, so this computes the
same numbers up to fp32 summation order. Each element is one chain over pairs of the summed index
in ascending order (dims 2d, 2d + 1; keys 2j, 2j + 1), each step adding the pair's two exact
products to the accumulator with at most two roundings: n terms, at most n roundings, as in the
fp32 chains (tests/attention/test_cpu_kernel_bf16.py derives its bounds from this). Tiles of 12 rows x 32
columns, K in panels of 32 keys by dim pairs, V in slices of 32 dims by key pairs, both decoded
straight to bf16; a block holding a value of V that is not finite runs the fp32 per-row kernel,
as it does beside the fp32 tiles. ``QFA_BF16_DOT=0`` runs the fp32 tiles in the same build.
Blocks of at most 16 rows (decode: new tokens x the GQA group) use fused kernels: 8 keys at a
time are decoded (AVX2: per group of 8 magnitudes the bf16 pattern is affine in the code's low 3
bits, with coefficients fitted to the 256-entry table at init, looked up with ``vpshufb`` and
applied with one ``vpmaddubsw``; bit-exact to the table) into an L1 buffer and the dot products
run from there in a fixed order; their P @ V chains are the tiles' (a zero P adds nothing to a
finite value), and a block holding a non-finite V value runs them so that it reaches only the
rows that see its key. Which path a
block takes depends only on the item's shape. The scalar build (no vector ISA), and head dims
other than 128, call torch's mm per block (MKL's sgemm where torch has it; ``host_mm`` in the
bindings, as the kernel's file includes no ATen header); its workers pin both OpenMP's and MKL's thread count to 1
(torch sets MKL's, which MKL reads instead of OpenMP's: without it, every GEMM inside a worker
opened a nested team).

Decode-shaped items (a few rows: new tokens x the GQA group; too few items to fill the cores)
split their keys into chunks of whole 256-key blocks. A chunk starts from the running max the
sequential walk has before its first block (pass 1 computes each chunk's row maxima, and keeps
the scores for pass 2 within a budget; max is exact; a chunk's two passes run on one thread,
its pass 2 once the earlier chunks' pass 1 is done), so every exponent, every P and every
HiF8(P) is the sequential walk's, bit for bit. What differs is only fp32
reassociation in the alphas: the sequential walk applies each block's alpha to l and O in turn,
``l = (l * a1 + r1) * a2 + r2``; a chunk starts from l = 0, O = 0 and keeps the product of its
alphas, and the merge, in chunk order, computes ``l = l * (a1 * a2) + ((0 * a1 + r1) * a2 + r2)``
(the same for O). The split depends only on the item's own shape, never on the thread count or on
the other batches, so the result is the same bits on any number of threads, and a batch gives
the same bits alone or in a batch of others.

The extension is compiled on first use (``torch.utils.cpp_extension.load``, into torch's
extension cache) with the vector flags of the CPU capability torch itself detected (AVX512
raised to AVX512_BF16 where /proc/cpuinfo lists avx512_bf16); the build name carries the
capability and a hash of the CPU's /proc/cpuinfo flags, so a machine never loads a binary built
for another CPU. Where no compiler is present or the build fails, :func:`available` says False
and warns once, and the op runs :mod:`qfa.attention.backends.torch_path`. ``QFA_NATIVE=0`` turns the
kernel off.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from qfa import _environ, csrc
from qfa.cast import luts
from qfa.cast import mxfp8
from qfa.cast import rounding
from qfa.tiling.attention import AttentionPlan, bound_mismatch, check_scale_floats, lse_shape, normalised_strides
from qfa.tiling.spec import HEAD_DIM, QuantMode

ENV_VAR = "QFA_NATIVE"
SOURCE = Path(csrc.__file__).resolve().parent / "cpu_attention.cpp"
#: The Python module (plain CPython, no pybind11 module: a third of the CPU time of the cold build
#: it was), a second source, which ninja compiles on another core beside the kernel. On the 2-core
#: Zen 4 the cold build went from 24 s to 14 (the kernel's own compile, 12-14 s, is the rest).
BINDINGS = SOURCE.with_name("cpu_attention_bindings.cpp")
#: GQA rows (query positions x group) per work item. Measured on the 2-core EPYC, (12, 2) S=2048
#: causal, one thread: 256 rows 230 ms, 128 rows 250-310 ms (MKL runs the larger M faster, and
#: the K/V blocks are read half as often).
TILE_ROWS = 256
#: Items of at most this many rows (decode: new tokens x GQA group) split their keys into chunks
#: of CHUNK_BLOCKS 256-key blocks. Constants of the item's own shape, not of the thread count or
#: the rest of the call: the split changes fp32 reassociation, and the bits must not move.
SPLIT_ROWS = 128
CHUNK_BLOCKS = 4
#: Prefill decodes the K and V that several tiles read to fp32 once, up to this many bytes.
PREDECODE_BYTES = 1 << 30
#: A split item's chunk keeps its pass 1's scores for its pass 2 (rather than computing them twice)
#: up to this many bytes, in the scratch of the thread that runs both passes, which the thread keeps
#: for the next call (decode calls come one per token, alike: fresh pages' faults cost more than
#: computing the scores again). A chunk's scores are at most SPLIT_ROWS x CHUNK_BLOCKS x 256 floats
#: (512 KB), so the default always keeps them. Measured on the 2-core Zen 5 EPYC, one thread,
#: Sq = 16, (12, 2), kept vs recomputed (when every chunk's scores were kept at once, before any
#: pass 2): B = 1 at Skv = 65536 30 vs 38 ms, B = 8 at 16384 58 vs 75.
SCORE_STORE_BYTES = 1 << 27

# -mf16c: GCC's -mavx512f does not imply it (every AVX-512 CPU has it); E4M3's decode converts fp16.
_AVX512 = ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
           "-mavx512dq", "-mfma", "-mf16c"]
_VECTOR_FLAGS = {
    # torch's AVX512 capability plus the bf16 dot products of the many-row blocks.
    "AVX512_BF16": [*_AVX512, "-mavx512bf16"],
    "AVX512": _AVX512,
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
#: The /proc/cpuinfo flag the AVX512_BF16 build needs beside torch's AVX512 capability.
BF16_FLAG = "avx512_bf16"
#: ``QFA_BF16_DOT=0``: the AVX512_BF16 build runs its fp32 tiles instead (same build, for comparisons).
BF16_ENV_VAR = "QFA_BF16_DOT"
#: Whether the kernel reads paged K/V (a block table) in place: op.py then hands it the table.
READS_PAGED_KV = True
# No contraction to FMA: the fused step must round S * dScale and the subtraction separately,
# as the torch path does. -fopenmp: the kernel opens torch's OpenMP region itself (the one
# at::parallel_for opens, see csrc/parallel_region.h), and the preparation its own.
_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]

_lock = threading.Lock()  # held for the build: a second caller waits for it
_module: ModuleType | None = None
_failed = False
#: A failed build's exception until available() has warned of it: once, in a caller's thread (not
#: in a background build's, where no filter or stack level of the caller would apply).
_error: Exception | None = None
_start_lock = threading.Lock()
#: The background build start_build() started in this process, if any.
_builder: threading.Thread | None = None


def cpu_capability() -> str:
    """The vector ISA the kernel is built for: torch's own detection (AVX512, AVX2 or DEFAULT),
    as AVX512_BF16 where torch says AVX512 and the CPU's flags have avx512_bf16."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512" and BF16_FLAG in _cpu_flags().split():
        return "AVX512_BF16"
    return cap if cap in _VECTOR_FLAGS else "DEFAULT"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def bf16_dot() -> bool:
    """Whether calls run the many-row blocks as bf16 dot products: the AVX512_BF16 build is
    loaded, and ``QFA_BF16_DOT`` is not 0."""
    return available() and _module.has_bf16_dot() and _environ.read(BF16_ENV_VAR, "1") != "0"


def last_paths() -> list[str]:
    """The kernels the blocks of the last call in this process ran: any of ``AVX512_BF16`` (bf16
    dot products), ``AVX2`` (the fp32 tiles, and the few-row fused kernels of the AVX2 build),
    ``AVX512`` (the AVX-512 builds' 16-lane few-row kernels) and ``scalar`` (MKL GEMMs, the
    build without a vector ISA)."""
    if not available():
        raise RuntimeError("the native CPU attention kernel is not available (see qfa.attention.backends.cpu_kernel.available)")
    return list(_module.last_paths())


def peak_kinds() -> list[str]:
    """The loops :func:`peak_gflops` can time in this build: ``fp32_avx2`` and ``fp32_avx512``
    (FMA on 8 / 16 lanes), ``bf16_dot`` (vdpbf16ps)."""
    if not available():
        return []
    return list(_module.peak_kinds())


def peak_gflops(kind: str, threads: int | None = None, seconds: float = 0.2) -> float:
    """The CPU's measured peak: ``threads`` threads (default torch's count) at once run
    independent chains of ``kind`` (see :func:`peak_kinds`), each for about ``seconds`` of its
    own CPU time, timed in windows of a few milliseconds of it; the sum of the threads' best
    window rates (so neither another process sharing the cores nor a slow stretch of a shared
    virtual machine's host lowers it)."""
    kinds = peak_kinds()
    if kind not in kinds:
        raise ValueError(f"kind must be one of this build's {kinds}, got {kind!r}")
    threads = torch.get_num_threads() if threads is None else threads
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds <= 10:
        raise ValueError(f"seconds must be a number in (0, 10], got {seconds!r}")
    return float(_module.peak_gflops(kind, threads, float(seconds)))


def headers_digest() -> bytes:
    """The content of the headers the sources include (``csrc/*.h``). torch's loader rebuilds
    when a listed source or the flags change, but it lists no headers: they go into the name."""
    digest = hashlib.sha1()
    for header in sorted(SOURCE.parent.glob("*.h")):
        digest.update(header.name.encode())
        digest.update(header.read_bytes())
    return digest.digest()


def build_name() -> str:
    """Extension name: capability plus a hash of the CPU flags, torch version and headers (torch's
    loader itself rebuilds when the source or the flags change)."""
    digest = hashlib.sha1()
    digest.update(_cpu_flags().encode())
    digest.update(torch.__version__.encode())
    digest.update(headers_digest())
    return f"qfa_cpu_attention_{cpu_capability().lower()}_{digest.hexdigest()[:12]}"


def sources() -> list[str]:
    """The extension's sources: the kernel and, from the same folder, its Python module."""
    return [str(SOURCE), str(SOURCE.with_name(BINDINGS.name))]


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    for source in sources():
        if not Path(source).is_file():
            raise FileNotFoundError(f"{source} (the native kernel's source, package data of qfa.csrc)")
    flags = _COMMON_FLAGS + _VECTOR_FLAGS.get(cpu_capability(), [])
    # libgomp, torch's own OpenMP runtime (the same soname: one runtime in the process).
    return load(name=build_name(), sources=sources(), extra_cflags=flags, extra_ldflags=["-lgomp"], verbose=False)


def enabled() -> bool:
    return _environ.read(ENV_VAR, "1") != "0"


def _load() -> None:
    global _module, _failed, _error
    with _lock:
        if _module is None and not _failed:
            try:
                _module = _build()
            except Exception as exc:  # no compiler, no ninja, a build error, ...
                _failed, _error = True, exc


def start_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """``target`` on a new thread that is not a daemon: the interpreter's exit waits for a build
    it runs rather than cutting the compiler off, which would leave torch's lock file in the
    build directory (the next process's build would wait on it forever)."""
    thread = threading.Thread(target=target, name=name)
    thread.start()
    return thread


def start_build() -> None:
    """Start building the kernel on a background thread, where it is not built or being built yet,
    so that it compiles while the caller does something else (the preparation's build: the two
    compiles share the cores instead of running one after the other). :func:`available` waits
    for it and warns, as ever, if it failed."""
    global _builder
    with _start_lock:
        if enabled() and _module is None and not _failed and _builder is None:
            _builder = start_thread(_load, "qfa-build-cpu-attention")


def available() -> bool:
    """Whether the native kernel runs: built (once, thread-safe) and not disabled by QFA_NATIVE=0."""
    if not enabled():
        return False
    if _module is None and not _failed:
        from qfa.attention.backends import cpu_prepare

        # Most callers of the kernel prepare their inputs natively too (the demo asks for both):
        # that 2 s build runs beside this one.
        cpu_prepare.start_build()
        _load()
    if _error is not None:
        _warn_once()
    return _module is not None


def _warn_once() -> None:
    global _error
    with _start_lock:
        exc, _error = _error, None
    if exc is not None:
        warnings.warn(f"qfa: the native CPU attention kernel is unavailable ({exc!r}); the pure-torch path "
                      "(qfa.attention.backends.torch_path) runs instead", stacklevel=3)


def _after_fork_in_child() -> None:
    # A build on another thread does not exist in the child, and its locks may have been held at
    # the fork: fresh ones, and the child builds for itself (torch's lock file makes it wait for a
    # build the parent is still running, then load that).
    global _lock, _start_lock, _builder
    _lock, _start_lock, _builder = threading.Lock(), threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _round_consts() -> list[int]:
    return [*rounding.BAND_LIMITS, rounding.MIN_DENORMAL_BITS, rounding.UNDERFLOW_BITS, rounding.MAX_BITS,
            rounding.NAN_BITS]


_ROUND_CONSTS = _round_consts()
_FP32 = struct.Struct("f")
_table: torch.Tensor | None = None


def round_fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 (ties to even; beyond FLT_MAX's rounding range, inf), as
    a Python float."""
    try:
        return _FP32.unpack(_FP32.pack(x))[0]
    except OverflowError:  # struct refuses a finite x that rounds to inf
        return math.copysign(math.inf, x)


def dscale_of(q_descale: float, k_descale: float, softmax_scale: float) -> float:
    """The torch path's ``(q_descale * k_descale) * softmax_scale`` on fp32 tensors, from the
    descales' values: fp32 times fp32 is exact in a double, so one rounding gives the fp32
    product, and torch rounds a Python scalar to the tensor's fp32 before multiplying."""
    return round_fp32(round_fp32(q_descale * k_descale) * round_fp32(softmax_scale))


def _decode_table() -> torch.Tensor:
    global _table
    if _table is None:
        _table = luts.decode_lut(torch.float32).view(torch.float32)
    return _table


#: The dtypes the kernel's rotated epilogue writes (csrc/row_rotation.h's), and the head dim of
#: its rows (the HiF8 mode's; row_rotation.h's kD).
ROTATED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROTATION_DIM = HEAD_DIM


@dataclass
class RotatedOutput:
    """The HiF8 drop-in's epilogue, asked of :func:`forward`: ``out`` as ``H bf16(out)`` in
    ``dtype``, with H the normalised Hadamard rotation (``c`` its fp32 normalisation) and finite
    values beyond ``dtype``'s range saturated: bit for bit what
    :func:`qfa.dropin.prepare.restore_output` makes of the op's bf16 out (a NaN as a NaN: its sign
    follows the SIMD level, as between the preparation's levels), written as the kernel finishes
    each row instead of in a pass of its own over a bf16 copy. ``applied`` is set when
    a run did so (head dim 128 and one of :data:`ROTATED_DTYPES`; the op runs it only on this
    kernel with K/V not paged); otherwise out is the op's usual bf16 out."""

    dtype: torch.dtype
    c: float
    applied: bool = False


def forward(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor, p_scale: torch.Tensor | None,
    *, known_available: bool = False, block_table: torch.Tensor | None = None,
    rotated: RotatedOutput | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the plan; returns (out bf16 in q's layout, lse fp32 or an empty tensor), as torch_path.
    ``known_available``: the caller has just seen :func:`available` say True (the op has).
    ``block_table``: paged K/V (the plan's layout_kv PA_*), read in place. ``rotated``: the
    drop-in's epilogue (see :class:`RotatedOutput`), out then in its dtype where it applies."""
    device = q.device
    rotate_c = 0.0
    out_dtype = torch.bfloat16
    # (an empty out has no rows to rotate: its bf16 form costs nothing, and its storage no pointer)
    if rotated is not None and plan.head_dim == ROTATION_DIM and rotated.dtype in ROTATED_DTYPES and q.numel():
        rotate_c, out_dtype = float(rotated.c), rotated.dtype
    # Contiguous whatever q's strides (plan.out_strides are the contiguous out's). Left unfilled:
    # the kernel sets rows no batch owns to 0 / +inf on the calling thread (``fill``), since a
    # torch fill here would leave torch's OpenMP worker spinning on the core the kernel needs.
    out = torch.empty_like(q, dtype=out_dtype, memory_format=torch.contiguous_format)
    if plan.return_lse:
        lse = torch.empty(lse_shape(q.shape, plan.layout), dtype=torch.float32, device=device)
        lse_strides = plan.lse_strides if lse.numel() else (0, 0, 0)  # the contiguous lse's, as planned
    else:
        lse = torch.empty(0, dtype=torch.float32, device=device)
        lse_strides = (0, 0, 0)
    _run(plan, q, k, v, q_descale, k_descale, v_descale, p_scale, out, plan.out_strides, lse, lse_strides,
         SPLIT_ROWS, CHUNK_BLOCKS, TILE_ROWS, device, known_available, block_table, None, fill=True,
         rotate_c=rotate_c)
    if rotate_c:  # said once the run has written it (a run that raises leaves the request as it was)
        rotated.applied = True
    return out, lse


def run_into(plan: AttentionPlan, q, k, v, q_descale, k_descale, v_descale, p_scale, out, lse, *,
             split_rows: int = SPLIT_ROWS, chunk_blocks: int = CHUNK_BLOCKS, tile_rows: int = TILE_ROWS,
             block_table: torch.Tensor | None = None, bf16_dot: bool | None = None) -> None:
    """Write every row the batches own (q_lens of them) into ``out`` / ``lse``; rows past them
    are left as they are (``forward`` allocates them as 0 / +inf). ``bf16_dot``: run the
    many-row blocks as bf16 dot products (True; needs the AVX512_BF16 build) or the fp32 tiles
    (False); None: as :func:`bf16_dot` says."""
    lse_strides = (0, 0, 0)
    if lse.numel():
        lse_strides = (0, *lse.stride()) if plan.layout == "TND" else lse.stride()
    _run(plan, q, k, v, q_descale, k_descale, v_descale, p_scale, out, normalised_strides(out, plan.layout), lse,
         lse_strides, split_rows, chunk_blocks, tile_rows, q.device, False, block_table, bf16_dot, fill=False)


def _table_of(plan: AttentionPlan, block_table: torch.Tensor | None) -> torch.Tensor:
    """The block table as the kernel reads it (int32, unit stride along a row), or an empty one."""
    if not plan.paged:
        if block_table is not None:
            raise ValueError("block_table is for paged K/V (layout_kv PA_BBND / PA_BNBD); the plan's K/V are "
                             f"{plan.layout_kv or plan.layout}")
        return _NO_TABLE
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        got = f"{block_table.dtype} {tuple(block_table.shape)}" if isinstance(block_table, torch.Tensor) else \
            type(block_table).__name__
        raise ValueError(f"block_table must be the plan's int32 (B, blocks) table for paged K/V, got {got}")
    return block_table if block_table.stride(1) == 1 else block_table.contiguous()


_NO_TABLE = torch.empty(0, 0, dtype=torch.int32, device="cpu")
_NO_SCALE = torch.empty(0, device="cpu")
_NO_LSE = torch.empty(0, dtype=torch.float32, device="cpu")


def _run(plan: AttentionPlan, q, k, v, q_descale, k_descale, v_descale, p_scale, out, out_strides, lse,
         lse_strides, split_rows: int, chunk_blocks: int, tile_rows: int, device: torch.device,
         known_available: bool, block_table: torch.Tensor | None, bf16: bool | None, *, fill: bool,
         rotate_c: float = 0.0) -> None:
    """``run_into`` with out's normalised strides and lse's (batch, head, position) strides given;
    ``fill``: out and lse are fresh and contiguous, set to 0 / +inf before the kernel's rows."""
    if device.type != "cpu":
        raise ValueError(f"q must be on the CPU for the native kernel, got {device}")
    if not (known_available and _module is not None) and not available():
        raise RuntimeError("the native CPU attention kernel is not available (see qfa.attention.backends.cpu_kernel.available)")
    table = _table_of(plan, block_table)
    if bf16 is None:
        bf16 = bf16_dot()
    elif bf16 and not _module.has_bf16_dot():
        raise ValueError(f"bf16_dot=True needs the AVX512_BF16 build (this CPU's is {cpu_capability()}: "
                         f"{'no ' + BF16_FLAG + ' flag' if BF16_FLAG not in _cpu_flags().split() else 'another build'})")
    # The scalars the torch path forms with fp32 tensor ops, bit for bit (see dscale_of).
    dscale = dscale_of(q_descale.item(), k_descale.item(), plan.softmax_scale)
    ln_p = torch.log(p_scale).item() if p_scale is not None else 0.0
    _launch(plan, q, k, v, out, out_strides, lse, lse_strides, dscale, ln_p, v_descale.item(), table, bf16, fill,
            rotate_c, split_rows, chunk_blocks, tile_rows)


def _launch(plan: AttentionPlan, q, k, v, out, out_strides, lse, lse_strides, dscale: float, ln_p: float,
            v_descale: float, table: torch.Tensor, bf16: bool, fill: bool, rotate_c: float,
            split_rows: int = SPLIT_ROWS, chunk_blocks: int = CHUNK_BLOCKS, tile_rows: int = TILE_ROWS) -> None:
    """The HiF8 mode's native call, every argument checked and every scalar formed."""
    # Sequences of ints go over as the std::vector<int64_t> arguments (tuples as well as lists).
    _module.forward(
        q, k, v, (*plan.strides_q, *plan.strides_kv, *plan.strides_v), out, out_strides, lse, lse_strides,
        plan.heads_kv, plan.group, plan.head_dim, plan.block_n, plan.q_starts, plan.kv_starts,
        plan.q_lens, plan.kv_lens, bool(plan.causal), dscale, ln_p, v_descale, _decode_table(),
        _ROUND_CONSTS, tile_rows, split_rows, chunk_blocks, PREDECODE_BYTES, SCORE_STORE_BYTES, table,
        plan.block_size, bool(bf16), fill, 0, _NO_SCALE, _NO_SCALE, [], _NO_SCALE, [], _NO_SCALE, [], [], _NO_SCALE,
        rotate_c, MIN_BF16_E8M0,
    )


def run_bound(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *,
              q_descale: float, k_descale: float, v_descale: float, block_table: torch.Tensor | None = None,
              rotate_c: float = 0.0) -> None:
    """The HiF8 mode's kernel on tensors a checked plan was bound for, with the descales' values
    given: what :func:`forward` runs after its per-call work, for an engine that runs one plan on
    many layers' tensors (a vLLM step: one batch and block table, each layer its cache and
    scales).

    Checked here: ``plan`` is the one ``tiling.bind`` made of its metadata for tensors of q, k,
    v and ``block_table``'s geometry (so the op call that bound it checked these shapes and
    strides), the descales (the op's ranges, ``tiling.check_scale_floats``), and ``out``. The
    caller vouches for what only the table's values say: they were checked against the plan
    (``tiling.check_block_table_values``) since they last changed.

    ``out``: contiguous, q's shape, on the CPU; bf16 (the op's out), or with ``rotate_c`` (the
    rotation's normalisation, > 0) fp32 / bf16 / fp16 holding :class:`RotatedOutput`'s rows.
    Every row of ``out`` is written (rows no sequence owns as 0); no LSE."""
    if not available():
        raise RuntimeError("the native CPU attention kernel is not available (see qfa.attention.backends.cpu_kernel.available)")
    if plan.meta.quant_mode != QuantMode.HIF8_PER_TENSOR or plan.return_lse:
        raise ValueError("run_bound runs HiF8 (quant_mode 0) plans without LSE")
    if any(t.dtype != torch.uint8 or not t.is_cpu for t in (q, k, v)):
        raise ValueError(f"q, k and v must be uint8 HiF8 codes on the CPU, got {q.dtype} / {k.dtype} / {v.dtype} on "
                         f"{q.device} / {k.device} / {v.device}")
    differs = bound_mismatch(plan, q, k, v, block_table)
    if differs is not None:
        raise ValueError(f"{differs} must have the geometry the plan was bound for (an op call with this metadata on "
                         f"tensors like these binds it)")
    if not (rotate_c == 0 or 0 < rotate_c < math.inf):
        raise ValueError(f"rotate_c must be 0 (no rotation) or the rotation's positive normalisation, got {rotate_c}")
    dtypes = ROTATED_DTYPES if rotate_c else (torch.bfloat16,)
    if out.dtype not in dtypes or out.shape != q.shape or not out.is_contiguous() or not out.is_cpu:
        raise ValueError(f"out must be a contiguous CPU tensor of q's shape {tuple(q.shape)} in "
                         f"{' / '.join(str(d) for d in dtypes)}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if rotate_c and plan.head_dim != ROTATION_DIM:
        raise ValueError(f"the rotated output needs head dim {ROTATION_DIM}, got {plan.head_dim}")
    check_scale_floats(plan, q_descale, k_descale, v_descale)
    _launch(plan, q, k, v, out, plan.out_strides, _NO_LSE, (0, 0, 0), dscale_of(q_descale, k_descale, plan.softmax_scale),
            0.0, v_descale, _table_of(plan, block_table), bf16_dot(), True, rotate_c)


# ---- quant_modes 1 (MXFP8) and 6 (FP8 per-token-head) -------------------------------------------
# The numerics of qfa.attention.backends.scaled_torch_path (the golden reference of these modes),
# on the same kernel: the same items, region, key chunks and GEMM tiles, with E4M3 codes decoded
# from a 256-entry table (vpshufb for the subnormals), P rounded to E4M3 and 512-key softmax
# blocks (the plan's block_n). Mode 1 folds its E8M0 scales into Q, K and V as they are decoded
# (a power of two times an E4M3 value is exact in fp32, so these are the torch path's operands);
# mode 6 scales S per row and column and P8 V per head, where the torch path does. Paged K/V and
# its scales are read in place through the block table.

#: The bf16 dot products need every scaled value of mode 1 to be a normal bf16 and every product
#: of two to be a normal fp32 (vdpbf16ps treats subnormals as zero): E4M3 values are at least
#: 2^-9, so scales of at least 2^(73 - 127) suffice (2 x (-9 + 73 - 127) = -126). Calls with a
#: smaller scale run the fp32 tiles (the same numbers up to summation order either way).
MIN_BF16_E8M0 = 73


def _e4m3_table() -> torch.Tensor:
    global _e4m3
    if _e4m3 is None:  # torch's fp8 cast, as the torch path's ``_values``: every E4M3 value is an fp32
        _e4m3 = torch.arange(256, dtype=torch.uint8, device="cpu").view(torch.float8_e4m3fn).to(torch.float32)
    return _e4m3


def _e8m0_table() -> torch.Tensor:
    global _e8m0
    if _e8m0 is None:  # as the torch path's ``_expand``
        _e8m0 = torch.arange(256, dtype=torch.uint8, device="cpu").view(torch.float8_e8m0fnu).to(torch.float32)
    return _e8m0


_e4m3: torch.Tensor | None = None
_e8m0: torch.Tensor | None = None


def supports_scaled(plan: AttentionPlan) -> bool:
    """Whether the kernel runs this mode 1 / 6 plan: built, on the CPU, and a head dim that is a
    multiple of the build's vector width (mode 1's D = 72 is not on AVX-512: the torch path
    runs it)."""
    return plan.device.type == "cpu" and available() and plan.head_dim % _module.vec_width() == 0


def _pairs_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` (.., pairs, 2) with its last two axes contiguous, so a row's scales lie at stride 1."""
    return t if t.stride(-1) == 1 and t.stride(-2) == 2 else t.contiguous()


def _mxfp8_scales(plan: AttentionPlan, q_descale, k_descale, v_descale):
    """(q scales (Tq, Nq, ceil(D/32)) E8M0 and its (token, head) strides, k and v scales with
    the kernel's descriptors, v's per-batch first key); the kernel reads E8M0 codes as bytes."""
    meta = plan.meta
    q_s = mxfp8.unpack_q_descale(q_descale, plan.head_dim, meta.layout_q_descale)
    k_s = _pairs_contiguous(k_descale)
    v_s = v_descale
    st_k, st_v = k_s.stride(), v_s.stride()
    if meta.layout_kv == "TND":  # k (T, N, P, 2); v (sum ceil(len/64), N, D, 2)
        k_desc = [0, st_k[1], st_k[0], 1, 0, 1, 32]
        v_desc = [0, st_v[1], st_v[0], 64, st_v[3], st_v[2], 1]
        starts = plan.derived.get("mxfp8_v_starts")
        if starts is None:  # a function of the plan's lengths alone: derived once per plan
            starts = plan.derived.setdefault("mxfp8_v_starts", _tnd_v_starts(plan))
    elif meta.layout_kv == "PA_BBND":  # k (Bn, Bs, N, P, 2); v (Bn, Bs/64, N, D, 2)
        k_desc = [st_k[0], st_k[2], st_k[1], 1, 0, 1, 32]
        v_desc = [st_v[0], st_v[2], st_v[1], 64, st_v[4], st_v[3], 1]
        starts = [0] * plan.batch
    else:  # PA_BNBD: k (Bn, N, Bs, P, 2); v (Bn, N, Bs/64, D, 2)
        k_desc = [st_k[0], st_k[1], st_k[2], 1, 0, 1, 32]
        v_desc = [st_v[0], st_v[1], st_v[2], 64, st_v[4], st_v[3], 1]
        starts = [0] * plan.batch
    return q_s, list(q_s.stride()[:2]), k_s, k_desc, v_s, v_desc, starts


def _tnd_v_starts(plan: AttentionPlan) -> tuple[int, ...]:
    """TND v_descale: each sequence's first key in the stacked scale rows (sequences start at
    multiples of 64 keys there: their key counts are padded to pairs of 32-key blocks)."""
    from qfa.tiling.scaled_checks import kv_segment_lengths

    rows, starts = 0, []
    for n in kv_segment_lengths(plan):
        starts.append(64 * rows)
        rows += -(-n // 64)
    return tuple(starts)


#: ln(p_scale) by p_scale's value: torch.log of a one-element fp32 tensor is a function of that
#: value (TensorIterator runs the scalar logf on fewer elements than a vector), so the entry made
#: from the first tensor holding it is the double torch.log(p_scale).item() gives for every other
#: (+0.0 and -0.0, equal keys, both give -inf). Bounded: a new value past the bound is not kept.
_LN_P_SIZE = 64
_ln_p: dict[float, float] = {}


def _ln_p_scale(p_scale: torch.Tensor | None) -> float:
    if p_scale is None:
        return 0.0
    if p_scale.dtype != torch.float32:  # the memo is of fp32's log (the op only passes fp32 here)
        return torch.log(p_scale).item()
    p = p_scale.item()
    ln_p = _ln_p.get(p)
    if ln_p is None:
        ln_p = torch.log(p_scale).item()
        if len(_ln_p) < _LN_P_SIZE and p == p:  # NaN is never equal to a key: no entry for it
            _ln_p[p] = ln_p
    return ln_p


def forward_scaled(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor, p_scale: torch.Tensor | None,
    *, block_table: torch.Tensor | None = None, bf16_dot: bool | None = None,
    split_rows: int = SPLIT_ROWS, tile_rows: int = TILE_ROWS, chunk_keys: int = CHUNK_BLOCKS * 256,
    known_available: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a mode 1 / 6 plan as :func:`qfa.attention.backends.scaled_torch_path.forward` does;
    returns (out bf16 TND, lse fp32 (Nq, Tq) or an empty tensor). ``bf16_dot`` as in
    :func:`run_into`. ``chunk_keys``: keys per chunk of a split (decode) item, whole blocks.
    ``known_available``: the caller has just seen :func:`available` say True (the op has, in
    :func:`supports_scaled`)."""
    if plan.device.type != "cpu":
        raise ValueError(f"q must be on the CPU for the native kernel, got {plan.device}")
    if not (known_available and _module is not None) and not available():
        raise RuntimeError("the native CPU attention kernel is not available (see qfa.attention.backends.cpu_kernel.available)")
    mode = int(plan.meta.quant_mode)
    if mode not in (QuantMode.MXFP8, QuantMode.FP8_PER_TOKEN_HEAD):
        raise ValueError(f"forward_scaled runs quant_mode 1 or 6, got {mode}")
    table = _table_of(plan, block_table)
    out = torch.empty(plan.out_shape, dtype=torch.bfloat16, device="cpu")
    if plan.return_lse:
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device="cpu")
        lse_strides = plan.lse_strides if lse.numel() else (0, 0, 0)
    else:
        lse = torch.empty(0, dtype=torch.float32, device="cpu")
        lse_strides = (0, 0, 0)
    if bf16_dot is None:
        # bf16_dot() with the module known to be loaded (it would ask available() once more)
        bf16_dot = _module.has_bf16_dot() and _environ.read(BF16_ENV_VAR, "1") != "0"
    elif bf16_dot and not _module.has_bf16_dot():
        raise ValueError(f"bf16_dot=True needs the AVX512_BF16 build (this CPU's is {cpu_capability()})")
    if mode == QuantMode.MXFP8:
        q_s, q_st, k_s, k_desc, v_s, v_desc, starts = _mxfp8_scales(plan, q_descale, k_descale, v_descale)
        # Many-row blocks run bf16 only if every scale allows it (few-row blocks check their own)
        if bf16_dot and max(plan.q_lens, default=0) * plan.group > 16:
            bf16_dot = all(int(t.view(torch.uint8).min()) >= MIN_BF16_E8M0 for t in (q_s, k_s, v_s) if t.numel())
        args = (1, _e8m0_table(), q_s, q_st, k_s, k_desc, v_s, v_desc, starts, _NO_SCALE)
        v_scalar = 1.0
    else:
        ks = k_descale if k_descale.stride(-1) == 1 else k_descale.contiguous()
        args = (6, _NO_SCALE, q_descale, list(q_descale.stride()), ks, list(ks.stride()), _NO_SCALE, [], [],
                v_descale.contiguous())
        v_scalar = 1.0
    dscale = round_fp32(plan.softmax_scale)
    ln_p = _ln_p_scale(p_scale)
    chunk_blocks = max(1, chunk_keys // plan.block_n)
    _module.forward(
        q, k, v, (*plan.strides_q, *plan.strides_kv, *plan.strides_v), out, plan.out_strides,
        lse, lse_strides, plan.heads_kv, plan.group, plan.head_dim, plan.block_n, plan.q_starts, plan.kv_starts,
        plan.q_lens, plan.kv_lens, bool(plan.causal), dscale, ln_p, v_scalar, _e4m3_table(), _ROUND_CONSTS,
        tile_rows, split_rows, chunk_blocks, PREDECODE_BYTES, SCORE_STORE_BYTES, table, plan.block_size,
        bool(bf16_dot), True, *args, 0.0, MIN_BF16_E8M0,
    )
    return out, lse


def bf16_dot_enabled() -> bool:
    return bf16_dot()
