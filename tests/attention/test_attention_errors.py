"""Every host-side check of quant_flash_attn (``quant-flash-attn.md``, "Host-side checks") has a
bad input here: the call raises TypeError (wrong type or dtype) or ValueError (wrong value or
shape) with a message that names the argument. All checks run in the host tiling before any
backend, so nothing here computes attention.

Two checks of the doc have no argument to get wrong in this API: "out dtype not bf16" (the op
allocates out itself, always bf16) and "layouts not all equal" (one ``layout`` serves q, kv and
out).
"""

from __future__ import annotations

import pytest
import torch

import qfa.tiling.checks
from qfa.attention import quant_flash_attn

D = 128
B, NQ, NKV, SQ, SKV = 2, 4, 2, 8, 16


def codes(*shape, device="cpu"):
    return torch.zeros(shape, dtype=torch.uint8, device=device)


def scale(value=1.0, dtype=torch.float32, shape=(1,), device="cpu"):
    return torch.full(shape, value, dtype=dtype, device=device)


def i32(values, dtype=torch.int32, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


def good_bnsd():
    """Valid positional arguments in BNSD."""
    return [codes(B, NQ, SQ, D), codes(B, NKV, SKV, D), codes(B, NKV, SKV, D), scale(), scale(), scale()]


def good_bsnd():
    return [codes(B, SQ, NQ, D), codes(B, SKV, NKV, D), codes(B, SKV, NKV, D), scale(), scale(), scale()]


def good_tnd(q_lens=(3, 5), kv_lens=(7, 9)):
    args = [codes(sum(q_lens), NQ, D), codes(sum(kv_lens), NKV, D), codes(sum(kv_lens), NKV, D), scale(), scale(), scale()]
    kwargs = dict(layout="TND", cu_seqlens_q=i32([0, q_lens[0], sum(q_lens)]),
                  cu_seqlens_kv=i32([0, kv_lens[0], sum(kv_lens)]))
    return args, kwargs


def call(args, **kwargs):
    kwargs.setdefault("backend", "torch")
    return quant_flash_attn(*args, **kwargs)


def replace(args, index, value):
    args = list(args)
    args[index] = value
    return args


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("QFA_BACKEND", raising=False)
    monkeypatch.setenv("QFA_COMPILE", "0")


def test_the_good_arguments_are_good():
    out, lse = call(good_bnsd(), return_softmax_lse=True)
    assert out.shape == (B, NQ, SQ, D) and lse.shape == (B, NQ, SQ)
    args, kwargs = good_tnd()
    out, lse = call(args, return_softmax_lse=True, mask_mode=3, **kwargs)
    assert out.shape == (8, NQ, D) and lse.shape == (NQ, 8)


# --- q, k, v: HiF8 codes, one dtype --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("index,name", [(0, "q"), (1, "k"), (2, "v")])
def test_qkv_dtype_not_hif8(index, name, dtype):
    args = good_bnsd()
    args = replace(args, index, args[index].to(dtype))
    with pytest.raises(TypeError, match=rf"^{name} must hold HiF8 codes .*{dtype}"):
        call(args)


@pytest.mark.parametrize("index,name", [(0, "q"), (1, "k"), (2, "v")])
def test_qkv_not_a_tensor(index, name):
    with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor"):
        call(replace(good_bnsd(), index, [[0]]))


def test_qkv_hif8_dtypes_differ(monkeypatch):
    # Only uint8 holds HiF8 without torch_npu; pretend a second HiF8 dtype exists (as
    # torch_npu.hifloat8 would) so that q and k can hold HiF8 in two different dtypes.
    monkeypatch.setattr(qfa.tiling.checks, "hifloat8_dtypes", lambda: (torch.uint8, torch.int8))
    args = good_bnsd()
    with pytest.raises(TypeError, match=r"q, k and v must share one HiF8 dtype, got torch\.uint8, torch\.int8"):
        call(replace(args, 1, args[1].view(torch.int8)))


# --- descales and p_scale: fp32, shape (1,) ------------------------------------------------------

SCALES = [(3, "q_descale"), (4, "k_descale"), (5, "v_descale")]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32], ids=str)
@pytest.mark.parametrize("index,name", SCALES)
def test_descale_dtype(index, name, dtype):
    with pytest.raises(TypeError, match=rf"^{name} must be torch\.float32, got {dtype}"):
        call(replace(good_bnsd(), index, scale(dtype=dtype)))


@pytest.mark.parametrize("shape", [(), (2,), (1, 1), (0,)], ids=str)
@pytest.mark.parametrize("index,name", SCALES)
def test_descale_shape(index, name, shape):
    with pytest.raises(ValueError, match=rf"^{name} must have shape \(1,\), got {re_shape(shape)}"):
        call(replace(good_bnsd(), index, scale(shape=shape)))


@pytest.mark.parametrize("index,name", SCALES)
def test_descale_not_a_tensor(index, name):
    with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor, got float"):
        call(replace(good_bnsd(), index, 1.0))


def re_shape(shape) -> str:
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("bad,error,match", [
    (scale(dtype=torch.float64), TypeError, r"^p_scale must be torch\.float32, got torch\.float64"),
    (scale(dtype=torch.float16), TypeError, r"^p_scale must be torch\.float32, got torch\.float16"),
    (scale(shape=()), ValueError, r"^p_scale must have shape \(1,\), got \(\)"),
    (scale(shape=(2,)), ValueError, r"^p_scale must have shape \(1,\), got \(2,\)"),
    (1.0, TypeError, r"^p_scale must be a torch\.Tensor, got float"),
    (torch.zeros(1), ValueError, r"^p_scale must be in \[2\^-15, 2\^15\] .*got 0$"),
    (torch.full((1,), -2.0), ValueError, r"^p_scale must be in \[2\^-15, 2\^15\] .*got -2$"),
    (torch.full((1,), float("nan")), ValueError, r"^p_scale must be in \[2\^-15, 2\^15\] .*got nan"),
    (torch.full((1,), float("inf")), ValueError, r"^p_scale must be in \[2\^-15, 2\^15\] .*got inf"),
    (torch.full((1,), 1e38), ValueError, r"^p_scale must be in \[2\^-15, 2\^15\] .*got 1e\+38"),
    (torch.full((1,), 1e-45), ValueError, r"^p_scale must be in \[2\^-15, 2\^15\] .*got 1\.4013e-45"),
    (torch.full((1,), 40000.0), ValueError, r"^p_scale must be in \[2\^-15, 2\^15\] .*got 40000"),
], ids=["fp64", "fp16", "0-d", "2", "float", "zero", "negative", "nan", "inf", "1e38", "1e-45", "40000"])
def test_p_scale(bad, error, match):
    with pytest.raises(error, match=match):
        call(good_bnsd(), p_scale=bad)


@pytest.mark.parametrize("p", [2.0**-15, 2.0**15, 1.0, 104.0])
def test_p_scale_range_edges_are_accepted(p):
    call(good_bnsd(), p_scale=torch.full((1,), p))


@pytest.mark.parametrize("name,value,match", [
    ("q_descale", -1.0, r"^q_descale must be a finite value > 0, got -1$"),
    ("k_descale", 0.0, r"^k_descale must be a finite value > 0, got 0$"),
    ("v_descale", float("nan"), r"^v_descale must be a finite value > 0, got nan"),
    ("k_descale", float("inf"), r"^k_descale must be a finite value > 0, got inf"),
    ("q_descale", 1e38, r"^softmax_scale \* q_descale \* k_descale must be <= 2\.48e\+27 .*got 8\.8"),
    ("v_descale", 1e33, r"^v_descale must be <= .* for this call \(FLT_MAX / \(1\.25 \* 32768 \* max Skv"),
], ids=["q-negative", "k-zero", "v-nan", "k-inf", "q-1e38", "v-1e33"])
def test_descale_values(name, value, match):
    args = good_bnsd()
    index = {"q_descale": 3, "k_descale": 4, "v_descale": 5}[name]
    args[index] = torch.full((1,), value)
    with pytest.raises(ValueError, match=match):
        call(args)


def test_softmax_scale_that_overflows_the_scores():
    with pytest.raises(ValueError, match=r"^softmax_scale \* q_descale \* k_descale must be <= "):
        call(good_bnsd(), softmax_scale=1e300)


# --- quant_mode, layout, mask_mode, softmax_scale, backend -----------------------------------------

@pytest.mark.parametrize("mode", [2, 8, -1])
def test_quant_mode(mode):
    with pytest.raises(ValueError, match=r"^quant_mode must be 0 \(HiF8 per-tensor; 7 is its older number\), 1 "
                                         r"\(MXFP8\) or 6 \(FP8 per-token-head\), got "):
        call(good_bnsd() + [mode])


@pytest.mark.parametrize("mode,layouts", [(1, dict(layout="TND")), (6, dict(layout_q="NTD"))])
def test_other_modes_refuse_hif8_codes(mode, layouts):
    with pytest.raises(TypeError, match=rf"^q must be torch.float8_e4m3fn in quant_mode {mode} .*got torch.uint8"):
        call(good_bnsd() + [mode], **layouts)


@pytest.mark.parametrize("mode", [True, "7", None, 7.0, 0.0])
def test_quant_mode_type(mode):
    with pytest.raises(TypeError, match=r"^quant_mode must be an int or qfa's QuantMode, got "):
        call(good_bnsd() + [mode])


@pytest.mark.parametrize("layout", ["bnsd", "BSH", "SBH", "NTD", "TH", "", 0])
def test_layout(layout):
    with pytest.raises(ValueError, match=r"^layout must be one of \('BNSD', 'BSND', 'TND'\).*got " + repr(layout)):
        call(good_bnsd(), layout=layout)


@pytest.mark.parametrize("mode", [1, 2, 4, 5, -1], ids=["1", "2", "4-sliding-window", "5", "-1"])
def test_mask_mode(mode):
    with pytest.raises(ValueError, match=rf"^mask_mode must be 0 \(none\) or 3 \(causal\).*got {mode}"):
        call(good_bnsd(), mask_mode=mode)


@pytest.mark.parametrize("mode", [None, 3.0, True, "3"], ids=str)
def test_mask_mode_type(mode):
    with pytest.raises(TypeError, match=r"^mask_mode must be an int \(0 none, 3 causal\), got "):
        call(good_bnsd(), mask_mode=mode)


CAUSAL_MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1)


def test_attn_mask_with_mode_0():
    with pytest.raises(ValueError, match=r"^attn_mask must be None with mask_mode 0"):
        call(good_bnsd(), attn_mask=CAUSAL_MASK)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.float16, torch.float32, torch.int32], ids=str)
def test_attn_mask_dtype_with_mode_3(dtype):
    with pytest.raises(TypeError, match=rf"^attn_mask for mask_mode 3 must be int8 \[2048, 2048\].*got {dtype}"):
        call(good_bnsd(), mask_mode=3, attn_mask=CAUSAL_MASK.to(dtype))


@pytest.mark.parametrize("shape", [(2048,), (1024, 1024), (2048, 2047), (1, 2048, 2048), (SQ, SKV)], ids=str)
def test_attn_mask_shape_with_mode_3(shape):
    with pytest.raises(ValueError, match=r"^attn_mask for mask_mode 3 must be int8 \[2048, 2048\].*got torch\.int8 "
                       + str(list(shape)).replace("[", r"\[").replace("]", r"\]")):
        call(good_bnsd(), mask_mode=3, attn_mask=torch.zeros(shape, dtype=torch.int8))


def test_attn_mask_not_a_tensor():
    with pytest.raises(TypeError, match=r"^attn_mask must be a torch\.Tensor"):
        call(good_bnsd(), mask_mode=3, attn_mask=CAUSAL_MASK.tolist()[:2])


@pytest.mark.parametrize("value", [0.0, -0.1, -1, float("nan"), float("inf"), float("-inf")], ids=str)
def test_softmax_scale_value(value):
    with pytest.raises(ValueError, match=r"^softmax_scale must be a finite number > 0, got "):
        call(good_bnsd(), softmax_scale=value)


@pytest.mark.parametrize(
    "value", [torch.tensor(0.1), "0.1", True, [0.1], 1j], ids=["tensor", "str", "bool", "list", "complex"]
)
def test_softmax_scale_type(value):
    with pytest.raises(TypeError, match=r"^softmax_scale must be a Python float or None, got "):
        call(good_bnsd(), softmax_scale=value)


def test_backend_bogus():
    with pytest.raises(ValueError, match=r"^backend must be one of \('torch', 'triton'\), got 'bogus'"):
        call(good_bnsd(), backend="bogus")


def test_backend_env_bogus(monkeypatch):
    monkeypatch.setenv("QFA_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"^QFA_BACKEND must be one of \('torch', 'triton'\), got 'bogus'"):
        call(good_bnsd(), backend=None)


def test_block_table_without_a_paged_layout_sinks_and_windows_rejected():
    with pytest.raises(ValueError, match=r"^block_table: paged KV needs layout_kv 'PA_BBND' or 'PA_BNBD'"):
        call(good_bnsd(), block_table=torch.zeros(B, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^sinks: attention sinks are not supported"):
        call(good_bnsd(), sinks=torch.zeros(NQ))
    for name in ("win_left", "win_right"):
        with pytest.raises(ValueError, match=rf"^{name} must be -1: sliding windows are not supported"):
            call(good_bnsd(), **{name: 16})


# --- shapes: ndim, D, heads, batch, k vs v ---------------------------------------------------------

@pytest.mark.parametrize("layout,index,name,shape,ndim", [
    ("BNSD", 0, "q", (B, NQ, SQ), 4), ("BNSD", 1, "k", (B, NKV, SKV, D, 1), 4), ("BSND", 0, "q", (B * SQ, NQ, D), 4),
    ("TND", 0, "q", (B, SQ, NQ, D), 3),
], ids=["bnsd-q-3d", "bnsd-k-5d", "bsnd-q-3d", "tnd-q-4d"])
def test_wrong_ndim(layout, index, name, shape, ndim):
    args, kwargs = good_tnd() if layout == "TND" else (good_bnsd() if layout == "BNSD" else good_bsnd(), {"layout": layout})
    args = replace(args, index, codes(*shape))
    if index == 1:
        args = replace(args, 2, codes(*shape))  # k and v alike, so the ndim check is what fires
    with pytest.raises(ValueError, match=rf"^{name} must be {ndim}-D for layout {layout}"):
        call(args, **kwargs)


@pytest.mark.parametrize("d", [64, 96, 127, 129, 256])
def test_head_dim_of_q(d):
    with pytest.raises(ValueError, match=rf"^head dim D of q must be 128, got {d}"):
        call(replace(good_bnsd(), 0, codes(B, NQ, SQ, d)))


@pytest.mark.parametrize("d", [64, 256])
def test_head_dim_of_kv(d):
    args = good_bnsd()
    with pytest.raises(ValueError, match=rf"^head dim D of k must be 128, got {d}"):
        call(replace(replace(args, 1, codes(B, NKV, SKV, d)), 2, codes(B, NKV, SKV, d)))
    # v alone: caught as a k / v mismatch, which names both.
    with pytest.raises(ValueError, match=r"^k and v must have the same shape"):
        call(replace(args, 2, codes(B, NKV, SKV, d)))


@pytest.mark.parametrize("v_shape", [(B, NKV, SKV + 1, D), (B, NKV + 1, SKV, D), (B + 1, NKV, SKV, D)], ids=["S", "N", "B"])
def test_k_and_v_shapes_differ(v_shape):
    with pytest.raises(ValueError, match=r"^k and v must have the same shape, got \(2, 2, 16, 128\) and "):
        call(replace(good_bnsd(), 2, codes(*v_shape)))


def test_batch_mismatch_between_q_and_kv():
    args = good_bnsd()
    with pytest.raises(ValueError, match=r"^batch size of k must equal q's \(2\), got 3"):
        call(replace(replace(args, 1, codes(3, NKV, SKV, D)), 2, codes(3, NKV, SKV, D)))
    bsnd = replace(replace(good_bsnd(), 1, codes(1, SKV, NKV, D)), 2, codes(1, SKV, NKV, D))
    with pytest.raises(ValueError, match=r"^batch size of k must equal q's \(2\), got 1"):
        call(bsnd, layout="BSND")


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_batch_out_of_range(layout):
    if layout == "BNSD":  # zero-size tensors: B = 0 and B = 65536 cost no memory with S = 0
        for b in (0, 65536):
            with pytest.raises(ValueError, match=rf"^batch size B must be in \[1, 65535\], got {b}"):
                call([codes(b, NQ, 0, D), codes(b, NKV, 0, D), codes(b, NKV, 0, D), scale(), scale(), scale()])
    else:
        cu_big = torch.zeros(65537, dtype=torch.int32)
        with pytest.raises(ValueError, match=r"^batch size B must be in \[1, 65535\], got 65536"):
            call([codes(0, NQ, D), codes(0, NKV, D), codes(0, NKV, D), scale(), scale(), scale()], layout="TND",
                 cu_seqlens_q=cu_big, cu_seqlens_kv=cu_big)


@pytest.mark.parametrize("nq,nkv,match", [
    (6, 4, r"^q heads must be a multiple of k/v heads \(GQA\), got Nq=6, Nkv=4"),
    (2, 4, r"^q heads must be a multiple of k/v heads \(GQA\), got Nq=2, Nkv=4"),
    (130, 2, r"^GQA group Nq/Nkv must be <= 64, got 65"),
    (256, 2, r"^GQA group Nq/Nkv must be <= 64, got 128"),
    (257, 257, r"^head count of q must be in \[1, 256\], got 257"),
    (512, 8, r"^head count of q must be in \[1, 256\], got 512"),
    (0, 1, r"^head count of q must be in \[1, 256\], got 0"),
    (4, 0, r"^head count of k/v must be in \[1, 256\], got 0"),
    (256, 257, r"^head count of k/v must be in \[1, 256\], got 257"),
], ids=["not-multiple", "nq<nkv", "group65", "group128", "nq257", "nq512", "nq0", "nkv0", "nkv257"])
def test_heads(nq, nkv, match):
    args = [codes(1, nq, 1, D), codes(1, nkv, 1, D), codes(1, nkv, 1, D), scale(), scale(), scale()]
    with pytest.raises(ValueError, match=match):
        call(args)


def test_largest_valid_heads_and_group_accepted():
    for nq, nkv in ((256, 4), (64, 1), (256, 256)):
        out, _ = call([codes(1, nq, 1, D), codes(1, nkv, 1, D), codes(1, nkv, 1, D), scale(), scale(), scale()])
        assert out.shape == (1, nq, 1, D)


# --- cu_seqlens (TND) ------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", ["cu_seqlens_q", "cu_seqlens_kv", "both"])
def test_cu_seqlens_missing_for_tnd(missing):
    args, kwargs = good_tnd()
    for name in ("cu_seqlens_q", "cu_seqlens_kv") if missing == "both" else (missing,):
        del kwargs[name]
    with pytest.raises(ValueError, match=r"^layout 'TND' needs cu_seqlens_q and cu_seqlens_kv"):
        call(args, **kwargs)


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_kv"])
def test_cu_seqlens_given_without_tnd(layout, name):
    with pytest.raises(ValueError, match=rf"^{name} is only for layout 'TND'; got it with layout '{layout}'"):
        call(good_bnsd() if layout == "BNSD" else good_bsnd(), layout=layout, **{name: i32([0, SQ, 2 * SQ])})


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_kv"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.float32, torch.uint8], ids=str)
def test_cu_seqlens_dtype(name, dtype):
    args, kwargs = good_tnd()
    kwargs[name] = kwargs[name].to(dtype)
    with pytest.raises(TypeError, match=rf"^{name} must be torch\.int32, got {dtype}"):
        call(args, **kwargs)


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_kv"])
def test_cu_seqlens_not_a_tensor(name):
    args, kwargs = good_tnd()
    kwargs[name] = kwargs[name].tolist()
    with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor"):
        call(args, **kwargs)


def test_cu_seqlens_length():
    args, kwargs = good_tnd()
    # cu_seqlens_q sets B; cu_seqlens_kv must then have B + 1 entries.
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv must have shape \(3,\), got \(4,\)"):
        call(args, **{**kwargs, "cu_seqlens_kv": i32([0, 7, 10, 16])})
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv must have shape \(3,\), got \(2,\)"):
        call(args, **{**kwargs, "cu_seqlens_kv": i32([0, 16])})
    for bad in (i32([8]), i32([]), i32([[0, 3, 8]])):
        with pytest.raises(ValueError, match=r"^cu_seqlens_q must be 1-D with B\+1 >= 2 entries"):
            call(args, **{**kwargs, "cu_seqlens_q": bad})


@pytest.mark.parametrize("name,bad,match", [
    ("cu_seqlens_q", [1, 3, 8], r"^cu_seqlens_q must start with 0, got 1"),
    ("cu_seqlens_kv", [2, 7, 16], r"^cu_seqlens_kv must start with 0, got 2"),
    ("cu_seqlens_q", [0, 5, 3], r"^cu_seqlens_q must be non-decreasing, got \[0, 5, 3\]"),
    ("cu_seqlens_kv", [0, -1, 16], r"^cu_seqlens_kv must be non-decreasing"),
    ("cu_seqlens_q", [0, 3, 7], r"^cu_seqlens_q\[-1\] must equal the token count 8 of the tensor, got 7"),
    ("cu_seqlens_kv", [0, 7, 17], r"^cu_seqlens_kv\[-1\] must equal the token count 16 of the tensor, got 17"),
], ids=["q-start", "kv-start", "q-decreasing", "kv-decreasing", "q-last", "kv-last"])
def test_cu_seqlens_values(name, bad, match):
    args, kwargs = good_tnd()
    kwargs[name] = i32(bad)
    with pytest.raises(ValueError, match=match):
        call(args, **kwargs)


# --- seqused -------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["BNSD", "TND"])
@pytest.mark.parametrize("name", ["seqused_q", "seqused_kv"])
def test_seqused(name, layout):
    args, kwargs = good_tnd() if layout == "TND" else (good_bnsd(), {})
    lengths = {"seqused_q": ([3, 5], [SQ, SQ]), "seqused_kv": ([7, 9], [SKV, SKV])}[name]
    full = lengths[0] if layout == "TND" else lengths[1]
    call(args, **kwargs, **{name: i32(full)})  # the full lengths are fine
    with pytest.raises(TypeError, match=rf"^{name} must be torch\.int32, got torch\.int64"):
        call(args, **kwargs, **{name: i32(full, dtype=torch.int64)})
    with pytest.raises(ValueError, match=rf"^{name} must have shape \(2,\), got \(3,\)"):
        call(args, **kwargs, **{name: i32(full + [0])})
    with pytest.raises(ValueError, match=rf"^{name} must have shape \(2,\), got \(1,\)"):
        call(args, **kwargs, **{name: i32(full[:1])})
    n = full[1]
    with pytest.raises(ValueError, match=rf"^{name}\[1\] must be in \[0, {n}\] \(the sequence's length\), got {n + 1}"):
        call(args, **kwargs, **{name: i32([full[0], n + 1])})
    with pytest.raises(ValueError, match=rf"^{name}\[0\] must be in \[0, {full[0]}\].*got -1"):
        call(args, **kwargs, **{name: i32([-1, full[1]])})
    with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor"):
        call(args, **kwargs, **{name: full})


# --- devices -------------------------------------------------------------------------------------

def test_tensors_on_different_devices():
    """Every tensor argument must be on q's device; 'meta' stands in for a second device."""
    args = good_bnsd()
    for index, name in [(1, "k"), (2, "v"), (3, "q_descale"), (4, "k_descale"), (5, "v_descale")]:
        with pytest.raises(ValueError, match=rf"^{name} must be on q's device cpu, got meta"):
            call(replace(args, index, args[index].to("meta")))
    for name, value in [("p_scale", scale(device="meta")), ("seqused_q", i32([SQ, SQ], device="meta")),
                        ("seqused_kv", i32([SKV, SKV], device="meta"))]:
        with pytest.raises(ValueError, match=rf"^{name} must be on q's device cpu, got meta"):
            call(args, **{name: value})
    with pytest.raises(ValueError, match=r"^attn_mask must be on q's device cpu, got meta"):
        call(args, mask_mode=3, attn_mask=CAUSAL_MASK.to("meta"))
    tnd, kwargs = good_tnd()
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        with pytest.raises(ValueError, match=rf"^{name} must be on q's device cpu, got meta"):
            call(tnd, **{**kwargs, name: kwargs[name].to("meta")})
    # q elsewhere: everything else is then on the wrong device, and k is named first.
    with pytest.raises(ValueError, match=r"^k must be on q's device meta, got cpu"):
        call(replace(args, 0, args[0].to("meta")))
