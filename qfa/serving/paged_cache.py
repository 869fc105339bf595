"""``PagedHiF8Cache``: a paged HiF8 KV cache, the reference a vLLM-style engine would copy.

Storage is preallocated once: per layer, one K and one V tensor of HiF8 codes (``torch.uint8``)
shaped ``(num_blocks, block_size, Nkv, 128)``, the op's ``PA_BBND`` layout. A sequence owns a
list of physical blocks, shared by all layers (vLLM's layout: one block table per sequence, one
K/V tensor pair per layer); its logical token ``j`` lives in block ``blocks[j // block_size]`` at
position ``j % block_size``. Blocks come from a free list and go back to it on :meth:`free`.

Scales: one fp32 K scale and one V scale per layer, fixed when the layer's first tokens arrive
(from the calibration rule on those tokens, or given up front), then used for every later token:
values beyond HiF8's range saturate and are counted (:attr:`saturated`). Re-scaling stored codes
would mean re-encoding them, which a cache exists to avoid.

The op reads the codes in place: :meth:`block_table` / :meth:`seqused_kv` give its paged
arguments for a list of sequences and :meth:`attend` makes the call. Paged attention is bit for
bit the contiguous call on the same keys (the op's numerics walk the *logical* key sequence).

Every operation is all-or-nothing: it checks its arguments and computes what it will store
(the blocks it takes, the scales a layer's first tokens fix, the codes and their saturation
counts) before it changes anything, so a call that raises leaves the blocks, the free list, the
lengths, the scales and the counters exactly as they were. An engine can retry or skip a
refused step without rebuilding the cache.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from qfa.dropin import calibration as cal
from qfa.attention.op import quant_flash_attn
from qfa.attention.wording import callers_words
from qfa.serving.encoding import encode
from qfa.tiling.checks import check_bool, check_float_tensor
from qfa.tiling.spec import HEAD_DIM, MaskMode, QuantMode

#: Block sizes the op's paged layouts take: multiples of 16 up to 1024.
BLOCK_SIZE_MULTIPLE = 16
MAX_BLOCK_SIZE = 1024


#: The op's names for what :meth:`PagedHiF8Cache.attend` builds itself, in attend's words.
_ATTEND_NAMES = {"k_descale": "k_scale", "v_descale": "v_scale", "layout_out": "layout_q", "mask_mode": "causal",
                 "block_table": "block_table(seq_ids)", "seqused_kv": "seqused_kv(layer, seq_ids)"}
_ATTEND_NOTES = {"k_descale": "k_scale, v_scale: the layer's scales, scales(layer)",
                 "v_descale": "k_scale, v_scale: the layer's scales, scales(layer)"}


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


class PagedHiF8Cache:
    """A block allocator over preallocated HiF8 K/V code tensors, one pair per layer.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads: the storage's geometry; ``block_size``
            is a multiple of 16 up to 1024 (the op's paged block sizes).
        head_dim: 128 (the op's only head size).
        device: where the code tensors live.
        calibration: the rule that fixes a layer's K and V scales from its first appended tokens
            (see :mod:`qfa.dropin.calibration`; None: the default rule).
        scales: optional per-layer ``(k_scale, v_scale)`` fixed up front (a sequence with one
            entry per layer, entries None for "from the rule"), e.g. from offline calibration.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, *,
                 head_dim: int = HEAD_DIM, device: torch.device | str = "cpu",
                 calibration: cal.RuleLike | None = None,
                 scales: Sequence[tuple | None] | None = None) -> None:
        self.num_layers = _positive_int(num_layers, "num_layers")
        self.num_blocks = _positive_int(num_blocks, "num_blocks")
        self.block_size = _positive_int(block_size, "block_size")
        if block_size % BLOCK_SIZE_MULTIPLE or block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be a multiple of {BLOCK_SIZE_MULTIPLE} up to {MAX_BLOCK_SIZE}, "
                             f"got {block_size}")
        self.num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
        if head_dim != HEAD_DIM:
            raise ValueError(f"head_dim must be {HEAD_DIM} (the HiF8 op's only head size), got {head_dim!r}")
        self.head_dim = head_dim
        self.device = torch.device(device)
        if self.device.type == "meta":  # it stores codes and reads its scales' values
            raise ValueError("device must hold memory (cpu, cuda, npu, ...): the cache stores codes and reads its "
                             "scales, got meta")
        self.rule = cal.get_rule(calibration)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_codes = [torch.zeros(shape, dtype=torch.uint8, device=self.device) for _ in range(num_layers)]
        self.v_codes = [torch.zeros(shape, dtype=torch.uint8, device=self.device) for _ in range(num_layers)]
        self.k_scales: list[torch.Tensor | None] = [None] * num_layers
        self.v_scales: list[torch.Tensor | None] = [None] * num_layers
        self._saturated = [torch.zeros((), dtype=torch.long, device=self.device) for _ in range(num_layers)]
        if scales is not None:
            self._set_scales(scales)
        # Lowest block index first: a freed block is handed out again before untouched ones.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._blocks: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, list[int]] = {}

    # ------------------------------------------------------------------ sequences and blocks

    def add_sequence(self, seq_id: Hashable) -> None:
        """Start an empty sequence (no blocks until tokens are appended)."""
        if self._has(seq_id):
            raise ValueError(f"seq_id {seq_id!r}: that sequence already exists; free it first")
        self._blocks[seq_id] = []
        self._lengths[seq_id] = [0] * self.num_layers

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence and return its blocks to the free list (their codes are left as they are)."""
        free = sorted(self._free + self._blocks[self._known(seq_id)], reverse=True)
        del self._blocks[seq_id], self._lengths[seq_id]
        self._free = free

    @property
    def saturated(self) -> list[int]:
        """Per layer, the K and V elements clamped to +-MAX when encoded (read on the host here)."""
        return [int(n) for n in self._saturated]

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks(self, seq_id: Hashable) -> list[int]:
        """The physical blocks of a sequence, in logical order (a copy)."""
        return list(self._blocks[self._known(seq_id)])

    def length(self, seq_id: Hashable, layer: int) -> int:
        """Tokens stored for ``seq_id`` in ``layer``."""
        return self._lengths[self._known(seq_id)][self._layer(layer)]

    def _has(self, seq_id, name: str = "seq_id") -> bool:
        try:
            return seq_id in self._blocks
        except TypeError:  # unhashable: never a key
            raise TypeError(f"{name} must be hashable (it is a dict key), got {type(seq_id).__name__}") from None

    def _known(self, seq_id: Hashable, name: str = "seq_id") -> Hashable:
        """``seq_id`` if the cache holds that sequence; errors call it ``name`` (the caller's)."""
        if not self._has(seq_id, name):
            raise ValueError(f"{name} {seq_id!r} is an unknown sequence (add it with add_sequence; known: "
                             f"{len(self._blocks)})")
        return seq_id

    def _known_ids(self, seq_ids) -> list:
        """``seq_ids`` (a list or tuple of known sequences) as a list."""
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence):
            raise TypeError(f"seq_ids must be a sequence (list or tuple) of sequence ids, got {type(seq_ids).__name__}")
        return [self._known(s, f"seq_ids[{i}]") for i, s in enumerate(seq_ids)]

    def _layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return layer

    def _reserve(self, seq_id: Hashable, tokens: int) -> list[int]:
        """The free blocks the sequence would take to hold ``tokens`` (the lowest first, as they
        will be taken); nothing is taken here, and ValueError if there are too few."""
        need = -(-tokens // self.block_size) - len(self._blocks[seq_id])
        if need > len(self._free):
            raise ValueError(f"out of blocks: seq_id {seq_id!r} needs {need} more block(s) of {self.block_size} "
                             f"tokens to hold {tokens} tokens with the new k and v, {len(self._free)} free of "
                             f"{self.num_blocks}")
        return self._free[len(self._free) - need:][::-1] if need > 0 else []

    # ------------------------------------------------------------------ scales and writes

    def _set_scales(self, scales) -> None:
        if not isinstance(scales, (list, tuple)) or len(scales) != self.num_layers:
            got = f"{len(scales)} entries" if isinstance(scales, (list, tuple)) else type(scales).__name__
            raise ValueError(f"scales must be a sequence of {self.num_layers} (k_scale, v_scale) pairs or None (one "
                             f"per layer), got {got}")
        for layer, pair in enumerate(scales):
            if pair is None:
                continue
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"scales[{layer}] must be a (k_scale, v_scale) pair or None, got {pair!r}")
            self.k_scales[layer] = cal.check_scale(pair[0], f"scales[{layer}][0] (k_scale)", self.device)
            self.v_scales[layer] = cal.check_scale(pair[1], f"scales[{layer}][1] (v_scale)", self.device)

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's fixed ``(k_scale, v_scale)`` (fp32 (1,) each, the op's descales)."""
        layer = self._layer(layer)
        if self.k_scales[layer] is None:
            raise ValueError(f"layer {layer} has no scales yet: append its first tokens (or pass scales=)")
        return self.k_scales[layer], self.v_scales[layer]

    def _check_tokens(self, x, name: str) -> None:
        check_float_tensor(x, name)
        shape = (self.num_kv_heads, self.head_dim)
        if x.dim() != 3 or tuple(x.shape[1:]) != shape:
            raise ValueError(f"{name} must have shape (tokens, Nkv={shape[0]}, D={shape[1]}), got {tuple(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"{name} must be on the cache's device {self.device}, got {x.device}")

    def append(self, seq_id: Hashable, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode new tokens of one sequence into one layer: ``k``, ``v`` float (tokens, Nkv, 128).

        The layer's scales are fixed from these tokens if it has none yet. Blocks are taken from
        the free list as needed. All or nothing: if there are too few blocks, or the tokens are
        refused (a computed scale needs finite values), ValueError and nothing is changed.
        """
        self._known(seq_id)
        layer = self._layer(layer)
        self._check_tokens(k, "k")
        self._check_tokens(v, "v")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")
        start = self._lengths[seq_id][layer]
        end = start + k.shape[0]
        taken = self._reserve(seq_id, end)
        if k.shape[0] == 0:
            return
        k_scale, v_scale = self.k_scales[layer], self.v_scales[layer]
        if k_scale is None:  # the layer's first tokens: the scales are fixed only if the append succeeds
            k_scale, v_scale = (cal.apply_rule(self.rule, k, "k", "PagedHiF8Cache(scales=...)"),
                                cal.apply_rule(self.rule, v, "v", "PagedHiF8Cache(scales=...)"))
        k_codes, k_sat = encode(k, k_scale)
        v_codes, v_sat = encode(v, v_scale)
        blocks = self._blocks[seq_id] + taken
        slots = self._slots(blocks, start, end)
        # commit: nothing below refuses anything
        del self._free[len(self._free) - len(taken):]
        self._blocks[seq_id] = blocks
        self.k_scales[layer], self.v_scales[layer] = k_scale, v_scale
        self.k_codes[layer].view(-1, self.num_kv_heads, self.head_dim)[slots] = k_codes
        self.v_codes[layer].view(-1, self.num_kv_heads, self.head_dim)[slots] = v_codes
        self._saturated[layer] = self._saturated[layer] + k_sat + v_sat
        self._lengths[seq_id][layer] = end

    def _slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Flat (block * block_size + offset) slots of logical tokens [start, end)."""
        pos = torch.arange(start, end, device=self.device)
        table = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # ------------------------------------------------------------------ what the op takes

    def block_table(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 (B, max blocks) physical block indices; unused entries are 0 (a valid index)."""
        rows = [self._blocks[s] for s in self._known_ids(seq_ids)]
        width = max([len(r) for r in rows] + [1])
        table = torch.zeros(len(rows), width, dtype=torch.int32, device="cpu")  # filled on the host, then moved
        for b, r in enumerate(rows):
            table[b, :len(r)] = torch.tensor(r, dtype=torch.int32, device="cpu")
        return table.to(self.device)

    def seqused_kv(self, layer: int, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 (B,) tokens stored per sequence in ``layer``."""
        layer = self._layer(layer)
        return torch.tensor([self._lengths[s][layer] for s in self._known_ids(seq_ids)], dtype=torch.int32,
                            device=self.device)

    def gather(self, layer: int, seq_ids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k, v, seqused_kv)``: the sequences' codes copied out contiguously, BNSD
        (B, Nkv, max length, 128), zero past each length. For tests and debugging: the op reads
        the blocks in place."""
        used = self.seqused_kv(layer, seq_ids)
        longest = int(used.max()) if len(seq_ids) else 0
        out = []
        for store in (self.k_codes[layer], self.v_codes[layer]):
            dense = torch.zeros(len(seq_ids), self.num_kv_heads, longest, self.head_dim, dtype=torch.uint8,
                                device=self.device)
            for b, s in enumerate(seq_ids):
                n = int(used[b])
                slots = self._slots(self._blocks[s], 0, n)
                dense[b, :, :n] = store.view(-1, self.num_kv_heads, self.head_dim)[slots].transpose(0, 1)
            out.append(dense)
        return out[0], out[1], used

    def attend(self, layer: int, q: torch.Tensor, seq_ids: Sequence[Hashable], *, q_descale=None,
               cu_seqlens_q: torch.Tensor | None = None, layout_q: str = "TND", causal: bool = True,
               softmax_scale: float | None = None, calibration: cal.RuleLike | None = None,
               return_softmax_lse: bool = False, backend: str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The op on this layer's blocks for ``seq_ids``: ``quant_flash_attn(..., block_table=,
        seqused_kv=, layout_kv="PA_BBND")``.

        ``q`` is either HiF8 codes (uint8) with ``q_descale``, or float, quantised here with
        ``q_descale`` if given, else a scale from ``calibration``. ``layout_q`` is ``"TND"``
        (with ``cu_seqlens_q``, int32 (B + 1,)), ``"BSND"`` or ``"BNSD"``; the output comes back in
        it. ``causal`` is aligned bottom-right per sequence, so a decode step (one query) sees
        every stored key and a chunk of new queries sees the keys up to its own position
        (the chunk's keys must already be appended). Returns the op's ``(out, lse)``.

        Nothing in the cache changes (errors name attend's arguments, not the op's: the layer's
        scales are ``k_scale`` / ``v_scale``, see :meth:`scales`).
        """
        layer = self._layer(layer)
        check_bool(causal, "causal")
        ids = self._check_batch(q, seq_ids, layout_q, cu_seqlens_q)
        q_codes, q_descale = self.quantize_q(q, q_descale, calibration)
        k_scale, v_scale = self.scales(layer)
        with callers_words(_ATTEND_NAMES, _ATTEND_NOTES):
            return quant_flash_attn(
                q_codes, self.k_codes[layer], self.v_codes[layer], q_descale, k_scale, v_scale,
                QuantMode.HIF8_PER_TENSOR, block_table=self.block_table(ids), seqused_kv=self.seqused_kv(layer, ids),
                cu_seqlens_q=cu_seqlens_q, layout_q=layout_q, layout_kv="PA_BBND", layout_out=layout_q,
                mask_mode=MaskMode.CAUSAL if causal else MaskMode.NONE, softmax_scale=softmax_scale,
                return_softmax_lse=return_softmax_lse, backend=backend,
            )

    def _check_batch(self, q, seq_ids, layout_q, cu_seqlens_q) -> list:
        """``seq_ids`` as a list of known sequences, one per sequence of ``q``'s batch (the op
        would see a disagreement only in the lengths and block table built from the ids)."""
        ids = self._known_ids(seq_ids)
        if not ids:
            raise ValueError("seq_ids must name at least one sequence")
        if layout_q == "TND":
            if isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] != len(ids) + 1:
                raise ValueError(f"cu_seqlens_q must have len(seq_ids) + 1 = {len(ids) + 1} entries (one query "
                                 f"sequence per id), got {cu_seqlens_q.shape[0]}")
        elif isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] != len(ids):
            raise ValueError(f"q's batch (dim 0 of {layout_q} q, shape {tuple(q.shape)}) must be len(seq_ids) = "
                             f"{len(ids)}, got {q.shape[0]}")
        return ids

    def quantize_q(self, q: torch.Tensor, q_descale=None, calibration: cal.RuleLike | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, descale)`` of a query: codes pass through (``q_descale`` required), float
        queries are quantised with ``q_descale`` or a scale from ``calibration``."""
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.dtype == torch.uint8:
            if q_descale is None:
                raise ValueError("q holds HiF8 codes (uint8): pass its q_descale")
            return q, cal.check_scale(q_descale, "q_descale", q.device)
        check_float_tensor(q, "q")
        scale = (cal.compute_scale(q, calibration, name="q", static="q_descale=...") if q_descale is None
                 else cal.check_scale(q_descale, "q_descale", q.device))
        return cal.quantize(q, scale), scale
