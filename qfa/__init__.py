"""qfa: quantized attention operators for LLM inference, built around HiFloat8 (HiF8).

* ``encode_to_hifloat8`` / ``decode_from_hifloat8``: the bit-exact HiF8 cast.
* ``quant_flash_attn``: QuantFlashAttn in HiF8 per-tensor mode (quant_mode 0) on HiF8 codes;
  ``quant_flash_attn_metadata`` plans a call once for many runs (``metadata=``).
* ``hif8_attention`` / ``HiF8Attention``: drop-in attention on float tensors (quantise, call the op);
  ``format="mxfp8"`` / ``"fp8"`` (or ``mxfp8_attention`` / ``fp8_attention``) for the other formats.

Optional pieces import lazily: ``qfa.integrations.transformers`` (transformers), the Triton
backend (triton, or triton-ascend with torch_npu on Ascend).
"""

from qfa import _moved

_moved.install()  # before anything imports a moved module by its old path

from qfa.attention import quant_flash_attn  # noqa: E402  (registers torch.ops.qfa.quant_flash_attn)
from qfa.dropin import HiF8Attention, fp8_attention, hif8_attention, mxfp8_attention  # noqa: E402
from qfa.cast import custom_ops as _cast_ops  # noqa: E402, F401  (registers torch.ops.qfa.encode_hif8 / decode_hif8)
from qfa.attention.op import quant_flash_attn_metadata  # noqa: E402
from qfa.cast import decode_from_hifloat8, encode_to_hifloat8  # noqa: E402

__version__ = "0.1.0"
__all__ = ["HiF8Attention", "decode_from_hifloat8", "encode_to_hifloat8", "fp8_attention", "hif8_attention",
           "mxfp8_attention", "quant_flash_attn", "quant_flash_attn_metadata"]
