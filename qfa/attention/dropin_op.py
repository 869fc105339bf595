"""The custom op ``torch.ops.qfa.hif8_attention``: the whole drop-in computation as one opaque
op, which :func:`qfa.hif8_attention` calls while ``torch.compile`` traces it.

Its schema is built from :class:`~qfa.attention.dropin_call.DropinCall` (arguments in the
dataclass's field order, with its defaults; also callable by name), its kernel is
:func:`qfa.attention.dropin_eager.run` and its fake gives the shapes and dtypes. One opaque op
keeps the data-dependent parts (scale rules, per-sequence means, the cast's own compiled kernels)
out of the traced graph. Inference only: no autograd formula is registered. ``lse`` is an empty
fp32 tensor of shape (0,) when not requested.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qfa.attention import dropin_eager
from qfa.attention.dropin_call import OP_NAME, DropinCall, schema


def _kernel(*args) -> tuple[Tensor, Tensor]:
    out, lse = dropin_eager.run(DropinCall(*args))
    return out.contiguous(), lse.contiguous()  # the fake promises contiguous outputs


def _fake(*args) -> tuple[Tensor, Tensor]:
    return dropin_eager.empty_outputs(DropinCall(*args))


hif8_attention_op = torch.library.custom_op(OP_NAME, _kernel, mutates_args=(), schema=schema())
hif8_attention_op.register_fake(_fake)
