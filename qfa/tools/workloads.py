"""Built-in workloads with LLM-like statistics, for the demo and the benchmarks (no download).

Real attention inputs are not N(0, 1): keys carry large per-channel offsets (bias terms), and
a few channels of queries and keys hold outliers. Those two features are what break a
per-tensor scale, so the default workload has both.
"""

from __future__ import annotations

import torch


def llm_like_qkv(
    batch: int = 1, heads_q: int = 12, heads_kv: int = 2, seq: int = 1024, head_dim: int = 128, *,
    seed: int = 0, key_offset: float = 8.0, outlier_channels: int = 4, outlier_gain: float = 12.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 BNSD q, k, v: N(0, 1) plus a per-channel key offset and a few outlier channels."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, seq, head_dim, generator=gen)
    k = torch.randn(batch, heads_kv, seq, head_dim, generator=gen)
    v = torch.randn(batch, heads_kv, seq, head_dim, generator=gen)
    k = k + key_offset * torch.randn(1, heads_kv, 1, head_dim, generator=gen)
    channels = torch.randperm(head_dim, generator=gen)[:outlier_channels]
    q[..., channels] *= outlier_gain / 4
    k[..., channels] *= outlier_gain
    return q, k, v


def uniform_qkv(batch: int, heads_q: int, heads_kv: int, seq: int, head_dim: int = 128, *, seed: int = 0):
    """Upstream's test data: uniform(-1, 1) q, k, v (fp32 BNSD)."""
    gen = torch.Generator().manual_seed(seed)
    shape = lambda n: (batch, n, seq, head_dim)  # noqa: E731
    return tuple(torch.rand(shape(n), generator=gen) * 2 - 1 for n in (heads_q, heads_kv, heads_kv))


def head_pairs(text: str) -> list[tuple[int, int]]:
    """``"12:2,32:8"`` -> ``[(12, 2), (32, 8)]``: q heads and kv heads (GQA), q a positive
    multiple of kv; a ValueError names the item that is not such a pair."""
    pairs = []
    for item in text.split(","):
        try:
            hq, hkv = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"expected Nq:Nkv pairs like 12:2,32:8, got {item!r}") from None
        if hkv < 1 or hq < hkv or hq % hkv:
            raise ValueError(f"Nq must be a positive multiple of Nkv, got {item!r}")
        pairs.append((hq, hkv))
    return pairs

