"""Hadamard rotation in the drop-in: exact in real arithmetic, and it helps outlier channels.

The stored H is fp32: its entries are all +-fl(1/sqrt(128)), one rounding of one number, so the
stored matrix is exactly lam * H for the exact orthogonal H, with |lam^2 - 1| <= RHO = 2u + u^2
(u = 2^-24). The float64 tolerances below follow from that and from Higham's gamma_n."""

import math

import pytest
import torch
import torch.nn.functional as F

import qfa
from qfa.dropin import rotation
from qfa.tools.workloads import llm_like_qkv


U32, U64 = 2.0 ** -24, 2.0 ** -53
RHO = 2 * U32 + U32 ** 2  # |lam^2 - 1| for the fp32 H = lam * (exact H)


def gamma(n: int, u: float) -> float:
    """Higham's bound on the relative error of an n-term sum or dot product, any order."""
    return n * u / (1 - n * u)


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_hadamard_is_orthogonal_and_its_own_inverse():
    h = rotation.hadamard(128).double()
    # H H^T = lam^2 I exactly; float64 adds its own rounding of the 128-term sums (|terms| sum to lam^2)
    assert ((h @ h.T - torch.eye(128, dtype=torch.float64)).abs() <= RHO + gamma(128, U64) * (1 + RHO)).all()
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full_like(h, 1 / math.sqrt(128)))


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power-of-two head_dim, got 96"):
        rotation.hadamard(96)


def test_rotation_leaves_exact_attention_unchanged():
    # The identity the drop-in relies on, in float64: rotate q, k, v, attend, rotate back.
    q, k, v = (t.double() for t in llm_like_qkv(1, 4, 2, 64, seed=3))
    h = rotation.hadamard(128).double()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    rot = F.scaled_dot_product_attention(q @ h, k @ h, v @ h, is_causal=True, enable_gqa=True) @ h.T
    # With the stored H = lam * H_exact: the scores scale by lam^2 (softmax moves by at most
    # 2 RHO max|S| relatively) and the output by lam^2 (RHO |out|); float64's own rounding in the
    # score dot products, the extra products by H and the softmax sums adds 4 gamma terms.
    s_max = ((q @ k.repeat_interleave(2, 1).transpose(-1, -2)).abs().max() / math.sqrt(128)).item()
    v_max = v.abs().max().item()
    bound = RHO * ref.abs().max().item() + (1 + RHO) * 2 * RHO * s_max * v_max
    bound += 4 * gamma(128, U64) * (1 + 2 * s_max) * v_max * 128 ** 0.5
    assert ((rot - ref).abs() <= bound).all()


def test_rotation_keeps_the_true_lse_and_shapes():
    q, k, v = llm_like_qkv(1, 4, 2, 200, seed=4)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(128)
    scores = scores.masked_fill(torch.ones(200, 200).triu(1).bool(), float("-inf"))
    exact_lse = torch.logsumexp(scores.double(), dim=-1)
    out, lse = qfa.hif8_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, rotate=True,
                                  return_softmax_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    # lse comes from HiF8-quantised scores, whose error scales with the scores' magnitude (up
    # to ~140 here, set by the outlier channels). Measured: 0.63 with the rotation, 3.7 without;
    # the bound (1 % of the largest |lse|) holds only for the rotated path, so it also shows the
    # rotation was applied, and a lost smoothing correction would be off by far more.
    assert (lse.double() - exact_lse).abs().max() < 0.01 * exact_lse.abs().max()


def test_rotation_reduces_error_on_outlier_channels():
    # Outlier channels 12x the rest: HiF8's 3-bit binades cannot hold both per tensor, the
    # rotation spreads them. Measured: about 0.26 -> 0.05 relative L2; assert a 2x gain.
    q, k, v = llm_like_qkv(1, 8, 2, 512, seed=0)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    plain = rel_l2(qfa.hif8_attention(q, k, v, is_causal=True, rotate=False), exact)
    rotated = rel_l2(qfa.hif8_attention(q, k, v, is_causal=True, rotate=True), exact)
    assert rotated < plain / 2


def test_rotation_is_the_default():
    q, k, v = llm_like_qkv(1, 2, 1, 64, seed=6)
    assert torch.equal(qfa.hif8_attention(q, k, v), qfa.hif8_attention(q, k, v, rotate=True))
    assert qfa.HiF8Attention().rotate


def test_rotate_must_be_bool():
    q, k, v = llm_like_qkv(1, 2, 1, 8)
    with pytest.raises(TypeError, match="rotate must be a bool, got str"):
        qfa.hif8_attention(q, k, v, rotate="yes")


def test_module_rotation_under_torch_compile_matches_eager():
    q, k, v = llm_like_qkv(1, 2, 1, 64, seed=5)
    attn = qfa.HiF8Attention(is_causal=True, rotate=True)
    eager = attn(q, k, v)
    compiled = torch.compile(attn, fullgraph=True)(q, k, v)
    assert torch.equal(eager, compiled)
