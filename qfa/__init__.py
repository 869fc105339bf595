"""qfa: quantized attention operators for LLM inference, built around HiFloat8 (HiF8)."""

from qfa.cast import decode_from_hifloat8, encode_to_hifloat8

__version__ = "0.1.0"
__all__ = ["decode_from_hifloat8", "encode_to_hifloat8"]
