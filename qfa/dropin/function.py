"""``hif8_attention``: attention on float Q/K/V through HiF8 per-tensor quantisation, or, with
``format=``, through MXFP8 or FP8 E4M3 per-token-head (:mod:`qfa.dropin.scaled`);
``mxfp8_attention`` and ``fp8_attention`` are the same function with the format set.

The public function checks its arguments (:mod:`qfa.dropin.inputs`), gathers them
into one :class:`~qfa.dropin.call.DropinCall`, and runs it: directly
(:func:`qfa.dropin.eager.run`) in eager mode, or as the custom op
``torch.ops.qfa.hif8_attention`` (:mod:`qfa.dropin.custom_op`) while ``torch.compile`` traces
it. K smoothing and the rotation are described in :mod:`qfa.dropin.smoothing` and
:mod:`qfa.dropin.rotation`; the module form is :class:`qfa.dropin.module.HiF8Attention`.
Tensor parallel (``process_group=``, heads sharded across ranks) is :mod:`qfa.dropin.distributed`.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Union

import torch

from qfa.dropin import calibration as cal
from qfa.dropin import distributed, eager as dropin_eager, inputs as dropin_inputs
from qfa.dropin import custom_op as dropin_op  # noqa: F401  (registers torch.ops.qfa.hif8_attention)
from qfa.dropin.call import DropinCall as _D
from qfa.attention.op import Metadata
from qfa.tiling.checks import check_bool

#: Deprecated keyword spellings and the names that replace them (upstream's).
DEPRECATED_NAMES = {"scale": "softmax_scale", "return_lse": "return_softmax_lse"}


def take_deprecated(deprecated: dict, given: dict, function: str, stacklevel: int = 3) -> dict:
    """``given`` (new name -> value, as passed) updated with the deprecated spellings in
    ``deprecated``: each warns (DeprecationWarning naming the new name). Passing an old name
    with its new one set to anything but its default is a TypeError (the default cannot be told
    from not passing it), and so is any other unknown keyword."""
    for old, value in deprecated.items():
        new = DEPRECATED_NAMES.get(old)
        if new is None or new not in given:
            raise TypeError(f"{function}() got an unexpected keyword argument {old!r}")
        if given[new] is not getattr(_D, new):  # the defaults (None, False) are singletons
            raise TypeError(f"{function}() got both {new}= and its deprecated alias {old}=; pass only {new}=")
        warnings.warn(f"{function}({old}=...) is deprecated; use {new}=", DeprecationWarning, stacklevel=stacklevel)
        given[new] = value
    return given


@torch.compiler.disable
def _run_sharded(call: _D, metadata: Optional[Metadata],
                 process_group: distributed.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dropin_eager.run` with a process group, never traced: when ``torch.compile``
    (without ``fullgraph``) breaks the graph at the refusal below and runs the call eagerly,
    this keeps dynamo from tracing the collectives."""
    return dropin_eager.run(call, metadata=metadata, process_group=process_group)


def hif8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = _D.is_causal,
    softmax_scale: Optional[float] = _D.softmax_scale, layout: str = _D.layout,
    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_kv: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None, seqused_kv: Optional[torch.Tensor] = None,
    calibration: cal.RuleLike | None = _D.calibration, smooth_k: bool = _D.smooth_k,
    p_scale: Union[float, torch.Tensor, None] = None, scales: Optional[Sequence] = None,
    return_softmax_lse: bool = _D.return_softmax_lse, backend: Optional[str] = _D.backend,
    rotate: bool = _D.rotate, metadata: Optional[Metadata] = None,
    process_group: Optional[distributed.ProcessGroup] = None, format: str = _D.format, **deprecated,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention on fp16/bf16/fp32 tensors through HiF8 per-tensor quantisation (quant_mode 0),
    or MXFP8 (quant_mode 1) / FP8 E4M3 per-token-head (quant_mode 6) with ``format=``.

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
        softmax_scale: the scores' scale; None means 1/sqrt(D). (``scale=`` is a deprecated alias.)
        cu_seqlens_q, cu_seqlens_kv: TND only, int32 (B + 1,), cumulative with a leading 0.
        seqused_q, seqused_kv: optional int32 (B,) used lengths per sequence, any layout: the
            tokens past them (padding at the end of each sequence) take no part in attention,
            the per-tensor scales or the K means.
        calibration: scale rule name (see :mod:`qfa.dropin.calibration`; default
            :data:`~qfa.dropin.calibration.DEFAULT_RULE`) or a callable tensor -> fp32 (1,).
        smooth_k: subtract the per-head, per-channel mean of K over the keys before quantising
            (exact for softmax; see :mod:`qfa.dropin.smoothing`). Strongly recommended for
            models with K bias terms.
        p_scale: float or fp32 (1,) tensor, where P lands on the HiF8 grid (None: 1.0, best
            for HiF8). Valid range [2^-15, 2^15] (HiF8's normal binades); outside it is a
            ValueError (P would saturate or flush to 0).
        scales: optional ``(q_scale, k_scale, v_scale)`` static scales (floats or fp32 (1,)
            tensors; None entries are computed by ``calibration``). With ``smooth_k`` the K scale
            applies to the smoothed K (and with ``rotate`` to the rotated tensors). They are the
            op's descales, so the op's ranges apply (ValueError outside them): each finite and
            > 0; ``softmax_scale * q_scale * k_scale <= FLT_MAX / (128 * 32768^2)`` (about
            2.5e27: no scaled score can overflow fp32); ``v_scale * p_scale <= FLT_MAX /
            (1.25 * 32768 * Skv)`` with Skv the longest key sequence (P @ V cannot overflow).
            Computed scales meet them for any finite input of a few orders of magnitude below
            fp32's range; NaN or Inf in a tensor whose scale is computed is a ValueError naming
            it (with a static scale they become HiF8's NaN/Inf codes).
        rotate: rotate the head dimension of q, k and v by a normalised Hadamard matrix before
            quantising and rotate the output back (exact in real arithmetic, see
            :mod:`qfa.dropin.rotation`): it spreads outlier channels, so per-tensor scales
            fit HiF8's 3-bit binades better, at the cost of four 128-point Walsh-Hadamard
            butterflies per token.
            On by default: on Qwen2.5-Coder-1.5B it halved the KL to bf16 attention and put
            perplexity within 0.6 % of bf16 on every text measured (see the README).
        return_softmax_lse: also return the natural-log LSE of the (unsmoothed) scores, fp32,
            (B, Nq, Sq) or (Nq, Tq) for TND; rows that see no key get +inf. (``return_lse=``
            is a deprecated alias.)
        backend: ``"torch"`` / ``"triton"`` / None (by device, or ``$QFA_BACKEND``). On CPU
            ``"torch"`` runs the native code where it is built (``QFA_NATIVE=0``: pure torch).
        metadata: optional plan of the op (:func:`qfa.quant_flash_attn_metadata`, or the
            ``AttentionPlan`` of an earlier call) for this call's layout, heads, mask and length
            tensors: the lengths are then not read on the host again (the values must be those
            it was planned with). Plan once, run many: the transformers adapter plans once per
            forward pass and passes it to every layer. Not used under ``torch.compile`` (the
            custom op plans itself; the result is the same).
        process_group: tensor parallel (see :mod:`qfa.dropin.distributed`): a
            ``torch.distributed.ProcessGroup`` whose ranks each hold a contiguous range of the
            q heads and the matching k/v heads (GQA kept, the same sequence lengths on every
            rank), shards in rank order. The scales that are computed are then those of the
            whole tensors, so each rank's output (and LSE) is bit for bit the matching heads of
            the unsharded call: exactly for ``"amax"`` and for rules without a reducible form
            (``"mse"``, user rules: the shards are all-gathered along the head axis, which costs
            moving q, k and v; every rank's shard must then have the same shape), and for
            ``"rms"`` (an all_reduce of the float64 sum of squares and count) except when
            log2(rms) ties a half-integer to within float64 rounding. K means and the rotation
            are per head: nothing else is reduced. Every rank must make the call (it runs
            collectives). Static scales need no reduction: with all three given the group is
            not used. A group cannot cross the custom op, so under ``torch.compile`` a call with
            one (and a computed scale) does not become ``torch.ops.qfa.hif8_attention``: with
            ``fullgraph=True`` it is a TypeError saying so; without, the graph breaks there and
            the call runs eagerly (never traced). None (default): this rank's tensors are the
            whole tensors.

        format: the number format of Q/K/V (one code path; smoothing, masks, GQA, padding and
            the checks are shared):

            - ``"hif8"`` (default): HiF8 with one scale per tensor, quant_mode 0 (all of the above).
            - ``"mxfp8"``: MXFP8 (OCP MX, E4M3 elements, E8M0 power-of-two scales): Q and K one
              scale per token, head and 32 channels of D; V one per channel and 32 keys of a
              sequence; quant_mode 1 on TND-packed tensors. D in {64, 72, 128, 256}.
            - ``"fp8"``: FP8 E4M3, Q and K one fp32 scale per token and head, V one per head;
              quant_mode 6 (K and V in 128-key pages). D = 128.

            The E4M3 formats compute their scales from the values on every call, so what chooses
            per-tensor scales does not apply: ``scales``, a ``calibration`` other than the
            default, ``metadata`` and ``rotate=True`` are ValueErrors there (the rotation is
            HiF8's; pass ``rotate=False``, as :func:`mxfp8_attention` / :func:`fp8_attention`
            do), and ``process_group`` needs no reduction (every scale lies within one head, so
            each rank's heads are exactly the unsharded call's). ``p_scale`` defaults to 448
            there (E4M3's largest value, on its grid; valid range [1, 448]; see
            :mod:`qfa.dropin.scaled`). NaN/Inf inputs are not an error there: they
            make their block's (or token's, or FP8 V's head's) scale NaN, and NaN reaches the
            outputs that read it.

    Returns:
        ``out`` in ``q``'s layout, shape and dtype, or ``(out, lse)`` with ``return_softmax_lse``.
        An fp16 output saturates at fp16's largest finite value (HiF8's rounding of V can
        carry the quantised answer past it where the exact one fits); NaN and Inf stay. Meta
        tensors give meta outputs (as the op does).

    Works inside ``torch.compile(fullgraph=True)`` with a named calibration rule: the whole
    computation is then the custom op ``torch.ops.qfa.hif8_attention``.
    """
    said = {}  # the drop-in's name -> the deprecated one the caller used
    if deprecated:
        named = take_deprecated(deprecated, {"softmax_scale": softmax_scale,
                                             "return_softmax_lse": return_softmax_lse}, "hif8_attention")
        softmax_scale, return_softmax_lse = named["softmax_scale"], named["return_softmax_lse"]
        said = {DEPRECATED_NAMES[old]: old for old in deprecated}
    return _attention(q, k, v, is_causal=is_causal, softmax_scale=softmax_scale, layout=layout,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q,
                      seqused_kv=seqused_kv, calibration=calibration, smooth_k=smooth_k, p_scale=p_scale,
                      scales=scales, return_softmax_lse=return_softmax_lse, backend=backend, rotate=rotate,
                      metadata=metadata, process_group=process_group, format=format, said=said)


def _attention(q, k, v, *, is_causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv,
               calibration, smooth_k, p_scale, scales, return_softmax_lse, backend, rotate, metadata, process_group,
               format, said: dict[str, str]):
    """:func:`hif8_attention` after its deprecated names; ``said`` maps a parameter's name to
    the one the caller used for it (``softmax_scale`` -> ``scale``), so errors use the latter."""
    format = dropin_inputs.check_format(format)
    dropin_inputs.check_qkv(q, k, v, layout, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, format=format)
    for flag, name in ((is_causal, "is_causal"), (smooth_k, "smooth_k"), (rotate, "rotate"),
                       (return_softmax_lse, "return_softmax_lse")):
        check_bool(flag, said.get(name, name))
    dropin_inputs.check_format_options(format, rotate=rotate, scales=scales, calibration=calibration,
                                       metadata=metadata)
    process_group = distributed.check_process_group(process_group)
    q_scale, k_scale, v_scale = dropin_inputs.static_scales(scales, q.device)
    if format != "hif8" or (q_scale is not None and k_scale is not None and v_scale is not None):
        process_group = None  # nothing is measured across heads, so nothing is reduced
    call = dict(
        q=q, k=k, v=v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        p_scale=dropin_inputs.p_scale_tensor(p_scale, q.device), cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv, seqused_q=seqused_q, seqused_kv=seqused_kv, is_causal=is_causal,
        softmax_scale=dropin_inputs.softmax_scale_value(softmax_scale, said.get("softmax_scale", "softmax_scale")),
        layout=layout,
        calibration=dropin_inputs.check_calibration(calibration), smooth_k=smooth_k,
        return_softmax_lse=return_softmax_lse, backend=backend, rotate=rotate, format=format,
    )
    if torch.compiler.is_compiling():
        if not isinstance(call["calibration"], str):
            raise TypeError(
                "calibration must be a registered rule name under torch.compile (a callable cannot cross the "
                "custom op); register it with qfa.dropin.calibration.register_rule(name, fn)"
            )
        if process_group is not None:
            raise TypeError(
                "process_group is not supported under torch.compile (a process group cannot cross the custom op "
                "torch.ops.qfa.hif8_attention): call hif8_attention eagerly, or pass static scales=(q, k, v) "
                "(e.g. a frozen HiF8Attention), which need no reduction"
            )
        out, lse = torch.ops.qfa.hif8_attention(**call)  # its kernel words its errors (no alias under compile)
    else:
        run = dropin_eager.run if process_group is None else _run_sharded
        with dropin_op.callers_words(said):
            out, lse = run(_D(**call), metadata=metadata, process_group=process_group)
        # (the caller's own scale tensors: static_scales converts them, dropping their graph)
        given = [*(scales if isinstance(scales, (tuple, list)) else ()), p_scale]
        inputs = (q, k, v, *(s for s in given if isinstance(s, torch.Tensor)))
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            out, lse = _NoGradient.apply(out, lse, *inputs)
    return (out, lse) if return_softmax_lse else out


class _NoGradient(torch.autograd.Function):
    """The outputs of a call whose inputs require grad, as the custom op leaves them under
    ``torch.compile``: in the graph, so that a backward pass through them fails, saying why,
    rather than finding no path and silently leaving the inputs' gradients out."""

    @staticmethod
    def forward(ctx, out, lse, *inputs):
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("qfa.hif8_attention has no gradient: it is an inference operator (Q, K, V and P are "
                           "rounded to 8 bits). Train through SDPA, or run it under torch.no_grad() / "
                           "torch.inference_mode() to say no gradient is wanted")


def mxfp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    **options: Any) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`hif8_attention` with ``format="mxfp8"`` (and ``rotate=False``, the rotation being
    HiF8's option): Q/K per 32 channels, V per 32 keys, quant_mode 1. ``options`` are
    hif8_attention's."""
    return hif8_attention(q, k, v, **{"rotate": False, **options}, format="mxfp8")


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  **options: Any) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`hif8_attention` with ``format="fp8"`` (and ``rotate=False``): FP8 E4M3 Q/K per token
    and head, V per head, quant_mode 6. ``options`` are hif8_attention's."""
    return hif8_attention(q, k, v, **{"rotate": False, **options}, format="fp8")
