"""One drop-in call's arguments, defined once: the dataclass :class:`DropinCall`.

Its fields, in order, are the custom op ``qfa::hif8_attention``'s schema (built by
:func:`schema`), the eager computation takes one :class:`DropinCall`, the op's fake reads one,
and the public :func:`qfa.hif8_attention` and :class:`qfa.HiF8Attention` take their defaults
from its class attributes. So a default (``rotate``'s, say) or a name is written here and
nowhere else; ``tests/attention/test_custom_ops.py`` fails if anything drifts from it.

``format`` picks the number format the float inputs are quantised to (:data:`FORMATS`, each run
by its ``quant_flash_attn`` mode, :data:`FORMAT_MODES`): HiF8 per-tensor (the default), MXFP8,
or FP8 E4M3 per-token-head. One call, one code path: the op ``qfa::hif8_attention`` carries it
like any other option.

The fields hold normalised values: per-tensor scales and ``p_scale`` as fp32 (1,) tensors (or
None), flags as bools, ``calibration`` as a rule name (or, in eager calls only, a callable:
a callable cannot cross the custom op, whose schema types it ``str``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from qfa.dropin import calibration as cal
from qfa.tiling.spec import QuantMode

OP_NAME = "qfa::hif8_attention"

#: The drop-in's number formats and the quant_flash_attn mode that runs each.
FORMAT_MODES = {"hif8": QuantMode.HIF8_PER_TENSOR, "mxfp8": QuantMode.MXFP8, "fp8": QuantMode.FP8_PER_TOKEN_HEAD}
FORMATS = tuple(FORMAT_MODES)


@dataclass(frozen=True, eq=False)  # tensors have no truth value to compare
class DropinCall:
    """The arguments of one :func:`qfa.hif8_attention` call, after its checks."""

    q: Tensor
    k: Tensor
    v: Tensor
    q_scale: Optional[Tensor] = None
    k_scale: Optional[Tensor] = None
    v_scale: Optional[Tensor] = None
    p_scale: Optional[Tensor] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_kv: Optional[Tensor] = None
    seqused_q: Optional[Tensor] = None
    seqused_kv: Optional[Tensor] = None
    is_causal: bool = False
    softmax_scale: Optional[float] = None
    layout: str = "BNSD"
    calibration: cal.RuleLike = cal.DEFAULT_RULE
    smooth_k: bool = True
    return_softmax_lse: bool = False
    backend: Optional[str] = None
    rotate: bool = True
    format: str = "hif8"

    def as_kwargs(self) -> dict:
        """The fields by name, shallow (``dataclasses.asdict`` would copy the tensors)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


#: The option fields: every field after the tensors, i.e. what has a default other than None.
OPTIONS = ("is_causal", "softmax_scale", "layout", "calibration", "smooth_k", "return_softmax_lse", "backend", "rotate",
           "format")

_SCHEMA_TYPES = {
    Tensor: "Tensor", Optional[Tensor]: "Tensor?", bool: "bool", Optional[float]: "float?", str: "str",
    Optional[str]: "str?", cal.RuleLike: "str",  # only a rule's name crosses the op
}


def _schema_default(value) -> str:
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        return f'"{value}"'
    raise TypeError(f"no schema spelling for the default {value!r}")


def schema() -> str:
    """``qfa::hif8_attention``'s torch.library schema, from :class:`DropinCall`'s fields."""
    hints = typing.get_type_hints(DropinCall)
    args = []
    for f in dataclasses.fields(DropinCall):
        arg = f"{_SCHEMA_TYPES[hints[f.name]]} {f.name}"
        if f.default is not dataclasses.MISSING:
            arg += f"={_schema_default(f.default)}"
        args.append(arg)
    return f"({', '.join(args)}) -> (Tensor, Tensor)"
