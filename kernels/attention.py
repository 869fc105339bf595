"""Triton kernel of quant_flash_attn (HiF8 per-tensor, quant_mode 0) and its host launcher.

``forward(plan, q, k, v, q_descale, k_descale, v_descale, p_scale)`` runs the
:class:`~qfa.tiling.attention.AttentionPlan` that ``qfa.tiling.attention.plan_attention`` built;
it validates nothing and re-derives no tiling. Numerics are those of ``quant-flash-attn.md``
and of the golden torch path (``qfa.attention.backends.torch_path``), per query row:

    for each block of BLOCK_N = 256 keys, ascending from key 0 of the sequence:
        S = Q @ K_j^T                 HiF8 codes decoded to fp16 (exact), fp32 accumulation
        S[masked] = -inf              causal (bottom-right, per-batch lengths) and padding
        m_new = max(m, rowmax(S) * dScale - ln p_scale)
        P = exp(S * dScale - m_new);  alpha = exp(m - m_new);  l = alpha * l + rowsum(P)
        O = alpha * O + (HiF8(P) @ V_j) * v_descale     HiF8(P): ties away, saturating
    out = O / l -> bf16 rounded half away from zero;  lse = m + ln l;  no key seen: 0 / +inf

Work items are (query tile of ``plan.block_m`` rows, batch * q head); every program walks the
items ``pid, pid + programs, ...`` of ``plan.grid``, so the same kernel serves the one-item-
per-program grid (CUDA) and the persistent grid of one program per core (NPU, interpreter).
A program computes its tile in sub-tiles of ``SUB_M`` rows (the query tile size does not
change the numbers; each sub-tile still visits whole 256-key blocks, which do). Blocks wholly
after a causal sub-tile's last visible key are skipped: for those rows they are an identity.

Decode: a 256-entry LUT of fp16 bit patterns (``qfa.kernels.hif8.hif8_decode``); every HiF8
value is exact in fp16 and every product of two is exact in fp32. P is rounded to HiF8 with
integer bit operations (``hif8_round_sat``) and is exact in fp16 too (|P8| <= 32768), so both
dots take fp16 operands (no bf16 ``tl.dot``: it is wrong under the 3.8/3.9 interpreter, and
triton-ascend's dots take only int8/fp16/bf16/fp32). The bf16 output is rounded with integer
operations as well (fp32 bits + 0x8000, upper half; NaN kept) and stored as int16 bits.
Masks and row limits are compared as fp32 values (exact below 2^24), since int32 vector
compares degrade to scalar code on Atlas A2/A3. Plain pointer arithmetic is used (upstream
Triton removed block pointers); per-platform launch choices are in :data:`LAUNCH`, not in the
kernel body.

NaN codes in q make their rows NaN (out and lse). Whether a row saw a key is structural
(lengths and mask), never read from ``l``. Masked keys have no influence, NaN/Inf in V included:
a V block holding specials takes a masked path (``_specials_over_visible``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qfa.cast import luts
from qfa.kernels.hif8 import hif8_decode, hif8_round_sat
from qfa.tiling.attention import AttentionPlan


@dataclass(frozen=True)
class LaunchOptions:
    """How a platform launches the kernel; none of these change the numbers."""

    #: Query rows per sub-tile (divides ``plan.block_m``; >= 16 for ``tl.dot``).
    sub_m: int
    #: Triton ``num_warps`` (None: Triton's default).
    num_warps: int | None = None
    #: Triton ``num_stages`` (None: Triton's default).
    num_stages: int | None = None


#: Per-platform launch choices, keyed by ``qfa.tiling.platform`` names. The interpreter runs
#: numpy per op, so one 128-row sub-tile is fastest there. On CUDA a 64 x 256 fp32 score tile
#: plus a 64 x 128 accumulator fits 8 warps' registers. On Ascend (not run on hardware here) a
#: 64-row sub-tile keeps the fp32 score tile at 64 KiB of the 192 KiB UB; to be tuned on a device.
LAUNCH: dict[str, LaunchOptions] = {
    "cpu-interpreter": LaunchOptions(sub_m=128),
    "cuda": LaunchOptions(sub_m=64, num_warps=8, num_stages=2),
    "atlas-a2": LaunchOptions(sub_m=64),
    "atlas-a3": LaunchOptions(sub_m=64),
    "ascend-950": LaunchOptions(sub_m=64),
}
_DEFAULT_LAUNCH = LaunchOptions(sub_m=64)

#: ``forward`` takes paged K/V (``block_table``) itself.
READS_PAGED_KV = True

# Rows of the per-batch int32 table the kernel reads (one row per field, B columns).
_Q_START, _KV_START, _Q_LEN, _KV_LEN, _ROWS = range(5)


@triton.jit
def _bf16_bits_round_half_away(x):
    """int16 bf16 patterns of fp32 ``x``, rounded half away from zero; NaN -> 0x7FC0."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x8000) >> 16  # arithmetic shift: the sign half stays a valid bf16 sign
    return tl.where(x == x, rounded, 0x7FC0).to(tl.int16)


@triton.jit
def _specials_over_visible(pv, p8, v, visible, BLOCK_N: tl.constexpr):
    """``P8 @ V`` of a block whose V holds NaN/Inf, summed over each row's visible keys only.

    ``pv`` is the GEMM on V with its specials zeroed; each key's special entries are added here,
    one key at a time, as IEEE products and sums over the rows that see the key (any NaN term,
    0 * Inf, or +Inf with -Inf gives NaN; otherwise an Inf term gives that Inf), the rule of the
    torch path's ``_pv_with_specials``. A scalar loop rather than more dots: this path is rare,
    and extra dots would double the kernel's shared memory."""
    keys = tl.arange(0, BLOCK_N)
    extra = tl.zeros(pv.shape, dtype=tl.float32)
    p32 = p8.to(tl.float32)
    for j in range(0, BLOCK_N):
        pick = keys == j
        p_j = tl.sum(tl.where(pick[None, :], p32, 0.0), 1)  # column j of P8: (rows,)
        seen_j = tl.sum(tl.where(pick[None, :] & visible, 1, 0), 1) > 0
        v_j = tl.sum(tl.where(pick[:, None], v.to(tl.float32), 0.0), 0)  # row j of V: (D,)
        bad_j = (v_j != v_j) | (tl.abs(v_j) == float("inf"))
        extra += tl.where(seen_j[:, None] & bad_j[None, :], p_j[:, None] * v_j[None, :], 0.0)
    return pv + extra


@triton.jit
def _attention_rows(
    q_base, k_base, v_base, out_base, lse_base, lut_ptr, table_base,
    row0, q_len, kv_len, rows_b, dscale, ln_p, v_descale, page, stc,
    sqs, sqd, skb, sks, skd, svb, svs, svd, sos, sod, sls,
    SUB_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, RETURN_LSE: tl.constexpr, PAGED: tl.constexpr,
):
    """Attention for query rows ``row0 .. row0 + SUB_M`` of one (batch, q head); stores them.
    ``PAGED``: key j is at block ``table_base[(j // page) * stc]`` (``stc``: the table's column
    stride), position ``j % page`` (``skb`` / ``svb`` are the block strides); otherwise at
    ``j * sks`` from ``k_base``."""
    rows = row0 + tl.arange(0, SUB_M)
    dims = tl.arange(0, HEAD_DIM)
    rows_f = rows.to(tl.float32)
    q_codes = tl.load(q_base + rows[:, None] * sqs + dims[None, :] * sqd, mask=(rows_f < q_len)[:, None], other=0)
    q = hif8_decode(q_codes, lut_ptr, tl.float16)

    # Last visible key of each row (as fp32: exact, and no int32 vector compares); -1: none.
    offset = kv_len - q_len  # bottom-right causal alignment
    last = tl.zeros([SUB_M], dtype=tl.float32) + (kv_len - 1).to(tl.float32)
    if CAUSAL:
        last = tl.minimum(last, rows_f + offset.to(tl.float32))
    last = tl.where(rows_f < q_len, last, -1.0)
    # Keys this sub-tile visits: up to the last visible key of its last valid row.
    rows_hi = tl.minimum(row0 + SUB_M, q_len)
    kv_hi = kv_len
    if CAUSAL:
        kv_hi = tl.minimum(kv_hi, rows_hi + offset)
    kv_hi = tl.where(rows_hi > row0, kv_hi, 0)

    m_i = tl.full([SUB_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([SUB_M], dtype=tl.float32)
    acc = tl.zeros([SUB_M, HEAD_DIM], dtype=tl.float32)
    for j0 in range(0, kv_hi, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        cols_f = cols.to(tl.float32)
        key_ok = cols_f < kv_len
        if PAGED:
            phys = tl.load(table_base + (cols // page) * stc, mask=key_ok, other=0).to(tl.int64)
            k_off = phys * skb + (cols % page) * sks
            v_off = phys * svb + (cols % page) * svs
        else:
            k_off = cols * sks
            v_off = cols * svs
        kt_codes = tl.load(k_base + dims[:, None] * skd + k_off[None, :], mask=key_ok[None, :], other=0)
        s = tl.dot(q, hif8_decode(kt_codes, lut_ptr, tl.float16))  # (SUB_M, BLOCK_N) fp32, exact products
        s = tl.where(cols_f[None, :] <= last[:, None], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1) * dscale - ln_p)
        # Rows that have seen no key yet keep m = -inf; subtract 0 there so exp gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s * dscale - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = alpha * l_i + tl.sum(p, 1)  # the unquantised P
        p8 = hif8_round_sat(p).to(tl.float16)  # exact: HiF8 values <= 32768 fit fp16

        v_codes = tl.load(v_base + v_off[:, None] + dims[None, :] * svd, mask=key_ok[:, None], other=0)
        v = hif8_decode(v_codes, lut_ptr, tl.float16)
        special = (v != v) | (tl.abs(v) == float("inf"))
        pv = tl.dot(p8, tl.where(special, 0.0, v).to(tl.float16))
        if tl.sum(tl.sum(special.to(tl.int32), 1), 0) > 0:
            pv = _specials_over_visible(pv, p8, v, cols_f[None, :] <= last[:, None], BLOCK_N)
        acc = acc * alpha[:, None] + pv * v_descale
        m_i = m_new

    # Structural: a row sees keys iff its last visible key exists. A row whose visible scores
    # are all -inf has l = 0 and gets 0 / 0 = NaN, as the exact softmax does; NaN rows stay NaN.
    seen = last >= 0.0
    out = tl.where(seen[:, None], acc / l_i[:, None], 0.0)
    store_ok = rows_f < rows_b
    tl.store(
        out_base + rows[:, None] * sos + dims[None, :] * sod,
        _bf16_bits_round_half_away(out),
        mask=store_ok[:, None],
    )
    if RETURN_LSE:
        lse = tl.where(seen, m_i + tl.log(l_i), float("inf"))
        tl.store(lse_base + rows * sls, lse, mask=store_ok)


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, lut_ptr, scalars_ptr, seq_ptr, table_ptr,
    batch, heads_q, group, n_tiles, page, stt, stc,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sos, sod, slb, slh, sls,
    BLOCK_M: tl.constexpr, SUB_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, RETURN_LSE: tl.constexpr, PAGED: tl.constexpr,
):
    programs = tl.num_programs(0) * tl.num_programs(1)
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    dscale = tl.load(scalars_ptr)
    ln_p = tl.load(scalars_ptr + 1)
    v_descale = tl.load(scalars_ptr + 2)
    for item in range(pid, n_tiles * batch * heads_q, programs):
        bh = item // n_tiles
        m0 = (item % n_tiles) * BLOCK_M
        b = bh // heads_q
        h = bh % heads_q
        rows_b = tl.load(seq_ptr + 4 * batch + b)  # rows of out/lse this batch owns
        if m0 < rows_b:
            q_start = tl.load(seq_ptr + b)
            kv_start = tl.load(seq_ptr + batch + b)
            q_len = tl.load(seq_ptr + 2 * batch + b)
            kv_len = tl.load(seq_ptr + 3 * batch + b)
            # 64-bit bases (large tensors); offsets inside a tile stay 32-bit.
            b64 = b.to(tl.int64)
            h64 = h.to(tl.int64)
            hk64 = (h // group).to(tl.int64)  # GQA: kv head of q head h
            qs64 = q_start.to(tl.int64)
            ks64 = kv_start.to(tl.int64)
            q_base = q_ptr + b64 * sqb + h64 * sqh + qs64 * sqs
            out_base = out_ptr + b64 * sob + h64 * soh + qs64 * sos
            lse_base = lse_ptr + b64 * slb + h64 * slh + qs64 * sls
            if PAGED:  # paged: the block table row locates the keys; skb / svb are block strides
                k_base = k_ptr + hk64 * skh
                v_base = v_ptr + hk64 * svh
            else:
                k_base = k_ptr + b64 * skb + hk64 * skh + ks64 * sks
                v_base = v_ptr + b64 * svb + hk64 * svh + ks64 * svs
            table_base = table_ptr + b64 * stt
            for sub in tl.static_range(BLOCK_M // SUB_M):
                _attention_rows(
                    q_base, k_base, v_base, out_base, lse_base, lut_ptr, table_base,
                    m0 + sub * SUB_M, q_len, kv_len, rows_b, dscale, ln_p, v_descale, page, stc,
                    sqs, sqd, skb, sks, skd, svb, svs, svd, sos, sod, sls,
                    SUB_M, BLOCK_N, HEAD_DIM, CAUSAL, RETURN_LSE, PAGED,
                )


def launch_options(plan: AttentionPlan) -> LaunchOptions:
    """The :data:`LAUNCH` entry for the plan's platform (the one its grid was made for)."""
    return LAUNCH.get(plan.platform.name, _DEFAULT_LAUNCH)


def forward(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor, p_scale: torch.Tensor | None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``plan`` on HiF8 codes (uint8) q, k, v; returns (out bf16 in q's layout, lse fp32 or empty).

    Outputs are allocated filled with NaN, so an element the kernel fails to write shows up
    (a memset, small next to the attention itself). Everything the launch needs comes from the
    plan: shapes, strides, the per-batch length table (uploaded once per plan) and the scalars.
    """
    out, lse = plan.new_outputs()
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    if out.numel() == 0:
        return out, lse
    scalars = plan.scalars(q_descale, k_descale, v_descale, p_scale)
    lut = luts.decode_lut(torch.float16, plan.device)
    opts = launch_options(plan)
    extra = {}
    if opts.num_warps is not None:
        extra["num_warps"] = opts.num_warps
    if opts.num_stages is not None:
        extra["num_stages"] = opts.num_stages
    _attention_kernel[plan.grid](
        q, k, v, out.view(torch.int16), lse if plan.return_lse else out, lut, scalars, plan.seq_table,
        block_table if plan.paged else plan.seq_table,
        plan.batch, plan.heads_q, plan.group, plan.n_tiles, max(plan.block_size, 1), *plan.table_strides,
        *plan.strides_q, *plan.strides_kv, *plan.strides_v, *plan.out_strides,
        *(plan.lse_strides if plan.return_lse else (0, 0, 0)),
        BLOCK_M=plan.block_m, SUB_M=min(opts.sub_m, plan.block_m), BLOCK_N=plan.block_n, HEAD_DIM=plan.head_dim,
        CAUSAL=plan.causal, RETURN_LSE=plan.return_lse, PAGED=plan.paged,
        **extra,
    )
    return out, lse
