"""qfa.attention.backends.cpu_kernel: the register-tiled GEMM paths (K in 16-key panels, V in 16-dim
slices, 6-row tiles with 1..5 leftover rows) and the budgets around them, at their edges.

Exact claims get exact tests (cpu_kernel's docstring): whether K and V were decoded for the
call (``PREDECODE_BYTES``, a budget over the whole call) or per block, whether pass 1's scores
were kept (``SCORE_STORE_BYTES``), which other batches share the call, and how the codes are
strided change no bit. Against the torch path (the golden reference) the shapes that end
tiles and panels off their multiples (GQA groups 1..8, row counts that are not multiples of 6,
1..17 keys, partial last blocks, causal with Skv < Sq and Skv > Sq, empty TND sequences) are
held to the reference tests' derived tolerances, and NaN / Inf values to the torch path's
exact NaN and Inf pattern.
"""

from __future__ import annotations

import pytest
import torch

from qfa.attention.backends import cpu_kernel, torch_path
from qfa.tiling.attention import plan_attention
from test_attention_reference import check_against_reference
from test_cpu_kernel import make, needs_kernel, v_max

pytestmark = needs_kernel

NAN_CODE, POS_INF_CODE, NEG_INF_CODE = 0x80, 0x6F, 0xEF


def _bits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return out.view(torch.int16).clone(), lse.view(torch.int32).clone()


def _same_bits(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _predecode_need(plan, b: int) -> int:
    """Bytes the kernel sets aside for batch b's decoded K and V with panel GEMMs: whole blocks."""
    blocks = -(-plan.kv_lens[b] // plan.block_n)
    return 2 * plan.heads_kv * blocks * plan.block_n * plan.head_dim * 4


#: Prefill-shaped calls (batches of more than one query tile, whose K / V the kernel predecodes
#: when the budget allows), with partial last blocks, causal offsets of both signs and a batch
#: with no keys.
BUDGET_CASES = {
    "B3-causal-tnd": dict(nq=8, nkv=2, q_lens=(300, 40, 700), kv_lens=(250, 600, 777), layout="TND", causal=True,
                          p_scale=15),
    "B2-skv-lt-sq-bsnd": dict(nq=6, nkv=2, q_lens=(200, 130), kv_lens=(90, 17), layout="BSND", causal=True),
    "B2-skv-gt-sq-bnsd": dict(nq=5, nkv=1, q_lens=(70, 61), kv_lens=(530, 300), causal=True),
    "B3-noncausal-empty-tnd": dict(nq=4, nkv=1, q_lens=(90, 0, 77), kv_lens=(300, 10, 0), layout="TND"),
    # Tiles of 32 positions: the last one (16 positions, 128 rows) is split, and reads the
    # predecoded panels and slices through pass 1's kept scores.
    "split-last-tile-of-a-predecoded-batch": dict(nq=8, nkv=1, q_lens=(48, 48), kv_lens=(1500, 700), causal=True),
}


@pytest.mark.parametrize("name", list(BUDGET_CASES))
def test_predecode_budget_changes_no_bit(name, monkeypatch):
    """A batch whose K / V the budget leaves to per-block decoding (panels of the visible keys
    only) gives the bits of a predecoded one (panels of whole blocks): all, none, and only the
    first batch predecoded."""
    plan, args = make(**BUDGET_CASES[name])
    assert max(plan.q_lens) * plan.group > cpu_kernel.TILE_ROWS  # several tiles: predecoded by default
    want = _bits(*cpu_kernel.forward(plan, *args))
    for budget in (0, _predecode_need(plan, 0)):
        monkeypatch.setattr(cpu_kernel, "PREDECODE_BYTES", budget)
        assert _same_bits(_bits(*cpu_kernel.forward(plan, *args)), want), budget


@pytest.mark.parametrize("shape", [(32, 4, (16,), (2000,), False), (24, 2, (10, 3), (1500, 1300), True),
                                   (8, 1, (33,), (3000,), True), (8, 1, (48,), (1500,), False),
                                   (8, 2, (2,), (1100,), False)],
                         ids=["128-rows", "B2-60-and-36-rows-causal", "short-last-tile-causal",
                              "predecoded-128-row-last-tile", "8-rows"])
def test_score_store_budget_changes_no_bit(shape, monkeypatch):
    """Split items of more than 16 rows (panel GEMMs, pass 1 writing whole 16-column panels
    into the kept score store) and of at most 16: recomputing the scores in pass 2 gives the
    kept ones' bits (partial last blocks: without the causal mask, the block's own end bounds
    every row)."""
    nq, nkv, q_lens, kv_lens, causal = shape
    plan, args = make(nq, nkv, q_lens, kv_lens, causal=causal, p_scale=15, seed=2)
    want = _bits(*cpu_kernel.forward(plan, *args))
    monkeypatch.setattr(cpu_kernel, "SCORE_STORE_BYTES", 0)
    assert _same_bits(_bits(*cpu_kernel.forward(plan, *args)), want)


def test_a_batch_gives_the_same_bits_alone_as_with_others():
    """TND batches of different lengths (one predecoded, one split for decode, one fused):
    each sequence alone gives the bits it gets in the call with the others."""
    q_lens, kv_lens = (300, 3, 40), (700, 1100, 250)
    plan, args = make(8, 2, q_lens, kv_lens, layout="TND", causal=True, p_scale=15, seed=5)
    out, lse = cpu_kernel.forward(plan, *args)
    q, k, v, qd, kd, vd, ps = args
    q0 = k0 = 0
    for ql, kl in zip(q_lens, kv_lens):
        one = [x[a : a + n] for x, a, n in ((q, q0, ql), (k, k0, kl), (v, k0, kl))]
        cu_q, cu_kv = torch.tensor([0, ql], dtype=torch.int32), torch.tensor([0, kl], dtype=torch.int32)
        plan1 = plan_attention(*one, qd, kd, vd, 7, p_scale=ps, layout="TND", mask_mode=3, return_softmax_lse=True,
                               cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
        out1, lse1 = cpu_kernel.forward(plan1, *one, qd, kd, vd, ps)
        assert torch.equal(out1.view(torch.int16), out[q0 : q0 + ql].view(torch.int16))
        assert torch.equal(lse1, lse[:, q0 : q0 + ql])
        q0, k0 = q0 + ql, k0 + kl


def _edge_shapes():
    shapes = []
    for g in (1, 2, 3, 5, 6, 7, 8):
        # (Sq, Skv): rows Sq * g in every residue mod 6 across the groups; 1, 3, 16, 17 keys
        # (one panel, a partial one, a panel and one key); a partial last 256-key block.
        for sq, skv in ((7, 17), (23, 3), (41, 16), (70, 257), (5, 1)):
            shapes.append((g, 1, sq, skv, g % 2 == 0))
    shapes += [(4, 3, 37, 300, True), (2, 2, 130, 40, True), (8, 2, 9, 600, False)]
    return shapes


@pytest.mark.parametrize("shape", _edge_shapes(), ids=lambda s: "g{}-kv{}-{}x{}-{}".format(*s[:4], "causal" if s[4]
                                                                                             else "full"))
def test_edge_shapes_match_torch_path(shape, monkeypatch):
    monkeypatch.setenv("QFA_COMPILE", "0")
    g, nkv, sq, skv, causal = shape
    plan, args = make(g * nkv, nkv, (sq,), (skv,), layout="BSND" if g % 3 == 0 else "BNSD", causal=causal, seed=g)
    want_out, want_lse = torch_path.forward(plan, *args)
    out, lse = cpu_kernel.forward(plan, *args)
    check_against_reference(out, lse, want_out.to(torch.float64).numpy(), want_lse.numpy(), v_max(args), True)


def _special_case(q_len: int, kv_len: int, codes: dict, q_descale_factor: float = 1.0):
    """A causal call with the given V codes set (key: code, at dim 3 + key % 7 of kv head 0)."""
    plan, args = make(4, 1, (q_len,), (kv_len,), causal=True, seed=4)
    q, k, v, qd, kd, vd, ps = args
    v = v.clone()
    for key, code in codes.items():
        v[0, 0, key, 3 + key % 7] = code
    return plan, (q, k, v, qd * q_descale_factor, kd, vd, ps)


def _check_specials(plan, args, monkeypatch):
    """NaN and Inf exactly where the torch path has them (same signed Inf), the rest within
    tolerance; and the same bits with and without the predecode."""
    monkeypatch.setenv("QFA_COMPILE", "0")
    want_out, want_lse = torch_path.forward(plan, *args)
    out, lse = cpu_kernel.forward(plan, *args)
    got, want = out.float(), want_out.float()
    nan, inf = torch.isnan(want), torch.isinf(want)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(torch.isinf(got), inf)
    assert torch.equal(got[inf], want[inf])
    assert torch.equal(torch.isnan(lse), torch.isnan(want_lse))
    keep = ~(nan | inf).any(dim=-1, keepdim=True).expand_as(nan)
    finite_v = args[2].masked_fill((args[2] == NAN_CODE) | ((args[2] & 0x7F) == POS_INF_CODE), 0)
    check_against_reference(torch.where(keep, out, 0), lse, torch.where(
        keep, want_out, 0).to(torch.float64).numpy(), want_lse.numpy(), v_max((*args[:2], finite_v, *args[3:])), True)
    monkeypatch.setattr(cpu_kernel, "PREDECODE_BYTES", 0)
    assert _same_bits(_bits(out, lse), _bits(*cpu_kernel.forward(plan, *args)))
    return nan, inf


def test_nan_value_past_a_tiles_edge_but_inside_its_block(monkeypatch):
    """Key 100 of block 0, Sq = Skv = 300 (tiles of 64 positions): the first tile's rows stop
    before it, so its predecoded block is flagged non-finite (the per-row sums) where the
    per-block decode of the tile's visible keys is finite (the panel GEMM): the same bits, the
    torch path's NaN pattern, and no NaN before position 100."""
    plan, args = _special_case(300, 300, {100: NAN_CODE})
    assert cpu_kernel.TILE_ROWS // plan.group < 100  # the first tile ends before key 100
    nan, _ = _check_specials(plan, args, monkeypatch)
    assert not nan[0, :, :100].any() and nan[0, :, 100:, 5].all()
    assert not nan[..., :5].any() and not nan[..., 6:].any()


@pytest.mark.parametrize("q_len", [3, 20, 300], ids=["fused-rows", "decoded-per-block", "predecoded"])
def test_inf_values_follow_the_torch_paths_ieee_sums(q_len, monkeypatch):
    """+Inf and -Inf values at keys most rows see: with a large q descale most visible P round to
    0 (0 * Inf is NaN) and the rows whose max is one of those keys keep +-Inf, or NaN where the
    signs meet; the kernel's per-row sums give the torch path's exact pattern."""
    plan, args = _special_case(q_len, 600, {0: POS_INF_CODE, 1: NEG_INF_CODE}, q_descale_factor=30.0)
    nan, inf = _check_specials(plan, args, monkeypatch)
    assert nan.any() and inf.any()  # both outcomes occur: the case tests what it claims


@pytest.mark.parametrize("shape", [(4, 1, 300, 600, True), (8, 2, 20, 300, False), (6, 1, 100, 257, True),
                                   (12, 2, 1, 700, False)],
                         ids=["predecoded", "decoded-per-block", "6-row-tail", "decode"])
def test_dim_strided_codes_give_the_contiguous_bits(shape):
    """Codes every other byte along the head dim (the scalar decode of strided rows feeding the
    panels and slices) give the contiguous codes' bits."""
    nq, nkv, sq, skv, causal = shape
    plan0, args = make(nq, nkv, (sq,), (skv,), causal=causal, seed=2)
    q, k, v, qd, kd, vd, ps = args

    def every_other(x):
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]

    q2, k2, v2 = (every_other(x) for x in (q, k, v))
    assert q2.stride(-1) == k2.stride(-1) == v2.stride(-1) == 2
    plan = plan_attention(q2, k2, v2, qd, kd, vd, 7, mask_mode=3 if causal else 0, return_softmax_lse=True)
    got = _bits(*cpu_kernel.forward(plan, q2, k2, v2, qd, kd, vd, ps))
    assert _same_bits(got, _bits(*cpu_kernel.forward(plan0, *args)))
