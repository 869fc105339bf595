"""QuantFlashAttn and the drop-in attention built on it (HiF8 per-tensor by default; MXFP8 and
FP8 per-token-head with ``format=``, or as ``mxfp8_attention`` / ``fp8_attention``)."""

from qfa.attention import calibration
from qfa.attention import custom_ops  # noqa: F401  (registers torch.ops.qfa.quant_flash_attn)
from qfa.attention.dropin import fp8_attention, hif8_attention, mxfp8_attention
from qfa.attention.dropin_module import HiF8Attention
from qfa.attention.op import quant_flash_attn

__all__ = ["HiF8Attention", "calibration", "fp8_attention", "hif8_attention", "mxfp8_attention", "quant_flash_attn"]
