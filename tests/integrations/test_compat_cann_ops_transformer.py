"""``qfa.compat.cann_ops_transformer``: upstream's names and defaults, exercised with code shaped
like upstream's own usage (fp16 uniform(-1, 1) data, per-tensor scale amax / 32768, BSND/TND,
the int8 [2048, 2048] causal mask, metadata planned first and passed back)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import qfa
import qfa.compat.cann_ops_transformer as cann_ops_transformer
from qfa.attention import op


def hif8_per_tensor(x: torch.Tensor):
    """Upstream's test recipe: scale = amax / 32768, codes of x / scale, descale = scale."""
    scale = x.abs().amax().float().reshape(1) / 32768
    return qfa.encode_to_hifloat8((x.float() / scale)), scale


def data(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.empty(shape, dtype=torch.float16).uniform_(-1, 1, generator=g)


def test_upstream_defaults_and_names():
    sig = inspect.signature(cann_ops_transformer.quant_flash_attn)
    assert sig.parameters["softmax_scale"].default == 1.0
    for name in ("layout_q", "layout_kv", "layout_out", "layout_q_descale"):
        assert sig.parameters[name].default == "BSND"
    assert sig.parameters["quant_mode"].default is inspect.Parameter.empty
    meta_sig = inspect.signature(cann_ops_transformer.quant_flash_attn_metadata)
    assert list(meta_sig.parameters)[:4] == ["num_heads_q", "num_heads_kv", "head_dim", "quant_mode"]
    assert cann_ops_transformer.QuantMode.HIF8_PER_TENSOR == 0 and cann_ops_transformer.MaskMode.CAUSAL == 3
    # every upstream keyword is accepted by qfa's own op as well
    assert set(sig.parameters) <= set(inspect.signature(op.quant_flash_attn).parameters)


def test_bsnd_causal_prefill_like_upstreams_example():
    B, S, N, KV_N, D = 2, 300, 8, 2, 128
    q, q_descale = hif8_per_tensor(data(B, S, N, D, seed=1))
    k, k_descale = hif8_per_tensor(data(B, S, KV_N, D, seed=2))
    v, v_descale = hif8_per_tensor(data(B, S, KV_N, D, seed=3))
    attn_mask = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1)
    seqused_q = torch.tensor([S, 200], dtype=torch.int32)
    seqused_kv = torch.tensor([S, 200], dtype=torch.int32)
    out, lse = cann_ops_transformer.quant_flash_attn(
        q, k, v, q_descale, k_descale, v_descale, cann_ops_transformer.QuantMode.HIF8_PER_TENSOR,
        seqused_q=seqused_q, seqused_kv=seqused_kv, attn_mask=attn_mask, softmax_scale=1 / math.sqrt(D),
        mask_mode=cann_ops_transformer.MaskMode.CAUSAL, max_seqlen_q=S, max_seqlen_kv=S, return_softmax_lse=True,
    )
    assert out.shape == (B, S, N, D) and out.dtype == torch.bfloat16 and lse.shape == (B, N, S)
    want = qfa.quant_flash_attn(q, k, v, q_descale, k_descale, v_descale, 0, layout="BSND", mask_mode=3,
                                seqused_q=seqused_q, seqused_kv=seqused_kv, return_softmax_lse=True)
    assert torch.equal(out.view(torch.int16), want[0].view(torch.int16)) and torch.equal(lse, want[1])


def test_tnd_with_metadata_like_upstreams_example():
    N, KV_N, D = 4, 1, 128
    lens_q, lens_kv = [37, 1, 64], [37, 129, 64]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_kv = torch.tensor([0, *torch.tensor(lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    q, q_descale = hif8_per_tensor(data(sum(lens_q), N, D, seed=4))
    k, k_descale = hif8_per_tensor(data(sum(lens_kv), KV_N, D, seed=5))
    v, v_descale = hif8_per_tensor(data(sum(lens_kv), KV_N, D, seed=6))
    metadata = cann_ops_transformer.quant_flash_attn_metadata(
        N, KV_N, D, 0, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=max(lens_q), max_seqlen_kv=max(lens_kv),
        mask_mode=3, layout_q="TND", layout_kv="TND", layout_out="TND",
    )
    out, lse = cann_ops_transformer.quant_flash_attn(
        q, k, v, q_descale, k_descale, v_descale, 0, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, metadata=metadata,
        softmax_scale=D ** -0.5, mask_mode=3, layout_q="TND", layout_kv="TND", layout_out="TND",
        return_softmax_lse=True,
    )
    assert out.shape == q.shape and lse.shape == (N, q.shape[0])
    want = qfa.quant_flash_attn(q, k, v, q_descale, k_descale, v_descale, layout="TND", mask_mode=3,
                                cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, return_softmax_lse=True)
    assert torch.equal(out.view(torch.int16), want[0].view(torch.int16)) and torch.equal(lse, want[1])


def test_upstreams_default_softmax_scale_is_one():
    q, qd = hif8_per_tensor(data(1, 16, 2, 128, seed=7))
    k, kd = hif8_per_tensor(data(1, 16, 2, 128, seed=8))
    v, vd = hif8_per_tensor(data(1, 16, 2, 128, seed=9))
    _, lse = cann_ops_transformer.quant_flash_attn(q, k, v, qd, kd, vd, 0, return_softmax_lse=True)
    _, lse_one = qfa.quant_flash_attn(q, k, v, qd, kd, vd, layout="BSND", softmax_scale=1.0, return_softmax_lse=True)
    _, lse_qfa = qfa.quant_flash_attn(q, k, v, qd, kd, vd, layout="BSND", return_softmax_lse=True)
    assert torch.equal(lse, lse_one) and not torch.equal(lse, lse_qfa)


@pytest.mark.parametrize("mode,dtype", [(1, "torch.float8_e8m0fnu"), (6, "torch.float32")])
def test_other_quant_modes_take_their_own_dtypes(mode, dtype):
    """Modes 1 and 6 exist (tests/attention/test_attention_scaled_modes.py); here: upstream-style calls
    reach their checks, which name what each mode takes."""
    q = torch.zeros(4, 4, 128, dtype=torch.float8_e4m3fn)
    one = torch.ones(1, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=rf"^q_descale must be {dtype} in quant_mode {mode}"):
        cann_ops_transformer.quant_flash_attn(q, q, q, one, one, one, mode, layout_q="TND" if mode == 1 else "NTD",
                                              layout_kv="TND" if mode == 1 else "PA_BNBD", layout_out="TND",
                                              layout_q_descale="TND" if mode == 1 else "NT")
