"""Errors in the caller's words: every public entry point, given bad input, raises an error that
names an argument of *that* entry point, and no name internal to qfa that it does not take.

The names come from ``inspect.signature``: an entry point's own parameters (with the
deprecated spellings it accepts, and for ``mxfp8_attention`` / ``fp8_attention`` the
``hif8_attention`` options their ``**options`` are documented to be). The foreign names are the
op's parameters (``quant_flash_attn``'s and ``quant_flash_attn_metadata``'s) and a calibration
rule's (``x``) that the entry point does not have: a drop-in or a cache builds those itself,
so its caller never passed them. A case may also name what must be said (``must``) or avoided
(``avoid``): a deprecated alias is reported as the caller spelled it.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import qfa
from qfa.dropin import calibration as cal
from qfa.dropin.function import DEPRECATED_NAMES
from qfa.serving import PagedHiF8Cache

D = 128


def params(*fns: Callable) -> set[str]:
    """The parameter names of ``fns`` (self and ``*args`` / ``**kwargs`` holders excluded)."""
    names: set[str] = set()
    for fn in fns:
        for p in inspect.signature(fn).parameters.values():
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                names.add(p.name)
    return names


#: Names internal to qfa: the op's parameters and a calibration rule's.
INTERNAL = params(qfa.quant_flash_attn, qfa.quant_flash_attn_metadata, cal.rms_scale)
#: What ``**options`` / ``**deprecated`` of the drop-in stand for.
DROPIN = params(qfa.hif8_attention) | set(DEPRECATED_NAMES)


def words(message: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message))


@dataclass
class Case:
    name: str
    call: Callable[[], object]
    entry: set[str]              # the entry point's argument names
    exc: type = ValueError
    must: set[str] = field(default_factory=set)
    avoid: set[str] = field(default_factory=set)


def qkv(b=1, n=2, s=16, dtype=torch.bfloat16, nan=None):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, D, generator=g).to(dtype) for _ in range(3))
    if nan is not None:
        {"q": q, "k": k, "v": v}[nan][0, 0, 0, 0] = math.nan
    return q, k, v


def tokens(n: int, nan: bool = False) -> torch.Tensor:
    x = torch.randn(n, 2, D, generator=torch.Generator().manual_seed(n))
    if nan:
        x[0, 0, 0] = math.nan
    return x


def paged(appended: int = 0) -> PagedHiF8Cache:
    cache = PagedHiF8Cache(1, 4, 16, 2)
    cache.add_sequence("a")
    if appended:
        cache.append("a", 0, tokens(appended), tokens(appended))
    return cache


def _compat():
    import qfa.compat.cann_ops_transformer as compat

    return compat


def _meta_scales():
    return tuple(torch.ones(1, device="meta") for _ in range(3))


def _warned(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn(*args, **kwargs)


def _cases() -> list[Case]:
    H, M = qfa.hif8_attention, qfa.HiF8Attention
    module = params(M) | params(M.forward) | set(DEPRECATED_NAMES)
    codes = cal.quantize(torch.randn(1, 2, 16, D), 0.1)
    one = torch.ones(1)
    cases = [
        # the cast
        Case("encode: not a tensor", lambda: qfa.encode_to_hifloat8([1.0]), params(qfa.encode_to_hifloat8), TypeError),
        Case("encode: overflow", lambda: qfa.encode_to_hifloat8(torch.ones(4), overflow="wrap"),
             params(qfa.encode_to_hifloat8), must={"overflow"}),
        Case("decode: float codes", lambda: qfa.decode_from_hifloat8(torch.ones(4)), params(qfa.decode_from_hifloat8),
             TypeError),
        Case("decode: dtype", lambda: qfa.decode_from_hifloat8(torch.zeros(4, dtype=torch.uint8), torch.int32),
             params(qfa.decode_from_hifloat8), (TypeError, ValueError)),
        # the op
        Case("op: negative descale", lambda: qfa.quant_flash_attn(codes, codes, codes, -one, one, one, 0),
             params(qfa.quant_flash_attn), must={"q_descale"}),
        Case("op: layout", lambda: qfa.quant_flash_attn(codes, codes, codes, one, one, one, 0, layout="SBND"),
             params(qfa.quant_flash_attn)),
        Case("compat: negative descale", lambda: _compat().quant_flash_attn(codes, codes, codes, -one, one, one, 0,
                                                                           layout_q="BNSD", layout_kv="BNSD",
                                                                           layout_out="BNSD"),
             params(_compat().quant_flash_attn), must={"q_descale"}),
        Case("compat: layout_kv", lambda: _compat().quant_flash_attn(codes, codes, codes, one, one, one, 0,
                                                                    layout_kv="SBND"),
             params(_compat().quant_flash_attn), must={"layout_kv"}),
        Case("metadata: heads", lambda: qfa.quant_flash_attn_metadata(3, 2), params(qfa.quant_flash_attn_metadata)),
        # calibration
        Case("compute_scale: NaN", lambda: cal.compute_scale(tokens(2, nan=True)), params(cal.compute_scale),
             must={"x"}),
        # the drop-in
        Case("drop-in: NaN k", lambda: H(*qkv(nan="k")), DROPIN, must={"k"}),
        Case("drop-in: v_scale too large", lambda: H(*qkv(), scales=(1.0, 1.0, 1e38)), DROPIN,
             must={"scales"}, avoid={"v_descale"}),
        Case("drop-in: scores overflow", lambda: H(*qkv(), scales=(1e20, 1e20, 1.0)), DROPIN,
             must={"softmax_scale", "scales"}),
        Case("drop-in: v's computed scale past the op's range", lambda: H(qkv()[0], qkv()[1], qkv()[2] * 1e36),
             DROPIN, must={"v"}, avoid={"v_descale"}),
        Case("drop-in: scale= alias", lambda: _warned(H, *qkv(), scale=-1.0), DROPIN, must={"scale"},
             avoid={"softmax_scale"}),
        Case("drop-in: scale= alias past the op's range", lambda: _warned(H, *qkv(), scale=1e30, scales=(1e3, 1e3, 1.0)),
             DROPIN, must={"scale"}, avoid={"softmax_scale"}),
        Case("drop-in: return_lse= alias", lambda: _warned(H, *qkv(), return_lse=3), DROPIN, TypeError,
             must={"return_lse"}, avoid={"return_softmax_lse"}),
        Case("drop-in: meta static scale", lambda: H(*qkv(), scales=_meta_scales()), DROPIN, must={"scales"}),
        Case("drop-in: negative static scale", lambda: H(*qkv(), scales=(1.0, torch.tensor([-1.0]), 1.0)), DROPIN,
             must={"scales"}),
        Case("drop-in: p_scale", lambda: H(*qkv(), p_scale=1e9), DROPIN, must={"p_scale"}),
        Case("mxfp8: scales", lambda: qfa.mxfp8_attention(*qkv(), scales=(1.0, 1.0, 1.0)), DROPIN | params(qfa.mxfp8_attention),
             must={"scales"}),
        Case("fp8: softmax_scale", lambda: qfa.fp8_attention(*qkv(), softmax_scale=-2.0), DROPIN | params(qfa.fp8_attention),
             must={"softmax_scale"}),
        Case("fp8: p_scale", lambda: qfa.fp8_attention(*qkv(), p_scale=1e9), DROPIN | params(qfa.fp8_attention),
             must={"p_scale"}),
        # the module
        Case("module: scales=", lambda: M(scales=(1.0, -1.0, 1.0)), module, must={"scales"}),
        Case("module: meta scales=", lambda: M(scales=_meta_scales()), module, must={"scales"}),
        Case("module: set_scales on meta", lambda: M().set_scales(*_meta_scales()), params(M.set_scales),
             must={"q_scale"}),
        Case("module: scale= alias", lambda: _warned(M, scale=-1.0), module, must={"scale"}, avoid={"softmax_scale"}),
        Case("module: return_lse= alias", lambda: _warned(M(), *qkv(), return_lse=2), module, TypeError,
             must={"return_lse"}, avoid={"return_softmax_lse"}),
        Case("module: NaN k", lambda: M()(*qkv(nan="k")), module, must={"k"}),
        Case("module: frozen scales past the op's range", lambda: M(scales=(1e20, 1e20, 1.0))(*qkv()), module,
             must={"scales"}),
        Case("module: observe meta", lambda: M().observe(*(t.to("meta") for t in qkv())), params(M.observe)),
        # the paged cache
        Case("paged: block_size", lambda: PagedHiF8Cache(1, 4, 24, 2), params(PagedHiF8Cache), must={"block_size"}),
        Case("paged: meta scales=", lambda: PagedHiF8Cache(1, 4, 16, 2, scales=[_meta_scales()[:2]]),
             params(PagedHiF8Cache), must={"scales"}),
        Case("paged: append NaN k", lambda: paged().append("a", 0, tokens(3, nan=True), tokens(3)),
             params(PagedHiF8Cache.append), must={"k"}),
        Case("paged: append NaN v", lambda: paged().append("a", 0, tokens(3), tokens(3, nan=True)),
             params(PagedHiF8Cache.append), must={"v"}),
        Case("paged: append unknown", lambda: paged().append("b", 0, tokens(3), tokens(3)),
             params(PagedHiF8Cache.append), must={"seq_id"}),
        Case("paged: out of blocks", lambda: paged().append("a", 0, tokens(65), tokens(65)),
             params(PagedHiF8Cache.append), must={"seq_id"}),
        Case("paged: add twice", lambda: paged().add_sequence("a"), params(PagedHiF8Cache.add_sequence)),
        Case("paged: free unknown", lambda: paged().free("b"), params(PagedHiF8Cache.free)),
        Case("paged: unhashable", lambda: paged().free(["a"]), params(PagedHiF8Cache.free), TypeError),
        Case("paged: attend batch", lambda: paged(5).attend(0, torch.randn(1, 4, 1, D), ["a", "a"], layout_q="BNSD"),
             params(PagedHiF8Cache.attend), must={"seq_ids"}),
        Case("paged: attend TND batch", lambda: paged(5).attend(0, torch.randn(2, 4, D), ["a", "a"],
                                                               cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)),
             params(PagedHiF8Cache.attend), must={"seq_ids", "cu_seqlens_q"}),
        Case("paged: attend NaN q", lambda: paged(5).attend(0, torch.full((1, 4, D), math.nan), ["a"],
                                                           cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32)),
             params(PagedHiF8Cache.attend), must={"q"}),
        Case("paged: attend unknown", lambda: paged(5).attend(0, torch.randn(1, 4, 1, D), ["b"], layout_q="BNSD"),
             params(PagedHiF8Cache.attend), must={"seq_ids"}),
        Case("paged: attend scores overflow", lambda: paged(5).attend(0, torch.randn(1, 4, 1, D), ["a"], layout_q="BNSD",
                                                                     q_descale=1e20, softmax_scale=1e20),
             params(PagedHiF8Cache.attend), must={"softmax_scale", "layer"}),
        Case("paged: attend causal", lambda: paged(5).attend(0, torch.randn(1, 4, 1, D), ["a"], layout_q="BNSD",
                                                            causal=1), params(PagedHiF8Cache.attend), TypeError),
        Case("paged: attend no scales", lambda: paged().attend(0, torch.randn(1, 4, 1, D), ["a"], layout_q="BNSD"),
             params(PagedHiF8Cache.attend), must={"layer"}),
        Case("paged: codes without descale", lambda: paged(5).quantize_q(torch.zeros(1, 4, D, dtype=torch.uint8)),
             params(PagedHiF8Cache.quantize_q), must={"q_descale"}),
    ]
    return cases + _hf_cases()


def _hf_cases() -> list[Case]:
    try:
        from qfa.serving.attention import cached_attention
        from qfa.serving.hif8_cache import HiF8Cache
    except ImportError:  # transformers is optional
        return []
    cache_path = params(HiF8Cache.update) | params(cached_attention)

    def queued(nan_k: bool = False) -> HiF8Cache:
        cache = HiF8Cache()
        k, v = qkv(s=4)[1:]
        if nan_k:
            k[0, 0, 0, 0] = math.nan
        cache.update(k, v, 0)
        return cache

    def nan_query():
        q = qkv(b=1, n=4, s=4)[0]
        q[0, 0, 0, 0] = math.nan
        return q

    q4 = qkv(b=1, n=4, s=4)[0]
    return [
        Case("HiF8Cache: scales=", lambda: HiF8Cache(scales=[(1.0, -1.0, 1.0)]), params(HiF8Cache), must={"scales"}),
        Case("HiF8Cache: meta scales=", lambda: HiF8Cache(scales=[_meta_scales()]), params(HiF8Cache),
             must={"scales"}),
        Case("HiF8Cache: update shapes", lambda: HiF8Cache().update(qkv(s=4)[1], qkv(s=5)[2], 0),
             params(HiF8Cache.update), must={"value_states"}),
        Case("HiF8Cache: update layer_idx", lambda: HiF8Cache().update(*qkv(s=4)[1:], -1), params(HiF8Cache.update),
             must={"layer_idx"}),
        Case("HiF8Cache: update dtype", lambda: HiF8Cache().update(qkv(s=4)[1].int(), qkv(s=4)[2], 0),
             params(HiF8Cache.update), TypeError, must={"key_states"}),
        Case("cached_attention: NaN prefill keys", lambda: cached_attention(None, q4, queued(nan_k=True), 0),
             cache_path, must={"key_states"}),
        Case("cached_attention: NaN query", lambda: cached_attention(None, nan_query(), queued(), 0),
             params(cached_attention), must={"query"}),
        Case("cached_attention: p_scale", lambda: cached_attention(None, q4, queued(), 0, p_scale=1e9),
             params(cached_attention), must={"p_scale"}),
        Case("cached_attention: scores overflow", lambda: cached_attention(None, q4, queued(), 0, softmax_scale=1e35),
             params(cached_attention), must={"softmax_scale"}),
        Case("cached_attention: layer without tokens",
             lambda: cached_attention(None, q4, HiF8Cache(config=_config()), 0), params(cached_attention),
             must={"layer_idx"}),
        Case("cached_attention: batch", lambda: cached_attention(None, qkv(b=2, n=4, s=4)[0], queued(), 0),
             params(cached_attention), must={"query"}),
        Case("cached_attention: backend", lambda: cached_attention(None, q4, queued(), 0, backend="nope"),
             params(cached_attention), must={"backend"}),
    ]


def _config():
    from transformers import Qwen2Config

    return Qwen2Config(num_hidden_layers=1, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64, vocab_size=64)


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[(c.values[0] if hasattr(c, "values") else c).name for c in CASES])
def test_the_error_names_an_argument_of_the_entry_point(case):
    with pytest.raises(case.exc) as info:
        case.call()
    said = words(str(info.value))
    foreign = (INTERNAL - case.entry) | case.avoid
    assert said & case.entry, f"names none of {sorted(case.entry)}: {info.value}"
    assert case.must <= said, f"does not name {sorted(case.must - said)}: {info.value}"
    assert not said & foreign, f"names {sorted(said & foreign)}, which the caller never passed: {info.value}"


def test_the_names_come_from_the_signatures():
    """The sets the cases check against are the entry points' own (a renamed parameter shows here)."""
    assert {"q", "k", "v", "scales", "softmax_scale", "return_softmax_lse"} <= DROPIN
    assert {"q_descale", "k_descale", "v_descale", "seqused_kv", "block_table", "layout_out", "x"} <= INTERNAL
    assert {"seq_ids", "q_descale", "layer"} <= params(PagedHiF8Cache.attend)
    assert not {"k_descale", "v_descale", "seqused_kv", "block_table"} & params(PagedHiF8Cache.attend)
