"""The Triton kernel of quant_flash_attn (``qfa.kernels.attention``) against the torch path.

Runs under Triton's interpreter on CPU tensors (``conftest.py`` sets ``TRITON_INTERPRET=1``), so
shapes stay small: S in {1, 37, 257, 300} crosses the 128-row query tile and the 256-key block.

Agreement rule (the issue's): at least 99.9 % of out elements within 1e-4 + 2^-7 * |ref|, and
lse within rtol 0.005 (atol 2.5e-5, upstream's, for lse near 0). Both backends run the same
numerics step by step, so the only differences allowed are fp32 summation order (the dots and
the row sums of P) and the last ulp of exp / log; those move P by an ulp or so, which flips
its HiF8 rounding only when P sits on a rounding threshold (rare: then one P8 moves by one
HiF8 step, 2^-3 relative, which shifts an output element by far less than its magnitude), and
moves the bf16 rounding of out by one bf16 ulp (2^-8 relative) at most in rare ties. In
practice the two agree bit for bit on almost every element.

``forward`` fills its outputs with NaN before the kernel runs, so an element the kernel does
not write (a padding row, a TND segment tail, a tile the grid missed) fails the no-NaN check.
"""

from __future__ import annotations

import pytest
import torch

from qfa.attention.op import quant_flash_attn
from qfa.cast import encode_to_hifloat8

pytest.importorskip("triton")

D = 128
NAN_CODE = 0x80


def _codes(*shape, scale=1.0, gen):
    return encode_to_hifloat8(torch.randn(*shape, generator=gen) * scale)


def _descales():
    return torch.tensor([0.5]), torch.tensor([0.75]), torch.tensor([1.25])


def _both(q, k, v, **kwargs):
    """(triton out, triton lse), (torch out, torch lse) for one call."""
    descales = _descales()
    got = quant_flash_attn(q, k, v, *descales, backend="triton", **kwargs)
    ref = quant_flash_attn(q, k, v, *descales, backend="torch", **kwargs)
    return got, ref


def _check(got, ref, return_lse=True):
    (out, lse), (ref_out, ref_lse) = got, ref
    assert out.dtype == torch.bfloat16 and out.shape == ref_out.shape
    o, r = out.float(), ref_out.float()
    assert not torch.isnan(o).any(), "out has NaN: an element the kernel did not write (or a NaN row)"
    close = (o - r).abs() <= 1e-4 + 2**-7 * r.abs()
    frac = close.float().mean().item()
    assert frac >= 0.999, f"only {frac:.5f} of out elements within tolerance; max diff {(o - r).abs().max()}"
    if not return_lse:
        assert lse.numel() == 0 and ref_lse.numel() == 0
        return
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert not torch.isnan(lse).any(), "lse has NaN: a row the kernel did not write"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows that see no key differ"
    assert torch.all(lse[torch.isinf(lse)] > 0)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=0.005, atol=2.5e-5)


BNSD_CASES = [
    # B, Nq, Nkv, Sq, Skv, causal, return_lse
    (1, 1, 1, 1, 1, False, True),
    (2, 4, 1, 37, 37, True, True),
    (1, 4, 2, 257, 300, True, True),  # causal, Sq < Skv
    (1, 4, 2, 300, 257, True, True),  # causal, Sq > Skv: the first 43 rows see no key
    (2, 1, 1, 300, 37, False, False),
    (1, 1, 1, 1, 300, True, True),  # one query row sees every key
]


@pytest.mark.parametrize("B,Nq,Nkv,Sq,Skv,causal,return_lse", BNSD_CASES)
def test_bnsd_matches_torch(B, Nq, Nkv, Sq, Skv, causal, return_lse):
    gen = torch.Generator().manual_seed(Sq * 1000 + Skv)
    q, k, v = _codes(B, Nq, Sq, D, gen=gen), _codes(B, Nkv, Skv, D, gen=gen), _codes(B, Nkv, Skv, D, gen=gen)
    got, ref = _both(q, k, v, mask_mode=3 if causal else 0, return_softmax_lse=return_lse)
    _check(got, ref, return_lse)


@pytest.mark.parametrize("causal", [False, True])
def test_bsnd_packed_qkv_matches_torch(causal):
    """BSND with q, k, v as strided views of one packed (B, S, Nq + 2 Nkv, D) tensor."""
    gen = torch.Generator().manual_seed(1)
    B, Nq, Nkv, S = 2, 4, 2, 257
    qkv = _codes(B, S, Nq + 2 * Nkv, D, gen=gen)
    q, k, v = qkv[:, :, :Nq], qkv[:, :, Nq : Nq + Nkv], qkv[:, :, Nq + Nkv :]
    got, ref = _both(q, k, v, layout="BSND", mask_mode=3 if causal else 0, return_softmax_lse=True)
    _check(got, ref)


def test_bsnd_cross_lengths():
    gen = torch.Generator().manual_seed(2)
    q, k, v = _codes(1, 37, 4, D, gen=gen), _codes(1, 300, 1, D, gen=gen), _codes(1, 300, 1, D, gen=gen)
    got, ref = _both(q, k, v, layout="BSND", mask_mode=3, return_softmax_lse=True)
    _check(got, ref)


@pytest.mark.parametrize("causal,seqused", [(False, False), (True, False), (True, True)])
def test_tnd_varlen_matches_torch(causal, seqused):
    """Unequal lengths with an empty sequence; seqused leaves unused rows in a segment."""
    gen = torch.Generator().manual_seed(3)
    q_lens, kv_lens = [37, 0, 257, 1], [300, 5, 257, 37]
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    cu_kv = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), dtype=torch.int32)
    Nq, Nkv = 4, 2
    q = _codes(sum(q_lens), Nq, D, gen=gen)
    k, v = _codes(sum(kv_lens), Nkv, D, gen=gen), _codes(sum(kv_lens), Nkv, D, gen=gen)
    kwargs = dict(layout="TND", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, mask_mode=3 if causal else 0,
                  return_softmax_lse=True)
    if seqused:
        kwargs.update(seqused_q=torch.tensor([30, 0, 130, 1], dtype=torch.int32),
                      seqused_kv=torch.tensor([290, 5, 0, 37], dtype=torch.int32))
    got, ref = _both(q, k, v, **kwargs)
    _check(got, ref)


def test_bnsd_seqused_with_empty_batches():
    gen = torch.Generator().manual_seed(4)
    B, Nq, Nkv, Sq, Skv = 3, 4, 1, 37, 300
    q, k, v = _codes(B, Nq, Sq, D, gen=gen), _codes(B, Nkv, Skv, D, gen=gen), _codes(B, Nkv, Skv, D, gen=gen)
    got, ref = _both(
        q, k, v, mask_mode=3, return_softmax_lse=True,
        seqused_q=torch.tensor([37, 0, 10], dtype=torch.int32),
        seqused_kv=torch.tensor([300, 17, 0], dtype=torch.int32),
    )
    _check(got, ref)
    out, lse = got
    assert torch.all(out[1:] == 0) and torch.all(torch.isinf(lse[1:]))  # q empty, kv empty


@pytest.mark.parametrize("p_scale", [2.0**-15, 15.0, 256.0, 32768.0])
def test_p_scale_matches_torch(p_scale):
    """p_scale moves P on the HiF8 grid, over the whole valid range [2^-15, 2^15] (its top
    binade keeps 1 mantissa bit; at the bottom most of P falls into the denormals)."""
    gen = torch.Generator().manual_seed(5)
    # Scores spread wide, so P covers many binades, down to HiF8's denormals.
    q, k, v = _codes(1, 4, 37, D, scale=3.0, gen=gen), _codes(1, 1, 300, D, scale=3.0, gen=gen), _codes(1, 1, 300, D, gen=gen)
    got, ref = _both(q, k, v, p_scale=torch.tensor([p_scale]), return_softmax_lse=True)
    _check(got, ref)


def test_lse_off_gives_same_out():
    gen = torch.Generator().manual_seed(6)
    q, k, v = _codes(1, 4, 37, D, gen=gen), _codes(1, 2, 257, D, gen=gen), _codes(1, 2, 257, D, gen=gen)
    descales = _descales()
    with_lse = quant_flash_attn(q, k, v, *descales, mask_mode=3, return_softmax_lse=True, backend="triton")
    without = quant_flash_attn(q, k, v, *descales, mask_mode=3, return_softmax_lse=False, backend="triton")
    assert without[1].numel() == 0
    assert torch.equal(with_lse[0].view(torch.int16), without[0].view(torch.int16))


def test_one_item_per_program_grid_and_row_subtiles(monkeypatch):
    """The CUDA entry: grid (B * Nq, query tiles), no persistent loop, 64-row sub-tiles; the
    plan's grid and the launch options come from one platform lookup."""
    monkeypatch.setenv("QFA_PLATFORM", "cuda")
    from qfa.kernels.attention import launch_options
    from qfa.tiling.attention import plan_attention

    gen = torch.Generator().manual_seed(7)
    q, k, v = _codes(2, 4, 300, D, gen=gen), _codes(2, 2, 257, D, gen=gen), _codes(2, 2, 257, D, gen=gen)
    one = torch.ones(1)
    plan = plan_attention(q, k, v, one, one, one, 0, mask_mode=3)
    assert plan.platform.name == "cuda" and launch_options(plan).sub_m < 128
    assert plan.grid == (2 * 4, plan.n_tiles) and plan.n_tiles == 3
    got, ref = _both(q, k, v, mask_mode=3, return_softmax_lse=True)
    _check(got, ref)


def test_nan_codes_in_q_give_nan_rows():
    """A NaN code in a q row makes that row's out and lse NaN; every other row is unaffected.
    (Whether a row saw a key is structural in both backends, never read from ``l``.)
    """
    gen = torch.Generator().manual_seed(8)
    q, k, v = _codes(1, 2, 37, D, gen=gen), _codes(1, 1, 300, D, gen=gen), _codes(1, 1, 300, D, gen=gen)
    q[0, 0, 3, 5] = NAN_CODE
    q[0, 1, 36, 0] = NAN_CODE
    q[0, 1, 0, :] = NAN_CODE
    descales = _descales()
    out, lse = quant_flash_attn(q, k, v, *descales, mask_mode=3, return_softmax_lse=True, backend="triton")
    ref_out, ref_lse = quant_flash_attn(q, k, v, *descales, mask_mode=3, return_softmax_lse=True, backend="torch")
    nan_rows = torch.zeros(1, 2, 37, dtype=torch.bool)
    nan_rows[0, 0, 3] = nan_rows[0, 1, 36] = nan_rows[0, 1, 0] = True
    assert torch.isnan(out[nan_rows]).all() and torch.isnan(lse[nan_rows]).all()
    keep = ~nan_rows
    _check((out[keep], lse[keep]), (ref_out[keep], ref_lse[keep]))
