"""HiFloat8 cast: ``encode_to_hifloat8`` / ``decode_from_hifloat8`` and the format itself."""

from qfa.cast import format
from qfa.cast.api import decode_from_hifloat8, encode_to_hifloat8

__all__ = ["decode_from_hifloat8", "encode_to_hifloat8", "format"]
