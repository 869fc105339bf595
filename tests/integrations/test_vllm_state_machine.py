"""The vLLM backend as a stateful system: random sequences growing in a paged cache, written
through ``do_kv_cache_update`` (valid calls and rejected ones), attended through ``forward``
(twice per step: the second call runs the plan the first one checked), and freed, against a
model that only remembers each sequence's float tokens. After every step every stored token's
codes are what the layer's frozen state makes of it, and a rejected call has left the cache and
the state as they were; attention equals the contiguous op on the model's codes, bit for bit. CI
runs the derandomised profile, ``QFA_HYPOTHESIS_PROFILE=long`` the long one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM extra is not installed (pip install 'qfa[vllm]')")

from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from qfa.dropin import calibration as cal  # noqa: E402
from qfa.dropin import rotation  # noqa: E402
from qfa.attention.op import quant_flash_attn  # noqa: E402
from qfa.integrations.vllm import backend as qb  # noqa: E402
from qfa.tiling.spec import MaskMode, QuantMode  # noqa: E402
from test_vllm_backend import NKV, NQ, SCALE, Layer, vllm_config  # noqa: E402

D, BLOCK, BLOCKS = 128, 16, 10


class BackendMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.config = vllm_config()
        with set_current_vllm_config(self.config):
            self.impl = qb.QfaHiF8Impl(NQ, D, SCALE, NKV, None, None, "fp8")
        self.cache = torch.zeros(BLOCKS, NKV, BLOCK, 2 * D, dtype=torch.uint8)
        self.free = list(range(BLOCKS))
        self.seqs: dict[int, dict] = {}  # id -> {"blocks": [...], "k": tensor, "v": tensor}
        self.next_id = 0
        self.seed = 0
        self.q_first = None

    # ------------------------------------------------------------------ helpers

    def tokens(self, n: int, heads: int = NKV) -> torch.Tensor:
        self.seed += 1
        return torch.randn(n, heads, D, generator=torch.Generator().manual_seed(self.seed)) * 2 + 1

    def slots(self, seq: dict, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return torch.tensor(seq["blocks"])[pos // BLOCK] * BLOCK + pos % BLOCK

    def context(self, metadata=None):
        dummy = metadata or qb.make_metadata(self.common([0], {0: {"blocks": [0], "k": torch.zeros(1)}}, [1]), NQ, NKV)
        return set_current_vllm_config(self.config), set_forward_context(dummy, self.config)

    def common(self, ids, seqs, news) -> CommonAttentionMetadata:
        cu = torch.tensor([0, *np.cumsum(news).tolist()], dtype=torch.int32)
        lens = torch.tensor([seqs[i]["k"].shape[0] for i in ids], dtype=torch.int32)
        width = max(len(seqs[i]["blocks"]) for i in ids)
        table = torch.zeros(len(ids), width, dtype=torch.int32)
        for b, i in enumerate(ids):
            table[b, :len(seqs[i]["blocks"])] = torch.tensor(seqs[i]["blocks"], dtype=torch.int32)
        return CommonAttentionMetadata(query_start_loc=cu, query_start_loc_cpu=cu, seq_lens=lens, num_reqs=len(ids),
                                       num_actual_tokens=int(cu[-1]), max_query_len=max(news),
                                       max_seq_len=int(lens.max()), block_table_tensor=table,
                                       slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.long))

    def write(self, key, value, slots):
        a, b = self.context()
        with a, b:
            self.impl.do_kv_cache_update(Layer(), key, value, self.cache, slots)

    # ------------------------------------------------------------------ rules

    def step_tokens(self, n: int, form: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's keys and values in one of the forms an engine hands over: fp32 or bf16 rows,
        or (as vLLM) the key and value parts of a fused qkv projection's bf16 rows."""
        k, v = self.tokens(n), self.tokens(n)
        if form == "fp32":
            return k, v
        if form == "bf16":
            return k.bfloat16(), v.bfloat16()
        qkv = torch.cat([self.tokens(n, NQ), k, v], dim=1).bfloat16()
        return qkv[:, NQ:NQ + NKV], qkv[:, NQ + NKV:]

    @rule(n=st.integers(1, 40), form=st.sampled_from(["fp32", "bf16", "qkv view"]),
          slot_dtype=st.sampled_from([torch.int64, torch.int32]))
    def append(self, n, form, slot_dtype):
        """A new sequence, or tokens appended to one, written like vLLM writes a step."""
        if self.seqs and self.seed % 2:
            sid = sorted(self.seqs)[self.seed % len(self.seqs)]
        else:
            sid, self.next_id = self.next_id, self.next_id + 1
            self.seqs[sid] = {"blocks": [], "k": self.tokens(0), "v": self.tokens(0)}
        seq = self.seqs[sid]
        old = seq["k"].shape[0]
        need = -(-(old + n) // BLOCK) - len(seq["blocks"])
        if need > len(self.free):
            if old == 0:
                del self.seqs[sid]
            return  # the scheduler would not schedule it
        seq["blocks"] += [self.free.pop() for _ in range(need)]
        k, v = self.step_tokens(n, form)
        self.write(k, v, self.slots(seq, old, old + n).to(slot_dtype))
        seq["k"], seq["v"] = torch.cat([seq["k"], k.float()]), torch.cat([seq["v"], v.float()])

    @rule(kind=st.sampled_from(["slot beyond the cache", "slot named twice", "wrong heads", "value shorter"]),
          n=st.integers(1, 8))
    def rejected_write(self, kind, n):
        before_cache = self.cache.clone()
        before_state = None if self.impl.state is None else (self.impl.state.k_scale.clone(),
                                                              self.impl.state.v_scale.clone(),
                                                              self.impl.state.saturated)
        k, v = self.tokens(n), self.tokens(n)
        slots = torch.arange(n)
        if kind == "slot beyond the cache":
            slots = slots + BLOCKS * BLOCK - n // 2
        elif kind == "slot named twice":
            slots[-1] = slots[0]
            if n == 1:  # two tokens at least
                k, v, slots = torch.cat([k, k]), torch.cat([v, v]), torch.cat([slots, slots])
        elif kind == "wrong heads":
            k = self.tokens(n, NKV + 1)
        else:
            v = v[:-1]
        with pytest.raises(ValueError):
            self.write(k, v, slots)
        assert torch.equal(self.cache, before_cache), f"a rejected write ({kind}) changed the cache"
        after = self.impl.state
        if before_state is None:
            assert after is None, f"a rejected write ({kind}) fixed the layer's state"
        else:
            assert torch.equal(after.k_scale, before_state[0]) and after.saturated == before_state[2]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def attend(self, data):
        """The last ``new`` tokens of some sequences as this step's queries (all already written)."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, max_size=3, unique=True))
        news = [data.draw(st.integers(1, min(self.seqs[i]["k"].shape[0], 20))) for i in ids]
        q = self.tokens(sum(news), NQ)
        metadata = qb.make_metadata(self.common(ids, self.seqs, news), NQ, NKV)
        out = torch.full((q.shape[0], NQ * D), float("nan"))
        a, b = self.context(metadata)
        with a, b:
            self.impl.forward(Layer(), q.reshape(-1, NQ * D), None, None, self.cache, metadata, out)
        # the step's next layer (here the same one again) runs the plan the first call checked
        again = torch.full_like(out, float("nan"))
        a, b = self.context(metadata)
        with a, b:
            self.impl.forward(Layer(), q.reshape(-1, NQ * D), None, None, self.cache, metadata, again)
        assert torch.equal(again, out), "a step's later layer gave other bits than its first"
        state = self.impl.state
        k = torch.cat([self.seqs[i]["k"] for i in ids])
        v = torch.cat([self.seqs[i]["v"] for i in ids])
        lens = [self.seqs[i]["k"].shape[0] for i in ids]
        cu_kv = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
        qr = rotation.rotate(q)
        q_scale = self.impl.q_scale  # static per layer: fixed by the layer's first call
        assert q_scale is not None, "a successful call left the layer without its query scale"
        if self.q_first is None:
            self.q_first = q_scale.clone()
        assert torch.equal(q_scale, self.q_first), "the static query scale moved after the first call"
        o, _ = quant_flash_attn(cal.quantize(qr, q_scale), state.encode_keys(k)[0], state.encode_values(v)[0],
                                q_scale, state.k_scale, state.v_scale, QuantMode.HIF8_PER_TENSOR,
                                cu_seqlens_q=metadata.cu_seqlens_q, cu_seqlens_kv=cu_kv, layout="TND",
                                mask_mode=MaskMode.CAUSAL, softmax_scale=SCALE)
        assert torch.equal(out.view(-1, NQ, D), rotation.rotate(o))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free_sequence(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.free += self.seqs.pop(sid)["blocks"]

    # ------------------------------------------------------------------ invariants

    @invariant()
    def blocks_are_conserved(self):
        owned = [b for s in self.seqs.values() for b in s["blocks"]]
        assert len(owned) == len(set(owned)) and sorted(owned + self.free) == list(range(BLOCKS))

    @invariant()
    def stored_codes_are_the_states_codes_of_the_tokens(self):
        state = self.impl.state
        if state is None:
            assert not any(s["k"].shape[0] for s in self.seqs.values())
            return
        k_view, v_view = qb.cache_views(self.cache)
        for seq in self.seqs.values():
            n = seq["k"].shape[0]
            if n == 0:
                continue
            slots = self.slots(seq, 0, n)
            assert torch.equal(k_view[slots // BLOCK, :, slots % BLOCK], state.encode_keys(seq["k"])[0])
            assert torch.equal(v_view[slots // BLOCK, :, slots % BLOCK], state.encode_values(seq["v"])[0])


TestBackendMachine = BackendMachine.TestCase
