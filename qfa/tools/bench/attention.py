"""``qfa bench attention``: the torch backend of quant_flash_attn beside SDPA, and its accuracy.

The header names the CPU, the ISA extensions that matter to the kernels (AVX2, AVX-512,
AVX512_BF16, AMX), the code path that ran (the native CPU kernel or the pure-torch path) and the
CPU's peak as the native extension measures it at start (independent FMA chains on 8 and 16
lanes, and bf16 dot products where the CPU has them, on torch's threads at once, each thread's
best window of a few milliseconds, the best of a few rounds).
Speed: causal prefill, B=1, D=128, and decode-shaped calls (Sq = 1 or 16 new tokens against a
long KV, B = 1 or 8, no mask), against ``scaled_dot_product_attention`` on the dequantised fp32
and bf16 tensors, measured in the same run (median of runs; ``--in-turns``: of rounds of one
call each). Each row names the kernels its blocks ran (AVX512_BF16 bf16 dot products, the AVX2
fp32 tiles and few-row kernels, scalar MKL GEMMs), its useful GFLOP/s as a share of the peak
of the fastest of them, and the qfa / fp32 SDPA ratio it would reach at that peak ("at peak /
fp32": a target below it cannot be met on this CPU, and a verdict that is not met says how many
of its failing rows are so bounded). Decode has a target for Sq = 1 on every CPU and one for
Sq >= 16 on AVX512_BF16 CPUs only (elsewhere the line says there is none). A vLLM-shaped row:
one call on a mixed batch (decodes of one token and a chunk of prefill, TND q, paged K/V in
vLLM's CPU cache view with a block table, causal bottom-right) against SDPA over the same
sequences one by one. ``--load`` measures the same rows again while a busy-loop process
occupies one core (it stops by itself), beside SDPA under the same load. Memory: peak RSS
growth of one call at S=16384 in a fresh process. Accuracy: error against exact fp32 attention
on the original (unquantised) inputs, for HiF8 and for a per-tensor FP8 E4M3 emulation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from qfa.tools import argtypes
from qfa.tools.bench import scaled_inputs
from qfa.tools.bench.timing import interleaved_medians, markdown_table, median_seconds
from qfa.tools.metrics import error_metrics
from qfa.tools.workloads import head_pairs

HEADS = ((12, 2), (32, 8))
#: ``--quant-mode``: the op's modes, as the header names them.
QUANT_MODES = {0: "HiF8 per-tensor", 1: "MXFP8", 6: "FP8 per-token-head"}
SEQS = (512, 1024, 2048, 4096)
MEMORY_SEQ = 16384
MEMORY_LIMIT_GIB = 4.0
#: The issue's speed target: the torch path at most this many times fp32 SDPA's time ...
SPEED_TARGET_RATIO = 1.0
#: ... (the HiF8 mode on CPUs with AVX512_BF16 dot products: this many; issue #21) ...
SPEED_TARGET_BF16 = 0.5
#: ... from this sequence length up.
SPEED_TARGET_MIN_SEQ = 2048
#: Decode rows: new tokens, KV lengths and batch sizes. The targets (issue #21): Sq = 1 at most
#: DECODE_TARGET_RATIO times fp32 SDPA on every CPU; Sq >= DECODE_MULTI_MIN_SQ at most
#: DECODE_MULTI_TARGET_BF16 times on CPUs with AVX512_BF16 dot products, none elsewhere (there the
#: fp32 FMA rate bounds qfa as it bounds SDPA).
DECODE_SQ = (1, 16)
DECODE_SKV = (4096, 16384, 65536)
DECODE_BATCH = (1, 8)
DECODE_TARGET_RATIO = 0.5
DECODE_MULTI_MIN_SQ = 16
DECODE_MULTI_TARGET_BF16 = 0.35
#: Under --load (one core busy), each row at most this many times its quiet time.
LOAD_TARGET_RATIO = 1.5
#: The vLLM-shaped row: this many decodes of one token and one prefill chunk of MIXED_CHUNK
#: tokens, each at the same context (Skv keys, the chunk's last rows seeing all of them), paged
#: in blocks of MIXED_BLOCK tokens; its target is this many times fp32 SDPA over the same
#: sequences (AVX512_BF16 CPUs; MIXED_TARGET_AVX2 elsewhere).
MIXED_DECODES = 4
MIXED_CHUNK = 256
MIXED_BLOCK = 128
MIXED_TARGET_BF16 = 0.35
MIXED_TARGET_AVX2 = 0.5
#: The CPU's peak: seconds each of the native extension's loops runs at start, in PEAK_ROUNDS
#: rounds over the kinds with PEAK_PAUSE seconds between rounds (see :func:`measure_peaks`).
PEAK_SECONDS = 0.25
PEAK_ROUNDS = 3
PEAK_PAUSE = 0.25
#: The peak loop of each kernel family a row can name (see :func:`peak_of`).
PEAK_KIND = {"AVX512_BF16": "bf16_dot", "AVX2": "fp32_avx2", "AVX512": "fp32_avx512", "scalar": "fp32_avx512"}
#: /proc/cpuinfo flags that decide which kernels a CPU can run, as the header names them.
ISA_FLAGS = (("AVX2", ("avx2",)), ("AVX-512", ("avx512f",)), ("AVX512_BF16", ("avx512_bf16",)),
             ("AMX", ("amx_tile", "amx_bf16")))


def _head_pairs(text: str) -> list[tuple[int, int]]:
    """``--heads``: :func:`qfa.tools.workloads.head_pairs`, its message kept for argparse."""
    try:
        return head_pairs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lengths(skip: bool) -> Callable[[str], list[int]]:
    """A comma-separated list of positive lengths; with ``skip``, 0 entries are dropped (a lone
    0 skips the rows)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if any(v < (0 if skip else 1) for v in values):
            least = "0 (skip) or more" if skip else "at least 1"
            raise argparse.ArgumentTypeError(f"expected lengths {least}, got {text!r}")
        return [v for v in values if v]

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seqs", type=_lengths(skip=True), default=list(SEQS),
                        help="S of the prefill rows (0 skips them)")
    parser.add_argument("--heads", type=_head_pairs, default=list(HEADS),
                        help="(Nq, Nkv) pairs of the speed table, as Nq:Nkv,... (default 12:2,32:8)")
    parser.add_argument("--memory-seq", type=argtypes.non_negative_int, default=MEMORY_SEQ, help="S of the peak-memory run (0 skips it)")
    parser.add_argument("--accuracy-seq", type=argtypes.non_negative_int, default=1024, help="S of the accuracy table (0 skips it)")
    parser.add_argument("--backend", default="torch", choices=("torch", "triton"))
    parser.add_argument("--decode-skv", type=_lengths(skip=True),
                        default=list(DECODE_SKV), help="KV lengths of the decode rows (0 skips them)")
    parser.add_argument("--decode-batch", type=_lengths(skip=False), default=list(DECODE_BATCH))
    parser.add_argument("--decode-sq", type=_lengths(skip=False), default=list(DECODE_SQ))
    parser.add_argument("--load", action="store_true",
                        help="also time every row while a busy-loop process occupies one core")
    parser.add_argument("--in-turns", action="store_true",
                        help="time each row's calls in turns (one of each per round) instead of one after the other")
    parser.add_argument("--quant-mode", type=int, choices=QUANT_MODES, default=0,
                        help="0 HiF8 per-tensor (default), 1 MXFP8, 6 FP8 per-token-head: the op's mode timed")
    parser.add_argument("--mixed-skv", type=_lengths(skip=True), default=None,
                        help=f"contexts of the vLLM-shaped rows ({MIXED_DECODES} decodes + one {MIXED_CHUNK}-token "
                             "chunk, paged); default: the first decode Skv, none when --decode-skv 0; 0 skips them")


def cpu_description(cpuinfo: str) -> str:
    """'<model name>; ISA: AVX2 yes, AVX-512 no, ...' from the text of /proc/cpuinfo."""
    model, flags = "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    isa = ", ".join(f"{name} {'yes' if any(f in flags for f in names) else 'no'}" for name, names in ISA_FLAGS)
    return f"{model}; {isa}"


def code_path(backend: str, quant_mode: int = 0) -> str:
    """Which implementation quant_flash_attn runs for ``backend`` on CPU tensors."""
    if backend != "torch":
        return f"backend {backend}"
    from qfa.attention.backends import cpu_kernel

    if cpu_kernel.available():
        return f"native CPU kernel ({cpu_kernel.cpu_capability()} build {cpu_kernel.build_name()})"
    torch_path = "scaled_torch_path" if quant_mode != 0 else "torch_path"
    return f"pure-torch path (qfa.attention.backends.{torch_path}; native kernel off or unavailable)"


def causal_flops(heads: int, seq: int, dim: int = 128) -> float:
    """Useful FLOPs of causal attention: two matmuls over half the score matrix."""
    return 4.0 * heads * seq * seq * dim / 2


def attention_flops(heads: int, seq_q: int, seq_kv: int, causal: bool, batch: int = 1, dim: int = 128) -> float:
    """Useful FLOPs of attention: two matmuls over the scores each row sees (causal: bottom-right,
    row i of Sq seeing Skv - Sq + i + 1 keys)."""
    if not causal:
        seen = seq_q * seq_kv
    else:
        first = seq_kv - seq_q + 1  # keys the first row sees (at least 0)
        seen = sum(max(0, min(seq_kv, first + i)) for i in range(seq_q))
    return 4.0 * batch * heads * seen * dim


def measure_peaks(threads: int | None = None, seconds: float = PEAK_SECONDS, rounds: int = PEAK_ROUNDS,
                  pause: float = PEAK_PAUSE) -> dict[str, float]:
    """GFLOP/s of each of the native extension's peak loops on ``threads`` threads at once
    (default torch's count), the best of ``rounds`` calls of ``seconds / rounds`` each: empty
    where the kernel is not built."""
    from qfa.attention.backends import cpu_kernel

    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    # The probe keeps each thread's best window of a few ms, which sees past host work in short
    # stretches; but on the Zen 3 KVM guest, 1 of 27 probes over 5 minutes ran at about half rate
    # from end to end (best window 139 GFLOP/s where the others read 206). Rounds apart in time
    # read low only when the host is busy through all of them.
    best: dict[str, float] = {}
    for i in range(rounds):
        if i:
            time.sleep(pause)
        for kind in cpu_kernel.peak_kinds():
            best[kind] = max(best.get(kind, 0.0), cpu_kernel.peak_gflops(kind, threads, seconds / rounds))
    return best


def peaks_line(peaks: dict[str, float]) -> str:
    if not peaks:
        return "peak: not measured (no native kernel)"
    names = {"fp32_avx2": "fp32 FMA 8 lanes", "fp32_avx512": "fp32 FMA 16 lanes", "bf16_dot": "bf16 dot (vdpbf16ps)"}
    cells = ", ".join(f"{names.get(k, k)} {v:.0f}" for k, v in peaks.items())
    return (f"peak, measured now ({torch.get_num_threads()} threads, independent chains in registers, each thread's "
            f"best window of a few ms of its CPU time, best of {PEAK_ROUNDS} rounds): {cells} GFLOP/s")


def peak_of(isa: Sequence[str], peaks: dict[str, float]) -> float | None:
    """The peak a row's GFLOP/s is a share of: that of the fastest kernel family it ran."""
    known = [peaks[PEAK_KIND[name]] for name in isa if PEAK_KIND.get(name) in peaks]
    return max(known) if known else None


def isa_of(fn: Callable[[], object], backend: str) -> list[str]:
    """The kernel families one call of ``fn`` ran: the native kernel's own account of its
    blocks, or the name of the other implementation."""
    from qfa.attention.backends import cpu_kernel

    if backend != "torch":
        return [f"backend {backend}"]
    if not cpu_kernel.available():
        return ["torch path"]
    fn()  # the bench's head dim (128) is one every build's vectors divide, in every mode
    return cpu_kernel.last_paths()


def _isa_cells(isa: Sequence[str], gflops: float, peaks: dict[str, float]) -> list[str]:
    peak = peak_of(isa, peaks)
    return ["+".join(isa) or "-", f"{100 * gflops / peak:.0f} %" if peak else "-"]


def at_peak_ratio(flops: float, isa: Sequence[str], peaks: dict[str, float], t_fp32: float) -> float | None:
    """qfa / fp32 SDPA if qfa did the row's useful ``flops`` at 100 % of the measured peak of the
    fastest kernel family it ran (None: no peak measured for them). No kernel does better, so a
    row whose value is above a target cannot meet it on this CPU, however well it is tuned."""
    peak = peak_of(isa, peaks)
    return flops / (peak * 1e9) / t_fp32 if peak else None


def _at_peak_cell(at_peak: float | None) -> str:
    return "-" if at_peak is None else f"{at_peak:.2f}x"


class RowRatio(NamedTuple):
    """A row's qfa / fp32 SDPA, measured and at the measured peak (:func:`at_peak_ratio`)."""
    ratio: float
    at_peak: float | None


#: The bench's measured peaks, set by :func:`run` (empty: rows print no share of a peak).
PEAKS: dict[str, float] = {}


def quantised_inputs(heads_q: int, heads_kv: int, seq: int, seed: int = 0):
    """HiF8 codes with amax/32768 descales (upstream's rule), and their dequantised values."""
    from qfa.cast import decode_from_hifloat8, encode_to_hifloat8

    gen = torch.Generator().manual_seed(seed)
    codes, descales, values = [], [], []
    for n in (heads_q, heads_kv, heads_kv):
        x = torch.randn(1, n, seq, 128, generator=gen)
        scale = (x.abs().amax() / 32768).reshape(1)
        c = encode_to_hifloat8(x / scale)
        codes.append(c)
        descales.append(scale)
        values.append(decode_from_hifloat8(c, torch.float32) * scale)
    return codes, descales, values


def quantised_decode_inputs(batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_kv: int, seed: int = 0):
    """Like :func:`quantised_inputs`, with a batch and Sq != Skv."""
    from qfa.cast import decode_from_hifloat8, encode_to_hifloat8

    gen = torch.Generator().manual_seed(seed)
    codes, descales, values = [], [], []
    for n, s in ((heads_q, seq_q), (heads_kv, seq_kv), (heads_kv, seq_kv)):
        x = torch.randn(batch, n, s, 128, generator=gen)
        scale = (x.abs().amax() / 32768).reshape(1)
        c = encode_to_hifloat8(x / scale)
        del x
        codes.append(c)
        descales.append(scale)
        values.append(decode_from_hifloat8(c, torch.float32) * scale)
    return codes, descales, values


#: Timed runs per call: at least MIN_RUNS, and more until MIN_TOTAL_SECONDS (at most MAX_RUNS):
#: a decode row takes about a millisecond, and the median of 3 of those moved by 2x from run to
#: run on a shared host, while a prefill row of a second needs no more than 3.
MIN_RUNS = 3
MIN_TOTAL_SECONDS = 0.3
MAX_RUNS = 300
#: ``--in-turns``: each row's calls timed in turns (one of each per round) rather than one after
#: the other. Slow minutes of a shared host then fall on every call alike; but each call also
#: starts with the caches the others left (for decode, the cold KV a model's layer sees).
TIMING = {"in_turns": False}


def _medians(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    if TIMING["in_turns"]:
        return interleaved_medians(fns, min_runs=MIN_RUNS, min_total=2 * MIN_TOTAL_SECONDS, max_runs=MAX_RUNS)
    return {name: median_seconds(fn, min_runs=MIN_RUNS, min_total=MIN_TOTAL_SECONDS, max_runs=MAX_RUNS)
            for name, fn in fns.items()}


def row_timings(quant_mode: int, batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_kv: int, backend: str,
                causal: bool) -> dict[str, Callable[[], object]]:
    """The timed calls of one row in ``quant_mode``: its inputs, quantised in the mode's format."""
    if quant_mode == 0:
        if batch == 1 and seq_q == seq_kv:
            codes, descales, values = quantised_inputs(heads_q, heads_kv, seq_q)
        else:
            codes, descales, values = quantised_decode_inputs(batch, heads_q, heads_kv, seq_q, seq_kv)
        return _timings(codes, descales, values, backend, causal)
    call, values = scaled_inputs.BUILDERS[quant_mode](batch, heads_q, heads_kv, seq_q, seq_kv, causal=causal,
                                                      backend=backend)
    return _timings(None, None, values, backend, causal, call=call)


def _timings(codes, descales, values, backend: str, causal: bool, call=None) -> dict[str, Callable[[], object]]:
    """The three timed calls of a row: qfa (``call``, or mode 0 on ``codes``), fp32 SDPA, bf16 SDPA."""
    from qfa.attention import quant_flash_attn

    qd, kd, vd = values
    qb, kb, vb = qd.bfloat16(), kd.bfloat16(), vd.bfloat16()
    mask = 3 if causal else 0
    return {
        "qfa": call or (lambda: quant_flash_attn(*codes, *descales, 0, mask_mode=mask, backend=backend)),
        "fp32": lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=True),
        "bf16": lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, enable_gqa=True),
    }


def measure(fns: dict[str, Callable[[], object]], load: bool) -> tuple[dict[str, float], dict[str, float] | None]:
    """Median seconds of each call quiet, and of qfa and fp32 SDPA with one core busy (``load``)."""
    quiet = _medians(fns)
    if not load:
        return quiet, None
    # The loop outlives the measurement only by a margin, and stops by itself if we die.
    loop = busy_loop(10 * (quiet["qfa"] + quiet["fp32"]) + 30)
    try:
        time.sleep(0.1)
        return quiet, _medians({name: fns[name] for name in ("qfa", "fp32")})
    finally:
        loop.terminate()
        loop.wait()


def _load_cells(quiet: dict[str, float], loaded: dict[str, float] | None) -> list[str]:
    if loaded is None:
        return []
    return [f"{loaded['qfa'] * 1e3:.1f}", f"{loaded['qfa'] / quiet['qfa']:.2f}x", f"{loaded['fp32'] * 1e3:.1f}",
            f"{loaded['fp32'] / quiet['fp32']:.2f}x"]


ISA_HEADERS = ["kernels", "of peak", "at peak / fp32"]
LOAD_HEADERS = ["qfa ms, 1 core busy", "qfa busy / quiet", "SDPA fp32 ms, 1 core busy", "SDPA busy / quiet"]


def decode_rows(skvs, batches, sqs, backend: str, heads: tuple[int, int], load: bool = False, quant_mode: int = 0):
    """Decode-shaped rows (no mask): (rows, (Sq, :class:`RowRatio`) per row, qfa busy / quiet per row)."""
    hq, hkv = heads
    rows, ratios, load_ratios = [], [], []
    for b in batches:
        for sq in sqs:
            for skv in skvs:
                fns = row_timings(quant_mode, b, hq, hkv, sq, skv, backend, causal=False)
                t, busy = measure(fns, load)
                flops = attention_flops(hq, sq, skv, False, b)
                gflops = flops / t["qfa"] / 1e9
                isa = isa_of(fns["qfa"], backend)
                at_peak = at_peak_ratio(flops, isa, PEAKS, t["fp32"])
                rows.append([b, sq, skv, f"{t['qfa'] * 1e3:.1f}", f"{t['fp32'] * 1e3:.1f}",
                             f"{t['qfa'] / t['fp32']:.2f}x", f"{t['bf16'] * 1e3:.1f}",
                             f"{t['qfa'] / t['bf16']:.2f}x", f"{gflops:.1f}"]
                            + _isa_cells(isa, gflops, PEAKS) + [_at_peak_cell(at_peak)]
                            + _load_cells(t, busy))
                ratios.append((sq, RowRatio(t["qfa"] / t["fp32"], at_peak)))
                if busy:
                    load_ratios.append(busy["qfa"] / t["qfa"])
                print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return rows, ratios, load_ratios


def _verdict(target: str, bound: float, ratios: Sequence[float], caller: str,
             at_peak: Sequence[float | None] | None = None) -> str:
    """``target``'s verdict line: met when every ratio is <= ``bound``, with the count within it;
    when not met and ``at_peak`` (each row's :func:`at_peak_ratio`) is given, also how many of the
    failing rows are above ``bound`` even at the measured peak (rows without a peak are not counted
    as bounded: nothing says they are)."""
    if not ratios:
        raise ValueError(f"{caller} needs at least one measured ratio, got none")
    if at_peak is not None and len(at_peak) != len(ratios):
        raise ValueError(f"{caller}: at_peak must hold one value per ratio ({len(ratios)}), got {len(at_peak)}")
    met = sum(r <= bound for r in ratios)
    line = (f"{target}: {'met' if met == len(ratios) else 'NOT met'}, {met} of {len(ratios)} rows within it "
            f"(worst {max(ratios):.2f}x)")
    if met == len(ratios) or at_peak is None:
        return line
    failing = [p for r, p in zip(ratios, at_peak) if r > bound]
    if all(p is None for p in failing):
        return line  # no peak measured: nothing to say about what the CPU allows
    bounded = [p for p in failing if p is not None and p > bound]
    line += f"; {len(bounded)} of {len(failing)} failing rows cannot meet it at the measured peak"
    return line + (f" (best {min(bounded):.2f}x)" if bounded else "")


def decode_verdict(ratios: Sequence[float], at_peak: Sequence[float | None] | None = None) -> str:
    """The verdict line on the Sq = 1 decode target (every CPU), from qfa / fp32 SDPA of those rows
    (and their :func:`at_peak_ratio`)."""
    return _verdict(f"decode target, Sq = 1 (qfa <= {DECODE_TARGET_RATIO:.2f}x fp32 SDPA)", DECODE_TARGET_RATIO,
                    ratios, "decode_verdict", at_peak)


def bf16_dot_measured(peaks: dict[str, float]) -> bool:
    """Whether the CPU runs the bf16 dot-product kernels (their peak was measured): the tighter
    targets hold there only."""
    return "bf16_dot" in peaks


def multi_decode_verdict(ratios: Sequence[float], peaks: dict[str, float],
                         at_peak: Sequence[float | None] | None = None) -> str:
    """The line on the Sq >= DECODE_MULTI_MIN_SQ decode rows: their target's verdict on an
    AVX512_BF16 CPU; elsewhere that there is none, and the rows' worst ratio."""
    if not bf16_dot_measured(peaks):
        if not ratios:
            raise ValueError("multi_decode_verdict needs at least one measured ratio, got none")
        return (f"decode, Sq >= {DECODE_MULTI_MIN_SQ}: no target on this ISA (its "
                f"{DECODE_MULTI_TARGET_BF16:.2f}x is for AVX512_BF16 dot products; without them qfa's fp32 FMA "
                f"rate bounds it as it bounds SDPA's); worst {max(ratios):.2f}x fp32 SDPA over {len(ratios)} rows")
    return _verdict(f"decode target, Sq >= {DECODE_MULTI_MIN_SQ}, AVX512_BF16 (qfa <= "
                    f"{DECODE_MULTI_TARGET_BF16:.2f}x fp32 SDPA)", DECODE_MULTI_TARGET_BF16, ratios,
                    "multi_decode_verdict", at_peak)


def decode_verdicts(rows: Sequence[tuple[int, RowRatio]], peaks: dict[str, float]) -> list[str]:
    """One line per decode target the rows cover, from each row's (Sq, :class:`RowRatio`): Sq = 1
    (:func:`decode_verdict`) and Sq >= DECODE_MULTI_MIN_SQ (:func:`multi_decode_verdict`); rows
    between the two have no target."""
    lines = []
    one = [r for sq, r in rows if sq == 1]
    multi = [r for sq, r in rows if sq >= DECODE_MULTI_MIN_SQ]
    if one:
        lines.append(decode_verdict([r.ratio for r in one], [r.at_peak for r in one]))
    if multi:
        lines.append(multi_decode_verdict([r.ratio for r in multi], peaks, [r.at_peak for r in multi]))
    return lines


def load_verdict(ratios: Sequence[float]) -> str:
    """The verdict line on the --load target, from qfa's loaded / quiet time of each row."""
    return _verdict(f"load target (qfa with one core busy <= {LOAD_TARGET_RATIO:.1f}x its quiet time)",
                    LOAD_TARGET_RATIO, ratios, "load_verdict")


#: The --load reference: a plain fp32 GEMM of this size on torch's threads.
REFERENCE_GEMM = 1024


def gemm_load_reference() -> float:
    """Busy / quiet time of a plain fp32 GEMM on torch's threads, beside the rows under --load.

    It keeps every thread busy with no synchronisation to speak of, so its ratio is what one
    busy core costs any compute-bound call on this machine: the scheduler shares the cores
    among runnable threads, so on 2 cores a 2-thread call beside one busy process gets about
    4/3 of a core each second, near 1.5x its quiet time."""
    a = torch.randn(REFERENCE_GEMM, REFERENCE_GEMM)
    b = torch.randn(REFERENCE_GEMM, REFERENCE_GEMM)
    quiet, busy = measure({"qfa": lambda: torch.mm(a, b), "fp32": lambda: None}, load=True)
    return busy["qfa"] / quiet["qfa"]


def load_reference_line(ratio: float) -> str:
    return (f"reference: a {REFERENCE_GEMM}^3 fp32 GEMM on {torch.get_num_threads()} threads takes {ratio:.2f}x its "
            f"quiet time with one core busy (what the busy core costs a call that keeps every core busy)")


_BUSY_LOOP = "import time\nend = time.monotonic() + float(__import__('sys').argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def busy_loop(seconds: float) -> subprocess.Popen:
    """A process that keeps one core busy and exits by itself after ``seconds``."""
    return subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(seconds)])


def speed_rows(seqs, backend: str, heads=HEADS) -> tuple[list[list[str]], list[float]]:
    """The prefill table, and qfa / fp32 SDPA for the rows the target covers."""
    rows, targets, _ = prefill_rows(seqs, backend, heads)
    return rows, [t.ratio for t in targets]


def prefill_rows(seqs, backend: str, heads=HEADS, load: bool = False, quant_mode: int = 0):
    """The prefill table (with ``load`` each row's times with one core busy beside them), a
    :class:`RowRatio` for each row the target covers, and qfa's busy / quiet time per row."""
    rows, target_ratios, load_ratios = [], [], []
    for hq, hkv in heads:
        for seq in seqs:
            fns = row_timings(quant_mode, 1, hq, hkv, seq, seq, backend, causal=True)
            t, busy = measure(fns, load)
            t_ours, t32, t16 = t["qfa"], t["fp32"], t["bf16"]
            flops = causal_flops(hq, seq)
            gflops = flops / t_ours / 1e9
            isa = isa_of(fns["qfa"], backend)
            at_peak = at_peak_ratio(flops, isa, PEAKS, t32)
            rows.append([f"({hq}, {hkv})", seq, f"{t_ours * 1e3:.1f}", f"{gflops:.1f}",
                         f"{t32 * 1e3:.1f}", f"{t_ours / t32:.2f}x", f"{t16 * 1e3:.1f}", f"{t_ours / t16:.2f}x"]
                        + _isa_cells(isa, gflops, PEAKS) + [_at_peak_cell(at_peak)]
                        + _load_cells(t, busy))
            if seq >= SPEED_TARGET_MIN_SEQ:
                target_ratios.append(RowRatio(t_ours / t32, at_peak))
            if busy:
                load_ratios.append(busy["qfa"] / t_ours)
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return rows, target_ratios, load_ratios


def mixed_batch_timings(heads_q: int, heads_kv: int, seq_kv: int, backend: str, decodes: int = MIXED_DECODES,
                        chunk: int = MIXED_CHUNK, block_size: int = MIXED_BLOCK, seed: int = 0):
    """The timed calls of the vLLM-shaped row, and its useful FLOPs.

    One call: TND q of ``decodes`` sequences of one token and one of ``chunk`` tokens, every
    sequence at ``seq_kv`` keys (the chunk is the last of its prompt: causal bottom-right), K/V
    paged as vLLM's CPU cache lays them out (``[blocks, Nkv, block_size, 2 * 128]`` codes, K the
    first 128 of each token's 256 bytes and V the rest: PA_BNBD with a token stride of 256), in
    blocks handed out in a shuffled order through a block table. SDPA runs on the dequantised
    values of each sequence in turn (the decodes unmasked, the chunk with its bottom-right mask)."""
    from qfa.attention import quant_flash_attn
    from qfa.cast import decode_from_hifloat8, encode_to_hifloat8

    if seq_kv < chunk:
        raise ValueError(f"the vLLM-shaped row's context must hold its {chunk}-token chunk, got Skv = {seq_kv}")
    gen = torch.Generator().manual_seed(seed)
    q_lens = [1] * decodes + [chunk]
    nseq = len(q_lens)
    per_seq = -(-seq_kv // block_size)
    q = torch.randn(sum(q_lens), heads_q, 128, generator=gen)
    kv = torch.randn(2, nseq, per_seq * block_size, heads_kv, 128, generator=gen)
    scales = [(x.abs().amax() / 32768).reshape(1) for x in (q, kv[0], kv[1])]
    q_codes = encode_to_hifloat8(q / scales[0])
    kv_codes = [encode_to_hifloat8(kv[i] / scales[1 + i]) for i in range(2)]
    cache = torch.zeros(nseq * per_seq, heads_kv, block_size, 2 * 128, dtype=torch.uint8)
    table = torch.randperm(nseq * per_seq, generator=gen).to(torch.int32).view(nseq, per_seq)
    for b in range(nseq):
        for i in range(2):  # (blocks, block_size, Nkv, D) -> the cache's (block, head, position, D)
            pages = kv_codes[i][b].view(per_seq, block_size, heads_kv, 128).transpose(1, 2)
            cache[table[b].long(), :, :, i * 128:(i + 1) * 128] = pages
    k_view, v_view = cache[..., :128], cache[..., 128:]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    used = torch.full((nseq,), seq_kv, dtype=torch.int32)

    def qfa():
        return quant_flash_attn(q_codes, k_view, v_view, *scales, 0, layout_q="TND", layout_out="TND",
                                layout_kv="PA_BNBD", cu_seqlens_q=cu, seqused_kv=used, block_table=table, mask_mode=3,
                                backend=backend)

    qd = decode_from_hifloat8(q_codes, torch.float32) * scales[0]
    seqs = []
    for b in range(nseq):
        q_b = qd[cu[b]:cu[b + 1]].transpose(0, 1).unsqueeze(0)
        k_b, v_b = (decode_from_hifloat8(kv_codes[i][b, :seq_kv], torch.float32).mul_(scales[1 + i])
                    .transpose(0, 1).unsqueeze(0) for i in range(2))
        sq = q_lens[b]
        mask = None
        if sq > 1:  # bottom-right: row i sees keys j <= i + Skv - Sq
            mask = (torch.arange(seq_kv)[None, :] <= torch.arange(sq)[:, None] + seq_kv - sq)
        seqs.append((q_b, k_b, v_b, mask))

    def sdpa(dtype):
        typed = [tuple(x.to(dtype) if x is not None and x.dtype.is_floating_point else x for x in t) for t in seqs]

        def run():
            return [F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m, enable_gqa=True) for qb, kb, vb, m in typed]
        return run

    flops = sum(attention_flops(heads_q, sq, seq_kv, True) for sq in q_lens)
    return {"qfa": qfa, "fp32": sdpa(torch.float32), "bf16": sdpa(torch.bfloat16)}, flops


def mixed_target(peaks: dict[str, float]) -> float:
    """The vLLM-shaped row's target: tighter where the CPU runs bf16 dot products."""
    return MIXED_TARGET_BF16 if bf16_dot_measured(peaks) else MIXED_TARGET_AVX2


def mixed_rows(skvs, backend: str, heads: tuple[int, int], load: bool = False):
    """The vLLM-shaped rows: (rows, :class:`RowRatio` per row, qfa busy / quiet per row)."""
    hq, hkv = heads
    rows, ratios, load_ratios = [], [], []
    for skv in skvs:
        fns, flops = mixed_batch_timings(hq, hkv, skv, backend)
        t, busy = measure(fns, load)
        gflops = flops / t["qfa"] / 1e9
        isa = isa_of(fns["qfa"], backend)
        at_peak = at_peak_ratio(flops, isa, PEAKS, t["fp32"])
        rows.append([f"{MIXED_DECODES} x 1 + 1 x {MIXED_CHUNK}", skv, f"{t['qfa'] * 1e3:.1f}", f"{t['fp32'] * 1e3:.1f}",
                     f"{t['qfa'] / t['fp32']:.2f}x", f"{t['bf16'] * 1e3:.1f}", f"{t['qfa'] / t['bf16']:.2f}x",
                     f"{gflops:.1f}"] + _isa_cells(isa, gflops, PEAKS) + [_at_peak_cell(at_peak)]
                    + _load_cells(t, busy))
        ratios.append(RowRatio(t["qfa"] / t["fp32"], at_peak))
        if busy:
            load_ratios.append(busy["qfa"] / t["qfa"])
        print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return rows, ratios, load_ratios


def mixed_verdict(ratios: Sequence[float], bound: float, at_peak: Sequence[float | None] | None = None) -> str:
    return _verdict(f"vLLM-shaped batch target (qfa <= {bound:.2f}x fp32 SDPA over the same sequences)", bound, ratios,
                    "mixed_verdict", at_peak)


def speed_target(peaks: dict[str, float], quant_mode: int = 0) -> float:
    """The prefill target: tighter for the HiF8 mode where the CPU runs bf16 dot products."""
    return SPEED_TARGET_BF16 if quant_mode == 0 and bf16_dot_measured(peaks) else SPEED_TARGET_RATIO


def speed_verdict(ratios: Sequence[float], at_peak: Sequence[float | None] | None = None,
                  target: float = SPEED_TARGET_RATIO) -> str:
    """The verdict line on the speed target, from qfa / fp32 SDPA of the rows it covers (S >= the
    minimum), and their :func:`at_peak_ratio`."""
    return _verdict(f"speed target (qfa <= {target:.1f}x fp32 SDPA for S >= {SPEED_TARGET_MIN_SEQ})",
                    target, ratios, "speed_verdict", at_peak)


_MEMORY_SCRIPT = """
import json, resource, sys, torch
from qfa.tools.bench.attention import quantised_inputs
from qfa.attention import quant_flash_attn
seq = int(sys.argv[1])
codes, descales, _ = quantised_inputs(32, 8, seq)
def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
before = rss_kib()
quant_flash_attn(*codes, *descales, 7, mask_mode=3, backend=sys.argv[2])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"inputs_mib": sum(c.numel() for c in codes) / 2**20, "peak_growth_gib": (peak - before) / 2**20}))
"""


def peak_memory(seq: int, backend: str) -> dict:
    """Peak RSS growth during one call, in a fresh process so earlier runs do not hide it."""
    done = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(seq), backend], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def accuracy_rows(seq: int) -> list[list[str]]:
    from qfa.attention import hif8_attention
    from qfa.dropin.fp8_emulation import fp8_e4m3_attention
    from qfa.tools.workloads import llm_like_qkv, uniform_qkv

    rows = []
    for name, (q, k, v) in (("N(0,1)", tuple(torch.randn(1, n, seq, 128, generator=torch.Generator().manual_seed(1))
                                             for n in (12, 2, 2))),
                            ("uniform(-1,1)", uniform_qkv(1, 12, 2, seq)),
                            ("LLM-like", llm_like_qkv(1, 12, 2, seq))):
        exact = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        variants = {
            "HiF8 amax/32768": lambda: hif8_attention(q, k, v, is_causal=True, calibration="amax", smooth_k=False,
                                                      rotate=False),
            "HiF8 rms + smooth K": lambda: hif8_attention(q, k, v, is_causal=True, rotate=False),
            "HiF8 default (rms + smooth K + rotate)": lambda: hif8_attention(q, k, v, is_causal=True),
            "FP8 E4M3 amax/448": lambda: fp8_e4m3_attention(q, k, v, is_causal=True),
            "FP8 E4M3 + smooth K": lambda: fp8_e4m3_attention(q, k, v, is_causal=True, smooth_k=True),
            "FP8 E4M3 + smooth K + rotate": lambda: fp8_e4m3_attention(q, k, v, is_causal=True, smooth_k=True,
                                                                       rotate=True),
        }
        for label, fn in variants.items():
            cos, rel, mx = error_metrics(fn(), exact)
            rows.append([name, label, f"{cos:.6f}", f"{rel:.4f}", f"{mx:.4f}"])
    return rows


def run(args: argparse.Namespace) -> int:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    mode = args.quant_mode
    TIMING["in_turns"] = args.in_turns
    print(f"quant_flash_attn ({QUANT_MODES[mode]}, quant_mode {mode}, D=128) vs SDPA on the dequantised inputs; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend={args.backend}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"CPU: {cpu_description(cpuinfo)}")
    print(f"code path: {code_path(args.backend, mode)}")
    PEAKS.clear()
    if args.backend == "torch":
        PEAKS.update(measure_peaks())
        print(peaks_line(PEAKS))
    extra = ISA_HEADERS + (LOAD_HEADERS if args.load else [])
    load_ratios = []
    if args.seqs:
        rows, target_ratios, busy = prefill_rows(args.seqs, args.backend, args.heads, args.load, mode)
        load_ratios += busy
        print("\nprefill: causal, B=1")
        print(markdown_table(["(Nq, Nkv)", "S", "qfa ms", "qfa GFLOP/s", "SDPA fp32 ms", "qfa / fp32",
                              "SDPA bf16 ms", "qfa / bf16"] + extra, rows))
        if target_ratios:
            print("\n" + speed_verdict([r.ratio for r in target_ratios], [r.at_peak for r in target_ratios],
                                        speed_target(PEAKS, mode)))
    if args.decode_skv:
        hq, hkv = args.heads[0]
        rows, decode_ratios, busy = decode_rows(args.decode_skv, args.decode_batch, args.decode_sq, args.backend,
                                                args.heads[0], args.load, mode)
        load_ratios += busy
        print(f"\ndecode: Sq new tokens against Skv keys, no mask, (Nq, Nkv) = ({hq}, {hkv})")
        print(markdown_table(["B", "Sq", "Skv", "qfa ms", "SDPA fp32 ms", "qfa / fp32", "SDPA bf16 ms",
                              "qfa / bf16", "qfa GFLOP/s"] + extra, rows))
        verdicts = decode_verdicts(decode_ratios, PEAKS)
        if verdicts:
            print("\n" + "\n".join(verdicts))
    mixed = args.mixed_skv if args.mixed_skv is not None else args.decode_skv[:1]
    if mixed and mode == 0:
        hq, hkv = args.heads[0]
        rows, mixed_ratios, busy = mixed_rows(mixed, args.backend, args.heads[0], args.load)
        load_ratios += busy
        print(f"\nvLLM-shaped batch: one call, TND q, paged K/V (vLLM's CPU cache view, blocks of {MIXED_BLOCK}, "
              f"shuffled), causal bottom-right, (Nq, Nkv) = ({hq}, {hkv}); SDPA over the same sequences one by one")
        print(markdown_table(["sequences (new tokens)", "Skv", "qfa ms", "SDPA fp32 ms", "qfa / fp32", "SDPA bf16 ms",
                              "qfa / bf16", "qfa GFLOP/s"] + extra, rows))
        print("\n" + mixed_verdict([r.ratio for r in mixed_ratios], mixed_target(PEAKS),
                                    [r.at_peak for r in mixed_ratios]))
    if load_ratios:
        print(load_verdict(load_ratios))
        print(load_reference_line(gemm_load_reference()))
    if mode != 0 and (args.memory_seq or args.accuracy_seq):
        print("\nthe memory and accuracy runs are the HiF8 mode's (quant_mode 0): skipped; for the formats' accuracy "
              "see eval-ppl --attn qfa_hif8,qfa_mxfp8,qfa_fp8")
    elif args.memory_seq:
        mem = peak_memory(args.memory_seq, args.backend)
        verdict = "OK" if mem["peak_growth_gib"] < MEMORY_LIMIT_GIB else "OVER"
        print(f"\npeak memory, (32, 8), S={args.memory_seq}: {mem['peak_growth_gib']:.2f} GiB above the "
              f"{mem['inputs_mib']:.0f} MiB of HiF8 inputs (limit {MEMORY_LIMIT_GIB} GiB: {verdict})")
    if mode == 0 and args.accuracy_seq:
        print(f"\naccuracy against exact fp32 attention on the unquantised inputs (causal, (12, 2), "
              f"S={args.accuracy_seq})")
        print(markdown_table(["data", "attention", "cosine", "rel L2", "max abs"], accuracy_rows(args.accuracy_seq)))
    return 0
