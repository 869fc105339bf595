"""Tensor parallel: per-tensor statistics over the ranks that each hold some attention heads.

Serving engines shard attention by heads: each rank of a tensor-parallel group holds a
contiguous range of q heads and the matching kv heads (GQA kept). A per-tensor scale computed
on one rank's heads is not the tensor's, so with ``process_group=`` the drop-in
(:func:`qfa.hif8_attention`), :class:`qfa.HiF8Attention` and its calibration combine what
each rank measures before turning it into a scale:

* a rule with a reducible form (:class:`qfa.dropin.calibration.Reduction`: ``"amax"``,
  ``"rms"``) computes its few statistics on the local shard and all-reduces them
  (:func:`all_reduce_statistics`, one small collective per distinct reduction op);
* any other rule (``"mse"``, user rules) sees the whole tensor, rebuilt by gathering the shards
  along the head axis (:func:`gather_heads`, concatenated in rank order), at the cost of that
  gather.

K smoothing means and the rotation are per head, so they need nothing from other ranks.
Every rank of the group must make the same calls in the same order (as for any collective).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

try:
    import torch.distributed as dist
except ImportError:  # a torch build without distributed support
    dist = None

#: The type ``process_group=`` takes (``object`` in a torch build without torch.distributed).
ProcessGroup = dist.ProcessGroup if dist is not None and dist.is_available() else object

#: Reduction op names a :class:`~qfa.dropin.calibration.Reduction` may use per statistic.
REDUCE_OPS = ("max", "sum")


def _available() -> bool:
    return dist is not None and dist.is_available()


def check_process_group(process_group: Optional[ProcessGroup], name: str = "process_group") -> Optional[ProcessGroup]:
    """``process_group`` itself when it is None or a ``torch.distributed.ProcessGroup``.

    TypeError for anything else; RuntimeError when torch.distributed is not available or not
    initialised (no collective could run).
    """
    if process_group is None:
        return None
    if not _available():
        raise RuntimeError(f"{name} was given, but this torch build has no torch.distributed support")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD or "
                        f"dist.new_group(...)) or None, got {type(process_group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError(f"{name} was given, but torch.distributed is not initialised: call "
                           f"torch.distributed.init_process_group(...) first")
    return process_group


def group_size(process_group: ProcessGroup) -> int:
    return dist.get_world_size(process_group)


def all_reduce_statistics(stats: torch.Tensor, ops: Sequence[str], process_group: ProcessGroup) -> torch.Tensor:
    """``stats`` (float64, one entry per op in ``ops``) reduced over the group, as a new tensor.

    One all_reduce per distinct op. MAX and SUM of the same values are exact whatever the order
    for MAX; float64 SUM in another order can differ in its last bits (see the rules).
    """
    out = stats.detach().clone()
    for op in dict.fromkeys(ops):
        if op not in REDUCE_OPS:
            raise ValueError(f"a statistic's reduction must be one of {REDUCE_OPS}, got {op!r}")
        if len(set(ops)) == 1:  # the usual case: the whole tensor at once
            dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=process_group)
            break
        index = torch.tensor([i for i, o in enumerate(ops) if o == op], device=out.device)
        part = out.index_select(0, index)
        dist.all_reduce(part, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=process_group)
        out.index_copy_(0, index, part)
    return out


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    # Collectives move bytes exactly; going through uint8 works for every dtype on every backend.
    return x.contiguous().view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8)


def gather_heads(x: torch.Tensor, head_axis: int, process_group: ProcessGroup) -> torch.Tensor:
    """The shards of every rank concatenated along ``head_axis`` in rank order: for contiguous
    head shards, exactly the unsharded tensor. Every rank's shard must have the same shape
    (ValueError on every rank otherwise, found by a first, tiny gather of the shapes)."""
    size = group_size(process_group)
    if size == 1:
        return x
    shape = torch.tensor(x.shape, dtype=torch.int64, device=x.device)
    shapes = [torch.empty_like(shape) for _ in range(size)]
    dist.all_gather(shapes, shape, group=process_group)
    if any(not torch.equal(s, shapes[0]) for s in shapes):
        raise ValueError(f"gathering head shards needs the same shard shape on every rank, got "
                         f"{[tuple(s.tolist()) for s in shapes]} (rank order)")
    xb = _as_bytes(x)
    parts = [torch.empty_like(xb) for _ in range(size)]
    dist.all_gather(parts, xb, group=process_group)
    return torch.cat([p.view(x.dtype) for p in parts], dim=head_axis)


def gather_flat(x: torch.Tensor, process_group: ProcessGroup) -> torch.Tensor:
    """1-D ``x`` of every rank, concatenated in rank order; the lengths may differ."""
    size = group_size(process_group)
    if size == 1:
        return x
    n = torch.tensor([x.numel()], dtype=torch.int64, device=x.device)
    counts = [torch.empty_like(n) for _ in range(size)]
    dist.all_gather(counts, n, group=process_group)
    counts = [int(c) for c in counts]
    longest = max(counts)
    padded = torch.zeros(longest, dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=process_group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def head_axis(layout: str) -> int:
    """The heads' axis of a tensor in ``layout`` (BNSD: 1, BSND: 2, TND: 1)."""
    return 2 if layout == "BSND" else 1

