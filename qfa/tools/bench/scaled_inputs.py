"""Benchmark inputs for quant_flash_attn's quant_mode 1 (MXFP8) and 6 (FP8 per-token-head).

Each builder quantises N(0, 1) tensors of the benchmark's (B, N, S, 128) shapes in the mode's
own layouts and returns the timed call with the dequantised fp32 values in BNSD, which SDPA runs
on in the same row (so both compute attention on the same numbers).
"""

from __future__ import annotations

from typing import Callable

import torch

from qfa.cast import fp8, mxfp8

D = 128
FP8_BLOCK = 128
#: p_scale of the timed calls: on the E4M3 grid (see quant_flash_attn's docstring).
P_SCALE = 448.0


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def mxfp8_inputs(batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_kv: int, *, causal: bool,
                 backend: str, seed: int = 0) -> tuple[Callable[[], object], tuple[torch.Tensor, ...]]:
    """Mode 1: q, k, v in TND (B sequences of equal length), per-32 E8M0 scales."""
    from qfa.attention import quant_flash_attn

    gen = torch.Generator().manual_seed(seed)
    q = _randn(gen, batch * seq_q, heads_q, D)
    k = _randn(gen, batch * seq_kv, heads_kv, D)
    v = _randn(gen, batch * seq_kv, heads_kv, D)
    (qe, qs), (ke, ks) = mxfp8.quantize(q), mxfp8.quantize(k)
    v_parts = [mxfp8.quantize(v[b * seq_kv : (b + 1) * seq_kv], 0) for b in range(batch)]
    ve = torch.cat([e.view(torch.uint8) for e, _ in v_parts]).view(torch.float8_e4m3fn)
    descales = (mxfp8.pack_q_descale(qs), mxfp8.pack_k_descale(ks), mxfp8.pack_v_descale([s for _, s in v_parts]))
    cu_q = torch.arange(0, batch + 1, dtype=torch.int32) * seq_q
    cu_kv = torch.arange(0, batch + 1, dtype=torch.int32) * seq_kv
    p = torch.tensor([P_SCALE])

    def call():
        return quant_flash_attn(qe, ke, ve, *descales, 1, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                mask_mode=3 if causal else 0, p_scale=p, backend=backend)

    bnsd = lambda t, s: t.view(batch, s, -1, D).transpose(1, 2).contiguous()  # noqa: E731
    values = (bnsd(mxfp8.dequantize(qe, qs), seq_q), bnsd(mxfp8.dequantize(ke, ks), seq_kv),
              bnsd(torch.cat([mxfp8.dequantize(e, s, 0) for e, s in v_parts]), seq_kv))
    return call, values


def fp8_inputs(batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_kv: int, *, causal: bool,
               backend: str, seed: int = 0) -> tuple[Callable[[], object], tuple[torch.Tensor, ...]]:
    """Mode 6: q in NTD with per-token-head scales, k/v paged PA_BNBD in blocks of 128 (each
    sequence's blocks in order), per-token-head k and per-head v scales."""
    from qfa.attention import quant_flash_attn

    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-seq_kv // FP8_BLOCK)
    q = _randn(gen, heads_q, batch * seq_q, D)
    k = _randn(gen, batch * per_seq, heads_kv, FP8_BLOCK, D)
    v = _randn(gen, batch * per_seq, heads_kv, FP8_BLOCK, D)
    (qe, qs), (ke, ks) = fp8.quantize_per_token_head(q), fp8.quantize_per_token_head(k)
    ve, vs = fp8.quantize_per_head(v, 1)
    table = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    cu_q = torch.arange(0, batch + 1, dtype=torch.int32) * seq_q
    used = torch.full((batch,), seq_kv, dtype=torch.int32)
    p = torch.tensor([P_SCALE])

    def call():
        return quant_flash_attn(qe, ke, ve, qs, ks, vs, 6, block_table=table, cu_seqlens_q=cu_q, seqused_kv=used,
                                mask_mode=3 if causal else 0, p_scale=p, backend=backend)

    def keys(values: torch.Tensor) -> torch.Tensor:  # (B * per_seq, Nkv, 128, D) -> (B, Nkv, Skv, D)
        return values.view(batch, per_seq, heads_kv, FP8_BLOCK, D).transpose(1, 2).flatten(2, 3)[:, :, :seq_kv]

    q_values = fp8.dequantize_per_token_head(qe, qs).view(heads_q, batch, seq_q, D).transpose(0, 1).contiguous()
    values = (q_values, keys(fp8.dequantize_per_token_head(ke, ks)).contiguous(),
              keys(fp8.dequantize_per_head(ve, vs, 1)).contiguous())
    return call, values


BUILDERS = {1: mxfp8_inputs, 6: fp8_inputs}
