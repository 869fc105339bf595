"""Triton kernel of quant_flash_attn's quant_mode 1 (MXFP8) and 6 (FP8 E4M3 per-token-head).

``forward(plan, q, k, v, q_descale, k_descale, v_descale, p_scale, block_table=None)`` runs a
mode 1 / 6 :class:`~qfa.tiling.attention.AttentionPlan` with the contract and the numerics of
the golden torch path (``qfa.attention.backends.scaled_torch_path``), per query row over its visible keys
in blocks of ``plan.block_n`` = 512 keys, ascending from key 0 of the sequence:

    mode 1: S = Q' @ K'^T, with Q' = Q * 2^eq and K' = K * 2^ek per 32-channel group (exact)
    mode 6: S = (Q @ K^T) * (q_descale[i] * k_descale[j])
    m_new = max(m, rowmax(S) * softmax_scale - ln p_scale)   (the max of the whole 512-key block)
    P = exp(S * softmax_scale - m_new);  alpha = exp(m - m_new);  l = alpha * l + rowsum(P)
    mode 1: O = alpha * O + E4M3(P) @ V', with V' = V * 2^ev per channel and 32-key group
    mode 6: O = alpha * O + (E4M3(P) @ V) * v_descale[head]
    out = O / l -> bf16 rounded half away from zero;  lse = m + ln l;  no key seen: 0 / +inf

Bytes in. float8 tensors reach the kernel as uint8 views (the interpreter runs on numpy, which
has no fp8) and are decoded with bit operations: E4M3 (``_e4m3_value``) and E8M0
(``_e8m0_value``, 2^(c - 127), code 0 is the fp32 subnormal 2^-127, 0xFF NaN). The E8M0 scales
are read straight from upstream's paired layouts: a pair axis (ceil(D/64), 2) or (Bs/64, 2)
holds consecutive 32-blocks, so block g sits at ``(g // 2) * pair_stride + (g % 2) * stride``.

Exact products. Mode 1 multiplies the E4M3 elements by their power-of-two scales in fp32 (exact:
the plan's checks keep every scaled element finite, and the smallest, 2^-9 * 2^-127, is an fp32
subnormal with all its bits) and runs fp32 dots with ``input_precision="ieee"``: fp16 cannot
hold 2^-127-scaled values, and bf16 drops the low bits of subnormal ones (and bf16 ``tl.dot`` is
wrong under the 3.8/3.9 interpreter). Mode 6's operands are unscaled E4M3 values and E4M3 P,
exact in fp16 (|x| <= 448, down to 2^-9), so its dots take fp16 with fp32 accumulation. Each
product of two 4-significant-bit values is exact in fp32: the result differs from the torch
path in fp32 summation order only. On sm_90 this means mode 6's dots are wgmma and mode 1's run
on the FMA units (exact, slower); bf16 tensor-core dots would be exact only for scaled values
>= 2^-130, i.e. scales >= 2^-121, which a kernel cannot know without reading the scales.

The 512-key block. Its row max must be taken over all 512 keys before any exp (numerics). The
interpreter computes a block's scores in one dot (``chunk`` = 512, fastest there); on a GPU a
512-key fp32 tile does not fit, so the block is walked in ``chunk``-key pieces twice: once for
the block's row max, once for P and P8 @ V with that max (the scores of the second pass are
the same dots on the same data, so they are the same bits). Chunking only changes the order of
the fp32 sums of l and O.

Work items, the persistent grid, the causal bottom-right masking, the structural "row saw a
key" rule and the masked path for NaN in V (``_specials_over_visible``) are mode 0's kernel's
(``qfa.kernels.attention``). D = 72 runs in a 128-wide block with masked loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qfa.kernels.attention import _bf16_bits_round_half_away, _specials_over_visible
from qfa.tiling.attention import AttentionPlan
from qfa.tiling.scaled_checks import kv_segment_lengths
from qfa.tiling.spec import MX_GROUP, QuantMode

#: ``forward`` takes paged K/V (``block_table``) itself.
READS_PAGED_KV = True

#: Keys per pair of E8M0 scales along v_descale's key axis (two 32-key groups).
_KEYS_PER_PAIR = 2 * MX_GROUP


@dataclass(frozen=True)
class LaunchOptions:
    """How a platform launches the kernel; none of these change the numbers."""

    #: Query rows per sub-tile (divides ``plan.block_m``; >= 16 for ``tl.dot``).
    sub_m: int
    #: Keys per score tile; divides the 512-key block (< 512: the two-pass walk, see above).
    chunk: int
    num_warps: int | None = None
    num_stages: int | None = None


#: Per-platform launch choices (``qfa.tiling.platform`` names). Interpreter: whole 512-key
#: blocks in 128-row sub-tiles (few, large numpy ops). CUDA: 64-key chunks keep mode 1's fp32
#: operand tiles (256 x 64 x 4 bytes at D = 256) within sm_90's shared memory.
LAUNCH: dict[str, LaunchOptions] = {
    "cpu-interpreter": LaunchOptions(sub_m=128, chunk=512),
    "cuda": LaunchOptions(sub_m=64, chunk=64, num_warps=8, num_stages=1),
}
_DEFAULT_LAUNCH = LaunchOptions(sub_m=64, chunk=128)


# ------------------------------------------------------------------------- device functions


@triton.jit
def _e4m3_value(codes):
    """fp32 values of E4M3 (fn) codes (any int tensor, low 8 bits): S.EEEE.MMM, bias 7;
    exponent 0: subnormals M/8 * 2^-6; S.1111.111: NaN. Exact (every E4M3 value is an fp32)."""
    c = codes.to(tl.int32) & 0xFF
    sign = (c & 0x80) << 24
    e = (c >> 3) & 0xF
    m = c & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # M * 2^-9, exact
    bits = value.to(tl.int32, bitcast=True) | sign
    bits = tl.where((c & 0x7F) == 0x7F, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_value(codes):
    """fp32 2^(c - 127) of E8M0 codes (any int tensor, low 8 bits); code 0 is the fp32
    subnormal 2^-127 (bit 22), 0xFF NaN."""
    c = codes.to(tl.int32) & 0xFF
    bits = tl.where(c == 0, 0x00400000, c << 23)
    bits = tl.where(c == 0xFF, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_round_sat(x):
    """fp32 ``x`` rounded to the nearest E4M3 value, ties to even, saturating at +-448 (+-Inf
    included), as fp32; NaN stays NaN, the sign of zero is kept: ``qfa.cast.fp8.on_e4m3_grid``
    with integer operations. Normal binades (|x| >= 2^-6) keep 3 mantissa bits (round the fp32
    pattern at bit 20); below, the grid is multiples of 2^-9 (round M * 2^(E - 141) to an int)."""
    bits = x.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    sign = bits ^ a  # the sign bit alone (an int32 literal cannot spell 0x80000000)
    nan = a > 0x7F800000
    a = tl.minimum(a, 0x43E00000)  # 448: clamping first equals saturating after (monotone)
    kept = (a + 0x7FFFF + ((a >> 20) & 1)) & -1048576  # 0xFFF00000: RNE at bit 20
    e = a >> 23
    e_eff = tl.maximum(e, 1)
    mant = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    shift = tl.minimum(141 - e_eff, 25)  # >= 21 here; from 25 on everything rounds to 0
    units = mant >> shift
    rem = mant - (units << shift)
    half = 1 << (shift - 1)
    units += tl.where((rem > half) | ((rem == half) & ((units & 1) == 1)), 1, 0)
    small = (units.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    out = tl.where(a >= 0x3C800000, kept, small) | sign
    out = tl.where(nan, 0x7FC00000, out)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _key_place(table_base, cols, key_ok, page, stc, PAGED: tl.constexpr):
    """(physical block int64, position in it) of keys ``cols``; unpaged: (0, cols). ``stc``:
    the block table's column stride."""
    if PAGED:
        phys = tl.load(table_base + (cols // page) * stc, mask=key_ok, other=0).to(tl.int64)
        pos = cols % page
    else:
        phys = tl.zeros(cols.shape, dtype=tl.int64)
        pos = cols
    return phys, pos


@triton.jit
def _scores(
    q, q_scale, k_base, ks_base, table_base, j0, kv_len, last, page, stc, dims, d_ok,
    skb, sks, skd, ksb, kss, ksp, ks2,
    CHUNK: tl.constexpr, MODE: tl.constexpr, PAGED: tl.constexpr,
):
    """Scores of keys ``j0 .. j0 + CHUNK`` for the sub-tile's rows (SUB_M, CHUNK), -inf where a
    row may not see the key. Mode 1: ``q`` holds Q' (fp32) and K is scaled here; mode 6: ``q``
    holds Q (fp16), ``q_scale`` its per-row scales, and the scores are scaled after the dot."""
    cols = j0 + tl.arange(0, CHUNK)
    cols_f = cols.to(tl.float32)
    key_ok = cols_f < kv_len
    phys, pos = _key_place(table_base, cols, key_ok, page, stc, PAGED)
    kt_codes = tl.load(k_base + dims[:, None] * skd + (phys * skb + pos * sks)[None, :],
                       mask=d_ok[:, None] & key_ok[None, :], other=0)
    kt = _e4m3_value(kt_codes)  # (D_PAD, CHUNK)
    if MODE == 1:
        groups = dims // 32
        ks_codes = tl.load(ks_base + ((groups // 2) * ksp + (groups % 2) * ks2)[:, None]
                           + (phys * ksb + pos * kss)[None, :], mask=d_ok[:, None] & key_ok[None, :], other=0)
        s = tl.dot(q, kt * _e8m0_value(ks_codes), input_precision="ieee")
    else:
        k_scale = tl.load(ks_base + phys * ksb + pos * kss, mask=key_ok, other=1.0)
        s = tl.dot(q, kt.to(tl.float16))
        s = s * (q_scale[:, None] * k_scale[None, :])
    return tl.where(cols_f[None, :] <= last[:, None], s, float("-inf"))


@triton.jit
def _p_times_v(
    p, v_base, vs_base, table_base, j0, kv_len, last, page, stc, dims, d_ok, v_scale,
    svb, svs, svd, vsb, vsr, vsc, vs2,
    CHUNK: tl.constexpr, MODE: tl.constexpr, PAGED: tl.constexpr,
):
    """E4M3(P) @ V of keys ``j0 .. j0 + CHUNK`` (SUB_M, D_PAD) fp32, with V's scales."""
    cols = j0 + tl.arange(0, CHUNK)
    cols_f = cols.to(tl.float32)
    key_ok = cols_f < kv_len
    phys, pos = _key_place(table_base, cols, key_ok, page, stc, PAGED)
    v_codes = tl.load(v_base + (phys * svb + pos * svs)[:, None] + dims[None, :] * svd,
                      mask=key_ok[:, None] & d_ok[None, :], other=0)
    v = _e4m3_value(v_codes)  # (CHUNK, D_PAD)
    p8 = e4m3_round_sat(p)
    if MODE == 1:
        vs_codes = tl.load(vs_base + (phys * vsb + (pos // 64) * vsr + ((pos // 32) % 2) * vs2)[:, None]
                           + dims[None, :] * vsc, mask=key_ok[:, None] & d_ok[None, :], other=0)
        v = v * _e8m0_value(vs_codes)
    special = (v != v) | (tl.abs(v) == float("inf"))
    if MODE == 1:
        pv = tl.dot(p8, tl.where(special, 0.0, v), input_precision="ieee")
    else:
        pv = tl.dot(p8.to(tl.float16), tl.where(special, 0.0, v).to(tl.float16))
    if tl.sum(tl.sum(special.to(tl.int32), 1), 0) > 0:
        pv = _specials_over_visible(pv, p8, v, cols_f[None, :] <= last[:, None], CHUNK)
    if MODE == 6:
        pv = pv * v_scale
    return pv


@triton.jit
def _attention_rows(
    q_base, qs_base, k_base, ks_base, v_base, vs_base, out_base, lse_base, table_base,
    row0, q_len, kv_len, rows_b, dscale, ln_p, v_scale, page, stc,
    sqs, sqd, qst, qsp, qs2, skb, sks, skd, ksb, kss, ksp, ks2,
    svb, svs, svd, vsb, vsr, vsc, vs2, sos, sod, sls,
    SUB_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, MODE: tl.constexpr, CAUSAL: tl.constexpr, RETURN_LSE: tl.constexpr,
    PAGED: tl.constexpr,
):
    """Attention for query rows ``row0 .. row0 + SUB_M`` of one (batch, q head); stores them."""
    rows = row0 + tl.arange(0, SUB_M)
    dims = tl.arange(0, D_PAD)
    d_ok = dims < HEAD_DIM
    rows_f = rows.to(tl.float32)
    row_ok = rows_f < q_len
    q_codes = tl.load(q_base + rows[:, None] * sqs + dims[None, :] * sqd,
                      mask=row_ok[:, None] & d_ok[None, :], other=0)
    q = _e4m3_value(q_codes)
    if MODE == 1:
        groups = dims // 32
        qs_codes = tl.load(qs_base + rows[:, None] * qst + ((groups // 2) * qsp + (groups % 2) * qs2)[None, :],
                           mask=row_ok[:, None] & d_ok[None, :], other=0)
        q = q * _e8m0_value(qs_codes)  # Q' in fp32
        q_scale = tl.zeros([SUB_M], dtype=tl.float32)  # unused
    else:
        q_scale = tl.load(qs_base + rows * qst, mask=row_ok, other=1.0)
        q = q.to(tl.float16)

    # Last visible key of each row (fp32: exact, no int32 vector compares); -1: none.
    offset = kv_len - q_len  # bottom-right causal alignment
    last = tl.zeros([SUB_M], dtype=tl.float32) + (kv_len - 1).to(tl.float32)
    if CAUSAL:
        last = tl.minimum(last, rows_f + offset.to(tl.float32))
    last = tl.where(row_ok, last, -1.0)
    rows_hi = tl.minimum(row0 + SUB_M, q_len)
    kv_hi = kv_len
    if CAUSAL:
        kv_hi = tl.minimum(kv_hi, rows_hi + offset)
    kv_hi = tl.where(rows_hi > row0, kv_hi, 0)

    m_i = tl.full([SUB_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([SUB_M], dtype=tl.float32)
    acc = tl.zeros([SUB_M, D_PAD], dtype=tl.float32)
    for j0 in range(0, kv_hi, BLOCK_N):
        if CHUNK == BLOCK_N:
            s = _scores(q, q_scale, k_base, ks_base, table_base, j0, kv_len, last, page, stc, dims, d_ok,
                        skb, sks, skd, ksb, kss, ksp, ks2, CHUNK, MODE, PAGED)
            block_max = tl.max(s, 1)
        else:  # first pass: the row max of the whole block
            block_max = tl.full([SUB_M], float("-inf"), dtype=tl.float32)
            for c0 in range(0, BLOCK_N, CHUNK):
                if j0 + c0 < kv_hi:
                    s_c = _scores(q, q_scale, k_base, ks_base, table_base, j0 + c0, kv_len, last, page, stc, dims,
                                  d_ok, skb, sks, skd, ksb, kss, ksp, ks2, CHUNK, MODE, PAGED)
                    block_max = tl.maximum(block_max, tl.max(s_c, 1))
        m_new = tl.maximum(m_i, block_max * dscale - ln_p)
        # Rows that have seen no key yet keep m = -inf; subtract 0 there so exp gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        if CHUNK == BLOCK_N:
            p = tl.exp(s * dscale - m_safe[:, None])
            l_i = alpha * l_i + tl.sum(p, 1)
            pv = _p_times_v(p, v_base, vs_base, table_base, j0, kv_len, last, page, stc, dims, d_ok, v_scale,
                            svb, svs, svd, vsb, vsr, vsc, vs2, CHUNK, MODE, PAGED)
            acc = acc * alpha[:, None] + pv
        else:  # second pass: P and P8 @ V of each chunk with the block's max
            l_i = alpha * l_i
            acc = acc * alpha[:, None]
            for c0 in range(0, BLOCK_N, CHUNK):
                if j0 + c0 < kv_hi:
                    s_c = _scores(q, q_scale, k_base, ks_base, table_base, j0 + c0, kv_len, last, page, stc, dims,
                                  d_ok, skb, sks, skd, ksb, kss, ksp, ks2, CHUNK, MODE, PAGED)
                    p = tl.exp(s_c * dscale - m_safe[:, None])
                    l_i += tl.sum(p, 1)
                    acc += _p_times_v(p, v_base, vs_base, table_base, j0 + c0, kv_len, last, page, stc, dims, d_ok,
                                      v_scale, svb, svs, svd, vsb, vsr, vsc, vs2, CHUNK, MODE, PAGED)
        m_i = m_new

    # Structural: a row sees keys iff its last visible key exists (mode 0's rule).
    seen = last >= 0.0
    out = tl.where(seen[:, None], acc / l_i[:, None], 0.0)
    store_ok = rows_f < rows_b
    tl.store(out_base + rows[:, None] * sos + dims[None, :] * sod, _bf16_bits_round_half_away(out),
             mask=store_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        lse = tl.where(seen, m_i + tl.log(l_i), float("inf"))
        tl.store(lse_base + rows * sls, lse, mask=store_ok)


@triton.jit
def _scaled_attention_kernel(
    q_ptr, k_ptr, v_ptr, qs_ptr, ks_ptr, vs_ptr, out_ptr, lse_ptr, scalars_ptr, seq_ptr, table_ptr, vrow_ptr,
    batch, heads_q, group, n_tiles, page, stt, stc,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod, slb, slh, sls,
    qsn, qsg, qst, qsp, qs2, ksb, ksh, kss, ksp, ks2, vsb, vsh, vsr, vsc, vs2,
    BLOCK_M: tl.constexpr, SUB_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MODE: tl.constexpr, CAUSAL: tl.constexpr,
    RETURN_LSE: tl.constexpr, PAGED: tl.constexpr,
):
    """Descale strides: q_descale (kv head, q head in its group, token, pair, in pair);
    k_descale (block or batch, head, position, pair, in pair); v_descale (block, head, 64-key
    row, channel, in pair). Mode 6 passes 0 for the axes its fp32 scales do not have."""
    programs = tl.num_programs(0) * tl.num_programs(1)
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    dscale = tl.load(scalars_ptr)
    ln_p = tl.load(scalars_ptr + 1)
    for item in range(pid, n_tiles * batch * heads_q, programs):
        bh = item // n_tiles
        m0 = (item % n_tiles) * BLOCK_M
        b = bh // heads_q
        h = bh % heads_q
        rows_b = tl.load(seq_ptr + 4 * batch + b)
        if m0 < rows_b:
            q_start = tl.load(seq_ptr + b)
            kv_start = tl.load(seq_ptr + batch + b)
            q_len = tl.load(seq_ptr + 2 * batch + b)
            kv_len = tl.load(seq_ptr + 3 * batch + b)
            b64 = b.to(tl.int64)
            h64 = h.to(tl.int64)
            hk64 = (h // group).to(tl.int64)  # GQA: kv head of q head h
            hg64 = (h % group).to(tl.int64)
            qs64 = q_start.to(tl.int64)
            ks64 = kv_start.to(tl.int64)
            q_base = q_ptr + b64 * sqb + h64 * sqh + qs64 * sqs
            qs_base = qs_ptr + hk64 * qsn + hg64 * qsg + qs64 * qst
            out_base = out_ptr + b64 * sob + h64 * soh + qs64 * sos
            lse_base = lse_ptr + b64 * slb + h64 * slh + qs64 * sls
            if PAGED:  # the block table locates keys; skb / svb / ksb / vsb are block strides
                k_base = k_ptr + hk64 * skh
                v_base = v_ptr + hk64 * svh
                ks_base = ks_ptr + hk64 * ksh
                vs_base = vs_ptr + hk64 * vsh
            else:
                k_base = k_ptr + b64 * skb + hk64 * skh + ks64 * sks
                v_base = v_ptr + b64 * svb + hk64 * svh + ks64 * svs
                ks_base = ks_ptr + hk64 * ksh + ks64 * kss
                # v_descale rows restart at each sequence (its keys rounded up to 64).
                vs_base = vs_ptr + hk64 * vsh + tl.load(vrow_ptr + b).to(tl.int64) * vsr
            v_scale = 1.0
            if MODE == 6:
                v_scale = tl.load(vs_ptr + hk64 * vsh)
            table_base = table_ptr + b64 * stt
            for sub in tl.static_range(BLOCK_M // SUB_M):
                _attention_rows(
                    q_base, qs_base, k_base, ks_base, v_base, vs_base, out_base, lse_base, table_base,
                    m0 + sub * SUB_M, q_len, kv_len, rows_b, dscale, ln_p, v_scale, page, stc,
                    sqs, sqd, qst, qsp, qs2, skb, sks, skd, ksb, kss, ksp, ks2,
                    svb, svs, svd, vsb, vsr, vsc, vs2, sos, sod, sls,
                    SUB_M, BLOCK_N, CHUNK, HEAD_DIM, D_PAD, MODE, CAUSAL, RETURN_LSE, PAGED,
                )


# ------------------------------------------------------------------------------- host side


def launch_options(plan: AttentionPlan) -> LaunchOptions:
    """The :data:`LAUNCH` entry for the plan's platform (the one its grid was made for)."""
    return LAUNCH.get(plan.platform.name, _DEFAULT_LAUNCH)


def _descale_strides(plan: AttentionPlan, q_descale, k_descale, v_descale) -> tuple[int, ...]:
    """The kernel's 15 descale strides (see ``_scaled_attention_kernel``) from the tensors'
    own strides in the plan's layouts (``tiling.scaled_checks.descale_shapes``)."""
    meta, g = plan.meta, plan.group
    if meta.quant_mode == QuantMode.FP8_PER_TOKEN_HEAD:
        # q_descale (Q_N, Q_T); k_descale (Bn, KV_N, 128); v_descale (KV_N,).
        qn, qt = q_descale.stride()
        kb, kh, ks = k_descale.stride()
        return (g * qn, qn, qt, 0, 0, kb, kh, ks, 0, 0, 0, v_descale.stride(0), 0, 0, 0)
    if meta.layout_q_descale == "TND":  # (Q_T, Q_N, pairs, 2)
        qt, qn, qp, q2 = q_descale.stride()
        q_strides = (g * qn, qn, qt, qp, q2)
    else:  # N2TGD (KV_N, Q_T, G, pairs, 2)
        qn, qt, qg, qp, q2 = q_descale.stride()
        q_strides = (qn, qg, qt, qp, q2)
    st = k_descale.stride()
    sv = v_descale.stride()
    if meta.layout_kv == "TND":  # k (KV_T, KV_N, pairs, 2); v (rows of 64 keys, KV_N, D, 2)
        k_strides = (0, st[1], st[0], st[2], st[3])
        v_strides = (0, sv[1], sv[0], sv[2], sv[3])
    elif meta.layout_kv == "PA_BBND":  # k (Bn, Bs, KV_N, pairs, 2); v (Bn, Bs/64, KV_N, D, 2)
        k_strides = (st[0], st[2], st[1], st[3], st[4])
        v_strides = (sv[0], sv[2], sv[1], sv[3], sv[4])
    else:  # PA_BNBD: k (Bn, KV_N, Bs, pairs, 2); v (Bn, KV_N, Bs/64, D, 2)
        k_strides = (st[0], st[1], st[2], st[3], st[4])
        v_strides = (sv[0], sv[1], sv[2], sv[3], sv[4])
    return (*q_strides, *k_strides, *v_strides)


def _v_descale_rows(plan: AttentionPlan) -> torch.Tensor:
    """int32 (B,): the first v_descale row of each TND sequence (rows of 64 stored keys)."""
    starts, row = [], 0
    for n in kv_segment_lengths(plan):
        starts.append(row)
        row += -(-n // _KEYS_PER_PAIR)
    return torch.tensor(starts, dtype=torch.int32).to(plan.device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def forward(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor, p_scale: torch.Tensor | None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a mode 1 / 6 plan on float8_e4m3fn q, k, v with their descales; returns (out bf16
    TND, lse fp32 (Nq, Tq) or an empty tensor). Validates nothing (the plan did).

    Outputs are allocated filled with NaN, so an element the kernel fails to write shows up.
    """
    out, lse = plan.new_outputs()
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    if out.numel() == 0:
        return out, lse
    mode = int(plan.meta.quant_mode)
    device = plan.device
    ln_p = torch.log(p_scale) if p_scale is not None else torch.zeros(1, dtype=torch.float32, device=device)
    scalars = torch.cat([torch.tensor([plan.softmax_scale], dtype=torch.float32, device=device), ln_p])
    opts = launch_options(plan)
    chunk = min(opts.chunk, plan.block_n)
    extra = {}
    if opts.num_warps is not None:
        extra["num_warps"] = opts.num_warps
    if opts.num_stages is not None:
        extra["num_stages"] = opts.num_stages
    vrow = plan.seq_table
    if mode == QuantMode.MXFP8 and not plan.paged:
        vrow = _v_descale_rows(plan)
    _scaled_attention_kernel[plan.grid](
        _bytes(q), _bytes(k), _bytes(v), _bytes(q_descale), _bytes(k_descale), _bytes(v_descale),
        out.view(torch.int16), lse if plan.return_lse else out, scalars, plan.seq_table,
        block_table if plan.paged else plan.seq_table, vrow,
        plan.batch, plan.heads_q, plan.group, plan.n_tiles, max(plan.block_size, 1), *plan.table_strides,
        *plan.strides_q, *plan.strides_kv, *plan.strides_v, *plan.out_strides,
        *(plan.lse_strides if plan.return_lse else (0, 0, 0)),
        *_descale_strides(plan, q_descale, k_descale, v_descale),
        BLOCK_M=plan.block_m, SUB_M=min(opts.sub_m, plan.block_m), BLOCK_N=plan.block_n, CHUNK=chunk,
        HEAD_DIM=plan.head_dim, D_PAD=triton.next_power_of_2(plan.head_dim), MODE=mode,
        CAUSAL=plan.causal, RETURN_LSE=plan.return_lse, PAGED=plan.paged,
        **extra,
    )
    return out, lse


__all__ = ["LAUNCH", "READS_PAGED_KV", "LaunchOptions", "e4m3_round_sat", "forward", "launch_options"]
