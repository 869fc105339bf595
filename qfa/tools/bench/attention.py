"""``qfa bench attention``: the torch path of quant_flash_attn beside SDPA, and its accuracy.

Speed: causal prefill, B=1, D=128, against ``scaled_dot_product_attention`` on the dequantised
fp32 and bf16 tensors, measured in the same run (median of runs). Memory: peak RSS growth of
one call at S=16384 in a fresh process. Accuracy: error against exact fp32 attention on the
original (unquantised) inputs, for HiF8 and for a per-tensor FP8 E4M3 emulation.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from typing import Sequence

import torch
import torch.nn.functional as F

from qfa.tools.bench.timing import markdown_table, median_seconds
from qfa.tools.metrics import error_metrics

HEADS = ((12, 2), (32, 8))
SEQS = (512, 1024, 2048, 4096)
MEMORY_SEQ = 16384
MEMORY_LIMIT_GIB = 4.0
#: The issue's speed target: the torch path at most this many times fp32 SDPA's time ...
SPEED_TARGET_RATIO = 1.0
#: ... from this sequence length up.
SPEED_TARGET_MIN_SEQ = 2048


def _head_pairs(text: str) -> list[tuple[int, int]]:
    """'12:2,32:8' -> [(12, 2), (32, 8)]: q heads and kv heads, q a multiple of kv."""
    pairs = []
    for item in text.split(","):
        try:
            hq, hkv = (int(x) for x in item.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected Nq:Nkv pairs like 12:2,32:8, got {item!r}") from None
        if hkv < 1 or hq < hkv or hq % hkv:
            raise argparse.ArgumentTypeError(f"Nq must be a positive multiple of Nkv, got {item!r}")
        pairs.append((hq, hkv))
    return pairs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=list(SEQS))
    parser.add_argument("--heads", type=_head_pairs, default=list(HEADS),
                        help="(Nq, Nkv) pairs of the speed table, as Nq:Nkv,... (default 12:2,32:8)")
    parser.add_argument("--memory-seq", type=int, default=MEMORY_SEQ, help="S of the peak-memory run (0 skips it)")
    parser.add_argument("--accuracy-seq", type=int, default=1024, help="S of the accuracy table (0 skips it)")
    parser.add_argument("--backend", default="torch")


def causal_flops(heads: int, seq: int, dim: int = 128) -> float:
    """Useful FLOPs of causal attention: two matmuls over half the score matrix."""
    return 4.0 * heads * seq * seq * dim / 2


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


def speed_rows(seqs, backend: str, heads=HEADS) -> tuple[list[list[str]], list[float]]:
    """The speed table, and qfa / fp32 SDPA for the rows the target covers."""
    from qfa.attention import quant_flash_attn

    rows, target_ratios = [], []
    for hq, hkv in heads:
        for seq in seqs:
            codes, descales, (qd, kd, vd) = quantised_inputs(hq, hkv, seq)
            t_ours = median_seconds(lambda: quant_flash_attn(*codes, *descales, 7, mask_mode=3, backend=backend),
                                    min_runs=3, min_total=0)
            t32 = median_seconds(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True),
                                 min_runs=3, min_total=0)
            qb, kb, vb = qd.bfloat16(), kd.bfloat16(), vd.bfloat16()
            t16 = median_seconds(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True),
                                 min_runs=3, min_total=0)
            flops = causal_flops(hq, seq)
            rows.append([f"({hq}, {hkv})", seq, f"{t_ours * 1e3:.1f}", f"{flops / t_ours / 1e9:.1f}",
                         f"{t32 * 1e3:.1f}", f"{t_ours / t32:.2f}x", f"{t16 * 1e3:.1f}", f"{t_ours / t16:.2f}x"])
            if seq >= SPEED_TARGET_MIN_SEQ:
                target_ratios.append(t_ours / t32)
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return rows, target_ratios


def speed_verdict(ratios: Sequence[float]) -> str:
    """The verdict line on the speed target, from qfa / fp32 SDPA of the rows it covers (S >= the minimum)."""
    if not ratios:
        raise ValueError("speed_verdict needs at least one measured ratio, got none")
    met = sum(r <= SPEED_TARGET_RATIO for r in ratios)
    return (f"speed target (qfa <= {SPEED_TARGET_RATIO:.1f}x fp32 SDPA for S >= {SPEED_TARGET_MIN_SEQ}): "
            f"{'met' if met == len(ratios) else 'NOT met'} in {met} of {len(ratios)} rows (worst {max(ratios):.2f}x)")


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
    from qfa.attention.fp8_emulation import fp8_e4m3_attention
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
    print(f"quant_flash_attn (mode 7, causal, B=1, D=128) vs SDPA; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, backend={args.backend}")
    rows, target_ratios = speed_rows(args.seqs, args.backend, args.heads)
    print(markdown_table(["(Nq, Nkv)", "S", "qfa ms", "qfa GFLOP/s", "SDPA fp32 ms", "qfa / fp32",
                          "SDPA bf16 ms", "qfa / bf16"], rows))
    if target_ratios:
        print("\n" + speed_verdict(target_ratios))
    if args.memory_seq:
        mem = peak_memory(args.memory_seq, args.backend)
        verdict = "OK" if mem["peak_growth_gib"] < MEMORY_LIMIT_GIB else "OVER"
        print(f"\npeak memory, (32, 8), S={args.memory_seq}: {mem['peak_growth_gib']:.2f} GiB above the "
              f"{mem['inputs_mib']:.0f} MiB of HiF8 inputs (limit {MEMORY_LIMIT_GIB} GiB: {verdict})")
    if args.accuracy_seq:
        print(f"\naccuracy against exact fp32 attention on the unquantised inputs (causal, (12, 2), "
              f"S={args.accuracy_seq})")
        print(markdown_table(["data", "attention", "cosine", "rel L2", "max abs"], accuracy_rows(args.accuracy_seq)))
    return 0
