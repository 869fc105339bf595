"""Property-based tests of the op and the drop-in under hostile and extreme input (issue 9).

Properties (hypothesis; the "ci" profile of ``conftest.py`` runs a fixed, derandomised set of
examples, ``QFA_HYPOTHESIS_PROFILE=long`` many more), over layouts (contiguous and permuted
views), GQA, batch sizes, per-sequence lengths (TND cu_seqlens, seqused, zero-length
sequences), causal both ways, descales, p_scale, softmax_scale, LSE on/off, the native and the
pure-torch CPU paths, and HiF8 codes from data or from random bytes:

* inputs are never modified, a repeated call gives the same bits, and the process state
  (dynamo's config, default dtype, grad mode, threads, qfa._compile's records) is unchanged
  after any call, good or bad;
* the op equals the spec-level float64 reference (``attention_reference``) on the decoded
  inputs within the bounds ``test_attention_reference`` derives, wherever the result is finite;
  with NaN/Inf codes among the inputs, a NaN of the reference is never a finite output;
* masked keys have no influence: keys past ``seqused_kv`` and keys hidden by the causal mask,
  poisoned with NaN/Inf codes or random codes, leave the bits of every row that cannot see them;
* a bad argument raises ValueError/TypeError naming it (every mutation in the lists below, not a
  sample: they are cheap);
* suspicious inputs (bad cu_seqlens through the drop-in used to abort the interpreter with
  "double free or corruption") raise a clean Python exception in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import attention_reference as ref
import qfa
from qfa import _compile
from qfa.attention.backends import cpu_kernel
from qfa.cast import format as fmt
from test_attention_reference import BAND_ATOL, BAND_RTOL, LSE_ATOL, LSE_RTOL, MIN_IN_BAND, OUTLIER_FLIPS

D = 128
SPECIAL_CODES = (fmt.NAN_CODE, fmt.POS_INF_CODE, fmt.POS_INF_CODE | fmt.SIGN_BIT)
FINITE_CODES = torch.tensor([c for c in range(256) if c not in SPECIAL_CODES], dtype=torch.uint8)
#: Total query (and key) positions per example, so an example costs well under a second.
MAX_TOKENS = 300
SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large]


# ----------------------------------------------------------------------------- process state

def native_runs() -> bool:
    return cpu_kernel.available()


def process_state(threads: bool = True) -> dict:
    """What no call may change. ``threads=False`` leaves out torch's thread count, which the
    native kernel currently changes (see test_the_native_kernel_leaves_the_thread_count)."""
    return {
        "recompile_limit": torch._dynamo.config.recompile_limit,
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "threads": torch.get_num_threads() if threads else None,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "compile_failed": set(_compile._failed),
        "compile_failed_signatures": {f: set(s) for f, s in _compile._failed_signatures.items()},
    }


@contextlib.contextmanager
def cpu_path(name: str):
    """The native CPU kernel (where it builds) or the pure-torch path."""
    old = os.environ.get(cpu_kernel.ENV_VAR)
    os.environ[cpu_kernel.ENV_VAR] = "1" if name == "native" else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[cpu_kernel.ENV_VAR]
        else:
            os.environ[cpu_kernel.ENV_VAR] = old


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns (so NaNs compare equal to themselves)."""
    if t.dtype in (torch.float32,):
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


# ----------------------------------------------------------------------------- op cases

@st.composite
def op_cases(draw, *, codes=("data", "bytes"), lengths=True):
    """One quant_flash_attn call: (args, kwargs, meta) with meta describing the lengths."""
    layout = draw(st.sampled_from(["BNSD", "BSND", "TND"]))
    nkv = draw(st.sampled_from([1, 2]))
    nq = nkv * draw(st.sampled_from([1, 2, 3]))
    batch = draw(st.integers(1, 3))
    cap = MAX_TOKENS // batch
    if layout == "TND":
        q_lens = draw(st.lists(st.integers(0, cap), min_size=batch, max_size=batch))
        kv_lens = draw(st.lists(st.integers(0, cap), min_size=batch, max_size=batch))
        assume(sum(q_lens) > 0 and sum(kv_lens) > 0)
        q_shape, kv_shape = (sum(q_lens), nq, D), (sum(kv_lens), nkv, D)
    else:
        sq, skv = draw(st.integers(1, cap)), draw(st.integers(1, cap))
        q_lens, kv_lens = [sq] * batch, [skv] * batch
        q_shape = (batch, nq, sq, D) if layout == "BNSD" else (batch, sq, nq, D)
        kv_shape = (batch, nkv, skv, D) if layout == "BNSD" else (batch, skv, nkv, D)
    kwargs = {"layout": layout}
    if layout == "TND":
        kwargs["cu_seqlens_q"] = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32)
        kwargs["cu_seqlens_kv"] = torch.tensor(np.cumsum([0] + kv_lens), dtype=torch.int32)
    used_q, used_kv = list(q_lens), list(kv_lens)
    if lengths and draw(st.booleans()):
        used_q = [draw(st.integers(0, n)) for n in q_lens]
        kwargs["seqused_q"] = torch.tensor(used_q, dtype=torch.int32)
    if lengths and draw(st.booleans()):
        used_kv = [draw(st.integers(0, n)) for n in kv_lens]
        kwargs["seqused_kv"] = torch.tensor(used_kv, dtype=torch.int32)
    mode = draw(st.sampled_from(codes))
    seed = draw(st.integers(0, 2**16))
    if mode == "data":
        q, k, v, qd, kd, vd = ref.random_qkv(q_shape, kv_shape, seed, draw(st.sampled_from(["upstream", "unit"])))
    else:  # any finite code, descales drawn within the op's valid ranges
        g = torch.Generator().manual_seed(seed)
        q, k, v = (FINITE_CODES[torch.randint(0, FINITE_CODES.numel(), s, generator=g)]
                   for s in (q_shape, kv_shape, kv_shape))
        qd, kd, vd = (torch.tensor([2.0 ** draw(st.integers(lo, hi))]) for lo, hi in ((-30, -8), (-30, -8), (-20, 4)))
    if layout != "TND" and draw(st.booleans()):  # the same values as a permuted (strided) view
        other = (0, 2, 1, 3)
        q, k, v = (t.permute(other).contiguous().permute(other) for t in (q, k, v))
    p_scale = draw(st.sampled_from([None, 2.0**-15, 2.0**-3, 1.0, 15.0, 256.0, 2.0**15]))
    if p_scale is not None:
        kwargs["p_scale"] = torch.tensor([p_scale])
    kwargs["softmax_scale"] = draw(st.sampled_from([None, 1.0, 0.05]))
    kwargs["mask_mode"] = 3 if draw(st.booleans()) else 0
    kwargs["return_softmax_lse"] = draw(st.booleans())
    meta = {"q_lens": used_q, "kv_lens": used_kv, "full_kv": kv_lens, "layout": layout, "group": nq // nkv}
    return [q, k, v, qd, kd, vd], kwargs, meta


def run_op(args, kwargs):
    return qfa.quant_flash_attn(*args, **kwargs)


def reference(args, kwargs):
    kw = {k: v for k, v in kwargs.items() if k not in ("mask_mode", "return_softmax_lse")}
    return ref.reference_attention(*args, causal=kwargs["mask_mode"] == 3, **kw)


def assert_matches_reference(out, lse, ref_out, ref_lse, v_max: float, want_lse: bool) -> None:
    """test_attention_reference's bounds, on the elements where the op's result is finite."""
    got = out.to(torch.float64).numpy()
    assert got.shape == ref_out.shape
    finite = np.isfinite(got)
    assert not (finite & np.isnan(ref_out)).any(), "a NaN of the reference came out finite"
    both = finite & np.isfinite(ref_out)
    diff = np.abs(got - ref_out)[both]
    band = BAND_ATOL + BAND_RTOL * np.abs(ref_out[both])
    assert (diff > band).sum() <= max((1 - MIN_IN_BAND) * diff.size, D)
    assert (diff <= band + OUTLIER_FLIPS * v_max).all()
    no_key = np.isposinf(ref_lse)
    if not want_lse:
        assert lse.numel() == 0
        return
    got_lse = lse.numpy()
    assert np.array_equal(np.isposinf(got_lse), no_key), "rows that see no key must have lse +inf, only they"
    ok = np.isfinite(got_lse) & np.isfinite(ref_lse)
    err = np.abs(got_lse[ok].astype(np.float64) - ref_lse[ok])
    assert (err <= LSE_ATOL + LSE_RTOL * np.abs(ref_lse[ok])).all()
    assert not (np.isfinite(got_lse) & np.isnan(ref_lse)).any(), "a NaN lse of the reference came out finite"


def v_max_of(args) -> float:
    values = ref.decode(args[2])
    finite = values[np.isfinite(values)]
    return float(np.abs(finite).max() * float(args[5])) if finite.size else 1.0


# ----------------------------------------------------------------------------- properties: op

@settings(suppress_health_check=SUPPRESSED)
@given(case=op_cases(), path=st.sampled_from(["native", "torch"]))
def test_op_matches_reference_leaves_inputs_and_state_alone_and_is_deterministic(case, path):
    args, kwargs, _ = case
    before = [t.clone() for t in args] + [t.clone() for t in kwargs.values() if isinstance(t, torch.Tensor)]
    state = process_state(threads=path == "torch")
    with cpu_path(path):
        out, lse = run_op(args, kwargs)
        again = run_op(args, kwargs)
    assert same_bits(out, again[0]) and same_bits(lse, again[1]), "not deterministic"
    after = list(args) + [t for t in kwargs.values() if isinstance(t, torch.Tensor)]
    assert all(same_bits(a, b) for a, b in zip(before, after)), "an input was modified"
    assert process_state(threads=path == "torch") == state
    ref_out, ref_lse = reference(args, kwargs)
    assert_matches_reference(out, lse, ref_out, ref_lse, v_max_of(args), kwargs["return_softmax_lse"])


def _poison(t: torch.Tensor, layout: str, b: int, start: int, positions, codes: torch.Tensor) -> torch.Tensor:
    """A copy of codes ``t`` with the given positions of batch ``b`` replaced by ``codes``."""
    t = t.clone()
    for j in positions:
        if layout == "BNSD":
            t[b, :, j] = codes[: t.shape[1] * D].view(t.shape[1], D)
        elif layout == "BSND":
            t[b, j] = codes[: t.shape[2] * D].view(t.shape[2], D)
        else:
            t[start + j] = codes[: t.shape[1] * D].view(t.shape[1], D)
    return t


@settings(suppress_health_check=SUPPRESSED)
@given(case=op_cases(codes=("data",)), poison=st.sampled_from(["nan", "inf", "random"]),
       path=st.sampled_from(["native", "torch"]), data=st.data())
def test_masked_keys_have_no_influence(case, poison, path, data):
    """Keys past seqused_kv, and one key hidden by the causal mask from some rows, poisoned in
    K and V: the bits of every row that cannot see a poisoned key are unchanged."""
    args, kwargs, meta = case
    layout, causal = meta["layout"], kwargs["mask_mode"] == 3
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    n = 4 * D * 8
    codes = {"nan": torch.full((n,), fmt.NAN_CODE, dtype=torch.uint8),
             "inf": torch.full((n,), fmt.POS_INF_CODE, dtype=torch.uint8),
             "random": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)}[poison]
    starts = [0] * len(meta["full_kv"])
    if layout == "TND":
        starts = kwargs["cu_seqlens_kv"][:-1].tolist()
    k, v = args[1], args[2]
    hidden_from = {}  # batch -> (key position, rows that cannot see it)
    for b, (full, used, q_len) in enumerate(zip(meta["full_kv"], meta["kv_lens"], meta["q_lens"])):
        pad = range(used, full)
        k, v = _poison(k, layout, b, starts[b], pad, codes), _poison(v, layout, b, starts[b], pad, codes)
        offset = used - q_len
        if causal and used and q_len and offset + 1 < used:  # some key is hidden from some row
            j = data.draw(st.integers(max(offset + 1, 0), used - 1))
            k, v = _poison(k, layout, b, starts[b], [j], codes), _poison(v, layout, b, starts[b], [j], codes)
            hidden_from[b] = j - offset  # rows i < j - offset cannot see key j
    poisoned = [args[0], k, v, *args[3:]]
    with cpu_path(path):
        clean_out, clean_lse = run_op(args, kwargs)
        out, lse = run_op(poisoned, kwargs)
    seq_axis = {"BNSD": 2, "BSND": 1}.get(layout)
    q_starts = kwargs["cu_seqlens_q"][:-1].tolist() if layout == "TND" else [0] * len(meta["q_lens"])
    cu_q = kwargs["cu_seqlens_q"].tolist() if layout == "TND" else None
    for b in range(len(meta["q_lens"])):
        full_rows = cu_q[b + 1] - cu_q[b] if layout == "TND" else out.shape[seq_axis]
        rows = hidden_from.get(b, full_rows)
        if layout == "TND":
            sl = slice(q_starts[b], q_starts[b] + rows)
            got, want = out[sl], clean_out[sl]
            got_l, want_l = (lse[:, sl], clean_lse[:, sl]) if lse.numel() else (lse, clean_lse)
        else:
            got, want = out[b].narrow(seq_axis - 1, 0, rows), clean_out[b].narrow(seq_axis - 1, 0, rows)
            got_l, want_l = (lse[b, :, :rows], clean_lse[b, :, :rows]) if lse.numel() else (lse, clean_lse)
        assert same_bits(got, want), f"batch {b}: a masked key changed the output"
        assert same_bits(got_l, want_l), f"batch {b}: a masked key changed the lse"


@settings(suppress_health_check=SUPPRESSED)
@given(case=op_cases(lengths=False), path=st.sampled_from(["native", "torch"]), data=st.data())
def test_special_codes_follow_the_reference_where_finite(case, path, data):
    """NaN/Inf codes at a few visible positions of q, k, v (no causal mask, so the reference's
    plain sums are IEEE's): finite results stay within the bounds of the reference, and a NaN
    of the reference is never a finite output."""
    args, kwargs, meta = case
    kwargs["mask_mode"] = 0
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    specials = torch.tensor(SPECIAL_CODES, dtype=torch.uint8)
    for i in range(3):
        if data.draw(st.booleans()):
            t = args[i].clone()
            flat = t.view(-1) if t.is_contiguous() else None
            if flat is None:
                t = t.contiguous()
                flat = t.view(-1)
            where = torch.randint(0, flat.numel(), (data.draw(st.integers(1, 4)),), generator=g)
            flat[where] = specials[torch.randint(0, 3, (where.numel(),), generator=g)]
            args[i] = t
    with cpu_path(path):
        out, lse = run_op(args, kwargs)
    ref_out, ref_lse = reference(args, kwargs)
    assert_matches_reference(out, lse, ref_out, ref_lse, v_max_of(args), kwargs["return_softmax_lse"])


# ----------------------------------------------------------------------------- bad input

def _good_op_call():
    q, k, v, qd, kd, vd = ref.random_qkv((1, 2, 8, D), (1, 2, 8, D), 0)
    return dict(q=q, k=k, v=v, q_descale=qd, k_descale=kd, v_descale=vd)


#: (argument, bad value, the name the message must contain); each replaces one argument.
OP_MUTATIONS = [
    ("q", lambda c: c["q"].float(), "q"), ("k", lambda c: c["k"][..., :64], "k"),
    ("v", lambda c: c["v"].to(torch.int8), "v"), ("q", lambda c: c["q"][:, :, :, None], "q"),
    ("q_descale", lambda c: torch.tensor([-1.0]), "q_descale"),
    ("k_descale", lambda c: torch.tensor([float("nan")]), "k_descale"),
    ("v_descale", lambda c: torch.tensor([0.0]), "v_descale"),
    ("v_descale", lambda c: torch.tensor([1e36]), "v_descale"),
    ("q_descale", lambda c: torch.tensor([1e38]), "q_descale"),
    ("k_descale", lambda c: torch.tensor([1.0], dtype=torch.float64), "k_descale"),
    ("q_descale", lambda c: torch.ones(2), "q_descale"),
    ("p_scale", lambda c: torch.tensor([1e38]), "p_scale"), ("p_scale", lambda c: torch.tensor([1e-45]), "p_scale"),
    ("p_scale", lambda c: 2.0, "p_scale"), ("softmax_scale", lambda c: 1e300, "softmax_scale"),
    ("softmax_scale", lambda c: -1.0, "softmax_scale"), ("softmax_scale", lambda c: torch.ones(1), "softmax_scale"),
    ("return_softmax_lse", lambda c: "no", "return_softmax_lse"), ("quant_mode", lambda c: 7.0, "quant_mode"),
    ("quant_mode", lambda c: 2, "quant_mode"), ("mask_mode", lambda c: 3.0, "mask_mode"),
    ("mask_mode", lambda c: 1, "mask_mode"), ("layout", lambda c: "NSD", "layout"),
    ("seqused_kv", lambda c: torch.tensor([9], dtype=torch.int32), "seqused_kv"),
    ("seqused_kv", lambda c: torch.tensor([-1], dtype=torch.int32), "seqused_kv"),
    ("seqused_q", lambda c: torch.tensor([1, 2], dtype=torch.int32), "seqused_q"),
    ("seqused_q", lambda c: torch.tensor([1], dtype=torch.int64), "seqused_q"),
    ("cu_seqlens_q", lambda c: torch.tensor([0, 8], dtype=torch.int32), "cu_seqlens_q"),
    ("max_seqlen_q", lambda c: 3, "max_seqlen_q"), ("win_left", lambda c: 4, "win_left"),
]

#: Mutations of a TND call (cu_seqlens values are where the drop-in used to corrupt memory).
#: (argument, its values, the name the message must contain: a cu_seqlens_q of another length
#: changes B, so the message is about the cu_seqlens_kv that no longer matches it).
TND_MUTATIONS = [
    ("cu_seqlens_kv", [0, 6, 2, 8], "cu_seqlens_kv"), ("cu_seqlens_kv", [0, 2, 4, 9], "cu_seqlens_kv"),
    ("cu_seqlens_kv", [1, 2, 4, 8], "cu_seqlens_kv"), ("cu_seqlens_kv", [0, -2, 4, 8], "cu_seqlens_kv"),
    ("cu_seqlens_q", [0, 5, 3, 8], "cu_seqlens_q"), ("cu_seqlens_q", [0, 2, 4, 7], "cu_seqlens_q"),
    ("cu_seqlens_q", [0, 2, 4], "cu_seqlens_kv"), ("cu_seqlens_kv", [0, 9, -1, 8], "cu_seqlens_kv"),
]


def _op_mutation_params():
    for i, (name, _, _) in enumerate(OP_MUTATIONS):
        yield pytest.param(i, id=f"{i}-{name}")


# Exhaustive over the list (cheap): a sampled subset would leave mutations untried in CI.
@pytest.mark.parametrize("index", list(_op_mutation_params()))
def test_a_bad_op_argument_raises_an_error_naming_it(index):
    name, bad, named = OP_MUTATIONS[index]
    call = _good_op_call()
    call[name] = bad(call)
    state = process_state()
    with pytest.raises((ValueError, TypeError), match=named):
        qfa.quant_flash_attn(**call)
    assert process_state() == state


def _tnd_floats(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 2, D, generator=g).to(dtype) for _ in range(3)]


DROPIN_MUTATIONS = [
    ("q", lambda: torch.randn(1, 2, 8, 64), "q"), ("k", lambda: torch.randn(1, 2, 8, D).double(), "k"),
    ("v", lambda: torch.randint(0, 3, (1, 2, 8, D)), "v"), ("is_causal", lambda: 1, "is_causal"),
    ("return_softmax_lse", lambda: "no", "return_softmax_lse"), ("rotate", lambda: None, "rotate"),
    ("p_scale", lambda: 1e38, "p_scale"), ("p_scale", lambda: "1", "p_scale"),
    ("scales", lambda: (1.0, -1.0, 1.0), "k_scale"), ("scales", lambda: (1.0, 1.0), "scales"),
    ("scales", lambda: (float("nan"), 1.0, 1.0), "q_scale"), ("calibration", lambda: "nope", "calibration"),
    ("softmax_scale", lambda: 0.0, "softmax_scale"), ("layout", lambda: "SBND", "layout"),
    ("seqused_kv", lambda: torch.tensor([20], dtype=torch.int32), "seqused_kv"),
    ("metadata", lambda: object(), "metadata"),
]


@pytest.mark.parametrize("index", range(len(DROPIN_MUTATIONS) + len(TND_MUTATIONS)))
def test_a_bad_dropin_argument_raises_an_error_naming_it(index):
    if index < len(DROPIN_MUTATIONS):
        name, bad, named = DROPIN_MUTATIONS[index]
        g = torch.Generator().manual_seed(1)
        call = dict(zip("qkv", (torch.randn(1, 2, 8, D, generator=g) for _ in range(3))))
        call[name] = bad()
    else:
        name, values, named = TND_MUTATIONS[index - len(DROPIN_MUTATIONS)]
        call = dict(zip("qkv", _tnd_floats()), layout="TND",
                    cu_seqlens_q=torch.tensor([0, 2, 4, 8], dtype=torch.int32),
                    cu_seqlens_kv=torch.tensor([0, 2, 4, 8], dtype=torch.int32))
        call[name] = torch.tensor(values, dtype=torch.int32)
    state = process_state()
    with pytest.raises((ValueError, TypeError), match=named):
        qfa.hif8_attention(**call)
    assert process_state() == state


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_a_calibrated_tensor_is_named(where, bad):
    g = torch.Generator().manual_seed(2)
    call = dict(zip("qkv", (torch.randn(1, 2, 8, D, generator=g) for _ in range(3))))
    call[where][0, 1, 3, 5] = bad
    with pytest.raises(ValueError, match=rf"^{where} contains NaN or Inf"):
        qfa.hif8_attention(**call)


def test_suspicious_inputs_raise_clean_exceptions_in_a_fresh_interpreter():
    """Bad cu_seqlens (decreasing ones that still sum to the total used to abort with "double
    free or corruption"), through the drop-in, its module's observe and the op: each raises a
    Python ValueError/TypeError, and the interpreter lives to report it."""
    script = textwrap.dedent(f"""
        import torch, qfa
        from qfa import HiF8Attention
        mutations = {TND_MUTATIONS!r}
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(8, 2, 128, generator=g) for _ in range(3))
        codes = [torch.randint(0, 100, (8, 2, 128), dtype=torch.uint8, generator=g) for _ in range(3)]
        one = torch.ones(1)
        good = torch.tensor([0, 2, 4, 8], dtype=torch.int32)
        clean = 0
        for name, values, named in mutations:
            lengths = dict(cu_seqlens_q=good, cu_seqlens_kv=good)
            lengths[name] = torch.tensor(values, dtype=torch.int32)
            calls = [lambda: qfa.hif8_attention(q, k, v, layout="TND", is_causal=True, **lengths),
                     lambda: HiF8Attention(layout="TND").observe(q, k, v, **lengths),
                     lambda: qfa.quant_flash_attn(*codes, one, one, one, layout="TND", **lengths)]
            for call in calls:
                try:
                    call()
                except (ValueError, TypeError) as exc:
                    assert named in str(exc), (named, str(exc))
                    clean += 1
        print("clean", clean)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == str(3 * len(TND_MUTATIONS)), done.stdout


# ----------------------------------------------------------------------------- the drop-in

@st.composite
def dropin_cases(draw):
    layout = draw(st.sampled_from(["BNSD", "BSND", "TND"]))
    nkv = draw(st.sampled_from([1, 2]))
    nq = nkv * draw(st.sampled_from([1, 2]))
    batch = draw(st.integers(1, 2))
    cap = MAX_TOKENS // batch
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    kw = {"layout": layout, "is_causal": draw(st.booleans()), "smooth_k": draw(st.booleans()),
          "rotate": draw(st.booleans()), "return_softmax_lse": draw(st.booleans()),
          "calibration": draw(st.sampled_from(["rms", "amax", "mse"]))}
    if layout == "TND":
        q_lens = draw(st.lists(st.integers(1, cap), min_size=batch, max_size=batch))
        kv_lens = draw(st.lists(st.integers(1, cap), min_size=batch, max_size=batch))
        kw["cu_seqlens_q"] = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32)
        kw["cu_seqlens_kv"] = torch.tensor(np.cumsum([0] + kv_lens), dtype=torch.int32)
        shapes = (sum(q_lens), nq, D), (sum(kv_lens), nkv, D)
    else:
        sq, skv = draw(st.integers(1, cap)), draw(st.integers(1, cap))
        q_lens, kv_lens = [sq] * batch, [skv] * batch
        shapes = ((batch, nq, sq, D), (batch, nkv, skv, D)) if layout == "BNSD" else \
            ((batch, sq, nq, D), (batch, skv, nkv, D))
    used_kv = [draw(st.integers(1, n)) for n in kv_lens]
    kw["seqused_kv"] = torch.tensor(used_kv, dtype=torch.int32)
    offset = draw(st.sampled_from([0.0, 3.0]))
    q, k, v = (torch.randn(s, generator=g).to(dtype) for s in (shapes[0], shapes[1], shapes[1]))
    k = (k.float() + offset).to(dtype)  # a K bias, which smoothing removes
    return dict(q=q, k=k, v=v, **kw), kv_lens, used_kv


def _pad_positions(t: torch.Tensor, layout: str, kv_lens, used_kv, value: float) -> torch.Tensor:
    t = t.clone()
    start = 0
    for b, (full, used) in enumerate(zip(kv_lens, used_kv)):
        if layout == "BNSD":
            t[b, :, used:full] = value
        elif layout == "BSND":
            t[b, used:full] = value
        else:
            t[start + used:start + full] = value
        start += full
    return t


@settings(suppress_health_check=SUPPRESSED)
@given(case=dropin_cases(), poison=st.sampled_from([float("nan"), float("inf"), 1e4]))
def test_dropin_padding_has_no_influence_inputs_and_state_unchanged(case, poison):
    """Keys past seqused_kv poisoned (NaN, Inf, or large values that would change a scale):
    the same bits; inputs unmodified; deterministic; process state unchanged."""
    call, kv_lens, used_kv = case
    before = {n: t.clone() for n, t in call.items() if isinstance(t, torch.Tensor)}
    state = process_state(threads=not native_runs())
    clean = qfa.hif8_attention(**call)
    again = qfa.hif8_attention(**call)
    poisoned = dict(call, k=_pad_positions(call["k"], call["layout"], kv_lens, used_kv, poison),
                    v=_pad_positions(call["v"], call["layout"], kv_lens, used_kv, poison))
    dirty = qfa.hif8_attention(**poisoned)
    as_tuple = lambda r: r if isinstance(r, tuple) else (r,)  # noqa: E731
    for a, b, c in zip(as_tuple(clean), as_tuple(again), as_tuple(dirty)):
        assert same_bits(a, b), "not deterministic"
        assert same_bits(a, c), "padding keys changed the result"
    assert all(same_bits(before[n], call[n]) for n in before), "an input was modified"
    assert process_state(threads=not native_runs()) == state


# ----------------------------------------------------------------------------- examples

def test_the_native_kernel_leaves_the_thread_count():
    q, k, v, qd, kd, vd = ref.random_qkv((1, 1, 4, D), (1, 1, 4, D), 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # an earlier native call may have left 1 already
    try:
        qfa.quant_flash_attn(q, k, v, qd, kd, vd)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_dropin_meta_tensors_give_meta_outputs():
    q, k, v = (torch.empty(2, 4, 33, D, device="meta", dtype=torch.float16) for _ in range(3))
    out, lse = qfa.hif8_attention(q, k, v, is_causal=True, return_softmax_lse=True)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype
    assert lse.device.type == "meta" and lse.shape == (2, 4, 33) and lse.dtype == torch.float32
    cu = torch.tensor([0, 33], dtype=torch.int32, device="meta")
    t = torch.empty(33, 4, D, device="meta")
    with pytest.raises(ValueError, match="cu_seqlens_q is on the meta device"):
        qfa.hif8_attention(t, t, t, layout="TND", cu_seqlens_q=cu, cu_seqlens_kv=cu)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_a_row_whose_only_score_is_not_finite_is_nan(path):
    q, k, v, qd, kd, vd = ref.random_qkv((1, 1, 2, D), (1, 1, 1, D), 0)
    q[0, 0, 1, 44] = q[0, 0, 1, 64] = fmt.POS_INF_CODE
    with cpu_path(path):
        out, lse = qfa.quant_flash_attn(q, k, v, qd, kd, vd, return_softmax_lse=True)
    ref_out, ref_lse = ref.reference_attention(q, k, v, qd, kd, vd)
    assert np.isnan(ref_out[0, 0, 1]).all()  # the premise: the exact answer is NaN (a -inf score only)
    assert torch.isnan(out[0, 0, 1]).all()
    assert not torch.isfinite(lse[0, 0, 1]) and lse[0, 0, 1] != float("inf")  # not "saw no key"
    assert torch.isfinite(out[0, 0, 0]).all()


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_dropin_under_a_float64_default_dtype(layout, path):
    g = torch.Generator().manual_seed(3)
    shape = (2, 2, 40, D) if layout == "BNSD" else (40, 2, D)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float32) for _ in range(3))
    kw = {}
    if layout == "TND":
        kw = dict(cu_seqlens_q=torch.tensor([0, 15, 40], dtype=torch.int32),
                  cu_seqlens_kv=torch.tensor([0, 15, 40], dtype=torch.int32))
    with cpu_path(path):
        want = qfa.hif8_attention(q, k, v, layout=layout, is_causal=True, return_softmax_lse=True, **kw)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = qfa.hif8_attention(q, k, v, layout=layout, is_causal=True, return_softmax_lse=True, **kw)
        finally:
            torch.set_default_dtype(old)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


@pytest.mark.parametrize("rotate", [False, True])
def test_dropin_huge_finite_fp16_inputs_do_not_overflow(rotate):
    """fp16 V = 64000 (rms scale 2^16: V/s = 0.977 rounds to 1.0, so the quantised answer is
    65536, past fp16's 65504): the output saturates at 65504 instead of becoming inf."""
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 2, 64, D, generator=g).half() for _ in range(2))
    v = torch.full((1, 2, 64, D), 64000.0, dtype=torch.float16)
    v[:, :, ::2] = -64000.0
    out = qfa.hif8_attention(q, k, v, rotate=rotate)
    assert torch.isfinite(out).all()
    assert out.abs().max() <= 65504
    exact = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    # the exact output fits fp16; the quantised one is within HiF8's error of it (|v| in V's
    # top 3-bit binade: 2^-4 relative per value, and P's own rounding: a few per cent of |v|)
    assert (out.float() - exact).abs().max() <= 0.1 * 64000


def test_static_scales_carry_nan_and_inf_as_codes():
    """With static scales NaN/Inf inputs are quantised to HiF8's codes (no calibration to
    refuse them) and reach exactly the rows that see them."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 16, D, generator=g) for _ in range(3))
    v[0, 0, 5, 0] = float("nan")
    out = qfa.hif8_attention(q, k, v, is_causal=True, rotate=False, smooth_k=False, scales=(0.01, 0.01, 0.01))
    assert torch.isnan(out[0, 0, 5:, 0]).all() and torch.isfinite(out[0, 0, :5]).all()
    assert torch.isfinite(out[0, 0, :, 1:]).all()


def test_scales_that_require_grad_change_nothing_and_poison_nothing():
    """Static scales and p_scale with requires_grad=True (they used to make the softmax step's
    compile fail, switching it to eager for the rest of the process): the bits of plain
    tensors, qfa._compile's records unchanged, and an output whose backward raises."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 40, D, generator=g) for _ in range(3))
    plain = [torch.tensor([0.02]), torch.tensor([0.03]), torch.tensor([0.01])]
    want = qfa.hif8_attention(q, k, v, scales=plain, p_scale=torch.tensor([2.0]), return_softmax_lse=True)
    state = process_state(threads=not native_runs())
    grads = [s.clone().requires_grad_() for s in plain]
    got = qfa.hif8_attention(q, k, v, scales=grads, p_scale=torch.tensor([2.0], requires_grad=True),
                             return_softmax_lse=True)
    assert process_state(threads=not native_runs()) == state
    assert same_bits(got[0].detach(), want[0]) and same_bits(got[1].detach(), want[1])
    # in the graph, as under torch.compile: a backward through it says there is no gradient
    # (it used to leave the scales' gradients out without a word)
    assert got[0].requires_grad and got[1].requires_grad
    with pytest.raises(RuntimeError, match="has no gradient"):
        got[0].sum().backward()


def test_calibrating_on_meta_tensors_is_a_clear_error():
    t = torch.empty(1, 2, 8, D, device="meta")
    attn = qfa.HiF8Attention()
    with pytest.raises(ValueError, match="meta device, but calibration reads their values"):
        with attn.calibrate():
            attn(t, t, t)
    assert not attn.calibrating
    assert attn(t, t, t).device.type == "meta"  # outside calibrate(): meta outputs, as the op
