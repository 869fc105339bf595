"""The drop-in attention on float tensors, built on QuantFlashAttn: quantise Q/K/V (with the
calibration, K smoothing and rotation it is configured with), call the op, return the output in
the inputs' dtype.

* :func:`hif8_attention` / :func:`mxfp8_attention` / :func:`fp8_attention` (:mod:`.function`)
  and the module :class:`HiF8Attention` (:mod:`.module`);
* :mod:`.calibration` (scale rules), :mod:`.smoothing`, :mod:`.rotation`, :mod:`.distributed`
  (tensor-parallel scales), :mod:`.fp8_emulation`;
* the plumbing: :mod:`.inputs` (argument checks), :mod:`.call` (one call's resolved options),
  :mod:`.prepare` (the fused preparation), :mod:`.eager` / :mod:`.custom_op` (eager and
  ``torch.ops.qfa.hif8_attention``), :mod:`.scaled` (the MXFP8 / FP8 formats).
"""

from qfa.dropin import calibration
from qfa.dropin.function import fp8_attention, hif8_attention, mxfp8_attention
from qfa.dropin.module import HiF8Attention

__all__ = ["HiF8Attention", "calibration", "fp8_attention", "hif8_attention", "mxfp8_attention"]
