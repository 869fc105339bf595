"""Triton device kernels (installed as ``qfa.kernels``).

* ``qfa.kernels.hif8``: in-kernel HiF8 helpers (``@triton.jit``) shared by every kernel.
* ``qfa.kernels.cast``: the HiF8 cast kernels and their host launchers.
* ``qfa.kernels.attention``: quant_flash_attn's HiF8 mode (quant_mode 0).
* ``qfa.kernels.scaled_attention``: its MXFP8 and FP8 modes (quant_mode 1 and 6), E4M3/E8M0
  decoded from their bits in-kernel.

Importing this package imports nothing else, so ``import qfa`` works without Triton; the
submodules import Triton. They run on CUDA with upstream Triton, on Ascend NPUs with
triton-ascend (not run on hardware here), and on CPU tensors under ``TRITON_INTERPRET=1``.
"""
