"""QuantFlashAttn (HiF8 per-tensor, quant_mode 7) and the drop-in attention built on it."""
