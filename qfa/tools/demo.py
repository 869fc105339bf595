"""``qfa demo``: what HiF8 does to attention, next to per-tensor FP8 E4M3, on a built-in workload.

The workload has LLM-like statistics (keys with a per-channel offset, a few outlier channels;
see :mod:`qfa.tools.workloads`); nothing is downloaded. It prints the codec round-trip error of Q, K
and V, the attention output error against exact fp32 attention, the speed of each path (median
of several runs after a warm-up; first calls compile and are shown apart), and
writes a PNG chart (HiF8's relative precision across binades beside E4M3/E5M2, and the errors).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qfa.tools import argtypes
from qfa.tools.bench.timing import markdown_table, median_seconds
from qfa.tools.metrics import error_metrics, relative_l2


def _heads(text: str) -> tuple[int, int]:
    """'12:2' -> (12, 2): one (q heads, kv heads) pair."""
    from qfa.tools.workloads import head_pairs

    try:
        pairs = head_pairs(text)
    except ValueError as exc:  # argparse prints the message, with usage, and exits 2
        raise argparse.ArgumentTypeError(str(exc)) from None
    if len(pairs) != 1:
        raise argparse.ArgumentTypeError(f"expected one Nq:Nkv pair like 12:2, got {text!r}")
    return pairs[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", type=argtypes.positive_int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--heads", type=_heads, default=(12, 2), help="q heads:kv heads (default 12:2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="qfa-report/demo.png", help="where to write the chart")


def codec_rows(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    from qfa.dropin import calibration
    from qfa.dropin.fp8_emulation import fake_quant_e4m3

    rows = []
    for name, x in tensors.items():
        for rule in ("amax", calibration.DEFAULT_RULE):
            scale = calibration.compute_scale(x, rule)
            back = calibration.dequantize(calibration.quantize(x, scale), scale)
            rows.append([name, f"HiF8 ({rule})", f"{relative_l2(back, x):.4f}", f"{(back - x).abs().max():.4f}"])
        back = fake_quant_e4m3(x)
        rows.append([name, "FP8 E4M3 (amax/448)", f"{relative_l2(back, x):.4f}", f"{(back - x).abs().max():.4f}"])
    return rows


#: Timed runs per figure (after a warm-up call), and the least total time measured per figure.
TIMED_RUNS = 5
MIN_TOTAL_SECONDS = 0.2


def _first_call(fn):
    """``fn()``'s result and wall time: the first call of a path pays its one-time work (the FP8
    emulation's TorchInductor compile, first-touch allocations)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _median(fn) -> float:
    return median_seconds(fn, min_runs=TIMED_RUNS, min_total=MIN_TOTAL_SECONDS)


def native_build_line() -> str:
    """Build (or load) the native CPU kernels before anything is timed, and say how long it took:
    the C++ build runs once per machine and torch version, then loads from torch's extension cache."""
    from qfa.attention.backends import cpu_kernel, cpu_prepare

    start = time.perf_counter()
    ready = cpu_kernel.available() and cpu_prepare.available()
    seconds = time.perf_counter() - start
    if not cpu_kernel.enabled():
        return "native CPU kernels: off (QFA_NATIVE=0); the torch paths run"
    if not ready:
        return "native CPU kernels: unavailable (see the warning above); the torch paths run"
    return (f"native CPU kernels ({cpu_kernel.cpu_capability()} build): ready in {seconds:.1f} s "
            "(a C++ build the first time on a machine, then a load from torch's extension cache)")


def attention_rows(q, k, v) -> tuple[list[list[str]], dict[str, float]]:
    """Error and time of each attention against exact fp32 SDPA; times are medians (see
    :func:`qfa.tools.bench.timing.median_seconds`), the first call is reported apart."""
    from qfa.dropin.function import hif8_attention
    from qfa.dropin.fp8_emulation import fp8_e4m3_attention

    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    exact, first_exact = _first_call(sdpa)
    variants = {
        "HiF8, default (rms, K smoothing, rotation)": lambda: hif8_attention(q, k, v, is_causal=True),
        "HiF8, amax/32768, no smoothing or rotation": lambda: hif8_attention(
            q, k, v, is_causal=True, calibration="amax", smooth_k=False, rotate=False),
        "FP8 E4M3 emulation, K smoothing + rotation": lambda: fp8_e4m3_attention(
            q, k, v, is_causal=True, smooth_k=True, rotate=True),
        "FP8 E4M3 emulation, plain": lambda: fp8_e4m3_attention(q, k, v, is_causal=True),
    }
    rows, rel = [], {}
    for label, fn in variants.items():
        out, first = _first_call(fn)
        m = error_metrics(out, exact)
        rel[label] = m.rel_l2
        rows.append([label, f"{m.cosine:.6f}", f"{m.rel_l2:.4f}", f"{m.max_abs:.4f}", f"{_median(fn) * 1e3:.1f}",
                     f"{first * 1e3:.0f}"])
    rows.append(["exact fp32 SDPA (reference)", "1", "0", "0", f"{_median(sdpa) * 1e3:.1f}",
                 f"{first_exact * 1e3:.0f}"])
    return rows, rel


def bits_per_binade(values: list[float]) -> dict[int, float]:
    """Mantissa bits of a format in each binade [2^e, 2^(e+1)): log2 of its value count there."""
    counts: dict[int, int] = {}
    for x in values:
        e = math.floor(math.log2(x))
        counts[e] = counts.get(e, 0) + 1
    return {e: math.log2(n) for e, n in sorted(counts.items())}


def _fp8_positive_values(dtype: torch.dtype) -> list[float]:
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return [x for x in vals.tolist() if math.isfinite(x) and x > 0]


#: How each format is drawn on the precision panel. HiF8's 3-bit plateau lies exactly on E4M3's
#: line and its 2-bit shoulders on E5M2's, so HiF8 is a filled area under a solid line, and the
#: FP8 lines are dashed / dotted, nudged a little up / down so that none hides another.
_FORMAT_STYLES = {
    "HiF8": dict(color="C0", linestyle="-", linewidth=2.4, marker="o", offset=0.0, fill=True),
    "FP8 E4M3": dict(color="C1", linestyle="--", linewidth=1.6, marker="s", offset=0.08, fill=False),
    "FP8 E5M2": dict(color="C2", linestyle=":", linewidth=2.0, marker="^", offset=-0.08, fill=False),
}


def write_chart(path: Path, rel_errors: dict[str, float], workload: str = "built-in workload") -> Path:
    """The demo's PNG: mantissa bits per binade of each format (left), attention error (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qfa.cast import format as fmt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [1.15, 1]})
    formats = {
        "HiF8": [x for x in fmt.POSITIVE_VALUES if x > 0],
        "FP8 E4M3": _fp8_positive_values(torch.float8_e4m3fn),
        "FP8 E5M2": _fp8_positive_values(torch.float8_e5m2),
    }
    for name, values in formats.items():
        style = _FORMAT_STYLES[name]
        bits = bits_per_binade(values)
        exps = list(bits) + [max(bits) + 1]
        heights = [b + style["offset"] for b in bits.values()]
        label = f"{name}: {len(bits)} binades, 2^{min(bits)} .. {max(values):g}"
        ax1.step(exps, heights + heights[-1:], where="post", color=style["color"], linestyle=style["linestyle"],
                 linewidth=style["linewidth"], label=label, zorder=3)
        ax1.plot([e + 0.5 for e in bits], heights, linestyle="none", marker=style["marker"], markersize=3.5,
                 color=style["color"], zorder=4)
        if style["fill"]:
            ax1.fill_between(exps, heights + heights[-1:], step="post", color=style["color"], alpha=0.18, zorder=2)
    ax1.set_xlabel("binade e (values in [2^e, 2^(e+1)))")
    ax1.set_ylabel("mantissa bits (relative precision 2^-bits)")
    ax1.set_title("Precision across binades (FP8 lines nudged ±0.08 to stay visible)", fontsize=10)
    ax1.set_yticks([0, 1, 2, 3])
    ax1.set_ylim(-0.3, 3.9)
    ax1.grid(axis="x", alpha=0.3)
    ax1.legend(loc="upper left", fontsize=8)

    labels = list(rel_errors)
    values = [rel_errors[k] for k in labels]
    bars = ax2.barh(labels, values, color=["C0" if k.startswith("HiF8") else "C1" for k in labels])
    ax2.bar_label(bars, labels=[f"{x:.4f}" for x in values], padding=3, fontsize=8)
    ax2.set_xlim(0, max(values) * 1.2)
    ax2.invert_yaxis()  # in the order the table prints them
    ax2.set_xlabel("relative L2 error vs exact fp32 attention (lower is better)")
    ax2.set_title(f"Attention output error\n{workload}", fontsize=10)
    ax2.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _busy_note() -> str:
    """A warning when other processes load the CPUs (medians do not undo a shared machine)."""
    try:
        load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):  # no load average on this OS
        return ""
    if load <= cpus:
        return ""
    return (f"Load average {load:.1f} on {cpus} CPUs: other processes share the cores, so every time above is "
            "slower and less steady than on an idle machine.")


def run(args: argparse.Namespace) -> int:
    from qfa.tools.workloads import llm_like_qkv

    heads_q, heads_kv = args.heads
    q, k, v = llm_like_qkv(1, heads_q, heads_kv, args.seq, seed=args.seed)
    workload = f"LLM-like workload, B=1, (Nq, Nkv)=({heads_q}, {heads_kv}), S={args.seq}, D=128, causal"
    print(f"qfa demo: {workload}\n")
    print(native_build_line() + "\n")
    print("Codec round trip (per-tensor scale)")
    print(markdown_table(["tensor", "format (scale rule)", "rel L2", "max abs"], codec_rows({"Q": q, "K": k, "V": v})))
    rows, rel = attention_rows(q, k, v)
    print("\nAttention output against exact fp32 attention on the unquantised inputs")
    print(markdown_table(["attention", "cosine", "rel L2", "max abs", "ms (median)", "first call ms"], rows))
    print(f"\nms: median of at least {TIMED_RUNS} runs after a warm-up call, on {torch.get_num_threads()} threads. "
          "The first call of each path is shown apart and is not in the medians.")
    busy = _busy_note()
    if busy:
        print(busy)
    try:
        path = write_chart(Path(args.out), rel, workload)
    except ImportError:
        print("\n(matplotlib is not installed: pip install 'qfa[plot]' for the chart)")
    else:
        print(f"\nchart: {path.resolve()}")
    return 0
