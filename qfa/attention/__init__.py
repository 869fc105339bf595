"""QuantFlashAttn (HiF8 per-tensor, quant_mode 0) and the drop-in attention built on it."""

from qfa.attention import calibration
from qfa.attention import custom_ops  # noqa: F401  (registers torch.ops.qfa.quant_flash_attn)
from qfa.attention.dropin import hif8_attention
from qfa.attention.dropin_module import HiF8Attention
from qfa.attention.op import quant_flash_attn

__all__ = ["HiF8Attention", "calibration", "hif8_attention", "quant_flash_attn"]
