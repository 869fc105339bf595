"""QuantFlashAttn (HiF8 per-tensor, quant_mode 7) and the drop-in attention built on it."""

from qfa.attention import calibration
from qfa.attention.dropin import HiF8Attention, hif8_attention
from qfa.attention.op import quant_flash_attn

__all__ = ["HiF8Attention", "calibration", "hif8_attention", "quant_flash_attn"]
