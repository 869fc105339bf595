"""quant_flash_attn (HiF8 per-tensor, quant_mode 7) as ``docs/spec/quant-flash-attn.md`` states it.

A slow, spec-level oracle for the tests: explicit Python loops over batch, q head, query row and
256-key block, one online-softmax step at a time, exactly in the doc's order. Like
``spec_reference`` it does not import qfa: codes are decoded with ``spec_reference.decode`` (parsed
from the bit layout) and P is rounded to HiF8 by :func:`hif8_round`, written here from the
format's rounding rule (``math.frexp``-style binade, mantissa bits per binade, first dropped bit),
so neither the LUTs nor the torch path's gather can hide a mistake on both sides.

Arithmetic: numpy float64 where it only removes rounding noise (the dot products, the row sum l,
the P8 @ V accumulation), and the doc's fp32 steps where they decide a value: S rounded to fp32,
dScale, the running max, the exponent argument and P in fp32 (P is what gets rounded to HiF8, so
it must be the fp32 P), out = O / l rounded to fp32 and then to bf16 half away from zero, lse in
fp32. What remains different from the torch path is fp32 summation order and exp's last ulp.

Use it on small shapes only: a (batch, head, row, block) step costs tens of microseconds.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import spec_reference as spec

BLOCK_N = 256  # keys per softmax block: part of the numerics (P is quantised per running max)
HEAD_DIM = 128
HIF8_MAX = 32768.0
OVERFLOW_THRESHOLD = 40960.0  # 1.25 * 2^15: at and above it, saturating rounding gives MAX

#: The value of every code, parsed from the bit layout by the independent spec module.
DECODE = np.array([spec.decode(c) for c in range(256)], dtype=np.float64)


def decode(codes: torch.Tensor | np.ndarray) -> np.ndarray:
    """float64 values of HiF8 codes (0x80 -> NaN, 0x6F/0xEF -> +-Inf)."""
    if isinstance(codes, torch.Tensor):
        codes = codes.cpu().numpy()
    return DECODE[np.asarray(codes, dtype=np.uint8).astype(np.int64)]


def _mantissa_bits(e: np.ndarray) -> np.ndarray:
    """Mantissa bits HiF8 keeps in binade 2^e (the format's table; 0 in the denormal binades)."""
    a = np.abs(e)
    return np.where(e <= -16, 0, np.where(a <= 3, 3, np.where(a <= 7, 2, 1)))


def hif8_round(x: np.ndarray) -> np.ndarray:
    """Values of fp32 ``x`` rounded to HiF8: nearest, ties away from zero, saturating at +-MAX.

    The format's rule applied directly: binade e = floor(log2 |x|) from ``np.frexp``, keep m(e)
    mantissa bits, round the magnitude up iff the first dropped bit is 1. Everything happens in
    float64 on powers of two, so no step rounds. NaN stays NaN, +-Inf stays +-Inf (saturate mode).
    """
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    a = np.abs(x)
    normal = (a >= 2.0**-22) & (a < OVERFLOW_THRESHOLD)
    safe = np.where(normal, a, 1.0)
    e = np.frexp(safe)[1] - 1  # frexp: a = f * 2^(e+1) with f in [0.5, 1), so e = floor(log2 a)
    m = _mantissa_bits(e)
    scaled = np.ldexp(safe, m - e)  # in [2^m, 2^(m+1)): the kept bits are its integer part
    kept = np.floor(scaled) + np.floor(scaled * 2) % 2  # + the first dropped bit (ties go away)
    rounded = np.ldexp(kept, e - m)  # a carry lands on 2^(e+1), always a HiF8 value
    out = np.select(
        [np.isnan(a), normal, (a >= 2.0**-23) & (a < 2.0**-22), np.isinf(a), a >= OVERFLOW_THRESHOLD],
        [np.nan, rounded, 2.0**-22, np.inf, HIF8_MAX],
        default=0.0,  # below 2^-23, and zero: HiF8 has no -0
    )
    return np.where(out == 0, 0.0, np.copysign(out, x))


def bf16_round_half_away(x: np.ndarray) -> np.ndarray:
    """fp32 ``x`` rounded to bf16 (8 significant bits) half away from zero, as float64 values.

    bf16 shares fp32's exponent range, so the quantum is 2^(e - 7) for |x| in [2^e, 2^(e+1)), and
    never below 2^-133 (bf16's subnormal step). Finite fp32 outputs of attention never overflow.
    """
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    a = np.abs(x)
    finite = np.isfinite(a) & (a > 0)
    _, exp = np.frexp(np.where(finite, a, 1.0))
    quantum = np.ldexp(1.0, np.maximum(exp - 8, -133))
    rounded = np.floor(np.where(finite, a, 0.0) / quantum + 0.5) * quantum
    return np.where(finite, np.copysign(rounded, x), x)


def _f32(x) -> np.float32:
    return np.float32(x)


def _sequences(t: np.ndarray, layout: str, cu: list[int] | None) -> list[np.ndarray]:
    """Per batch, the (N, S, D) sequence of a tensor in ``layout``."""
    if layout == "BNSD":
        return [t[b] for b in range(t.shape[0])]
    if layout == "BSND":
        return [t[b].transpose(1, 0, 2) for b in range(t.shape[0])]
    return [t[cu[b] : cu[b + 1]].transpose(1, 0, 2) for b in range(len(cu) - 1)]


def _as_list(t) -> list[int] | None:
    return None if t is None else [int(x) for x in (t.tolist() if isinstance(t, torch.Tensor) else t)]


def _scalar(t) -> float:
    return float(t.reshape(-1)[0]) if isinstance(t, torch.Tensor) else float(t)


def row_attention(q_row, keys, values, dscale, ln_p, v_descale, visible):
    """The doc's loop for one query row: returns (out fp32 value or None if no key seen, lse).

    ``q_row`` (D,), ``keys`` / ``values`` (Skv, D) float64 HiF8 values, ``visible`` (Skv,) bool.
    """
    m = _f32(-np.inf)
    l = 0.0  # float64: the sum of the unquantised fp32 P (only summation order differs)
    o = np.zeros(values.shape[1])
    seen = False
    for j0 in range(0, keys.shape[0], BLOCK_N):
        vis = visible[j0 : j0 + BLOCK_N]
        if not vis.any():
            # S is all -inf: m_new = m, P = 0, alpha = 1, so the step changes nothing (and the
            # doc's exp(-inf - -inf) for a row that has seen nothing yet means "no contribution").
            continue
        seen = True
        s = (keys[j0 : j0 + BLOCK_N] @ q_row).astype(np.float32)  # exact products, rounded to fp32
        s[~vis] = -np.inf
        m_new = np.maximum(m, _f32(_f32(np.max(s) * dscale) - ln_p))  # np.maximum keeps NaN
        arg = (s * dscale).astype(np.float32) - m_new  # fp32, <= ln p_scale
        p = np.exp(arg.astype(np.float64)).astype(np.float32)  # exp in float64, rounded to fp32
        alpha = float(np.exp(np.float64(_f32(m - m_new)), dtype=np.float32)) if m != -np.inf else 0.0
        l = alpha * l + float(np.sum(p, dtype=np.float64))
        p8 = hif8_round(p)  # round half away from zero, saturating; never NaN/Inf for finite P
        o = alpha * o + (p8 @ values[j0 : j0 + BLOCK_N]) * v_descale
        m = m_new
    if not seen:
        return None, np.inf
    out = (o / l).astype(np.float32) if np.isfinite(l) else np.full(o.shape, np.nan, dtype=np.float32)
    lse = np.float32(np.float64(m) + math.log(l)) if l > 0 and math.isfinite(l) else np.float32(np.nan)
    return out, lse


def reference_attention(
    q, k, v, q_descale, k_descale, v_descale, *, p_scale=None, layout="BNSD", cu_seqlens_q=None,
    cu_seqlens_kv=None, seqused_q=None, seqused_kv=None, causal=False, softmax_scale=None,
) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of quant_flash_attn by the doc: out as float64 bf16 values in q's layout and
    shape, lse float32 (B, Nq, Sq) or (Nq, Tq). Rows that see no key: out 0, lse +inf."""
    qv, kv, vv = decode(q), decode(k), decode(v)
    cu_q, cu_kv = _as_list(cu_seqlens_q), _as_list(cu_seqlens_kv)
    qs, ks, vs = _sequences(qv, layout, cu_q), _sequences(kv, layout, cu_kv), _sequences(vv, layout, cu_kv)
    head_axis = {"BNSD": 1, "BSND": 2, "TND": 1}[layout]
    batch, nq, nkv = len(qs), qv.shape[head_axis], kv.shape[head_axis]
    group = nq // nkv
    used_q, used_kv = _as_list(seqused_q), _as_list(seqused_kv)

    scale = 1.0 / math.sqrt(HEAD_DIM) if softmax_scale is None else softmax_scale
    dscale = _f32(_f32(scale) * (_f32(_scalar(q_descale)) * _f32(_scalar(k_descale))))
    ln_p = _f32(0.0 if p_scale is None else math.log(_scalar(p_scale)))
    v_descale = _scalar(v_descale)

    seq_q = max((s.shape[1] for s in qs), default=0)
    out_b = np.zeros((batch, nq, seq_q, HEAD_DIM))  # padding rows stay 0
    lse_b = np.full((batch, nq, seq_q), np.inf, dtype=np.float32)
    for b in range(batch):
        lq = qs[b].shape[1] if used_q is None else used_q[b]
        lkv = ks[b].shape[1] if used_kv is None else used_kv[b]
        for h in range(nq):
            keys, values = ks[b][h // group, :lkv], vs[b][h // group, :lkv]  # GQA: kv head h // G
            for i in range(lq):
                visible = np.ones(lkv, dtype=bool)
                if causal:  # bottom-right aligned with this batch's lengths
                    visible = np.arange(lkv) <= i + (lkv - lq)
                o, lse = row_attention(qs[b][h, i], keys, values, dscale, ln_p, v_descale, visible)
                if o is not None:
                    out_b[b, h, i] = bf16_round_half_away(o)
                    lse_b[b, h, i] = lse

    if layout == "BNSD":
        return out_b, lse_b
    if layout == "BSND":
        return out_b.transpose(0, 2, 1, 3), lse_b
    out = np.zeros((qv.shape[0], nq, HEAD_DIM))
    lse = np.full((nq, qv.shape[0]), np.inf, dtype=np.float32)
    for b in range(batch):
        n = cu_q[b + 1] - cu_q[b]
        out[cu_q[b] : cu_q[b + 1]] = out_b[b, :, :n].transpose(1, 0, 2)
        lse[:, cu_q[b] : cu_q[b + 1]] = lse_b[b, :, :n]
    return out, lse


def exact_attention(q, k, v, *, causal=False, softmax_scale=None, quantise_p=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out, lse) of softmax(q k^T * scale) v on real-valued BNSD tensors (GQA by h // G),
    Sq x Skv at once; rows with no visible key give 0 and +inf.

    ``quantise_p`` = p_scale rounds P = p_scale * exp(s - rowmax) to HiF8 (one global row max,
    normaliser from the unquantised P, no bf16): the "only P is quantised" reference of
    FlashAttention-3's accuracy criterion.
    """
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = q @ k.transpose(-1, -2) * scale
    sq, skv = s.shape[-2:]
    if causal:
        s = s.masked_fill(torch.arange(skv) > torch.arange(sq)[:, None] + (skv - sq), float("-inf"))
    rowmax = s.amax(dim=-1, keepdim=True)
    rowmax = torch.where(rowmax == float("-inf"), 0.0, rowmax)
    p = torch.exp(s - rowmax)
    l = p.sum(dim=-1, keepdim=True)
    if quantise_p is not None:
        p = torch.from_numpy(hif8_round((p * quantise_p).to(torch.float32).numpy())) / quantise_p
    seen = l > 0
    out = torch.where(seen, (p @ v) / torch.where(seen, l, 1.0), 0.0)
    lse = torch.where(seen, rowmax + torch.log(torch.where(seen, l, 1.0)), float("inf")).squeeze(-1)
    return out, lse


#: Finite HiF8 values in ascending order and their codes, to turn rounded values into codes.
_FINITE = [(value, code) for code, value in enumerate(DECODE.tolist()) if math.isfinite(value) and code != 0x80]
_VALUES = np.array(sorted(v for v, _ in _FINITE))
_CODES = np.array([c for _, c in sorted(_FINITE)], dtype=np.uint8)


def encode(x: np.ndarray) -> np.ndarray:
    """HiF8 codes of finite fp32 values (saturating), via :func:`hif8_round` and the decode table."""
    rounded = hif8_round(x)
    if not np.isfinite(rounded).all():
        raise ValueError("encode here is for finite test data only")
    return _CODES[np.searchsorted(_VALUES, rounded)]


def quantise(x: torch.Tensor, scale_rule: str = "upstream") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, descale fp32 (1,)) of a float tensor, per tensor. ``upstream``: descale =
    amax / 32768, the Ascend goldens' rule; ``unit``: amax / 8, which puts the bulk of the values
    near 1 where HiF8 has 3 mantissa bits."""
    x = x.to(torch.float32)
    descale = np.float32(float(x.abs().max()) / (HIF8_MAX if scale_rule == "upstream" else 8.0))
    codes = encode((x.numpy() / descale).astype(np.float32))
    return torch.from_numpy(codes), torch.tensor([descale], dtype=torch.float32)


def uniform_fp16(shape, seed: int) -> torch.Tensor:
    """Upstream's test data: fp16 uniform(-1, 1), as fp32."""
    g = torch.Generator().manual_seed(seed)
    return torch.empty(shape, dtype=torch.float16).uniform_(-1, 1, generator=g).to(torch.float32)


def random_qkv(q_shape, kv_shape, seed: int = 0, scale_rule: str = "upstream"):
    """HiF8 (q, k, v) codes and fp32 (1,) descales of fp16 uniform(-1, 1) data."""
    shapes = (q_shape, kv_shape, kv_shape)
    (q, qd), (k, kd), (v, vd) = (quantise(uniform_fp16(s, seed * 3 + i), scale_rule) for i, s in enumerate(shapes))
    return q, k, v, qd, kd, vd
