"""Paged K/V (block_table, layout_kv PA_BBND / PA_BNBD) in the HiF8 mode: bit for bit the call
on the same keys laid out contiguously, in every backend; bad tables are errors."""

from __future__ import annotations

import os

import pytest
import torch

import qfa
from qfa.attention.backends import torch_path
from qfa.tiling import attention as tiling

D = 128
ONE = torch.ones(1)


def codes(*shape, gen):
    return qfa.encode_to_hifloat8(torch.randn(shape, generator=gen))


def page_out(keys: list[torch.Tensor], block_size: int, layout_kv: str, gen, *, spare: int = 3,
             interleaved: bool = False, table: torch.Tensor | None = None):
    """Scatter each sequence's (n, Nkv, D) codes into randomly chosen blocks (or ``table``'s) of a
    pool filled with random codes (so a wrong read shows), in PA_BBND or PA_BNBD.
    Returns (pool, table)."""
    nkv = keys[0].shape[1]
    need = [-(-k.shape[0] // block_size) for k in keys]
    n_blocks = sum(need) + spare
    shape = (n_blocks, block_size, nkv, D) if layout_kv == "PA_BBND" else (n_blocks, nkv, block_size, D)
    if interleaved:  # k and v of one block side by side: a stride along the block axis of 2 blocks
        pool = torch.randint(0, 256, (n_blocks, 2, *shape[1:]), dtype=torch.uint8, generator=gen)[:, 0]
    else:
        pool = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    free = torch.randperm(n_blocks, generator=gen).tolist()
    given = table is not None
    if not given:
        table = torch.full((len(keys), max(need, default=0) + 1), -7, dtype=torch.int32)  # unused: garbage
    for b, k in enumerate(keys):
        for j in range(need[b]):
            block = int(table[b, j]) if given else free.pop()
            table[b, j] = block
            part = k[j * block_size:(j + 1) * block_size]
            if layout_kv == "PA_BBND":
                pool[block, : part.shape[0]] = part
            else:
                pool[block, :, : part.shape[0]] = part.transpose(0, 1)
    return pool, table


def contiguous_bsnd(seqs: list[torch.Tensor]) -> torch.Tensor:
    s = max(max(x.shape[0] for x in seqs), 1)
    out = torch.zeros(len(seqs), s, *seqs[0].shape[1:], dtype=torch.uint8)
    for b, x in enumerate(seqs):
        out[b, : x.shape[0]] = x
    return out


def make_case(q_lens, kv_lens, *, nq=4, nkv=2, layout="BSND", seed=0):
    gen = torch.Generator().manual_seed(seed)
    ks = [codes(n, nkv, D, gen=gen) for n in kv_lens]
    vs = [codes(n, nkv, D, gen=gen) for n in kv_lens]
    qs = [codes(n, nq, D, gen=gen) for n in q_lens]
    if layout == "TND":
        q = torch.cat(qs)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q_args = dict(layout_q="TND", layout_out="TND", cu_seqlens_q=cu)
        flat_k, flat_v = torch.cat(ks), torch.cat(vs)
        cu_kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
        flat = dict(layout="TND", cu_seqlens_q=cu, cu_seqlens_kv=cu_kv)
    else:
        q = contiguous_bsnd(qs)
        used_q = torch.tensor(q_lens, dtype=torch.int32)
        if layout == "BNSD":
            q = q.transpose(1, 2).contiguous()
        q_args = dict(layout_q=layout, layout_out=layout, seqused_q=used_q)
        flat_k, flat_v = contiguous_bsnd(ks), contiguous_bsnd(vs)
        if layout == "BNSD":
            flat_k, flat_v = flat_k.transpose(1, 2).contiguous(), flat_v.transpose(1, 2).contiguous()
        flat = dict(layout=layout, seqused_q=used_q, seqused_kv=torch.tensor(kv_lens, dtype=torch.int32))
    return q, ks, vs, q_args, (flat_k, flat_v, flat), gen


def _triton_ok():
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def run_both(backend, q, kv_paged, kv_flat, *, mask_mode=3, **kwargs):
    """(paged result, contiguous result) through one backend."""
    pool_k, pool_v, table, layout_kv, q_args, used_kv = kv_paged
    flat_k, flat_v, flat = kv_flat
    common = dict(mask_mode=mask_mode, return_softmax_lse=True, **kwargs)
    if backend == "triton" and not _triton_ok():
        pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
    if backend == "torch_path":  # the pure-torch path, which reads the blocks itself
        plan = tiling.plan_attention(q, pool_k, pool_v, ONE, ONE, ONE, 0, layout=q_args["layout_q"],
                                     layout_kv=layout_kv, block_table=table, seqused_kv=used_kv,
                                     cu_seqlens_q=q_args.get("cu_seqlens_q"), seqused_q=q_args.get("seqused_q"),
                                     **common)
        paged = torch_path.forward(plan, q, pool_k, pool_v, ONE, ONE, ONE, None, block_table=table)
        fplan = tiling.plan_attention(q, flat_k, flat_v, ONE, ONE, ONE, 0, **flat, **common)
        return paged, torch_path.forward(fplan, q, flat_k, flat_v, ONE, ONE, ONE, None)
    extra = {"backend": backend} if backend == "triton" else {}
    paged = qfa.quant_flash_attn(q, pool_k, pool_v, ONE, ONE, ONE, layout_kv=layout_kv, block_table=table,
                                 seqused_kv=used_kv, **q_args, **common, **extra)
    return paged, qfa.quant_flash_attn(q, flat_k, flat_v, ONE, ONE, ONE, **flat, **common, **extra)


def assert_same_bits(a, b):
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))
    assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))


BACKENDS = ["default", "torch_path", "triton"]
CASES = {  # (q lengths, kv lengths): decode, chunked prefill, unequal with an empty sequence
    "decode": ([1, 1, 1], [300, 17, 513]),
    "chunked-prefill": ([37, 5], [300, 261]),
    "unequal-with-empty": ([3, 0, 16], [40, 0, 257]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout_kv,block_size,layout", [
    ("PA_BBND", 16, "BSND"), ("PA_BNBD", 48, "TND"), ("PA_BBND", 256, "BNSD"), ("PA_BNBD", 1024, "BSND"),
])
def test_paged_equals_contiguous(backend, case, layout_kv, block_size, layout):
    q_lens, kv_lens = CASES[case]
    if backend == "triton" and block_size == 16 and case != "decode":
        pytest.skip("kept small under the interpreter")
    q, ks, vs, q_args, flat, gen = make_case(q_lens, kv_lens, layout=layout, seed=block_size)
    pool_k, table = page_out(ks, block_size, layout_kv, gen)
    pool_v, _ = page_out(vs, block_size, layout_kv, gen, table=table, interleaved=True)
    used = torch.tensor(kv_lens, dtype=torch.int32)
    paged, contiguous = run_both(backend, q, (pool_k, pool_v, table, layout_kv, q_args, used), flat)
    assert_same_bits(paged, contiguous)


@pytest.mark.parametrize("backend", ["default", "torch_path"])
def test_kv_strided_along_the_block_axis(backend):
    q, ks, vs, q_args, flat, gen = make_case([1, 4], [70, 33], layout="BSND", seed=3)
    pool_k, table = page_out(ks, 32, "PA_BBND", gen, interleaved=True)
    pool_v, _ = page_out(vs, 32, "PA_BBND", gen, interleaved=True, table=table)
    assert not pool_k.is_contiguous() and pool_k.stride(0) == 2 * pool_k[0].numel()
    used = torch.tensor([70, 33], dtype=torch.int32)
    paged, contiguous = run_both(backend, q, (pool_k, pool_v, table, "PA_BBND", q_args, used), flat)
    assert_same_bits(paged, contiguous)


def test_metadata_runs_of_a_paged_call():
    q, ks, vs, q_args, flat, gen = make_case([1, 1], [300, 40], layout="BSND", seed=4)
    pool_k, table = page_out(ks, 64, "PA_BNBD", gen)
    pool_v, _ = page_out(vs, 64, "PA_BNBD", gen, table=table)
    used = torch.tensor([300, 40], dtype=torch.int32)
    meta = qfa.quant_flash_attn_metadata(4, 2, D, 0, seqused_kv=used, layout_q="BSND", layout_out="BSND",
                                         layout_kv="PA_BNBD", mask_mode=3, batch_size=2)
    args = dict(layout_q="BSND", layout_out="BSND", layout_kv="PA_BNBD", block_table=table, seqused_kv=used,
                mask_mode=3, return_softmax_lse=True, seqused_q=None)
    want = qfa.quant_flash_attn(q, pool_k, pool_v, ONE, ONE, ONE, **args)
    got = qfa.quant_flash_attn(q, pool_k, pool_v, ONE, ONE, ONE, metadata=meta, **args)
    assert_same_bits(got, want)


# ----------------------------------------------------------------------------- bad tables

def _bad_call(**change):
    gen = torch.Generator().manual_seed(5)
    q = codes(2, 1, 4, D, gen=gen)
    pool = torch.zeros(6, 16, 2, D, dtype=torch.uint8)
    args = dict(layout_q="BSND", layout_out="BSND", layout_kv="PA_BBND",
                block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
                seqused_kv=torch.tensor([40, 17], dtype=torch.int32))
    args.update(change)
    k = args.pop("k", pool)
    return qfa.quant_flash_attn(q, k, k, ONE, ONE, ONE, **args)


@pytest.mark.parametrize("change,error,match", [
    (dict(block_table=torch.tensor([[0, 1, 6], [3, 4, 5]], dtype=torch.int32)), ValueError,
     r"^block_table\[0, 2\] must be a block index in \[0, 6\), got 6"),
    (dict(block_table=torch.tensor([[0, 1, 2], [-1, 4, 5]], dtype=torch.int32)), ValueError,
     r"^block_table\[1, 0\] must be a block index in \[0, 6\), got -1"),
    (dict(seqused_kv=torch.tensor([49, 17], dtype=torch.int32)), ValueError,
     r"^seqused_kv\[0\] = 49 needs 4 blocks of 16, but block_table rows hold 3"),
    (dict(block_table=torch.tensor([[0], [3]], dtype=torch.int32)), ValueError,
     r"^seqused_kv\[0\] = 40 needs 3 blocks of 16, but block_table rows hold 1"),
    (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, r"^block_table must have shape \(B=2, "),
    (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), TypeError, r"^block_table must be torch\.int32"),
    (dict(block_table=None), ValueError, r"^layout_kv 'PA_BBND' needs block_table"),
    (dict(seqused_kv=None), ValueError, r"^paged k/v \(block_table\) needs seqused_kv"),
    (dict(k=torch.zeros(6, 24, 2, D, dtype=torch.uint8)), ValueError,
     r"^block size of paged k/v must be a multiple of 16 up to 1024, got 24"),
    (dict(k=torch.zeros(2, 2048, 2, D, dtype=torch.uint8)), ValueError,
     r"^block size of paged k/v must be a multiple of 16 up to 1024, got 2048"),
    (dict(k=torch.zeros(6, 16, 2, 64, dtype=torch.uint8)), ValueError, r"^head dim D of k must be 128, got 64"),
    (dict(layout_kv="BSND"), ValueError, r"^block_table: paged KV needs layout_kv 'PA_BBND' or 'PA_BNBD'"),
    (dict(layout_kv="PA_NZ"), ValueError, r"^layout_kv must be one of \('BNSD', 'BSND', 'TND', 'PA_BBND', 'PA_BNBD'\)"),
], ids=["index-high", "index-negative", "seqused-too-long", "row-too-short", "rows", "dtype", "missing",
        "no-seqused", "block-24", "block-2048", "head-dim", "contiguous-layout", "pa-nz"])
def test_bad_paged_arguments(change, error, match):
    with pytest.raises(error, match=match):
        _bad_call(**change)


def test_cu_seqlens_kv_is_not_for_paged_kv():
    gen = torch.Generator().manual_seed(6)
    q = codes(3, 4, D, gen=gen)
    pool = torch.zeros(4, 16, 2, D, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv is not for paged k/v"):
        qfa.quant_flash_attn(q, pool, pool, ONE, ONE, ONE, layout_q="TND", layout_out="TND", layout_kv="PA_BBND",
                             cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
                             cu_seqlens_kv=torch.tensor([0, 5], dtype=torch.int32),
                             seqused_kv=torch.tensor([5], dtype=torch.int32),
                             block_table=torch.zeros(1, 1, dtype=torch.int32))
