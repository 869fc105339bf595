"""quant_flash_attn's torch path: layouts, GQA, seqused, empty and masked rows, NaN codes, and
the arguments that must not change the result. Everything here is bit-exact: the same data in
any layout, or with the work split differently, runs the same fp32 steps on the same values."""

from __future__ import annotations

import math

import pytest
import torch

import attention_reference as ref
from qfa.attention import quant_flash_attn

D = 128
NAN_CODE = 0x80
CAUSAL_MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1)  # upstream's compressed mask


@pytest.fixture(autouse=True)
def _eager_torch_path(monkeypatch):
    # The torch backend, and eager torch unless a test asks for the compiled steps: these tests
    # call the op on many small shapes, each of which would be a recompile.
    monkeypatch.delenv("QFA_BACKEND", raising=False)
    monkeypatch.setenv("QFA_COMPILE", "0")


def attn(*args, **kwargs):
    kwargs.setdefault("backend", "torch")
    return quant_flash_attn(*args, **kwargs)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bit patterns (so NaN == NaN and -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def bnsd_to_bsnd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()


def bnsd_to_tnd(t: torch.Tensor, lens=None) -> torch.Tensor:
    """(B, N, S, D) -> (sum lens, N, D), keeping the first lens[b] positions of batch b."""
    lens = lens or [t.shape[2]] * t.shape[0]
    return torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])


def cu(lens) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def lse_tnd_to_bnsd(lse: torch.Tensor, lens, seq: int) -> torch.Tensor:
    out = torch.full((len(lens), lse.shape[0], seq), float("inf"))
    starts = cu(lens).tolist()
    for b, n in enumerate(lens):
        out[b, :, :n] = lse[:, starts[b] : starts[b] + n]
    return out


@pytest.mark.parametrize("compiled", ["0", "1"], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "nq,nkv,sq,skv,causal",
    [(4, 1, 257, 513, True), (12, 2, 300, 37, True), (8, 8, 129, 256, False), (4, 2, 513, 300, False)],
    ids=["gqa4-causal", "gqa6-causal-sq>skv", "mha", "gqa2"],
)
def test_layouts_give_identical_bits(nq, nkv, sq, skv, causal, compiled, monkeypatch):
    monkeypatch.setenv("QFA_COMPILE", compiled)
    b = 2
    q, k, v, qd, kd, vd = ref.random_qkv((b, nq, sq, D), (b, nkv, skv, D), seed=5)
    kw = dict(mask_mode=3 if causal else 0, return_softmax_lse=True)
    out, lse = attn(q, k, v, qd, kd, vd, **kw)

    out_s, lse_s = attn(bnsd_to_bsnd(q), bnsd_to_bsnd(k), bnsd_to_bsnd(v), qd, kd, vd, layout="BSND", **kw)
    assert bits_equal(out_s, bnsd_to_bsnd(out)) and bits_equal(lse_s, lse)

    out_t, lse_t = attn(bnsd_to_tnd(q), bnsd_to_tnd(k), bnsd_to_tnd(v), qd, kd, vd, layout="TND",
                        cu_seqlens_q=cu([sq] * b), cu_seqlens_kv=cu([skv] * b), **kw)
    assert bits_equal(out_t, bnsd_to_tnd(out))
    assert bits_equal(lse_t, torch.cat(list(lse), dim=1))  # (Nq, T): batches side by side

    # Non-contiguous inputs: a BNSD view of BSND storage.
    out_v, lse_v = attn(bnsd_to_bsnd(q).transpose(1, 2), bnsd_to_bsnd(k).transpose(1, 2), bnsd_to_bsnd(v).transpose(1, 2),
                        qd, kd, vd, **kw)
    assert bits_equal(out_v, out) and bits_equal(lse_v, lse)


@pytest.mark.parametrize("compiled", ["0", "1"], ids=["eager", "compiled"])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
def test_torch_tile_size_does_not_change_the_numbers(rows, causal, compiled, monkeypatch):
    """The torch path cuts each batch into query tiles of ``plan.torch_rows`` positions (512+ by
    default, so the small shapes elsewhere run one tile). Tiles of a few rows, including ones
    that end mid-block and causal tiles whose first rows skip a block, give the same bits in
    eager torch. Compiled, inductor may split the row sums of a tile with very few rows across
    threads: the same fp32 values summed in another order, so lse may move by an ulp and out,
    rarely, by one bf16 step."""
    import dataclasses

    import qfa.attention.op as op

    monkeypatch.setenv("QFA_COMPILE", compiled)
    used = dict(seqused_q=torch.tensor([300, 37, 1], dtype=torch.int32),
                seqused_kv=torch.tensor([513, 290, 0], dtype=torch.int32))
    q, k, v, qd, kd, vd = ref.random_qkv((3, 8, 300, D), (3, 2, 513, D), seed=23)
    kw = dict(mask_mode=3 if causal else 0, return_softmax_lse=True, **used)
    out, lse = attn(q, k, v, qd, kd, vd, **kw)
    plan = op.plan_attention
    monkeypatch.setattr(op, "plan_attention", lambda *a, **k: dataclasses.replace(plan(*a, **k), torch_rows=rows))
    out_t, lse_t = attn(q, k, v, qd, kd, vd, **kw)
    if compiled == "0":
        assert bits_equal(out_t, out) and bits_equal(lse_t, lse)
    else:
        torch.testing.assert_close(out_t.float(), out.float(), rtol=2.0**-7, atol=0)
        torch.testing.assert_close(lse_t, lse, rtol=1e-6, atol=0)
        assert (out_t == out).float().mean() >= 0.999


@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
def test_tnd_unequal_lengths_equal_bnsd_with_seqused(causal):
    """Packed sequences of unequal lengths (one empty) == padded BNSD/BSND with seqused."""
    q_lens, kv_lens = [37, 0, 257], [300, 5, 256]
    q, k, v, qd, kd, vd = ref.random_qkv((3, 4, 257, D), (3, 2, 300, D), seed=6)
    kw = dict(mask_mode=3 if causal else 0, return_softmax_lse=True)
    used = dict(seqused_q=torch.tensor(q_lens, dtype=torch.int32), seqused_kv=torch.tensor(kv_lens, dtype=torch.int32))
    out, lse = attn(q, k, v, qd, kd, vd, **used, **kw)
    out_s, lse_s = attn(bnsd_to_bsnd(q), bnsd_to_bsnd(k), bnsd_to_bsnd(v), qd, kd, vd, layout="BSND", **used, **kw)
    assert bits_equal(out_s, bnsd_to_bsnd(out)) and bits_equal(lse_s, lse)
    out_t, lse_t = attn(bnsd_to_tnd(q, q_lens), bnsd_to_tnd(k, kv_lens), bnsd_to_tnd(v, kv_lens), qd, kd, vd,
                        layout="TND", cu_seqlens_q=cu(q_lens), cu_seqlens_kv=cu(kv_lens), **kw)
    assert out_t.shape == (sum(q_lens), 4, D) and lse_t.shape == (4, sum(q_lens))
    assert bits_equal(out_t, bnsd_to_tnd(out, q_lens))
    assert bits_equal(lse_tnd_to_bnsd(lse_t, q_lens, 257), lse)


@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("nq,nkv", [(4, 1), (12, 2), (8, 4)])
def test_gqa_equals_repeated_kv_heads(nq, nkv, causal):
    q, k, v, qd, kd, vd = ref.random_qkv((2, nq, 130, D), (2, nkv, 300, D), seed=8)
    g = nq // nkv
    kw = dict(mask_mode=3 if causal else 0, return_softmax_lse=True)
    out, lse = attn(q, k, v, qd, kd, vd, **kw)
    out_r, lse_r = attn(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), qd, kd, vd, **kw)
    assert bits_equal(out, out_r) and bits_equal(lse, lse_r)
    # And q head h really reads kv head h // g: one q head alone against its kv head.
    h = nq - 1
    out_h, lse_h = attn(q[:, h : h + 1], k[:, h // g : h // g + 1], v[:, h // g : h // g + 1], qd, kd, vd, **kw)
    assert bits_equal(out_h, out[:, h : h + 1]) and bits_equal(lse_h, lse[:, h : h + 1])


@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
def test_seqused_equals_slicing(causal):
    """BNSD + seqused == each batch's used part on its own; rows past seqused_q give 0 / +inf.
    Causal alignment follows the used lengths (bottom-right per batch).

    Not bit for bit: in the padded call a 256-key block is cut short by masking (P = 0 on the
    padding) rather than by slicing, so rowsum(P) and P8 @ V sum vectors of another length in
    another order. The scores, the running max and P itself are the same, so what differs is
    fp32 summation order only: lse by an ulp or two, out by at most one bf16 step, rarely.
    """
    sq, skv = 300, 513
    used_q, used_kv = [300, 37, 0, 200], [513, 300, 100, 0]
    q, k, v, qd, kd, vd = ref.random_qkv((4, 4, sq, D), (4, 2, skv, D), seed=9)
    kw = dict(mask_mode=3 if causal else 0, return_softmax_lse=True)
    out, lse = attn(q, k, v, qd, kd, vd, seqused_q=torch.tensor(used_q, dtype=torch.int32),
                    seqused_kv=torch.tensor(used_kv, dtype=torch.int32), **kw)
    equal = total = 0
    for b, (nq_, nkv_) in enumerate(zip(used_q, used_kv)):
        out_b, lse_b = attn(q[b : b + 1, :, :nq_], k[b : b + 1, :, :nkv_], v[b : b + 1, :, :nkv_], qd, kd, vd, **kw)
        got = out[b : b + 1, :, :nq_]
        assert got.shape == out_b.shape
        torch.testing.assert_close(got.float(), out_b.float(), rtol=2.0**-7, atol=0)  # <= one bf16 step
        torch.testing.assert_close(lse[b : b + 1, :, :nq_], lse_b, rtol=1e-6, atol=0)
        assert torch.equal(lse[b : b + 1, :, :nq_].isinf(), lse_b.isinf())
        equal, total = equal + int((got == out_b).sum()), total + got.numel()
        assert bits_equal(out[b, :, nq_:], torch.zeros_like(out[b, :, nq_:])) and (lse[b, :, nq_:] == float("inf")).all()
    assert equal >= 0.999 * total, (equal, total)
    # Batch 3 has no keys at all: its used rows see nothing.
    assert (out[3] == 0).all() and (lse[3] == float("inf")).all()
    # Batch 0 uses everything: bit for bit the unpadded call.
    out_0, lse_0 = attn(q[:1], k[:1], v[:1], qd, kd, vd, **kw)
    assert bits_equal(out[:1], out_0) and bits_equal(lse[:1], lse_0)


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_padding_past_seqused_is_never_read(layout):
    """NaN codes in the padding past seqused_q / seqused_kv (q, k and v) change nothing: masked
    keys must not reach P8 @ V (0 * NaN would be NaN) and padding rows stay 0 / +inf."""
    used_q, used_kv = [37, 20], [300, 100]
    q, k, v, qd, kd, vd = ref.random_qkv((2, 4, 64, D), (2, 2, 320, D), seed=21)
    dirty = [t.clone() for t in (q, k, v)]
    for b in range(2):
        dirty[0][b, :, used_q[b]:] = NAN_CODE
        dirty[1][b, :, used_kv[b]:] = NAN_CODE
        dirty[2][b, :, used_kv[b]:] = NAN_CODE
    kw = dict(mask_mode=3, return_softmax_lse=True, seqused_q=torch.tensor(used_q, dtype=torch.int32),
              seqused_kv=torch.tensor(used_kv, dtype=torch.int32))
    if layout == "TND":
        q, k, v = (bnsd_to_tnd(t) for t in (q, k, v))
        dirty = [bnsd_to_tnd(t) for t in dirty]
        kw.update(layout="TND", cu_seqlens_q=cu([64, 64]), cu_seqlens_kv=cu([320, 320]))
    out, lse = attn(q, k, v, qd, kd, vd, **kw)
    out_d, lse_d = attn(*dirty, qd, kd, vd, **kw)
    assert bits_equal(out_d, out) and bits_equal(lse_d, lse)
    assert not out.isnan().any() and not lse.isnan().any()


def test_rows_that_see_no_key():
    """Causal with Sq > Skv: the first Sq - Skv rows see no key -> out 0 (+0.0) and lse +inf;
    every other row is finite. Skv = 0 gives the same for every row."""
    sq, skv = 300, 37
    q, k, v, qd, kd, vd = ref.random_qkv((2, 4, sq, D), (2, 1, skv, D), seed=10)
    out, lse = attn(q, k, v, qd, kd, vd, mask_mode=3, return_softmax_lse=True)
    blind = sq - skv
    assert bits_equal(out[:, :, :blind], torch.zeros_like(out[:, :, :blind]))
    assert (lse[:, :, :blind] == float("inf")).all()
    assert torch.isfinite(lse[:, :, blind:]).all() and torch.isfinite(out).all()
    assert (out[:, :, blind:].abs().sum(-1) > 0).all()
    # The first row that sees a key sees exactly key 0: out = v[0] (P8 = p_scale exactly).
    v0 = torch.from_numpy(ref.decode(v[:, 0, 0])).float() * vd
    assert torch.allclose(out[:, :, blind].float(), v0[:, None].expand(2, 4, D), rtol=2.0**-8, atol=0)

    for causal in (0, 3):
        out, lse = attn(q, k[:, :, :0], v[:, :, :0], qd, kd, vd, mask_mode=causal, return_softmax_lse=True)
        assert out.shape == q.shape and bits_equal(out, torch.zeros_like(out))
        assert (lse == float("inf")).all()


def test_nan_codes_propagate_to_their_rows():
    """A NaN code (0x80) in q makes exactly its row NaN (out and lse); nothing crashes and every
    other row, including the same row in other heads, is unchanged and finite."""
    q, k, v, qd, kd, vd = ref.random_qkv((2, 4, 257, D), (2, 2, 300, D), seed=12)
    bad = q.clone()
    bad[0, 1, 5, 7] = NAN_CODE  # one element of a row
    bad[1, 3, 256, :] = NAN_CODE  # a whole row, in the last query tile
    for causal in (0, 3):
        clean_out, clean_lse = attn(q, k, v, qd, kd, vd, mask_mode=causal, return_softmax_lse=True)
        out, lse = attn(bad, k, v, qd, kd, vd, mask_mode=causal, return_softmax_lse=True)
        nan_rows = torch.zeros(2, 4, 257, dtype=torch.bool)
        nan_rows[0, 1, 5] = nan_rows[1, 3, 256] = True
        assert out[nan_rows].isnan().all() and lse[nan_rows].isnan().all()
        assert bits_equal(out[~nan_rows], clean_out[~nan_rows]) and bits_equal(lse[~nan_rows], clean_lse[~nan_rows])
        assert torch.isfinite(out[~nan_rows]).all()


def test_nan_row_that_sees_no_key_stays_zero():
    """A NaN q row that no key is visible to (causal, Sq > Skv) never computes a score: 0 / +inf."""
    q, k, v, qd, kd, vd = ref.random_qkv((1, 1, 40, D), (1, 1, 30, D), seed=13)
    q = q.clone()
    q[0, 0, 3] = NAN_CODE
    out, lse = attn(q, k, v, qd, kd, vd, mask_mode=3, return_softmax_lse=True)
    assert (out[0, 0, 3] == 0).all() and lse[0, 0, 3] == float("inf")


def test_inputs_left_unmodified():
    q, k, v, qd, kd, vd = ref.random_qkv((9, 4, D), (11, 2, D), seed=14)
    args = dict(p_scale=torch.tensor([15.0]), cu_seqlens_q=cu([4, 5]), cu_seqlens_kv=cu([5, 6]),
                seqused_q=torch.tensor([4, 3], dtype=torch.int32), seqused_kv=torch.tensor([5, 6], dtype=torch.int32),
                attn_mask=CAUSAL_MASK.clone())
    tensors = [q, k, v, qd, kd, vd, *args.values()]
    before = [t.clone() for t in tensors]
    attn(q, k, v, qd, kd, vd, layout="TND", mask_mode=3, return_softmax_lse=True, **args)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


@pytest.mark.parametrize("lse_on", [True, False], ids=["lse", "nolse"])
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "TND"])
def test_output_dtype_and_shapes(layout, lse_on):
    b, nq, nkv, sq, skv = 2, 4, 2, 37, 50
    shapes = {"BNSD": ((b, nq, sq, D), (b, nkv, skv, D)), "BSND": ((b, sq, nq, D), (b, skv, nkv, D)),
              "TND": ((b * sq, nq, D), (b * skv, nkv, D))}[layout]
    q, k, v, qd, kd, vd = ref.random_qkv(*shapes, seed=15)
    kw = dict(cu_seqlens_q=cu([sq] * b), cu_seqlens_kv=cu([skv] * b)) if layout == "TND" else {}
    out, lse = attn(q, k, v, qd, kd, vd, layout=layout, return_softmax_lse=lse_on, **kw)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and out.device == q.device
    assert lse.dtype == torch.float32
    if lse_on:
        assert lse.shape == ((nq, b * sq) if layout == "TND" else (b, nq, sq))
    else:
        assert lse.numel() == 0


def test_quant_mode_0_is_an_alias_of_7():
    q, k, v, qd, kd, vd = ref.random_qkv((1, 4, 100, D), (1, 1, 300, D), seed=16)
    out7, lse7 = attn(q, k, v, qd, kd, vd, 7, mask_mode=3, return_softmax_lse=True)
    out0, lse0 = attn(q, k, v, qd, kd, vd, 0, mask_mode=3, return_softmax_lse=True)
    out_default, _ = attn(q, k, v, qd, kd, vd, mask_mode=3)
    assert bits_equal(out0, out7) and bits_equal(lse0, lse7) and bits_equal(out_default, out7)


def test_attn_mask_is_accepted_and_never_read():
    """Mode 3 takes upstream's int8 [2048, 2048] mask but computes the causal pattern itself:
    the result equals no mask, and even a nonsense mask of the right type changes nothing."""
    q, k, v, qd, kd, vd = ref.random_qkv((2, 4, 100, D), (2, 2, 300, D), seed=17)
    out, lse = attn(q, k, v, qd, kd, vd, mask_mode=3, return_softmax_lse=True)
    for mask in (CAUSAL_MASK, torch.ones(2048, 2048, dtype=torch.int8), torch.zeros(2048, 2048, dtype=torch.int8)):
        out_m, lse_m = attn(q, k, v, qd, kd, vd, mask_mode=3, attn_mask=mask, return_softmax_lse=True)
        assert bits_equal(out_m, out) and bits_equal(lse_m, lse)
    out_nomask, _ = attn(q, k, v, qd, kd, vd, mask_mode=0)
    assert not bits_equal(out_nomask, out), "mode 3 must actually mask"


def test_softmax_scale_none_is_one_over_sqrt_d():
    q, k, v, qd, kd, vd = ref.random_qkv((1, 4, 64, D), (1, 2, 300, D), seed=18)
    out, lse = attn(q, k, v, qd, kd, vd, return_softmax_lse=True)
    out_s, lse_s = attn(q, k, v, qd, kd, vd, softmax_scale=1 / math.sqrt(D), return_softmax_lse=True)
    assert bits_equal(out, out_s) and bits_equal(lse, lse_s)
    out_1, _ = attn(q, k, v, qd, kd, vd, softmax_scale=1.0)  # upstream's default: a different result
    assert not bits_equal(out, out_1)


@pytest.mark.parametrize("causal", [0, 3])
def test_zero_length_sequences(causal):
    """Empty q (Sq = 0, or T = 0), empty kv, and all-zero seqused: right shapes, 0 / +inf."""
    q, k, v, qd, kd, vd = ref.random_qkv((2, 4, 10, D), (2, 2, 20, D), seed=20)
    kw = dict(mask_mode=causal, return_softmax_lse=True)

    out, lse = attn(q[:, :, :0], k, v, qd, kd, vd, **kw)  # BNSD, Sq = 0
    assert out.shape == (2, 4, 0, D) and lse.shape == (2, 4, 0)
    out, lse = attn(bnsd_to_bsnd(q)[:, :0], bnsd_to_bsnd(k)[:, :0], bnsd_to_bsnd(v)[:, :0], qd, kd, vd, layout="BSND", **kw)
    assert out.shape == (2, 0, 4, D) and lse.shape == (2, 4, 0)

    tq, tk = bnsd_to_tnd(q), bnsd_to_tnd(k)
    empty_q, empty_kv = tq[:0], tk[:0]
    out, lse = attn(empty_q, tk, bnsd_to_tnd(v), qd, kd, vd, layout="TND", cu_seqlens_q=cu([0, 0]),
                    cu_seqlens_kv=cu([20, 20]), **kw)
    assert out.shape == (0, 4, D) and lse.shape == (4, 0)
    out, lse = attn(tq, empty_kv, empty_kv, qd, kd, vd, layout="TND", cu_seqlens_q=cu([10, 10]),
                    cu_seqlens_kv=cu([0, 0]), **kw)
    assert out.shape == tq.shape and (out == 0).all() and (lse == float("inf")).all()
    out, lse = attn(empty_q, empty_kv, empty_kv, qd, kd, vd, layout="TND", cu_seqlens_q=cu([0]),
                    cu_seqlens_kv=cu([0]), **kw)
    assert out.shape == (0, 4, D) and lse.shape == (4, 0)

    zeros = torch.zeros(2, dtype=torch.int32)
    out, lse = attn(q, k, v, qd, kd, vd, seqused_q=zeros, **kw)
    assert bits_equal(out, torch.zeros_like(out)) and (lse == float("inf")).all()
    out, lse = attn(q, k, v, qd, kd, vd, seqused_kv=zeros, **kw)
    assert bits_equal(out, torch.zeros_like(out)) and (lse == float("inf")).all()
