"""The plan: complete (backends re-derive nothing), made once and run many times (metadata=),
and free of host synchronisation when it is ready."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import qfa
from qfa.attention import op
from qfa.attention.backends import torch_path
from qfa.kernels import attention as kernel
from qfa.tiling import attention as tiling

D = 128


def codes(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(shape).uniform_(-1, 1, generator=g)
    return qfa.encode_to_hifloat8(x)


def scales():
    return [torch.full((1,), s) for s in (0.5, 0.25, 2.0)]


def tnd_case(seed=0):
    """Three sequences, one of them empty, with seqused_q leaving TND rows unused."""
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    cu_kv = torch.tensor([0, 9, 13, 300], dtype=torch.int32)
    used_q = torch.tensor([3, 0, 7], dtype=torch.int32)
    q, k, v = codes(12, 4, D, seed=seed), codes(300, 2, D, seed=seed + 1), codes(300, 2, D, seed=seed + 2)
    return q, k, v, dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, seqused_q=used_q)


# ----------------------------------------------------------------------------- completeness

def test_plan_carries_output_geometry_rows_tiles_and_a_grid_that_agrees():
    q, k, v, lens = tnd_case()
    plan = tiling.plan_attention(q, k, v, *scales(), 0, layout="TND", mask_mode=3, return_softmax_lse=True, **lens)
    assert plan.out_shape == tuple(q.shape) and plan.lse_shape == (4, 12)
    assert plan.rows == (5, 0, 7)  # the TND segments, not the used lengths (3, 0, 7)
    assert plan.q_lens == (3, 0, 7) and plan.kv_lens == (9, 4, 287)
    assert plan.n_tiles == math.ceil(7 / plan.block_m)
    out, lse = plan.new_outputs()
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, torch.bfloat16, (4, 12), torch.float32)
    assert tiling.normalised_strides(out, "TND") == plan.out_strides
    assert plan.lse_strides == (0, lse.stride(0), lse.stride(1))
    # The interpreter's persistent grid covers the plan's items; table columns are per batch.
    programs = plan.grid[0] * plan.grid[1]
    assert 1 <= programs <= plan.batch * plan.heads_q * plan.n_tiles
    assert plan.seq_table.tolist() == [list(plan.q_starts), list(plan.kv_starts), list(plan.q_lens),
                                       list(plan.kv_lens), list(plan.rows)]


def test_device_scalars_are_formed_once_for_both_backends():
    q, k, v = codes(1, 2, 4, D), codes(1, 1, 4, D), codes(1, 1, 4, D)
    qd, kd, vd = scales()
    p = torch.full((1,), 4.0)
    plan = tiling.plan_attention(q, k, v, qd, kd, vd, 0, p_scale=p, softmax_scale=0.3)
    got = plan.scalars(qd, kd, vd, p)
    want = torch.cat([(qd * kd) * 0.3, torch.log(p), vd])
    assert torch.equal(got, want) and got.dtype == torch.float32
    assert torch.equal(plan.scalars(qd, kd, vd, None)[1:2], torch.zeros(1))


def test_plan_has_no_fields_nothing_reads():
    names = {f.name for f in tiling.AttentionPlan.__dataclass_fields__.values()}
    assert not names & {"uniform", "persistent", "tiling_key"}


# ----------------------------------------------------------------------------- plan once, run many

def test_metadata_runs_give_the_bits_of_planned_calls():
    q, k, v, lens = tnd_case()
    meta = qfa.quant_flash_attn_metadata(4, 2, D, 0, mask_mode=3, layout="TND", **lens)
    want = qfa.quant_flash_attn(q, k, v, *scales(), 0, layout="TND", mask_mode=3, return_softmax_lse=True, **lens)
    for _ in range(2):
        got = qfa.quant_flash_attn(q, k, v, *scales(), 0, layout="TND", mask_mode=3, return_softmax_lse=True,
                                   metadata=meta, **lens)
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)) and torch.equal(got[1], want[1])
    # A second layer with other codes but the same geometry reuses the same bound plan object.
    q2, k2, v2, _ = tnd_case(seed=7)
    plans = list(meta._plans.values())
    qfa.quant_flash_attn(q2, k2, v2, *scales(), 0, layout="TND", mask_mode=3, return_softmax_lse=True,
                         metadata=meta, **lens)
    assert list(meta._plans.values()) == plans and len(plans) == 1


def test_an_earlier_calls_plan_is_metadata_too(monkeypatch):
    q, k, v = codes(2, 4, 33, D), codes(2, 2, 40, D), codes(2, 2, 40, D)
    plan = tiling.plan_attention(q, k, v, *scales(), 0, mask_mode=3)
    seen = []
    monkeypatch.setenv("QFA_NATIVE", "0")
    monkeypatch.setattr(torch_path, "forward", lambda p, *a: seen.append(p) or p.new_outputs())
    qfa.quant_flash_attn(q, k, v, *scales(), 0, mask_mode=3, metadata=plan)
    assert seen == [plan]  # the very same object: nothing re-planned


def test_metadata_without_lengths_binds_to_any_sequence_length():
    meta = qfa.quant_flash_attn_metadata(4, 2, D, 0, layout="BSND")
    for s in (3, 17):
        q, k, v = codes(1, s, 4, D), codes(1, s + 2, 2, D), codes(1, s + 2, 2, D)
        got = qfa.quant_flash_attn(q, k, v, *scales(), layout="BSND", metadata=meta)
        want = qfa.quant_flash_attn(q, k, v, *scales(), layout="BSND")
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert len(meta._plans) == 2


@pytest.mark.parametrize("change,match", [
    (dict(layout="BSND"), r"^layout must be the metadata's 'TND', got 'BSND'"),
    (dict(mask_mode=0), r"^mask_mode must be the metadata's 3, got 0"),
    (dict(seqused_q=None), r"^seqused_q must be like the one the metadata was planned with"),
    (dict(seqused_kv=torch.zeros(3, dtype=torch.int32)), r"^seqused_kv must be like the one the metadata"),
    (dict(max_seqlen_q=99), r"^max_seqlen_q must be -1 or the metadata's -1, got 99"),
    (dict(quant_mode=1), r"^quant_mode must be the metadata's 0, got 1"),
], ids=["layout", "mask", "seqused-dropped", "seqused-added", "max_seqlen", "quant_mode"])
def test_a_run_must_match_its_metadata(change, match):
    q, k, v, lens = tnd_case()
    meta = qfa.quant_flash_attn_metadata(4, 2, D, 0, mask_mode=3, layout="TND", **lens)
    args = dict(layout="TND", mask_mode=3, metadata=meta, **lens)
    mode = change.pop("quant_mode", 0)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        qfa.quant_flash_attn(q, k, v, *scales(), mode, **args)


def test_a_run_must_match_its_metadatas_tensors():
    meta = qfa.quant_flash_attn_metadata(4, 2, D, 0, batch_size=2, seqused_kv=torch.tensor([3, 5], dtype=torch.int32))
    q, k, v = codes(3, 4, 6, D), codes(3, 2, 6, D), codes(3, 2, 6, D)
    used = torch.tensor([3, 5, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^seqused_kv must be like the one the metadata was planned with"):
        qfa.quant_flash_attn(q, k, v, *scales(), metadata=meta, seqused_kv=used)
    with pytest.raises(ValueError, match=r"^batch size of q must equal the metadata's \(2\), got 3"):
        qfa.quant_flash_attn(q, k, v, *scales(), metadata=meta, seqused_kv=used[:2])
    q, k, v = codes(2, 8, 6, D), codes(2, 2, 6, D), codes(2, 2, 6, D)
    with pytest.raises(ValueError, match=r"^q/k heads must match the metadata's \(4, 2\), got \(8, 2\)"):
        qfa.quant_flash_attn(q, k, v, *scales(), metadata=meta, seqused_kv=used[:2])
    q, k, v = codes(2, 4, 4, D), codes(2, 2, 4, D), codes(2, 2, 4, D)  # seqused_kv 5 > Skv 4
    with pytest.raises(ValueError, match=r"^seqused_kv\[1\] must be in \[0, 4\]"):
        qfa.quant_flash_attn(q, k, v, *scales(), metadata=meta, seqused_kv=used[:2])
    with pytest.raises(TypeError, match=r"^metadata must come from qfa.quant_flash_attn_metadata"):
        qfa.quant_flash_attn(q, k, v, *scales(), metadata=torch.zeros(2, 8, dtype=torch.int32))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(head_dim=64), ValueError, r"^head_dim must be 128 in the HiF8 mode, got 64"),
    (dict(head_dim_v=64), ValueError, r"^head_dim_v must be None or equal head_dim \(128\)"),
    (dict(is_grad_enabled=True), ValueError, r"^is_grad_enabled must be False"),
    (dict(is_grad_enabled="no"), TypeError, r"^is_grad_enabled must be a bool, got str"),
    (dict(win_left=128), ValueError, r"^win_left must be -1: sliding windows are not supported"),
    (dict(layout="TND", batch_size=2), ValueError, r"^batch_size is not accepted with layout 'TND'"),
    (dict(layout="TND"), ValueError, r"^layout 'TND' needs cu_seqlens_q and cu_seqlens_kv"),
    (dict(batch_size=0), ValueError, r"^batch size B must be in \[1, 65535\], got 0"),
    (dict(batch_size=2.0), TypeError, r"^batch_size must be an int or None, got float"),
    (dict(max_seqlen_q=-2), ValueError, r"^max_seqlen_q must be -1 \(not given\) or >= 0, got -2"),
    (dict(max_seqlen_kv=3, seqused_kv=torch.tensor([5], dtype=torch.int32)), ValueError,
     r"^max_seqlen_kv must be an upper bound of the used lengths \(>= 5\), got 3"),
    (dict(mask_mode=4), ValueError, r"^mask_mode must be 0 \(none\) or 3 \(causal\)"),
    (dict(quant_mode=2), ValueError, r"^quant_mode must be 0 \(HiF8 per-tensor; 7 is its older number\), 1 \(MXFP8\) "
                                     r"or 6 \(FP8 per-token-head\), got 2"),
    (dict(quant_mode=1, head_dim=96, layout="TND"), ValueError, r"^head_dim must be one of \(64, 72, 128, 256\) in quant_mode 1, "
                                                   r"got 96"),
    (dict(quant_mode=6, layout_q="TND"), ValueError, r"^layout_q must be one of \('NTD',\) in quant_mode 6 "
                                                     r"\(FP8_PER_TOKEN_HEAD\), got 'TND'"),
    (dict(layout_q="TND"), ValueError, r"^layout_q, layout_kv and layout_out must be equal in the HiF8 mode"),
    (dict(layout_q_descale="TND"), ValueError, r"^layout_q_descale must be 'BSND' in the HiF8 mode"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_metadata_bad_arguments(kwargs, error, match):
    args = dict(num_heads_q=4, num_heads_kv=2, head_dim=D, quant_mode=0)
    for name in list(args):
        if name in kwargs:
            args[name] = kwargs.pop(name)
    with pytest.raises(error, match=match):
        qfa.quant_flash_attn_metadata(*args.values(), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(layout="BSND", layout_q="TND"), r"^layout='BSND' sets layout_q, layout_kv and layout_out; it contradicts"),
    (dict(layout_q="BSND", layout_kv="BSND"), r"^layout_q, layout_kv and layout_out must be equal .*'layout_out': 'BNSD'"),
    (dict(layout_out="SBH"), r"^layout_out must be one of \('BNSD', 'BSND', 'TND'\), got 'SBH'"),
])
def test_per_operand_layouts(kwargs, match):
    q, k, v = codes(1, 4, 4, D), codes(1, 4, 2, D), codes(1, 4, 2, D)
    with pytest.raises(ValueError, match=match):
        qfa.quant_flash_attn(q, k, v, *scales(), **kwargs)
    # all three given alike is the same call as the shorthand
    a = qfa.quant_flash_attn(q, k, v, *scales(), layout_q="BSND", layout_kv="BSND", layout_out="BSND")
    b = qfa.quant_flash_attn(q, k, v, *scales(), layout="BSND")
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))


def test_quant_mode_7_is_an_alias_of_0():
    q, k, v = codes(1, 2, 5, D), codes(1, 1, 5, D), codes(1, 1, 5, D)
    a, b = (qfa.quant_flash_attn(q, k, v, *scales(), mode)[0] for mode in (0, 7))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert qfa.quant_flash_attn_metadata(2, 1, D, 7).quant_mode == 0


# ----------------------------------------------------------------------------- no host synchronisation

_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def count_host_reads(monkeypatch):
    """Counts every way Python code can read a tensor's values to the host (each a device sync
    on a GPU or NPU), across torch and qfa alike."""
    counts: dict[str, int] = {}
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **kw):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield counts
    monkeypatch.undo()


def _as_device(monkeypatch):
    """Make qfa treat CPU tensors as device memory, where a host read is a synchronisation; the
    native CPU kernel (CPU only, never used on devices) is left out."""
    monkeypatch.setattr(tiling, "host_reads_are_free", lambda device: False)
    monkeypatch.setenv("QFA_NATIVE", "0")


@pytest.mark.parametrize("layout", ["TND", "BNSD"])
def test_a_ready_plan_makes_no_host_read_on_devices(monkeypatch, layout):
    _as_device(monkeypatch)
    if layout == "TND":
        q, k, v, lens = tnd_case()
    else:
        q, k, v = codes(2, 4, 9, D), codes(2, 2, 11, D), codes(2, 2, 11, D)
        lens = dict(seqused_kv=torch.tensor([11, 4], dtype=torch.int32))
    meta = qfa.quant_flash_attn_metadata(4, 2, D, 0, mask_mode=3, layout=layout, **lens)
    p = torch.full((1,), 2.0)
    call = dict(layout=layout, mask_mode=3, metadata=meta, p_scale=p, softmax_scale=0.1, return_softmax_lse=True)
    want = qfa.quant_flash_attn(q, k, v, *scales(), 0, **call, **lens)  # binds the plan (cached)
    with count_host_reads(monkeypatch) as reads:
        got = qfa.quant_flash_attn(q, k, v, *scales(), 0, **call, **lens)
    assert reads == {}
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))


def test_the_triton_launch_of_a_ready_plan_makes_no_host_read(monkeypatch):
    """The kernel module's host side: outputs, scalars and the length table come from the plan
    (the table is uploaded once per plan), so a second launch reads nothing back."""
    _as_device(monkeypatch)
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(kernel, "_attention_kernel", Recorder())
    q, k, v, lens = tnd_case()
    meta = qfa.quant_flash_attn_metadata(4, 2, D, 0, layout="TND", **lens)
    run = dict(layout="TND", metadata=meta, return_softmax_lse=True, backend="triton", **lens)
    monkeypatch.setattr("qfa.backends.resolve", lambda device, requested=None: "triton")
    qfa.quant_flash_attn(q, k, v, *scales(), **run)
    with count_host_reads(monkeypatch) as reads:
        qfa.quant_flash_attn(q, k, v, *scales(), **run)
    assert reads == {}
    plan = next(iter(meta._plans.values()))
    (grid, args, kwargs), _ = launches
    assert grid == plan.grid and args[7] is plan.seq_table and args[12] == plan.n_tiles


def test_planning_without_metadata_reads_the_lengths(monkeypatch):
    """The counter sees reads: the one-off path reads cu_seqlens / seqused (and p_scale) on the host."""
    q, k, v, lens = tnd_case()
    with count_host_reads(monkeypatch) as reads:
        tiling.plan_attention(q, k, v, *scales(), 0, layout="TND", p_scale=torch.ones(1), **lens)
    assert reads.get("tolist", 0) >= 4  # cu_seqlens_q, cu_seqlens_kv, seqused_q, the scales
