"""qfa: quantized attention operators for LLM inference, built around HiFloat8 (HiF8).

* ``encode_to_hifloat8`` / ``decode_from_hifloat8``: the bit-exact HiF8 cast.
* ``quant_flash_attn``: QuantFlashAttn in HiF8 per-tensor mode (quant_mode 7) on HiF8 codes.
* ``hif8_attention`` / ``HiF8Attention``: drop-in attention on float tensors (quantise, call the op).

Optional pieces import lazily: ``qfa.integrations.transformers`` (transformers), the Triton
backend (triton, or triton-ascend with torch_npu on Ascend).
"""

from qfa.attention.dropin import HiF8Attention, hif8_attention
from qfa.attention.op import quant_flash_attn
from qfa.cast import decode_from_hifloat8, encode_to_hifloat8

__version__ = "0.1.0"
__all__ = ["HiF8Attention", "decode_from_hifloat8", "encode_to_hifloat8", "hif8_attention", "quant_flash_attn"]
