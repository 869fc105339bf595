"""One-off CUDA check of the quant_flash_attn Triton kernel: not collected by pytest (no test_ prefix).

    python tests/attention/gpu_check_attention.py            # correctness + timing table, default launch
    python tests/attention/gpu_check_attention.py --sweep    # also try other CUDA launch options

On a CUDA device (TRITON_INTERPRET unset), for a few shapes it runs the Triton kernel and the torch
path on the same HiF8 inputs and prints: the fraction of out elements within 1e-4 + 2^-7 |ref| (the
rule the CPU tests use; it must be >= 0.999), the bit-identical fraction, the largest lse relative
error (must be <= 0.005), NaNs left in out/lse (the kernel's outputs start as NaN), and median times
(CUDA events) of the kernel, the torch path and bf16 SDPA on the dequantised tensors, with the
kernel's TFLOP/s. Exit status 1 if any row fails. Needs a few minutes at most on one GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch

D = 128


def _codes(shape, gen, scale=1.0):
    from qfa.cast import encode_to_hifloat8

    x = torch.randn(*shape, generator=gen, device="cuda") * scale
    return encode_to_hifloat8(x, backend="torch")


def _time_ms(fn, warmup=2, iters=7):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


CASES = [
    # name, layout, B, Nq, Nkv, Sq, Skv, causal, extra kwargs, time it
    ("odd-cross", "BNSD", 2, 4, 2, 300, 257, True, {}, False),
    ("odd-cross2", "BNSD", 2, 4, 1, 257, 300, True, {}, False),
    ("bsnd-nomask", "BSND", 2, 8, 8, 1000, 1000, False, {}, False),
    ("pscale256", "BNSD", 1, 4, 1, 37, 513, False, {"p_scale": 256.0}, False),
    ("tnd-varlen", "TND", (37, 0, 700, 1), 4, 2, None, (300, 5, 700, 37), True, {"seqused": True}, False),
    ("prefill-1k", "BNSD", 1, 12, 2, 1024, 1024, True, {}, True),
    ("prefill-4k", "BNSD", 1, 32, 8, 4096, 4096, True, {}, True),
    ("prefill-4k-bsnd", "BSND", 1, 32, 8, 4096, 4096, True, {}, True),
]


def _inputs(case, gen):
    name, layout, B, Nq, Nkv, Sq, Skv, causal, extra, _ = case
    kwargs = {"layout": layout, "mask_mode": 3 if causal else 0, "return_softmax_lse": True}
    if "p_scale" in extra:
        kwargs["p_scale"] = torch.tensor([extra["p_scale"]], device="cuda")
    if layout == "TND":
        q_lens, kv_lens = B, Skv
        cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = _codes((sum(q_lens), Nq, D), gen)
        k, v = _codes((sum(kv_lens), Nkv, D), gen), _codes((sum(kv_lens), Nkv, D), gen)
        kwargs.update(cu_seqlens_q=cu(q_lens), cu_seqlens_kv=cu(kv_lens))
        if extra.get("seqused"):
            kwargs["seqused_q"] = torch.tensor([30, 0, 650, 1], dtype=torch.int32, device="cuda")
            kwargs["seqused_kv"] = torch.tensor([290, 5, 0, 37], dtype=torch.int32, device="cuda")
        flops = sum(4 * Nq * a * b * D for a, b in zip(q_lens, kv_lens))
    else:
        shape = (lambda n, s: (B, n, s, D)) if layout == "BNSD" else (lambda n, s: (B, s, n, D))
        q, k, v = _codes(shape(Nq, Sq), gen), _codes(shape(Nkv, Skv), gen), _codes(shape(Nkv, Skv), gen)
        flops = 4 * B * Nq * Sq * Skv * D
    if causal:
        flops //= 2
    return q, k, v, kwargs, flops


def _sdpa_fn(q, k, v, descales, kwargs):
    """bf16 SDPA on the dequantised tensors (BNSD/BSND only), as a speed reference."""
    from qfa.cast import decode_from_hifloat8

    if kwargs["layout"] == "TND":
        return None
    deq = [decode_from_hifloat8(t, torch.float32, backend="torch") * s for t, s in zip((q, k, v), descales)]
    if kwargs["layout"] == "BSND":
        deq = [t.transpose(1, 2) for t in deq]
    qb, kb, vb = (t.to(torch.bfloat16).contiguous() for t in deq)
    group = qb.shape[1] // kb.shape[1]
    kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
    causal = kwargs["mask_mode"] == 3 and qb.shape[2] == kb.shape[2]
    return lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)


def run_cases(cases, timing: bool):
    from qfa.attention.op import quant_flash_attn

    gen = torch.Generator(device="cuda").manual_seed(0)
    descales = [torch.tensor([x], device="cuda") for x in (0.5, 0.75, 1.25)]
    header = (f"{'case':<16}{'within':>9}{'bitexact':>10}{'lse_rel':>10}{'nan':>5}"
              f"{'triton ms':>11}{'torch ms':>10}{'sdpa ms':>9}{'TFLOP/s':>9}  ok")
    print(header)
    print("-" * len(header))
    all_ok = True
    for case in cases:
        q, k, v, kwargs, flops = _inputs(case, gen)
        try:
            out, lse = quant_flash_attn(q, k, v, *descales, backend="triton", **kwargs)
            torch.cuda.synchronize()
        except Exception as exc:  # compile / launch errors (e.g. out of shared memory): report, go on
            print(f"{case[0]:<16} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            all_ok = False
            continue
        ref, ref_lse = quant_flash_attn(q, k, v, *descales, backend="torch", **kwargs)
        o, r = out.float(), ref.float()
        nan = int(torch.isnan(o).sum() + torch.isnan(lse).sum())
        within = ((o - r).abs() <= 1e-4 + 2**-7 * r.abs()).float().mean().item()
        bitexact = (out.view(torch.int16) == ref.view(torch.int16)).float().mean().item()
        finite = torch.isfinite(ref_lse)
        same_inf = torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        lse_rel = ((lse[finite] - ref_lse[finite]).abs() / ref_lse[finite].abs().clamp_min(2.5e-5 / 0.005)).max().item() \
            if finite.any() else 0.0
        ok = nan == 0 and within >= 0.999 and lse_rel <= 0.005 and same_inf
        all_ok &= ok
        t_tri = t_torch = t_sdpa = float("nan")
        if timing and case[-1]:
            t_tri = _time_ms(lambda: quant_flash_attn(q, k, v, *descales, backend="triton", **kwargs))
            t_torch = _time_ms(lambda: quant_flash_attn(q, k, v, *descales, backend="torch", **kwargs), warmup=1, iters=3)
            sdpa = _sdpa_fn(q, k, v, descales, kwargs)
            if sdpa is not None:
                t_sdpa = _time_ms(sdpa)
        tflops = flops / (t_tri * 1e-3) / 1e12 if not math.isnan(t_tri) else float("nan")
        print(f"{case[0]:<16}{within:>9.5f}{bitexact:>10.5f}{lse_rel:>10.2e}{nan:>5}"
              f"{t_tri:>11.3f}{t_torch:>10.3f}{t_sdpa:>9.3f}{tflops:>9.1f}  {'ok' if ok else 'FAIL'}")
    return all_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also try other CUDA launch options (sub_m, warps, stages)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this script checks the compiled kernel on CUDA")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device; nothing to check")
        return 2
    import triton

    from qfa.kernels import attention as kernel

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"launch options (cuda): {kernel.LAUNCH['cuda']}")
    ok = run_cases(CASES, timing=True)
    if args.sweep:
        default = kernel.LAUNCH["cuda"]
        for opts in (
            kernel.LaunchOptions(sub_m=64, num_warps=4, num_stages=1),
            kernel.LaunchOptions(sub_m=128, num_warps=8, num_stages=1),
            kernel.LaunchOptions(sub_m=32, num_warps=4, num_stages=2),
        ):
            kernel.LAUNCH["cuda"] = opts
            print(f"\nlaunch options (cuda): {opts}")
            run_cases([c for c in CASES if c[0] in ("odd-cross", "prefill-4k")], timing=True)
        kernel.LAUNCH["cuda"] = default
    print("\nALL OK" if ok else "\nSOME CASES FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
