"""The torch path's GEMM helper: oneDNN's fp32 linear on CPU, plain matmul elsewhere.

Both must give fp32-accumulated dot products of HiF8 values: the products are exact in fp32
(at most 4 significant bits each side), so the two may differ only in summation order, and
both stay within the fp32 accumulation bound of the float64 result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attention_reference as ref
from qfa.attention import quant_flash_attn
from qfa.attention.backends import cpu_gemm

UNIT_ROUNDOFF = 2.0**-24


def hif8_values(shape, seed: int) -> torch.Tensor:
    """fp32 tensor of HiF8 values (decoded random finite codes, of both signs)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).numpy()
    values = ref.decode(codes)
    values[~np.isfinite(values)] = 1.0
    return torch.from_numpy(values.astype(np.float32))


@pytest.mark.parametrize("onednn", ["1", "0"], ids=["onednn", "matmul"])
@pytest.mark.parametrize("strided_b", [False, True], ids=["contiguous", "transposed-view"])
@pytest.mark.parametrize("m,n,k", [(1, 1, 128), (37, 256, 128), (513, 128, 256), (2048, 256, 128)])
def test_matmul_nt_is_fp32_accumulation_of_exact_products(m, n, k, strided_b, onednn, monkeypatch):
    monkeypatch.setenv(cpu_gemm.ENV_VAR, onednn)
    a = hif8_values((m, k), seed=m)
    b = hif8_values((k, n), seed=n).t() if strided_b else hif8_values((n, k), seed=n)
    got = cpu_gemm.matmul_nt(a, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    exact = a.double() @ b.double().t()
    # Recursive or blocked fp32 summation of k exact terms: |error| <= k * u * sum |terms|.
    bound = k * UNIT_ROUNDOFF * (a.double().abs() @ b.double().abs().t())
    assert ((got.double() - exact).abs() <= bound).all()


def test_single_products_are_exact():
    """K = 1: one product, no summation; any rounding would show."""
    a, b = hif8_values((64, 1), seed=1), hif8_values((96, 1), seed=2)
    assert torch.equal(cpu_gemm.matmul_nt(a, b).double(), a.double() @ b.double().t())


def test_onednn_only_for_cpu_tensors(monkeypatch):
    assert not cpu_gemm.onednn_enabled(torch.device("meta"))
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "0")
    assert not cpu_gemm.onednn_enabled(torch.device("cpu"))


@pytest.mark.skipif(not cpu_gemm.onednn_enabled(torch.device("cpu")), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
def test_op_with_and_without_onednn(causal, monkeypatch):
    """Only the GEMMs' summation order differs: lse within an ulp or two, out within one bf16
    step (and nearly always equal)."""
    monkeypatch.setenv("QFA_COMPILE", "0")
    q, k, v, qd, kd, vd = ref.random_qkv((2, 8, 300, 128), (2, 2, 513, 128), seed=4)
    kw = dict(mask_mode=3 if causal else 0, return_softmax_lse=True, backend="torch")
    out, lse = quant_flash_attn(q, k, v, qd, kd, vd, **kw)
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "0")
    out_m, lse_m = quant_flash_attn(q, k, v, qd, kd, vd, **kw)
    torch.testing.assert_close(lse_m, lse, rtol=1e-6, atol=0)
    torch.testing.assert_close(out_m.float(), out.float(), rtol=2.0**-7, atol=0)
    assert (out_m == out).float().mean() >= 0.99
