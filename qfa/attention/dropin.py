"""Drop-in HiF8 attention: float Q/K/V in, per-tensor HiF8 quantisation, ``quant_flash_attn``.

:func:`hif8_attention` is the functional form (scales computed per call, or given);
:class:`HiF8Attention` is the module form with a dynamic mode and a calibrate-then-freeze
static mode whose scales live in buffers (``state_dict``).

K smoothing
-----------
Some models (those with K bias terms, e.g. Qwen2) carry large per-channel offsets in K. One
per-tensor scale is then set by the offset and the informative part of K drowns in HiF8's
coarse binades. With ``smooth_k=True`` the per-head, per-channel mean of K over the valid keys
of each sequence, ``mu``, is subtracted before quantising. For every query row the scores shift
by the constant ``scale * q . mu``, so softmax (the output) is unchanged in exact arithmetic;
the log-sum-exp shifts by the same constant, and :func:`hif8_attention` adds it back (computed
in fp32 from the unquantised ``q``), so the returned LSE is that of the original scores.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from qfa.attention import calibration as cal
from qfa.attention import rotation
from qfa.attention import custom_ops  # noqa: F401  (registers torch.ops.qfa.*)

from qfa.tiling.attention import LAYOUTS, check_shapes  # the op's shape rules live in one place

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: quant_mode of quant_flash_attn for HiF8 per-tensor Q/K/V/P.
QUANT_MODE = 7
#: mask_mode of quant_flash_attn for causal attention aligned bottom-right.
CAUSAL_MASK_MODE = 3


# ----------------------------------------------------------------------------- validation

def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def _check_index(t, name: str, length: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {t.device}")


def _validate(q, k, v, layout, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, scale, p_scale, scales):
    """Static checks (shapes, dtypes, devices): no data-dependent work, so torch.compile traces them."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(t, name)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    check_shapes(q, k, v, layout)  # the op's shape rules, before any work on the float tensors
    if layout == "TND":
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("layout 'TND' needs cu_seqlens_q and cu_seqlens_kv (int32, batch + 1, leading 0)")
        for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_kv, "cu_seqlens_kv")):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] < 2:
                raise ValueError(f"{name} must be a 1-D int32 tensor of length batch + 1 >= 2")
            _check_index(t, name, t.shape[0], q.device)
        if cu_seqlens_kv.shape[0] != cu_seqlens_q.shape[0]:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_kv must have the same length (batch + 1), got "
                f"{cu_seqlens_q.shape[0]} and {cu_seqlens_kv.shape[0]}"
            )
        batch = cu_seqlens_q.shape[0] - 1
    else:
        if cu_seqlens_q is not None or cu_seqlens_kv is not None:
            raise ValueError(f"cu_seqlens_q / cu_seqlens_kv are only for layout 'TND', got layout {layout!r}")
        batch = q.shape[0]
    _check_index(seqused_q, "seqused_q", batch, q.device)
    _check_index(seqused_kv, "seqused_kv", batch, q.device)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be positive and finite, got {scale}")
    if isinstance(p_scale, bool) or (p_scale is not None and not isinstance(p_scale, (int, float, torch.Tensor))):
        raise TypeError(f"p_scale must be None, a float or an fp32 tensor of shape (1,), got {type(p_scale).__name__}")
    if scales is not None:
        if not isinstance(scales, (tuple, list)) or len(scales) != 3:
            raise TypeError("scales must be a tuple (q_scale, k_scale, v_scale); each may be None (computed)")


def _p_scale_tensor(p_scale, device) -> Optional[torch.Tensor]:
    if p_scale is None:
        return None
    if isinstance(p_scale, torch.Tensor):
        if p_scale.dtype != torch.float32 or p_scale.shape != (1,):
            raise ValueError(f"p_scale must be an fp32 tensor of shape (1,), got {p_scale.dtype} {tuple(p_scale.shape)}")
        return p_scale
    return torch.full((1,), float(p_scale), dtype=torch.float32, device=device)


def _scale_tensor(s, name: str, device) -> Optional[torch.Tensor]:
    if s is None:
        return None
    if isinstance(s, torch.Tensor):
        if s.numel() != 1 or not s.is_floating_point():
            raise ValueError(f"{name} must be a float or a floating tensor with one element, got {s.dtype} {tuple(s.shape)}")
        return s.reshape(1).to(device=device, dtype=torch.float32)
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"{name} must be positive and finite, got {s}")
        return torch.full((1,), float(s), dtype=torch.float32, device=device)
    raise TypeError(f"{name} must be None, a float or an fp32 tensor of shape (1,), got {type(s).__name__}")


# ----------------------------------------------------------------------------- smoothing

def _segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index (int64) of each of ``total`` packed tokens."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=total)


def _valid_mask(length: int, seqused: Optional[torch.Tensor], batch: int, device) -> Optional[torch.Tensor]:
    """(B, S) bool mask of positions below ``seqused`` (None: all valid)."""
    if seqused is None:
        return None
    return torch.arange(length, device=device)[None, :] < seqused.long()[:, None]


def _tnd_valid(cu_seqlens: torch.Tensor, seqused: Optional[torch.Tensor], total: int) -> Optional[torch.Tensor]:
    """(T,) bool: packed tokens within their sequence's used length (None: all valid)."""
    if seqused is None:
        return None
    seg = _segment_ids(cu_seqlens, total)
    pos = torch.arange(total, device=cu_seqlens.device) - cu_seqlens.long()[seg]
    return pos < seqused.long()[seg]


def key_means(k: torch.Tensor, layout: str = "BNSD", cu_seqlens_kv=None, seqused_kv=None) -> torch.Tensor:
    """fp32 per-head, per-channel mean of K over the valid keys of each sequence.

    Shape: (B, Nkv, D) for BNSD/BSND, (number of sequences, Nkv, D) for TND. Valid keys are
    those below ``seqused_kv`` when given; sequences without keys get 0.
    """
    kf = k.float()
    if layout == "TND":
        seg = _segment_ids(cu_seqlens_kv, k.shape[0])
        nseq = cu_seqlens_kv.shape[0] - 1
        valid = _tnd_valid(cu_seqlens_kv, seqused_kv, k.shape[0])
        if valid is None:
            counts = (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).float()
        else:
            kf = torch.where(valid[:, None, None], kf, 0.0)
            counts = kf.new_zeros(nseq).index_add_(0, seg, valid.float())
        sums = kf.new_zeros((nseq, *k.shape[1:])).index_add_(0, seg, kf)
        return sums / counts.clamp_min(1)[:, None, None]
    seq_axis = 2 if layout == "BNSD" else 1
    mask = _valid_mask(k.shape[seq_axis], seqused_kv, k.shape[0], k.device)
    if mask is None:
        mu = kf.mean(dim=seq_axis)
    else:
        m = mask[:, None, :, None] if layout == "BNSD" else mask[:, :, None, None]
        counts = mask.sum(dim=1).float().clamp_min(1)[:, None, None]
        mu = torch.where(m, kf, 0.0).sum(dim=seq_axis) / counts
    return mu  # (B, Nkv, D)


def _broadcast_means(mu: torch.Tensor, layout: str, cu_seqlens, total: int) -> torch.Tensor:
    """``mu`` shaped to broadcast against a K (or, per kv head, Q) tensor of ``layout``."""
    if layout == "BNSD":
        return mu[:, :, None, :]
    if layout == "BSND":
        return mu[:, None, :, :]
    return mu[_segment_ids(cu_seqlens, total)]  # (T, Nkv, D)


def _lse_shift(q: torch.Tensor, mu: torch.Tensor, layout: str, cu_seqlens_q, softmax_scale: float) -> torch.Tensor:
    """``softmax_scale * q . mu`` per q head and row, in the LSE's shape, fp32 from the unquantised q."""
    qf = q.float()
    if layout == "BNSD":
        b, nq, s, d = q.shape
        nkv = mu.shape[1]
        shift = torch.einsum("bhgsd,bhd->bhgs", qf.view(b, nkv, nq // nkv, s, d), mu).reshape(b, nq, s)
    elif layout == "BSND":
        b, s, nq, d = q.shape
        nkv = mu.shape[1]
        shift = torch.einsum("bshgd,bhd->bhgs", qf.view(b, s, nkv, nq // nkv, d), mu).reshape(b, nq, s)
    else:
        t, nq, d = q.shape
        nkv = mu.shape[1]
        mu_tok = _broadcast_means(mu, "TND", cu_seqlens_q, t)  # (Tq, Nkv, D)
        shift = torch.einsum("thgd,thd->hgt", qf.view(t, nkv, nq // nkv, d), mu_tok).reshape(nq, t)
    return shift * softmax_scale


def _valid_values(x: torch.Tensor, layout: str, seqused, cu_seqlens=None) -> torch.Tensor:
    """The elements of ``x`` at valid positions (all of them when ``seqused`` is None)."""
    if seqused is None:
        return x
    if layout == "TND":
        return x[_tnd_valid(cu_seqlens, seqused, x.shape[0])]
    seq_axis = 2 if layout == "BNSD" else 1
    mask = _valid_mask(x.shape[seq_axis], seqused, x.shape[0], x.device)
    m = mask[:, None, :, None] if layout == "BNSD" else mask[:, :, None, None]
    return x.masked_select(m.expand(x.shape))


# ----------------------------------------------------------------------------- the computation

def prepare(q, k, v, *, layout="BNSD", cu_seqlens_kv=None, seqused_kv=None, smooth_k=True, rotate=False):
    """The tensors ``quant_flash_attn`` would get, before encoding: (q, k_smoothed, v), key means, rule.

    Returns ``(tensors, mu)`` where ``tensors`` are the float tensors to quantise (K smoothed
    in fp32 when ``smooth_k``; the inputs themselves otherwise, never modified) and ``mu`` the
    key means (None without smoothing). Used by :class:`HiF8Attention` to observe exactly what
    gets quantised.
    """
    mu = None
    k_in = k
    if smooth_k:
        mu = key_means(k, layout, cu_seqlens_kv, seqused_kv)
        k_in = k.float() - _broadcast_means(mu, layout, cu_seqlens_kv, k.shape[0])
    if rotate:
        return (rotation.rotate(q), rotation.rotate(k_in), rotation.rotate(v)), mu
    return (q, k_in, v), mu


def _compute_scales(tensors, layout, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, calibration, scales):
    rule = cal.get_rule(calibration)
    out = []
    valid = ((seqused_q, cu_seqlens_q), (seqused_kv, cu_seqlens_kv), (seqused_kv, cu_seqlens_kv))
    for t, s, (used, cu), name in zip(tensors, scales, valid, ("q", "k", "v")):
        if s is None:
            s = cal.check_scale(rule(_valid_values(t, layout, used, cu)), f"{name} scale from calibration rule")
        else:
            s = cal.check_scale(s, f"{name}_scale", t.device)
        out.append(s)
    return out


def hif8_attention_eager(q, k, v, q_scale, k_scale, v_scale, p_scale, cu_seqlens_q, cu_seqlens_kv,
                         seqused_q, seqused_kv, is_causal, scale, layout, calibration, smooth_k, return_lse,
                         backend, rotate=False):
    """The computation behind :func:`hif8_attention` (arguments already validated; tensors for scales)."""
    from qfa.attention.op import quant_flash_attn

    tensors, mu = prepare(q, k, v, layout=layout, cu_seqlens_kv=cu_seqlens_kv, seqused_kv=seqused_kv,
                          smooth_k=smooth_k, rotate=rotate)
    qs, ks, vs = _compute_scales(tensors, layout, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, calibration,
                                 (q_scale, k_scale, v_scale))
    codes = [cal.quantize(t, s) for t, s in zip(tensors, (qs, ks, vs))]
    del tensors
    softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, lse = quant_flash_attn(
        *codes, qs, ks, vs, QUANT_MODE, p_scale=p_scale, layout=layout, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q, seqused_kv=seqused_kv,
        mask_mode=CAUSAL_MASK_MODE if is_causal else 0, softmax_scale=softmax_scale,
        return_softmax_lse=bool(return_lse), backend=backend,
    )
    out = (rotation.rotate(out) if rotate else out).to(q.dtype)  # H is its own inverse
    if not return_lse:
        return out, q.new_empty((0,), dtype=torch.float32)
    if mu is not None:
        shift = _lse_shift(q, mu, layout, cu_seqlens_q, softmax_scale)
        lse = torch.where(torch.isinf(lse), lse, lse + shift)  # rows that see no key keep +inf
    return out, lse


def hif8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                   scale: Optional[float] = None, layout: str = "BNSD", cu_seqlens_q: Optional[torch.Tensor] = None,
                   cu_seqlens_kv: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None,
                   seqused_kv: Optional[torch.Tensor] = None, calibration: cal.RuleLike | None = None,
                   smooth_k: bool = True, p_scale=None, scales: Optional[Sequence] = None,
                   return_lse: bool = False, backend: Optional[str] = None, rotate: bool = True):
    """Attention on fp16/bf16/fp32 tensors through HiF8 per-tensor quantisation (quant_mode 7).

    Like ``torch.nn.functional.scaled_dot_product_attention`` without a dropout or an explicit
    mask: each of ``q``, ``k`` (after smoothing) and ``v`` is quantised to HiF8 with one fp32
    scale, :func:`qfa.attention.op.quant_flash_attn` runs on the codes, and the output comes back
    in ``q``'s dtype (the op produces bf16, so an fp32 caller gets bf16 precision).

    Args:
        q, k, v: same float dtype; layout ``"BNSD"`` (B, N, S, D), ``"BSND"`` (B, S, N, D) or
            ``"TND"`` (T, N, D, packed sequences with ``cu_seqlens_q/kv``). D must be 128. GQA:
            the number of q heads is a multiple of the number of k/v heads (k, v not repeated).
        is_causal: causal mask aligned **bottom-right** (key j is hidden from query i iff
            j > i + Skv - Sq, per sequence). With Sq == Skv this is ordinary causal prefill;
            with Sq < Skv it is what a KV cache needs: continuing a prefill with new tokens, or
            decoding one token (Sq = 1 sees every cached key). Note that SDPA's ``is_causal``
            is aligned top-left instead; they agree only when Sq == Skv.
        scale: softmax scale; None means 1/sqrt(D).
        cu_seqlens_q, cu_seqlens_kv: TND only, int32 (B + 1,), cumulative with a leading 0.
        seqused_q, seqused_kv: optional int32 (B,) used lengths per sequence, any layout: the
            tokens past them (padding at the end of each sequence) take no part in attention,
            the per-tensor scales or the K means.
        calibration: scale rule name (see :mod:`qfa.attention.calibration`; default
            :data:`~qfa.attention.calibration.DEFAULT_RULE`) or a callable tensor -> fp32 (1,).
        smooth_k: subtract the per-head, per-channel mean of K over the keys before quantising
            (exact for softmax; see the module docstring). Strongly recommended for models with
            K bias terms.
        p_scale: float or fp32 (1,) tensor, where P lands on the HiF8 grid (None: 1.0, best
            for HiF8).
        scales: optional ``(q_scale, k_scale, v_scale)`` static scales (floats or fp32 (1,)
            tensors; None entries are computed by ``calibration``). With ``smooth_k`` the K scale
            applies to the smoothed K.
        rotate: rotate the head dimension of q, k and v by a normalised Hadamard matrix before
            quantising and rotate the output back (exact in real arithmetic, see
            :mod:`qfa.attention.rotation`): it spreads outlier channels, so per-tensor scales
            fit HiF8's 3-bit binades better, at the cost of four 128 x 128 matmuls per token.
            On by default: on Qwen2.5-Coder-1.5B it halved the KL to bf16 attention and put
            perplexity within 0.6 % of bf16 on every text measured (see the README).
        return_lse: also return the natural-log LSE of the (unsmoothed) scores, fp32, (B, Nq, Sq)
            or (Nq, Tq) for TND; rows that see no key get +inf.
        backend: ``"torch"`` / ``"triton"`` / None (by device, or ``$QFA_BACKEND``).

    Returns:
        ``out`` in ``q``'s layout, shape and dtype, or ``(out, lse)`` with ``return_lse=True``.

    Works inside ``torch.compile(fullgraph=True)`` with a named calibration rule: the whole
    computation is then the custom op ``torch.ops.qfa.hif8_attention``.
    """
    _validate(q, k, v, layout, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, scale, p_scale, scales)
    for flag, name in ((smooth_k, "smooth_k"), (rotate, "rotate")):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if calibration is None:
        calibration = cal.DEFAULT_RULE
    if isinstance(calibration, str):
        cal.get_rule(calibration)  # ValueError for an unknown name, before any work
    elif not callable(calibration):
        raise TypeError(f"calibration must be a rule name (str) or a callable, got {type(calibration).__name__}")
    scales = tuple(scales) if scales is not None else (None, None, None)
    q_scale, k_scale, v_scale = (_scale_tensor(s, n, q.device) for s, n in zip(scales, ("q_scale", "k_scale", "v_scale")))
    p = _p_scale_tensor(p_scale, q.device)
    args = (q, k, v, q_scale, k_scale, v_scale, p, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv,
            is_causal, None if scale is None else float(scale), layout)
    if torch.compiler.is_compiling():
        if not isinstance(calibration, str):
            raise TypeError(
                "calibration must be a registered rule name under torch.compile (a callable cannot cross the "
                "custom op); register it with qfa.attention.calibration.register_rule(name, fn)"
            )
        out, lse = torch.ops.qfa.hif8_attention(*args, calibration, smooth_k, return_lse, backend, rotate)
    else:
        out, lse = hif8_attention_eager(*args, calibration, smooth_k, return_lse, backend, rotate)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- module

class HiF8Attention(nn.Module):
    """:func:`hif8_attention` as a module, with dynamic or static (calibrated, frozen) scales.

    Dynamic mode (default): scales are computed on every call by ``calibration``.

    Static mode: observe representative batches, then freeze one scale per tensor into the
    buffers ``q_scale``, ``k_scale``, ``v_scale`` (fp32, shape (1,)); they travel with
    ``state_dict`` and a module that loads finite scales is frozen::

        attn = HiF8Attention(is_causal=True)
        with attn.calibrate():          # forward still computes attention (dynamic scales)...
            for q, k, v in samples:     # ...and records what it quantises
                attn(q, k, v)
        # leaving the block froze the scales (calibrate(freeze=False) leaves that to you)
        torch.save(attn.state_dict(), "attn.pt")

        served = HiF8Attention(is_causal=True)
        served.load_state_dict(torch.load("attn.pt"))   # now static: served.frozen is True

    :meth:`observe` records a batch without computing attention; :meth:`freeze` turns the
    observations into scales; :meth:`unfreeze` returns to dynamic mode. Static scales apply to
    the K that was observed, i.e. the smoothed K when ``smooth_k`` (keep the setting). Values
    outside a frozen scale's range saturate to HiF8's MAX.

    ``HiF8Attention(static=True)`` demands scales: calling it before they are frozen or loaded
    raises ``ValueError``.
    """

    def __init__(self, *, is_causal: bool = False, scale: Optional[float] = None, layout: str = "BNSD",
                 calibration: cal.RuleLike | None = None, smooth_k: bool = True, p_scale=None,
                 backend: Optional[str] = None, static: bool = False, rotate: bool = True):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        cal.get_rule(calibration)  # validates the name
        self.calibration = cal.DEFAULT_RULE if calibration is None else calibration
        self.is_causal, self.scale, self.layout = bool(is_causal), scale, layout
        self.smooth_k, self.p_scale, self.backend = bool(smooth_k), p_scale, backend
        self.static, self.rotate = bool(static), bool(rotate)
        for name in ("q_scale", "k_scale", "v_scale"):
            self.register_buffer(name, torch.full((1,), math.nan, dtype=torch.float32))
        self._has_scales = False
        self._observers: Optional[tuple[cal.ScaleObserver, ...]] = None
        self.register_load_state_dict_post_hook(_after_load)

    # -- state
    @property
    def frozen(self) -> bool:
        """True when forward uses the stored static scales."""
        return self.static and self._has_scales

    @property
    def calibrating(self) -> bool:
        return self._observers is not None

    def extra_repr(self) -> str:
        mode = "static" if self.static else "dynamic"
        return (f"layout={self.layout!r}, is_causal={self.is_causal}, calibration={self.calibration!r}, "
                f"smooth_k={self.smooth_k}, rotate={self.rotate}, mode={mode}")

    def start_calibration(self) -> None:
        """Begin (or restart) recording batches for :meth:`freeze`."""
        self._observers = tuple(cal.ScaleObserver(self.calibration) for _ in range(3))

    def observe(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_kv=None, seqused_q=None, seqused_kv=None) -> None:
        """Record one batch's statistics (what would be quantised) without computing attention."""
        _validate(q, k, v, self.layout, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, self.scale, None, None)
        if self._observers is None:
            self.start_calibration()
        tensors, _ = prepare(q, k, v, layout=self.layout, cu_seqlens_kv=cu_seqlens_kv, seqused_kv=seqused_kv,
                             smooth_k=self.smooth_k, rotate=self.rotate)
        valid = ((seqused_q, cu_seqlens_q), (seqused_kv, cu_seqlens_kv), (seqused_kv, cu_seqlens_kv))
        for obs, t, (used, cu), name in zip(self._observers, tensors, valid, "qkv"):
            obs.observe(_valid_values(t, self.layout, used, cu), name)

    def freeze(self) -> "HiF8Attention":
        """Turn the observed batches into static scales (buffers) and switch to static mode."""
        if self._observers is None or self._observers[0].batches == 0:
            raise ValueError("freeze() needs observed batches: call observe() or run forward inside calibrate() first")
        scales = [obs.scale() for obs in self._observers]
        with torch.no_grad():
            for buf, s in zip((self.q_scale, self.k_scale, self.v_scale), scales):
                buf.copy_(s.to(buf.device))
        self._observers = None
        self._has_scales = True
        self.static = True
        return self

    def unfreeze(self) -> "HiF8Attention":
        """Back to dynamic scales (the stored buffers are kept but unused)."""
        self.static = False
        return self

    @contextlib.contextmanager
    def calibrate(self, freeze: bool = True) -> Iterator["HiF8Attention"]:
        """Record every forward's batch inside the block; freeze on a normal exit when ``freeze``."""
        self.start_calibration()
        try:
            yield self
        except BaseException:
            self._observers = None
            raise
        if freeze:
            self.freeze()

    def set_scales(self, q_scale, k_scale, v_scale) -> "HiF8Attention":
        """Set static scales by hand (positive floats or fp32 (1,) tensors) and switch to static mode."""
        with torch.no_grad():
            for buf, s, n in zip((self.q_scale, self.k_scale, self.v_scale), (q_scale, k_scale, v_scale),
                                 ("q_scale", "k_scale", "v_scale")):
                buf.copy_(cal.check_scale(s, n).to(buf.device))
        self._has_scales = True
        self.static = True
        return self

    # -- compute
    def forward(self, q, k, v, *, is_causal: Optional[bool] = None, cu_seqlens_q=None, cu_seqlens_kv=None,
                seqused_q=None, seqused_kv=None, return_lse: bool = False):
        if self.calibrating:
            self.observe(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                         seqused_q=seqused_q, seqused_kv=seqused_kv)
        scales = None
        if self.static:
            if not self._has_scales:
                raise ValueError(
                    "this HiF8Attention is static but has no scales: calibrate and freeze() it, set_scales(), "
                    "or load a state_dict with frozen scales"
                )
            scales = (self.q_scale, self.k_scale, self.v_scale)
        return hif8_attention(
            q, k, v, is_causal=self.is_causal if is_causal is None else is_causal, scale=self.scale,
            layout=self.layout, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q,
            seqused_kv=seqused_kv, calibration=self.calibration, smooth_k=self.smooth_k, p_scale=self.p_scale,
            scales=scales, return_lse=return_lse, backend=self.backend, rotate=self.rotate,
        )


def _after_load(module: HiF8Attention, incompatible_keys) -> None:
    """A loaded state_dict with finite scales freezes the module (static serving)."""
    bufs = (module.q_scale, module.k_scale, module.v_scale)
    finite = all(bool(torch.isfinite(b).all()) and bool((b > 0).all()) for b in bufs)
    module._has_scales = finite
    if finite:
        module.static = True
