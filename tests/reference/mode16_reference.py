"""quant_flash_attn quant_mode 1 (MXFP8) and quant_mode 6 (FP8 E4M3 per-token-head) as
``docs/spec/quant-flash-attn.md`` states them, for one sequence.

A slow, spec-level oracle for the tests, in the style of ``attention_reference`` (mode 0): Python
loops over q head and query row, one online-softmax step per key block, in the doc's order. It
does not import qfa: E4M3 and E8M0 bytes are decoded here from their bit layouts, and P is rounded
to E4M3 by :func:`e4m3_round`, written from the format's rule (binade from ``np.frexp``, 3
mantissa bits, ties to even, saturating at 448), so neither qfa's codec nor its torch path can
hide a mistake on both sides.

Per query row, over its visible keys in blocks of ``block_n`` keys (ascending):

    S = Q . K_j^T            mode 1: sum over 32-channel groups g of dot_g * 2^(eq_g + ek_g)
                             mode 6: dot * q_descale[i] * k_descale[j]
    S[masked] = -inf
    m_new = max(m, rowmax(S) * softmax_scale - ln p_scale)
    P = exp(S * softmax_scale - m_new)            fp32, in (0, p_scale]
    alpha = exp(m - m_new);  l = alpha * l + rowsum(P)        (l: the UNquantised P)
    P8 = E4M3(P)                                  nearest even, saturating at 448
    O = alpha * O + P8 . V_j                      mode 1: per channel c, sum over 32-key groups t
                                                  of 2^(ev[t, c]) * sum_{j in t} P8_j V[j, c]
                                                  mode 6: (P8 . V_j) * v_descale[head]
out = O / l -> bf16, rounded half away from zero (as mode 0); lse = m + ln(l).
Rows that see no key: out 0, lse +inf.

Arithmetic: the dot products in float64, where they are exact (products of two E4M3 values have
8 significant bits and span 2^-18 .. 2^18, so 32 or 128 of them add up exactly in 53 bits); the
scaled sum over groups (mode 1) or the product with the two scales (mode 6) in float64, and S
then rounded to fp32 once; the doc's fp32 steps where they decide a value (the running max, the
exponent argument, P, alpha, out = O / l, lse); l and O in float64. What remains different from
an implementation is fp32 summation order and exp's last ulp.

The key-block size is a parameter: upstream's is not public for these modes (the HiF8 tiling
notes say HiF8 uses 256-key blocks "instead of 512"), so :data:`BLOCK_N` = 512 is the default.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import torch

from attention_reference import bf16_round_half_away

BLOCK_N = 512
GROUP = 32  # channels per q/k scale, keys per v scale (mode 1)
E4M3_MAX = 448.0
E8M0_NAN = 0xFF


def e4m3_value(code: int) -> float:
    """The value of one float8_e4m3fn byte: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 holds the subnormals m/8 * 2^-6; S.1111.111 is NaN (no Inf)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * math.ldexp(m / 8, -6)
    return sign * math.ldexp(1 + m / 8, e - 7)


def e8m0_value(code: int) -> float:
    """The value of one E8M0 byte: 2^(c - 127), 0xFF = NaN."""
    return math.nan if code == E8M0_NAN else math.ldexp(1.0, code - 127)


E4M3_DECODE = np.array([e4m3_value(c) for c in range(256)])
E8M0_DECODE = np.array([e8m0_value(c) for c in range(256)])


#: Finite non-negative E4M3 values: codes 0x00 .. 0x7E, which are in ascending order (so an
#: index here is the code, and an even index an even mantissa).
E4M3_GRID = tuple(float(v) for v in E4M3_DECODE[:0x7F])
assert list(E4M3_GRID) == sorted(set(E4M3_GRID)) and E4M3_GRID[-1] == E4M3_MAX


def e4m3_nearest(x: float) -> float:
    """``x`` (any Python float) rounded to E4M3 by search over the grid: the nearer neighbour,
    the even code on a tie, +-448 for anything beyond (+-Inf too), NaN for NaN, zero's sign kept.
    A second, independent statement of :func:`e4m3_round`'s rule (the comparisons are exact:
    2x and the sum of two 4-bit E4M3 values are float64 values)."""
    if math.isnan(x):
        return math.nan
    a = min(abs(x), E4M3_MAX)
    i = bisect.bisect_left(E4M3_GRID, a)
    if E4M3_GRID[i] == a:
        r = a
    else:
        lo, hi = E4M3_GRID[i - 1], E4M3_GRID[i]
        r = lo if 2 * a < lo + hi else hi if 2 * a > lo + hi else (lo if (i - 1) % 2 == 0 else hi)
    return math.copysign(r, x)


def _bytes(t) -> np.ndarray:
    """The bytes of a float8 (or uint8) tensor or array, as int64 indices."""
    if isinstance(t, torch.Tensor):
        t = t.view(torch.uint8).cpu().numpy()
    return np.asarray(t, dtype=np.uint8).astype(np.int64)


def decode_e4m3(t) -> np.ndarray:
    return E4M3_DECODE[_bytes(t)]


def decode_e8m0(t) -> np.ndarray:
    return E8M0_DECODE[_bytes(t)]


def e4m3_round(x) -> np.ndarray:
    """Values of fp32 ``x`` rounded to E4M3: nearest, ties to even, saturating at +-448 (+-Inf
    too); NaN stays NaN; the sign of zero is kept. Everything in float64 on powers of two."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    a = np.minimum(np.abs(x), E4M3_MAX)  # NaN stays NaN
    safe = np.where((a > 0) & np.isfinite(a), a, 1.0)
    e = np.maximum(np.frexp(safe)[1] - 1, -6)  # the binade; subnormals share 2^-6's quantum 2^-9
    rounded = np.ldexp(np.rint(np.ldexp(safe, 3 - e)), e - 3)  # np.rint: half to even
    out = np.where(a > 0, rounded, 0.0)
    out = np.where(np.isnan(a), np.nan, out)
    return np.copysign(out, x)


def _f32(x) -> np.float32:
    return np.float32(x)


def _online_softmax_row(score_blocks, pv_block, skv: int, visible, scale, ln_p, dim: int, block_n: int):
    """The doc's loop for one row: ``score_blocks(j0, j1)`` gives S (float64), ``pv_block(p8,
    j0, j1)`` gives P8 . V_j (float64 (dim,)). Returns (out fp32 or None, lse fp32)."""
    m = _f32(-np.inf)
    l = 0.0
    o = np.zeros(dim)
    seen = False
    for j0 in range(0, skv, block_n):
        j1 = min(skv, j0 + block_n)
        vis = visible[j0:j1]
        if not vis.any():
            continue  # all -inf: the step changes nothing
        seen = True
        s = score_blocks(j0, j1).astype(np.float32)
        s[~vis] = -np.inf
        m_new = np.maximum(m, _f32(_f32(np.max(s) * scale) - ln_p))
        arg = (s * scale).astype(np.float32) - m_new
        p = np.exp(arg.astype(np.float64)).astype(np.float32)
        alpha = float(np.exp(np.float64(_f32(m - m_new)), dtype=np.float32)) if m != -np.inf else 0.0
        l = alpha * l + float(np.sum(p, dtype=np.float64))
        o = alpha * o + pv_block(e4m3_round(p), j0, j1)
        m = m_new
    if not seen:
        return None, np.float32(np.inf)
    out = (o / l).astype(np.float32) if np.isfinite(l) else np.full(dim, np.nan, dtype=np.float32)
    lse = np.float32(np.float64(m) + math.log(l)) if l > 0 and math.isfinite(l) else np.float32(np.nan)
    return out, lse


def _attention(nq: int, nkv: int, sq: int, skv: int, dim: int, scores, pv, *, p_scale, softmax_scale, causal,
               block_n):
    if block_n <= 0:
        raise ValueError(f"block_n must be positive, got {block_n}")
    group = nq // nkv
    scale = _f32(1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale)
    ln_p = _f32(math.log(float(p_scale)))
    out = np.zeros((nq, sq, dim))
    lse = np.full((nq, sq), np.inf, dtype=np.float32)
    for h in range(nq):
        hk = h // group  # GQA: q head h reads kv head h // G
        for i in range(sq):
            visible = np.ones(skv, dtype=bool)
            if causal:  # bottom-right aligned: key j is visible iff j <= i + skv - sq
                visible = np.arange(skv) <= i + (skv - sq)
            o, row_lse = _online_softmax_row(
                lambda j0, j1: scores(h, hk, i, j0, j1), lambda p8, j0, j1: pv(hk, p8, j0, j1),
                skv, visible, scale, ln_p, dim, block_n)
            if o is not None:
                out[h, i] = bf16_round_half_away(o)
                lse[h, i] = row_lse
    return out, lse


def _shape(t, name: str, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def mxfp8_attention(q, k, v, q_scales, k_scales, v_scales, *, p_scale: float = 1.0, softmax_scale=None,
                    causal: bool = False, block_n: int = BLOCK_N) -> tuple[np.ndarray, np.ndarray]:
    """quant_mode 1 for one sequence: q (Nq, Sq, D), k and v (Nkv, Skv, D) float8_e4m3fn (or
    their bytes); q_scales (Nq, Sq, ceil(D/32)) and k_scales (Nkv, Skv, ceil(D/32)) E8M0, one per
    32 channels; v_scales (Nkv, ceil(Skv/32), D) E8M0, per channel one per 32 keys. Returns
    (out float64 bf16 values (Nq, Sq, D), lse float32 (Nq, Sq))."""
    qv, kv, vv = decode_e4m3(q), decode_e4m3(k), decode_e4m3(v)
    (nq, sq, dim), (nkv, skv, _) = qv.shape, kv.shape
    groups = -(-dim // GROUP)
    _shape(q_scales, "q_scales", (nq, sq, groups))
    _shape(k_scales, "k_scales", (nkv, skv, groups))
    _shape(v_scales, "v_scales", (nkv, -(-skv // GROUP), dim))
    eq, ek, ev = decode_e8m0(q_scales), decode_e8m0(k_scales), decode_e8m0(v_scales)
    pad = groups * GROUP - dim  # the tail group (D = 72: 8 channels) padded with zeros
    qg = np.pad(qv, ((0, 0), (0, 0), (0, pad))).reshape(nq, sq, groups, GROUP)
    kg = np.pad(kv, ((0, 0), (0, 0), (0, pad))).reshape(nkv, skv, groups, GROUP)

    def scores(h, hk, i, j0, j1):
        dots = np.einsum("kgc,gc->kg", kg[hk, j0:j1], qg[h, i])  # exact per group
        return (dots * (eq[h, i] * ek[hk, j0:j1])).sum(axis=-1)

    def pv(hk, p8, j0, j1):
        o = np.zeros(dim)
        for t0 in range(j0, j1, GROUP):  # 32-key groups from the sequence start (j0 % 32 == 0)
            t1 = min(j1, t0 + GROUP)
            o += ev[hk, t0 // GROUP] * (p8[t0 - j0 : t1 - j0] @ vv[hk, t0:t1])
        return o

    return _attention(nq, nkv, sq, skv, dim, scores, pv, p_scale=p_scale, softmax_scale=softmax_scale,
                      causal=causal, block_n=_block_n(block_n))


def _block_n(block_n: int) -> int:
    if block_n % GROUP:
        raise ValueError(f"block_n must be a multiple of {GROUP} (v's key groups), got {block_n}")
    return block_n


def _floats(t, name: str) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        t = t.cpu().numpy()
    return np.asarray(t, dtype=np.float32).astype(np.float64)


def fp8_attention(q, k, v, q_scale, k_scale, v_scale, *, p_scale: float = 1.0, softmax_scale=None,
                  causal: bool = False, block_n: int = BLOCK_N) -> tuple[np.ndarray, np.ndarray]:
    """quant_mode 6 for one sequence: q (Nq, Sq, D), k and v (Nkv, Skv, D) float8_e4m3fn (or
    their bytes); fp32 q_scale (Nq, Sq) and k_scale (Nkv, Skv), one per token and head; fp32
    v_scale (Nkv,), one per head. Returns (out float64 bf16 values (Nq, Sq, D), lse (Nq, Sq))."""
    qv, kv, vv = decode_e4m3(q), decode_e4m3(k), decode_e4m3(v)
    (nq, sq, dim), (nkv, skv, _) = qv.shape, kv.shape
    qs, ks, vs = _floats(q_scale, "q_scale"), _floats(k_scale, "k_scale"), _floats(v_scale, "v_scale")
    _shape(qs, "q_scale", (nq, sq))
    _shape(ks, "k_scale", (nkv, skv))
    _shape(vs, "v_scale", (nkv,))

    def scores(h, hk, i, j0, j1):
        return (kv[hk, j0:j1] @ qv[h, i]) * (qs[h, i] * ks[hk, j0:j1])

    def pv(hk, p8, j0, j1):
        return (p8 @ vv[hk, j0:j1]) * vs[hk]

    return _attention(nq, nkv, sq, skv, dim, scores, pv, p_scale=p_scale, softmax_scale=softmax_scale,
                      causal=causal, block_n=block_n)


# --- Against exact attention on the dequantised inputs ------------------------------------------


def p8_error_bound(s, v, p_scale, visible, arg_max, n_blocks):
    """Per output element, the bound on |reference - exact| derived from the arithmetic.

    With p_j = exp(s_j - rowmax) (exact, float64) and l = sum p_j (>= 1), the op's P_j is
    p_scale * p_j / A_j, where A_j <= 1 is the product of the later alphas; E4M3 rounds it to
    P_j (1 + d_j) + e_j with |d_j| <= 2^-4 (3 mantissa bits, nearest) and |e_j| <= 2^-10 (half the
    subnormal step 2^-9), saturation at 448 included (P <= p_scale <= 448 up to exp's rounding).
    The normaliser is the unquantised sum, so out - exact = sum_j A_j (P8_j - P_j) v_j / (p_scale l):
        |dout_c| <= 2^-4 T1_c + 2^-10 T2_c / p_scale,  T1 = sum p|v| / l,  T2 = sum |v| / l.
    fp32 on top: the exponent argument carries <= 8 rounding errors of size 2^-24 * arg_max
    (S, S * scale, the max, ln p_scale, the subtraction), exp one more ulp, and each of the
    n_blocks alphas as much again; eps = (n_blocks + 1) * (8 * arg_max + 2) * 2^-24 bounds the
    relative error of every P, of l, and so (times a few) of each term above. Last, O / l in fp32
    (2^-24) and the bf16 rounding of the result (2^-8 relative, half of 8 significant bits).
    """
    p = np.where(visible, np.exp(s - np.max(np.where(visible, s, -np.inf), axis=-1, keepdims=True)), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    t1 = (p @ np.abs(v)) / l
    t2 = (visible @ np.abs(v)) / l
    exact = (p @ v) / l
    eps = (n_blocks + 1) * (8 * arg_max + 2) * 2.0**-24
    bound = (2.0**-4 + 4 * eps) * t1 + 2.0**-10 * t2 / p_scale + 2 * eps * np.abs(exact)
    bound = bound * (1 + 2.0**-24) + 2.0**-24 * np.abs(exact)
    return exact, bound + 2.0**-8 * (np.abs(exact) + bound), np.log(l[..., 0])


def check_against_exact(out, lse, q, k, v, *, p_scale, scale, causal, block_n):
    """Assert that (out, lse) of mode 1 or 6 for one sequence lie within the bound of
    :func:`p8_error_bound` around float64 attention on the dequantised q, k, v ((N, S, D) float64
    each, GQA by head // G); returns the largest error / bound ratio."""
    nq, sq, _ = q.shape
    nkv, skv, _ = k.shape
    g = nq // nkv
    ratios = []
    for h in range(nq):
        s = (q[h] @ k[h // g].T) * float(np.float32(scale))
        visible = np.ones((sq, skv), dtype=bool)
        if causal:
            visible = np.arange(skv)[None, :] <= np.arange(sq)[:, None] + (skv - sq)
        seen = visible.any(axis=-1)
        arg_max = float(np.abs(s).max()) + abs(math.log(p_scale))
        n_blocks = -(-skv // block_n)
        exact, bound, ln_l = p8_error_bound(s[seen], v[h // g], p_scale, visible[seen], arg_max, n_blocks)
        err = np.abs(out[h][seen] - exact)
        assert (err <= bound).all(), float((err / bound).max())
        ratios.append(float((err / bound).max()))
        assert (out[h][~seen] == 0).all() and np.isposinf(lse[h][~seen]).all()
        exact_lse = np.max(np.where(visible[seen], s[seen], -np.inf), axis=-1) + ln_l
        eps = (n_blocks + 1) * (8 * arg_max + 2) * 2.0**-24
        assert (np.abs(lse[h][seen] - exact_lse) <= 2 * eps + 2.0**-22 * (arg_max + np.abs(exact_lse))).all()
    return max(ratios)
