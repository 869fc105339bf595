"""The custom op ``torch.ops.qfa.hif8_attention``: the whole drop-in computation as one opaque
op, which :func:`qfa.hif8_attention` calls while ``torch.compile`` traces it.

Its schema is built from :class:`~qfa.dropin.call.DropinCall` (arguments in the
dataclass's field order, with its defaults; also callable by name), its kernel is
:func:`qfa.dropin.eager.run` and its fake gives the shapes and dtypes. One opaque op
keeps the data-dependent parts (scale rules, per-sequence means, the cast's own compiled kernels)
out of the traced graph. Inference only: no autograd formula is registered. ``lse`` is an empty
fp32 tensor of shape (0,) when not requested.
"""

from __future__ import annotations

from typing import ContextManager, Mapping

import torch
from torch import Tensor

from qfa.attention import wording
from qfa.dropin import eager as dropin_eager
from qfa.dropin.call import FORMAT_MODES, OP_NAME, DropinCall, schema

#: ``quant_flash_attn``'s names for the scales the drop-in computes or takes from ``scales=``,
#: in the drop-in's words (its callers never pass a descale).
OP_SCALE_NAMES = {"q_descale": "q_scale", "k_descale": "k_scale", "v_descale": "v_scale"}
SCALES_NOTE = ("q_scale, k_scale, v_scale: the scales q, k and v are quantised with, given in scales= or computed "
               "from them")
#: The op's modes as the drop-in's formats (``format=``, what the caller chose).
OP_MODE_NAMES = {f"quant_mode {int(mode)}": f"format {name!r}" for name, mode in FORMAT_MODES.items()}


def callers_words(said: Mapping[str, str] | None = None) -> ContextManager[None]:
    """The drop-in's computation's errors in its caller's words: the op's descales under the
    names of ``scales=``, its modes as formats, and ``said``'s renames (a parameter -> the
    deprecated alias used)."""
    return wording.callers_words({**OP_SCALE_NAMES, **OP_MODE_NAMES, **(said or {})},
                                 dict.fromkeys(OP_SCALE_NAMES, SCALES_NOTE))


def _kernel(*args) -> tuple[Tensor, Tensor]:
    with callers_words():
        out, lse = dropin_eager.run(DropinCall(*args))
    return out.contiguous(), lse.contiguous()  # the fake promises contiguous outputs


def _fake(*args) -> tuple[Tensor, Tensor]:
    return dropin_eager.empty_outputs(DropinCall(*args))


hif8_attention_op = torch.library.custom_op(OP_NAME, _kernel, mutates_args=(), schema=schema())
hif8_attention_op.register_fake(_fake)
