"""``qfa bench vllm-layer``: one attention layer's step inside vLLM, qfa's backend beside CPU_ATTN.

::

    python -m qfa bench vllm-layer

What an engine runs per layer and step, through each backend's own impl classes on the same
Q/K/V, block table and slots: the cache write of the step's new keys and values
(``do_kv_cache_update``) and the attention (``forward``). qfa's backend writes and reads its HiF8
cache (scales fixed by the first write, the context's); vLLM's CPU_ATTN its bf16 cache (the
reference) and, where the CPU runs it, its fp8_e4m3 cache (scale 1.0). Shapes are the packaged
model's (Qwen2.5-1.5B: 12 query heads, 2 kv heads, hidden 1536, MLP 8960), blocks of 128 tokens
in a random order, the model dtype bf16.

Rows: decode steps (one new token per sequence) at each batch and context; the same batches with
a shared prefix, as ``qfa bench vllm`` times them (its batch's prompts differ in their last
``TAIL_TOKENS`` tokens, so vLLM's prefix cache gives every sequence the same blocks for the rest, and
those blocks stay in the CPU's caches from one sequence to the next); and a vLLM-shaped mixed
step (decodes beside one prefill chunk). Each row is timed in turns (one call of each
backend per round, the median of rounds) twice: back to back, and each call right after an
MLP-sized matmul (the step's hidden states times a bf16 (1536, 8960) weight), as a layer's
attention runs in a model, after the MLP of the layer before has evicted its data and code.
The whole-model picture, with prefill, sampling and the scheduler, is ``qfa bench vllm``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import types
from pathlib import Path

import torch

from qfa.tools import argtypes
from qfa.tools.bench.timing import interleaved_medians, markdown_table, set_threads
# the shared-prefix rows' sequences differ in their last TAIL_TOKENS context tokens, as `bench vllm`'s do
from qfa.tools.bench.vllm import TAIL_TOKENS

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 2, 128
HIDDEN, INTERMEDIATE = 1536, 8960
BLOCK_SIZE = 128
BATCHES = (1, 8)
CONTEXTS = (1024, 4096)
#: The mixed step: this many decodes at the first context beside one chunk of CHUNK new tokens.
MIXED_DECODES, CHUNK = 4, 256
MIN_RUNS, MIN_TOTAL_SECONDS, MAX_RUNS = 20, 1.0, 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=argtypes.positive_ints, default=list(BATCHES), help="decode batch sizes (default 1,8)")
    parser.add_argument("--contexts", type=argtypes.positive_ints, default=list(CONTEXTS),
                        help="context tokens per sequence (default 1024,4096)")
    parser.add_argument("--no-mixed", dest="mixed", action="store_false",
                        help=f"skip the mixed step ({MIXED_DECODES} decodes beside a {CHUNK}-token chunk)")
    parser.add_argument("--threads", type=argtypes.positive_int, default=None, help="torch's thread count (default: torch's own)")


class Step:
    """One step's batch: per sequence (context tokens, new tokens), its blocks in a random order
    of a cache with room for every sequence, and random bf16 Q/K/V (context and new tokens). The
    first ``shared_blocks`` blocks of every table are the same blocks (a prefix vLLM's prefix
    cache shares), written once."""

    def __init__(self, shapes: list[tuple[int, int]], seed: int = 0, shared_blocks: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        if not 0 <= shared_blocks <= min(c for c, _ in shapes) // BLOCK_SIZE:
            raise ValueError(f"shared_blocks must be in [0, {min(c for c, _ in shapes) // BLOCK_SIZE}] (full "
                             f"blocks of the shortest context), got {shared_blocks}")
        self.shared_blocks = shared_blocks
        per_seq = [-(-(c + n) // BLOCK_SIZE) for c, n in shapes]
        self.num_blocks = shared_blocks + sum(n - shared_blocks for n in per_seq)
        order = torch.randperm(self.num_blocks, generator=g).tolist()
        common = [order.pop() for _ in range(shared_blocks)]
        self.tables = [common + [order.pop() for _ in range(n - shared_blocks)] for n in per_seq]
        self.block_table = torch.zeros(len(shapes), max(per_seq), dtype=torch.int32)
        for b, t in enumerate(self.tables):
            self.block_table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
        news = [n for _, n in shapes]
        self.query_start_loc = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int32)
        self.seq_lens = torch.tensor([c + n for c, n in shapes], dtype=torch.int32)
        self.slots = torch.cat([self._slots(b, c, c + n) for b, (c, n) in enumerate(shapes)])
        # the shared blocks' tokens once, with the first sequence's
        starts = [0] + [shared_blocks * BLOCK_SIZE] * (len(shapes) - 1)
        self.context_slots = torch.cat([self._slots(b, s, c) for b, ((c, _), s) in enumerate(zip(shapes, starts))])
        tokens, context = sum(news), self.context_slots.numel()

        def rand(rows: int, heads: int, bias: float | torch.Tensor = 0.0) -> torch.Tensor:
            return (torch.randn(rows, heads, HEAD_DIM, generator=g) + bias).to(torch.bfloat16)

        # keys with a per-channel offset, as real keys have (what K smoothing is for)
        bias = torch.randn(HEAD_DIM, generator=g)
        self.q, self.k, self.v = rand(tokens, NUM_HEADS), rand(tokens, NUM_KV_HEADS, bias), rand(tokens, NUM_KV_HEADS)
        self.context_k, self.context_v = rand(context, NUM_KV_HEADS, bias), rand(context, NUM_KV_HEADS)
        self.hidden = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)

    def _slots(self, b: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return torch.tensor(self.tables[b], dtype=torch.int64)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    @property
    def tokens(self) -> int:
        return int(self.query_start_loc[-1])


def _common(step: Step):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    news = [n for _, n in step.shapes]
    return CommonAttentionMetadata(
        query_start_loc=step.query_start_loc, query_start_loc_cpu=step.query_start_loc, seq_lens=step.seq_lens,
        num_reqs=len(step.shapes), num_actual_tokens=step.tokens, max_query_len=max(news),
        max_seq_len=int(step.seq_lens.max()), block_table_tensor=step.block_table, slot_mapping=step.slots)


def qfa_layer(step: Step, stack: contextlib.ExitStack):
    """qfa's backend on ``step``: its context written, then a callable running the step's
    ``do_kv_cache_update`` and ``forward`` into its ``output`` attribute (tokens, heads x 128). The
    step's forward context (which an engine sets once for all its layers) is entered on ``stack``."""
    from vllm.config import AttentionConfig, CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from qfa.integrations.vllm import backend as qb

    config = VllmConfig(attention_config=AttentionConfig(backend=AttentionBackendEnum.CUSTOM),
                        cache_config=CacheConfig(cache_dtype="fp8"), additional_config={"qfa": {}})
    with set_current_vllm_config(config):
        impl = qb.QfaHiF8Impl(NUM_HEADS, HEAD_DIM, 1 / math.sqrt(HEAD_DIM), NUM_KV_HEADS, None, None, "fp8")
    layer = types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    cache = torch.zeros(step.num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.uint8)
    metadata = qb.make_metadata(_common(step), NUM_HEADS, NUM_KV_HEADS)
    output = torch.empty(step.tokens, NUM_HEADS * HEAD_DIM, dtype=torch.bfloat16)
    query = step.q.view(step.tokens, -1)
    stack.enter_context(set_forward_context(metadata, config))
    impl.do_kv_cache_update(layer, step.context_k, step.context_v, cache, step.context_slots)

    def run() -> None:
        impl.do_kv_cache_update(layer, step.k, step.v, cache, step.slots)
        impl.forward(layer, query, step.k, step.v, cache, metadata, output=output)
    run.output = output  # what it writes (the tests compare the backends on it)
    return run


def cpu_attn_layer(step: Step, kv_cache_dtype: str):
    """vLLM's CPU_ATTN on ``step`` with its ``kv_cache_dtype`` cache ("auto": the model's bf16;
    "fp8_e4m3": scale 1.0), as its metadata builder and impl run it."""
    from vllm import _custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata, _get_attn_isa

    config = VllmConfig()
    config.model_config = types.SimpleNamespace(dtype=torch.bfloat16)  # all the impl reads of it
    with set_current_vllm_config(config):
        impl = CPUAttentionBackendImpl(NUM_HEADS, HEAD_DIM, 1 / math.sqrt(HEAD_DIM), NUM_KV_HEADS, None, None,
                                       kv_cache_dtype)
    isa = _get_attn_isa(torch.bfloat16, BLOCK_SIZE, HEAD_DIM, kv_cache_dtype)
    layer = types.SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8
    cache = torch.zeros(step.num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=dtype)
    news = [n for _, n in step.shapes]
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(step.shapes), num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        seq_lens=step.seq_lens, dtype=torch.bfloat16, query_start_loc=step.query_start_loc, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=False, kv_cache_dtype=kv_cache_dtype)
    metadata = CPUAttentionMetadata(
        num_actual_tokens=step.tokens, max_query_len=max(news), query_start_loc=step.query_start_loc,
        max_seq_len=int(step.seq_lens.max()), seq_lens=step.seq_lens, block_table=step.block_table,
        slot_mapping=step.slots, scheduler_metadata=schedule, causal=True)
    output = torch.empty(step.tokens, NUM_HEADS * HEAD_DIM, dtype=torch.bfloat16)
    impl.do_kv_cache_update(layer, step.context_k, step.context_v, cache, step.context_slots)

    def run() -> None:
        impl.do_kv_cache_update(layer, step.k, step.v, cache, step.slots)
        impl.forward(layer, step.q, step.k, step.v, cache, metadata, output=output)
    run.output = output
    return run


def fp8_cache_runs() -> bool:
    """Whether CPU_ATTN takes an fp8 cache on this CPU (it needs AVX-512 or AMX)."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def measure(step: Step) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per backend, back to back and right after an MLP-sized matmul."""
    with contextlib.ExitStack() as stack:
        fns = {"qfa": qfa_layer(step, stack), "bf16": cpu_attn_layer(step, "auto")}
        if fp8_cache_runs():
            fns["fp8"] = cpu_attn_layer(step, "fp8_e4m3")
        weight = torch.randn(HIDDEN, INTERMEDIATE).to(torch.bfloat16)
        hot = interleaved_medians(fns, min_runs=MIN_RUNS, min_total=MIN_TOTAL_SECONDS, max_runs=MAX_RUNS)
        in_model = interleaved_medians(fns, min_runs=MIN_RUNS, min_total=MIN_TOTAL_SECONDS, max_runs=MAX_RUNS,
                                       before=lambda: step.hidden @ weight)
    return hot, in_model


def steps(batches, contexts, mixed: bool) -> list[tuple[str, Step]]:
    out = [(f"decode, {b} x {c}", Step([(c, 1)] * b)) for c in contexts for b in batches]
    out += [(f"decode, {b} x {c}, prefix shared", Step([(c, 1)] * b, shared_blocks=(c - TAIL_TOKENS) // BLOCK_SIZE))
            for c in contexts for b in batches if b > 1 and (c - TAIL_TOKENS) // BLOCK_SIZE > 0]
    if mixed:
        c = contexts[-1]
        out.append((f"mixed: {MIXED_DECODES} decodes at {c} + a {CHUNK}-token chunk after {c}",
                    Step([(c, 1)] * MIXED_DECODES + [(c, CHUNK)])))
    return out


def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM is not installed (pip install 'qfa[vllm]'): nothing to measure")
        return 1
    from tqdm import tqdm

    from qfa.attention.backends import cpu_kernel, cpu_prepare
    from qfa.tools.bench.attention import cpu_description

    set_threads(args.threads)
    fp8 = fp8_cache_runs()
    headers = ["step", "qfa us", "CPU_ATTN bf16 us", "qfa / bf16"] + (["CPU_ATTN fp8 us", "qfa / fp8"] if fp8 else [])
    tables: dict[str, list] = {"back to back": [], "after an MLP-sized matmul": []}
    for name, step in tqdm(steps(args.batches, args.contexts, args.mixed), desc="vllm-layer", unit="step"):
        for rows, t in zip(tables.values(), measure(step)):
            row = [name, f"{t['qfa'] * 1e6:.0f}", f"{t['bf16'] * 1e6:.0f}", f"{t['qfa'] / t['bf16']:.2f}x"]
            if fp8:
                row += [f"{t['fp8'] * 1e6:.0f}", f"{t['qfa'] / t['fp8']:.2f}x"]
            rows.append(row)
    cpu = cpu_description(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
    import vllm

    print(f"one attention layer's step (do_kv_cache_update + forward), heads {NUM_HEADS}:{NUM_KV_HEADS}, blocks of "
          f"{BLOCK_SIZE}, bf16 model, on {cpu}")
    print(f"torch {torch.__version__}, vLLM {vllm.__version__}, {torch.get_num_threads()} threads; qfa: "
          f"{'native kernel ' + cpu_kernel.cpu_capability() if cpu_kernel.available() else 'torch path'}, "
          f"preparation {cpu_prepare.ISA_NAMES[cpu_prepare.isa_level()] if cpu_prepare.available() else 'torch'}; "
          "medians of rounds taking one call of each in turn")
    for title, rows in tables.items():
        print(f"\n{title}:")
        print(markdown_table(headers, rows))
    return 0
