"""qfa: quantized attention operators for LLM inference, built around HiFloat8 (HiF8).

* ``encode_to_hifloat8`` / ``decode_from_hifloat8``: the bit-exact HiF8 cast.
* ``quant_flash_attn``: QuantFlashAttn in HiF8 per-tensor mode (quant_mode 0) on HiF8 codes;
  ``quant_flash_attn_metadata`` plans a call once for many runs (``metadata=``).
* ``hif8_attention`` / ``HiF8Attention``: drop-in attention on float tensors (quantise, call the op).

Optional pieces import lazily: ``qfa.integrations.transformers`` (transformers), the Triton
backend (triton, or triton-ascend with torch_npu on Ascend).
"""

from qfa.attention import HiF8Attention, hif8_attention, quant_flash_attn  # registers the attention ops
from qfa.cast import custom_ops as _cast_ops  # noqa: F401  (registers torch.ops.qfa.encode_hif8 / decode_hif8)
from qfa.attention.op import quant_flash_attn_metadata
from qfa.cast import decode_from_hifloat8, encode_to_hifloat8

__version__ = "0.1.0"
__all__ = ["HiF8Attention", "decode_from_hifloat8", "encode_to_hifloat8", "hif8_attention", "quant_flash_attn",
           "quant_flash_attn_metadata"]
