"""QuantFlashAttn (HiF8 per-tensor, quant_mode 7) and the drop-in attention built on it."""

from qfa.attention.op import quant_flash_attn

__all__ = ["quant_flash_attn"]
