"""``qfa demo``: what HiF8 does to attention, next to per-tensor FP8 E4M3, on a built-in workload.

The workload has LLM-like statistics (keys with a per-channel offset, a few outlier channels;
see :mod:`qfa.tools.workloads`); nothing is downloaded. It prints the codec round-trip error of Q, K
and V, the attention output error against exact fp32 attention, the speed of each path, and
writes a PNG chart (HiF8's relative precision across binades beside E4M3/E5M2, and the errors).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qfa.tools.metrics import error_metrics
from qfa.tools.bench.timing import markdown_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--heads", default="12,2", help="q heads,kv heads (default 12,2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="qfa-report/demo.png", help="where to write the chart")


def _relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def codec_rows(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    from qfa.attention import calibration
    from qfa.attention.fp8_emulation import fake_quant_e4m3

    rows = []
    for name, x in tensors.items():
        for rule in ("amax", calibration.DEFAULT_RULE):
            scale = calibration.compute_scale(x, rule)
            back = calibration.dequantize(calibration.quantize(x, scale), scale)
            rows.append([name, f"HiF8 ({rule})", f"{_relative_l2(back, x):.4f}", f"{(back - x).abs().max():.4f}"])
        back = fake_quant_e4m3(x)
        rows.append([name, "FP8 E4M3 (amax/448)", f"{_relative_l2(back, x):.4f}", f"{(back - x).abs().max():.4f}"])
    return rows


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def attention_rows(q, k, v) -> tuple[list[list[str]], dict[str, float]]:
    from qfa.attention import hif8_attention
    from qfa.attention.fp8_emulation import fp8_e4m3_attention

    exact, t_exact = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
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
        fn()  # warm-up: the first call compiles the torch path's fused loops
        out, seconds = _timed(fn)
        cos, rel_l2, max_abs = error_metrics(out, exact)
        rel[label] = rel_l2
        rows.append([label, f"{cos:.6f}", f"{rel_l2:.4f}", f"{max_abs:.4f}", f"{seconds * 1e3:.0f}"])
    rows.append(["exact fp32 SDPA (reference)", "1", "0", "0", f"{t_exact * 1e3:.0f}"])
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


def write_chart(path: Path, rel_errors: dict[str, float]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qfa.cast import format as fmt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    formats = {
        "HiF8": [x for x in fmt.POSITIVE_VALUES if x > 0],
        "FP8 E4M3": _fp8_positive_values(torch.float8_e4m3fn),
        "FP8 E5M2": _fp8_positive_values(torch.float8_e5m2),
    }
    for name, values in formats.items():
        bits = bits_per_binade(values)
        exps = list(bits) + [max(bits) + 1]
        ax1.step(exps, list(bits.values()) + [list(bits.values())[-1]], where="post",
                 label=f"{name}: {len(bits)} binades, 2^{min(bits)} .. {max(values):g}")
    ax1.set_xlabel("binade e (values in [2^e, 2^(e+1)))")
    ax1.set_ylabel("mantissa bits (relative precision 2^-bits)")
    ax1.set_title("Precision across binades")
    ax1.set_yticks([0, 1, 2, 3])
    ax1.legend(loc="upper left", fontsize=8)
    labels = list(rel_errors)
    ax2.barh(labels, [rel_errors[k] for k in labels], color=["C0", "C0", "C1", "C1"])
    ax2.set_xlabel("relative L2 error vs exact fp32 attention")
    ax2.set_title("Attention output error (built-in workload)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from qfa.tools.workloads import llm_like_qkv

    heads_q, heads_kv = (int(h) for h in args.heads.split(","))
    q, k, v = llm_like_qkv(1, heads_q, heads_kv, args.seq, seed=args.seed)
    print(f"qfa demo: LLM-like workload, B=1, (Nq, Nkv)=({heads_q}, {heads_kv}), S={args.seq}, D=128, causal\n")
    print("Codec round trip (per-tensor scale)")
    print(markdown_table(["tensor", "format (scale rule)", "rel L2", "max abs"], codec_rows({"Q": q, "K": k, "V": v})))
    rows, rel = attention_rows(q, k, v)
    print("\nAttention output against exact fp32 attention on the unquantised inputs")
    print(markdown_table(["attention", "cosine", "rel L2", "max abs", "ms"], rows))
    try:
        path = write_chart(Path(args.out), rel)
    except ImportError:
        print("\n(matplotlib is not installed: pip install 'qfa[plot]' for the chart)")
    else:
        print(f"\nchart: {path.resolve()}")
    return 0
