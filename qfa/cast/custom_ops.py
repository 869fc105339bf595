"""The cast as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` can trace it
(``import qfa`` registers them once):

``torch.ops.qfa.encode_hif8(x, overflow="saturate") -> uint8``
    :func:`qfa.encode_to_hifloat8`.
``torch.ops.qfa.decode_hif8(codes, dtype) -> dtype``
    :func:`qfa.decode_from_hifloat8`.

Each has a fake (meta) implementation that gives only shapes and dtypes; no autograd formula.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qfa.cast.api import decode_from_hifloat8, encode_to_hifloat8


@torch.library.custom_op("qfa::encode_hif8", mutates_args=())
def encode_hif8(x: Tensor, overflow: str = "saturate") -> Tensor:
    return encode_to_hifloat8(x.contiguous(), overflow=overflow).clone()


@encode_hif8.register_fake
def _(x: Tensor, overflow: str = "saturate") -> Tensor:
    return x.new_empty(x.shape, dtype=torch.uint8)


@torch.library.custom_op("qfa::decode_hif8", mutates_args=())
def decode_hif8(codes: Tensor, dtype: torch.dtype) -> Tensor:
    return decode_from_hifloat8(codes.contiguous(), dtype).clone()


@decode_hif8.register_fake
def _(codes: Tensor, dtype: torch.dtype) -> Tensor:
    return codes.new_empty(codes.shape, dtype=dtype)
