"""Every tensor argument of every backend is read through its own strides and storage offset.

For each case (quant_flash_attn in modes 0, 1 and 6 in each q and k/v layout, paged ones
included, and the cast API) and each backend (the torch path, the native CPU kernel, the Triton
kernels under ``TRITON_INTERPRET=1``), the call is repeated with every tensor argument replaced
by a view holding the same values in other memory:

* ``transposed``: the axes stored in reverse order (no axis has stride 1 where it had);
* ``step``: every other element along every axis of a larger buffer;
* ``offset``: a contiguous view at a storage offset of 7 elements;
* ``expanded``: a zero stride along one axis (its values repeated from index 0), compared with
  the op on the view's contiguous copy, since the values change.

Where the view leaves gaps (step, offset), the gaps hold *junk*: values that change the answer
if read in place of the argument's (random codes, NaN elements and scales, other descales, the
indices of blocks no sequence owns). Each call must give the bits of the call on contiguous
inputs, and leave every input, gaps included, as it was. All arguments are views at once (one
call per kind keeps the interpreter's share of CI small); a mismatch is then traced to the
arguments that cause it alone, which the failure names.

A zero stride in paged k / v is refused, by rule (``docs/spec/quant-flash-attn.md``: paged k/v may
be strided along the blocks, never with a zero stride): their blocks would alias one another.
cu_seqlens cannot have a zero stride (their values rise from 0), so they are never expanded.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from functools import cache  # noqa: E402
from typing import Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import qfa  # noqa: E402
from qfa.attention.backends import cpu_kernel  # noqa: E402
from qfa.cast import fp8, mxfp8  # noqa: E402
from qfa.tiling import attention as tiling  # noqa: E402
from qfa.tiling.attention_checks import CAUSAL_MASK_SHAPE  # noqa: E402
from test_attention_scaled_modes import mx_call, mx_case  # noqa: E402

KINDS = ("transposed", "step", "offset", "expanded")
OFFSET = 7
E4M3 = torch.float8_e4m3fn
E4M3_NAN = 0x7F
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: The op's positional tensor arguments; every other tensor argument is a keyword.
POSITIONAL = ("q", "k", "v", "q_descale", "k_descale", "v_descale")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its element size: bytes compare and copy in any dtype (float8 too)."""
    return t.view(_BITS[t.element_size()])


def _dense(t: torch.Tensor) -> torch.Tensor:
    return _bits(t).contiguous().view(t.dtype)


@dataclass
class Arg:
    value: torch.Tensor  # contiguous
    #: n -> n elements (of ``_bits(value)``'s dtype) that change the result if read in its place.
    junk: Callable[[int], torch.Tensor]
    #: The axis a zero-stride view repeats (index 0's values); None: no such view is valid.
    axis: int | None = 0


@dataclass
class Case:
    args: dict[str, Arg]
    #: (tensors by name, backend) -> a tuple of result tensors.
    run: Callable[[dict, str], tuple]
    backends: tuple[str, ...]


def view_of(arg: Arg, kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(view, the buffer it lives in) of ``arg`` for ``kind``, or None where none applies."""
    t = arg.value
    bits = _bits(t)
    if kind == "transposed":
        if t.dim() < 2:
            return None
        order = tuple(reversed(range(t.dim())))
        view = bits.permute(order).contiguous().permute(order)
        return view.view(t.dtype), view
    if kind == "step":
        backing = arg.junk(math.prod(2 * n for n in t.shape)).view([2 * n for n in t.shape])
        view = backing[(slice(None, None, 2),) * t.dim()]
    elif kind == "offset":
        backing = arg.junk(t.numel() + OFFSET)
        view = backing[OFFSET:].view(t.shape)
    else:
        if arg.axis is None:
            return None
        first = bits.narrow(arg.axis, 0, 1)
        strides = [0 if i == arg.axis else s for i, s in enumerate(first.stride())]
        view = first.as_strided(t.shape, strides)
        return view.view(t.dtype), bits
    view.copy_(bits)
    return view.view(t.dtype), backing


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def _attempt(case: Case, tensors: dict, backend: str):
    try:
        return case.run(tensors, backend)
    except Exception as exc:  # a culprit may also be a call that raises
        return exc


def check_views(case: Case, backend: str, kind: str, reference: Callable[[], tuple]) -> None:
    given = {name: arg.value for name, arg in case.args.items()}
    views, backings = {}, {}
    for name, arg in case.args.items():
        made = view_of(arg, kind)
        if made is not None:
            views[name], backings[name] = made
    assert views, "no argument has a view of this kind"
    buffers = {**{f"{n} (its buffer)": b for n, b in backings.items()}, **given}
    before = {name: _bits(t).clone() for name, t in buffers.items()}
    got = case.run({**given, **views}, backend)
    dense = {name: _dense(view) for name, view in views.items()}
    want = case.run({**given, **dense}, backend) if kind == "expanded" else reference()
    if not _same(got, want):
        culprits = []
        for name, view in views.items():  # which views change the result on their own
            alone = _attempt(case, {**given, name: view}, backend)
            ref = _attempt(case, {**given, name: dense[name]}, backend) if kind == "expanded" else want
            if isinstance(alone, Exception) or isinstance(ref, Exception) or not _same(alone, ref):
                culprits.append(f"{name} {tuple(view.shape)} strides {view.stride()} offset {view.storage_offset()}"
                                + (f" ({alone!r})" if isinstance(alone, Exception) else ""))
        pytest.fail(f"{kind} views change the result ({backend}); alone: {culprits or 'none (only together)'}")
    changed = [name for name, t in buffers.items() if not torch.equal(_bits(t), before[name])]
    assert not changed, f"the call modified {changed}"


# ----------------------------------------------------------------------------- backends


@pytest.fixture
def backend_env(monkeypatch):
    """Selects a backend: the torch path (QFA_NATIVE=0), the native kernel or Triton; eager torch
    (the inputs' strides never reach a compiled graph: it runs on the path's own tensors)."""
    monkeypatch.delenv("QFA_BACKEND", raising=False)
    monkeypatch.setenv("QFA_COMPILE", "0")

    def select(backend: str) -> None:
        if backend == "native" and not cpu_kernel.available():
            pytest.skip("the native CPU kernel did not build here")
        if backend == "triton":
            pytest.importorskip("triton")
            if not qfa.backends.triton_interpreting():
                pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
        monkeypatch.setenv("QFA_NATIVE", "0" if backend == "torch_path" else "1")

    return select


def _op_backend(backend: str) -> str:
    return "triton" if backend == "triton" else "torch"


# ----------------------------------------------------------------------------- junk


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_codes(seed: int) -> Callable[[int], torch.Tensor]:
    return lambda n: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=_gen(seed))


def filled(value, dtype: torch.dtype) -> Callable[[int], torch.Tensor]:
    """Junk of one value; fp32 values as their int32 bits."""
    if dtype == torch.float32:
        return lambda n: torch.full((n,), float(value)).view(torch.int32)
    return lambda n: torch.full((n,), value, dtype=dtype)


def spare_blocks(spare: list[int]) -> Callable[[int], torch.Tensor]:
    """Block indices no sequence owns (valid, so a misread gives wrong keys, not a crash)."""
    pool = torch.tensor(spare, dtype=torch.int32)
    return lambda n: pool[torch.randint(len(spare), (n,), generator=_gen(5))]


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _cu(lens) -> torch.Tensor:
    return _i32([0, *torch.tensor(lens).cumsum(0).tolist()])


def _table(batch: int, width: int, spare: int, gen) -> tuple[torch.Tensor, list[int]]:
    """A (batch, width) table of distinct blocks in shuffled order, every entry a block with valid
    keys (so an expanded table, or a longer seqused, stays valid), and the spare blocks' indices."""
    order = torch.randperm(batch * width + spare, generator=gen).to(torch.int32)
    return order[: batch * width].view(batch, width).clone(), order[batch * width:].tolist()


# ----------------------------------------------------------------------------- mode 0

D = 128
#: Sequence 0 is the shortest, so a zero-stride seqused (sequence 0's length for all) is valid.
Q_LENS, KV_LENS = (2, 3), (20, 37)
HEADS = (4, 2)


def _hif8(*shape, gen) -> torch.Tensor:
    return qfa.encode_to_hifloat8(torch.randn(shape, generator=gen))


def _hif8_args(q, k, v, *, seed: int, head_axis: int, kv_axis: int | None) -> dict[str, Arg]:
    scalar = lambda x: Arg(torch.tensor([x]), filled(3.0, torch.float32))  # noqa: E731
    return {"q": Arg(q, random_codes(seed), head_axis), "k": Arg(k, random_codes(seed + 1), kv_axis),
            "v": Arg(v, random_codes(seed + 2), kv_axis), "q_descale": scalar(0.5), "k_descale": scalar(0.75),
            "v_descale": scalar(1.25), "p_scale": scalar(2.0)}


def _hif8_run(static: dict) -> Callable[[dict, str], tuple]:
    def run(t: dict, backend: str) -> tuple:
        keywords = {name: x for name, x in t.items() if name not in POSITIONAL}
        return qfa.quant_flash_attn(*(t[n] for n in POSITIONAL), 0, **keywords, **static, mask_mode=3,
                                    return_softmax_lse=True, backend=_op_backend(backend))
    return run


HIF8_BACKENDS = ("torch_path", "native", "triton")


def hif8_contiguous(layout: str) -> Case:
    gen = _gen(len(layout))
    nq, nkv = HEADS
    lengths = {"seqused_q": Arg(_i32(Q_LENS), filled(-5, torch.int32)),
               "seqused_kv": Arg(_i32(KV_LENS), filled(-5, torch.int32))}
    if layout == "TND":
        q, k, v = _hif8(sum(Q_LENS), nq, D, gen=gen), _hif8(sum(KV_LENS), nkv, D, gen=gen), \
            _hif8(sum(KV_LENS), nkv, D, gen=gen)
        lengths = {"cu_seqlens_q": Arg(_cu(Q_LENS), filled(-5, torch.int32), None),
                   "cu_seqlens_kv": Arg(_cu(KV_LENS), filled(-5, torch.int32), None),
                   "seqused_q": Arg(_i32([2, 2]), filled(-5, torch.int32)),
                   "seqused_kv": Arg(_i32([15, 30]), filled(-5, torch.int32))}
        axis = 1
    elif layout == "BNSD":
        q, k, v = _hif8(2, nq, 3, D, gen=gen), _hif8(2, nkv, 40, D, gen=gen), _hif8(2, nkv, 40, D, gen=gen)
        axis = 1
    else:
        q, k, v = _hif8(2, 3, nq, D, gen=gen), _hif8(2, 40, nkv, D, gen=gen), _hif8(2, 40, nkv, D, gen=gen)
        axis = 2
    args = _hif8_args(q, k, v, seed=10, head_axis=axis, kv_axis=axis) | lengths
    if layout == "BNSD":  # upstream's compressed causal mask: accepted in mode 3, never read
        args["attn_mask"] = Arg(torch.ones(CAUSAL_MASK_SHAPE, dtype=torch.int8), filled(0, torch.int8))
    return Case(args, _hif8_run({"layout": layout}), HIF8_BACKENDS)


def hif8_paged(layout_kv: str, layout_q: str, block_size: int = 16) -> Case:
    gen = _gen(block_size + len(layout_q))
    nq, nkv = HEADS
    width = -(-max(KV_LENS) // block_size)
    table, spare = _table(2, width, 3, gen)
    n_blocks = table.numel() + len(spare)
    shape = (n_blocks, block_size, nkv, D) if layout_kv == "PA_BBND" else (n_blocks, nkv, block_size, D)
    k, v = _hif8(*shape, gen=gen), _hif8(*shape, gen=gen)
    if layout_q == "TND":
        q = _hif8(sum(Q_LENS), nq, D, gen=gen)
        lengths = {"cu_seqlens_q": Arg(_cu(Q_LENS), filled(-5, torch.int32), None)}
    else:
        q = _hif8(2, 3, nq, D, gen=gen)
        lengths = {"seqused_q": Arg(_i32(Q_LENS), filled(-5, torch.int32))}
    args = _hif8_args(q, k, v, seed=20, head_axis=q.dim() - 2, kv_axis=None) | lengths | {
        "seqused_kv": Arg(_i32(KV_LENS), filled(-5, torch.int32)),
        "block_table": Arg(table, spare_blocks(spare), 0)}
    static = {"layout_q": layout_q, "layout_out": layout_q, "layout_kv": layout_kv}
    return Case(args, _hif8_run(static), HIF8_BACKENDS)


# ----------------------------------------------------------------------------- modes 1 and 6

SCALED_BACKENDS = ("torch", "triton")
MX_D = 64
MX_BLOCK = 64
MX_KV_LENS = (70, 100)


def _scaled_run(mode: int, static: dict) -> Callable[[dict, str], tuple]:
    def run(t: dict, backend: str) -> tuple:
        keywords = {name: x for name, x in t.items() if name not in POSITIONAL}
        return qfa.quant_flash_attn(*(t[n] for n in POSITIONAL), mode, **keywords, **static,
                                    return_softmax_lse=True, backend=_op_backend(backend))
    return run


def _e4m3_junk(n: int) -> torch.Tensor:
    return torch.full((n,), E4M3_NAN, dtype=torch.uint8)


def _e8m0_junk(n: int) -> torch.Tensor:
    return torch.full((n,), mxfp8.E8M0_NAN_CODE, dtype=torch.uint8)


def mx_tnd() -> Case:
    case = mx_case(Q_LENS, (20, 70), d=MX_D, seed=3)
    args, kwargs = mx_call(case, causal=True, p_scale=104.0)
    names = dict(zip(POSITIONAL, args[:6]))
    built = {name: Arg(t, _e8m0_junk if "descale" in name else _e4m3_junk, 1) for name, t in names.items()}
    built |= {"p_scale": Arg(kwargs["p_scale"], filled(3.0, torch.float32)),
              "cu_seqlens_q": Arg(kwargs["cu_seqlens_q"], filled(-5, torch.int32), None),
              "cu_seqlens_kv": Arg(kwargs["cu_seqlens_kv"], filled(-5, torch.int32), None)}
    return Case(built, _scaled_run(1, {"mask_mode": 3}), SCALED_BACKENDS)


def _to_nz(t: torch.Tensor) -> torch.Tensor:
    """(Bn, N, S, D) -> (Bn, N, D/32, S, 32): rows into 32-channel slabs."""
    bn, n, s, d = t.shape
    return _bits(t).view(bn, n, s, d // 32, 32).permute(0, 1, 3, 2, 4).contiguous().view(t.dtype)


def mx_paged(layout_kv: str, q_layout: str) -> Case:
    """MXFP8 paged k/v: every table entry a block of valid keys and scales; spare blocks hold NaN
    elements and NaN scales (what a misread table reads: the issue's NaN)."""
    gen = _gen(len(layout_kv) + len(q_layout))
    nq, nkv = HEADS
    width = -(-max(MX_KV_LENS) // MX_BLOCK)
    table, spare = _table(2, width, 2, gen)
    n_blocks = table.numel() + len(spare)
    mag = torch.exp(2 * torch.randn(n_blocks, nkv, MX_BLOCK, 1, generator=gen))
    k_elems, k_scales = mxfp8.quantize(torch.randn(n_blocks, nkv, MX_BLOCK, MX_D, generator=gen) * mag, -1)
    v_elems, v_scales = mxfp8.quantize(torch.randn(n_blocks, nkv, MX_BLOCK, MX_D, generator=gen) * 3, 2)
    for t in (k_elems, v_elems):
        _bits(t)[spare] = E4M3_NAN
    for t in (k_scales, v_scales):
        _bits(t)[spare] = mxfp8.E8M0_NAN_CODE
    head = 1  # of every PA_BNBD / PA_NZ tensor; PA_BBND's is 2
    if layout_kv == "PA_NZ":
        nz_k_scales = _bits(k_scales).transpose(2, 3).unsqueeze(-1).contiguous().view(mxfp8.E8M0)
        k, v = _to_nz(k_elems), _to_nz(v_elems)
        kd, vd = mxfp8.pack_k_descale(nz_k_scales, "PA_NZ"), mxfp8.pack_v_descale(_to_nz(v_scales), "PA_NZ")
    else:
        if layout_kv == "PA_BBND":
            k_elems, v_elems, k_scales, v_scales = (_dense(t.transpose(1, 2)) for t in
                                                    (k_elems, v_elems, k_scales, v_scales))
            head = 2
        k, v = k_elems, v_elems
        kd, vd = mxfp8.pack_k_descale(k_scales, layout_kv), mxfp8.pack_v_descale(v_scales, layout_kv)
    q_elems, q_scales = mxfp8.quantize(torch.randn(sum(Q_LENS), nq, MX_D, generator=gen) * 2, -1)
    qd = mxfp8.pack_q_descale(q_scales, q_layout, num_heads_kv=nkv if q_layout == "N2TGD" else None)
    built = {"q": Arg(q_elems, _e4m3_junk, 1), "k": Arg(k, _e4m3_junk, None), "v": Arg(v, _e4m3_junk, None),
             "q_descale": Arg(qd, _e8m0_junk, 0 if q_layout == "N2TGD" else 1),
             "k_descale": Arg(kd, _e8m0_junk, head), "v_descale": Arg(vd, _e8m0_junk, head),
             "p_scale": Arg(torch.tensor([104.0]), filled(3.0, torch.float32)),
             "cu_seqlens_q": Arg(_cu(Q_LENS), filled(-5, torch.int32), None),
             "seqused_kv": Arg(_i32(MX_KV_LENS), filled(-5, torch.int32)),
             "block_table": Arg(table, spare_blocks(spare), 0)}
    static = {"mask_mode": 3, "layout_kv": layout_kv, "layout_q_descale": q_layout}
    return Case(built, _scaled_run(1, static), SCALED_BACKENDS)


def fp8_paged() -> Case:
    gen = _gen(6)
    nq, nkv = HEADS
    kv_lens, bs = (130, 200), 128
    table, spare = _table(2, 2, 2, gen)
    n_blocks = table.numel() + len(spare)
    mag = lambda *s: torch.exp(2 * torch.randn(*s, 1, generator=gen))  # noqa: E731
    q, qs = fp8.quantize_per_token_head(torch.randn(nq, sum(Q_LENS), 128, generator=gen) * mag(nq, sum(Q_LENS)))
    k, ks = fp8.quantize_per_token_head(torch.randn(n_blocks, nkv, bs, 128, generator=gen) * mag(n_blocks, nkv, bs))
    v, vs = fp8.quantize_per_head(torch.randn(n_blocks, nkv, bs, 128, generator=gen) * 3, 1)
    for t in (k, v):
        _bits(t)[spare] = E4M3_NAN
    built = {"q": Arg(q, _e4m3_junk, 0), "k": Arg(k, _e4m3_junk, None), "v": Arg(v, _e4m3_junk, None),
             "q_descale": Arg(qs, filled(3.0, torch.float32), 0), "k_descale": Arg(ks, filled(3.0, torch.float32), 1),
             "v_descale": Arg(vs, filled(3.0, torch.float32), 0),
             "p_scale": Arg(torch.tensor([448.0]), filled(3.0, torch.float32)),
             "cu_seqlens_q": Arg(_cu(Q_LENS), filled(-5, torch.int32), None),
             "seqused_kv": Arg(_i32(kv_lens), filled(-5, torch.int32)),
             "block_table": Arg(table, spare_blocks(spare), 0)}
    return Case(built, _scaled_run(6, {"mask_mode": 3}), SCALED_BACKENDS)


# ----------------------------------------------------------------------------- the cast API

CAST_BACKENDS = ("torch", "triton")


def _floats(*shape, seed: int) -> torch.Tensor:
    """Values over many binades (so each block, row and head has its own scale)."""
    return torch.randn(shape, generator=_gen(seed)) * torch.exp(3 * torch.randn(shape, generator=_gen(seed + 1)))


def cast_case(name: str) -> Case:
    f32 = filled(7.0, torch.float32)
    if name == "encode":
        x = _floats(3, 5, 8, seed=1)
        return Case({"x": Arg(x, f32, 1)}, lambda t, b: (qfa.encode_to_hifloat8(t["x"], backend=b),), CAST_BACKENDS)
    if name == "decode":
        y = torch.randint(0, 256, (3, 5, 8), dtype=torch.uint8, generator=_gen(2))
        return Case({"y": Arg(y, random_codes(3), 1)},
                    lambda t, b: (qfa.decode_from_hifloat8(t["y"], torch.float32, backend=b),), CAST_BACKENDS)
    if name == "mxfp8":
        x = _floats(3, 4, 64, seed=4)
        elements, scales = mxfp8.quantize(x, -1)
        return Case({"x": Arg(x, f32, 1), "elements": Arg(elements, _e4m3_junk, 1),
                     "scales": Arg(scales, _e8m0_junk, 1)},
                    lambda t, b: (*mxfp8.quantize(t["x"], -1), mxfp8.dequantize(t["elements"], t["scales"], -1)),
                    ("torch",))
    x = _floats(3, 4, 128, seed=5)
    elements, scale = fp8.quantize_per_token_head(x)
    head_elements, head_scale = fp8.quantize_per_head(x, 1)
    return Case({"x": Arg(x, f32, 1), "elements": Arg(elements, _e4m3_junk, 1), "scale": Arg(scale, f32, 1),
                 "head_elements": Arg(head_elements, _e4m3_junk, 0), "head_scale": Arg(head_scale, f32, 0)},
                lambda t, b: (*fp8.quantize_per_token_head(t["x"]), *fp8.quantize_per_head(t["x"], 1),
                              fp8.dequantize_per_token_head(t["elements"], t["scale"]),
                              fp8.dequantize_per_head(t["head_elements"], t["head_scale"], 1)),
                ("torch",))


# ----------------------------------------------------------------------------- the tests

BUILDERS: dict[str, Callable[[], Case]] = {
    "hif8-BNSD": lambda: hif8_contiguous("BNSD"),
    "hif8-BSND": lambda: hif8_contiguous("BSND"),
    "hif8-TND": lambda: hif8_contiguous("TND"),
    "hif8-PA_BBND-q-BSND": lambda: hif8_paged("PA_BBND", "BSND"),
    "hif8-PA_BNBD-q-TND": lambda: hif8_paged("PA_BNBD", "TND"),
    "mxfp8-TND": mx_tnd,
    "mxfp8-PA_BBND-N2TGD": lambda: mx_paged("PA_BBND", "N2TGD"),
    "mxfp8-PA_BNBD": lambda: mx_paged("PA_BNBD", "TND"),
    "mxfp8-PA_NZ": lambda: mx_paged("PA_NZ", "TND"),
    "fp8-PA_BNBD": fp8_paged,
    **{f"cast-{name}": (lambda name=name: cast_case(name)) for name in ("encode", "decode", "mxfp8", "fp8")},
}
#: Every backend each case runs on.
_BACKENDS = {"hif8": HIF8_BACKENDS, "mxfp8": SCALED_BACKENDS, "fp8": SCALED_BACKENDS, "cast": CAST_BACKENDS}
PARAMS = [(case, backend) for case in BUILDERS for backend in _BACKENDS[case.split("-")[0]]
          if not (case in ("cast-mxfp8", "cast-fp8") and backend != "torch")]


@cache
def build(case_id: str) -> Case:
    return BUILDERS[case_id]()


_references: dict = {}


def _reference(case_id: str, backend: str) -> Callable[[], tuple]:
    """The call on the contiguous inputs, made once per case and backend."""
    def get() -> tuple:
        key = (case_id, backend)
        if key not in _references:
            case = build(case_id)
            _references[key] = case.run({name: arg.value for name, arg in case.args.items()}, backend)
        return _references[key]
    return get


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case_id,backend", PARAMS, ids=[f"{c}-{b}" for c, b in PARAMS])
def test_views_give_the_contiguous_bits(case_id, backend, kind, backend_env):
    backend_env(backend)
    check_views(build(case_id), backend, kind, _reference(case_id, backend))


#: (case, argument) pairs whose junk is not read by construction: attn_mask's values never are.
_UNREAD = {("hif8-BNSD", "attn_mask")}


@pytest.mark.parametrize("case_id,name", [(c, n) for c in BUILDERS for n in build(c).args if (c, n) not in _UNREAD])
def test_junk_read_in_place_of_an_argument_shows(case_id, name, backend_env):
    """What makes the checks above able to fail: a backend that read an argument's gaps (step,
    offset) would read its junk, and the junk in place of the argument changes the result (or
    is refused). Run on the CPU's torch backend, where it is cheap."""
    backend = _BACKENDS[case_id.split("-")[0]][0]
    backend_env(backend)
    case = build(case_id)
    arg = case.args[name]
    junk = arg.junk(arg.value.numel()).view(arg.value.shape).view(arg.value.dtype)
    got = _attempt(case, {n: a.value for n, a in case.args.items()} | {name: junk}, backend)
    assert isinstance(got, Exception) or not _same(got, _reference(case_id, backend)())


@pytest.mark.parametrize("case_id", [c for c in BUILDERS if "PA_" in c])
@pytest.mark.parametrize("name", ["k", "v"])
def test_paged_kv_with_a_zero_stride_is_refused(case_id, name, backend_env):
    """Paged k / v: refused by rule, before any backend runs (planning does it)."""
    backend_env("torch_path")
    case = build(case_id)
    t = case.args[name].value
    aliased = _bits(t).narrow(1, 0, 1).expand(t.shape).view(t.dtype)
    tensors = {n: a.value for n, a in case.args.items()} | {name: aliased}
    with pytest.raises(ValueError, match=rf"^{name} must not have a zero stride in a paged layout"):
        case.run(tensors, "torch_path")


@pytest.mark.parametrize("backend", HIF8_BACKENDS)
def test_metadata_runs_read_the_table_through_its_strides(backend, backend_env):
    """A run with ready metadata binds a plan of its own for a table of other strides."""
    backend_env(backend)
    case = build("hif8-PA_BBND-q-BSND")
    given = {name: arg.value for name, arg in case.args.items()}
    lengths = {"seqused_q": given["seqused_q"], "seqused_kv": given["seqused_kv"]}
    layouts = {"layout_q": "BSND", "layout_out": "BSND", "layout_kv": "PA_BBND"}
    meta = qfa.quant_flash_attn_metadata(*HEADS, D, 0, **lengths, **layouts, mask_mode=3, batch_size=2)
    want = _reference("hif8-PA_BBND-q-BSND", backend)()
    for kind in ("transposed", "step"):
        table, _ = view_of(case.args["block_table"], kind)
        got = qfa.quant_flash_attn(*(given[n] for n in POSITIONAL), 0, block_table=table, p_scale=given["p_scale"],
                                   metadata=meta, **lengths, **layouts, mask_mode=3, return_softmax_lse=True,
                                   backend=_op_backend(backend))
        assert _same(got, want), kind


@pytest.mark.parametrize("kind", ["transposed", "step", "offset"])
def test_native_kernel_writes_out_and_lse_through_their_strides(kind, backend_env):
    """``cpu_kernel.run_into``'s out / lse (the one entry that takes them) as views: the rows
    written are ``forward``'s bits, and the gaps between them are left alone."""
    backend_env("native")
    case = build("hif8-BNSD")
    given = {name: arg.value for name, arg in case.args.items()}
    plan = tiling.plan_attention(*(given[n] for n in POSITIONAL), 0, p_scale=given["p_scale"], layout="BNSD",
                                 mask_mode=3, return_softmax_lse=True)
    args = (*(given[n] for n in POSITIONAL), given["p_scale"])
    wanted = cpu_kernel.forward(plan, *args)
    views, buffers = zip(*(view_of(Arg(torch.full(w.shape, float("nan"), dtype=w.dtype),
                                       filled(-1, _bits(w).dtype)), kind) for w in wanted))
    before = [_bits(b).clone() for b in buffers]
    cpu_kernel.run_into(plan, *args, *views)
    for view, want, buffer, old in zip(views, wanted, buffers, before):
        assert torch.equal(_bits(view), _bits(want))
        gaps = torch.ones(buffer.numel(), dtype=torch.bool)
        gaps[_index_of(view, buffer)] = False
        assert torch.equal(_bits(buffer).flatten()[gaps], old.flatten()[gaps]), "a gap was written"


def _index_of(view: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """Flat indices into contiguous ``buffer`` of the elements of ``view`` (a view of it)."""
    index = torch.arange(buffer.numel()).view(buffer.shape)
    return index.as_strided(view.shape, view.stride(), view.storage_offset() - buffer.storage_offset()).flatten()
