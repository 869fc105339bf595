"""``python -m qfa bench calibration``: per-tensor scale rules measured on a real model's attention.

It runs one forward pass of a local transformers model (a folder, or a GGUF file inside it) on
``--tokens`` tokens of a text file, records every selected layer's post-RoPE Q, K, V as the
attention function receives them (BNSD, K/V not repeated for GQA), then, per calibration rule,
with and without K smoothing, runs :func:`qfa.hif8_attention` (the real ``quant_flash_attn``) on
them and compares with exact fp32 attention on the unquantised inputs. The table gives the mean
over layers of the output's cosine similarity and relative L2 error, and the worst layer's
relative L2 error. For scale, the first rows show bf16 SDPA on the same inputs (the precision the
model runs in) and the per-tensor FP8 E4M3 emulation (``qfa.dropin.fp8_emulation``).

Example::

    HF_HUB_OFFLINE=1 python -m qfa bench calibration --model /tmp/qwen_gguf \\
        --gguf qwen2.5-coder-1.5b-instruct.gguf --text /usr/share/common-licenses/GPL-3 --tokens 512
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time
from typing import Iterable, Optional, Sequence

import torch

from qfa.tools.metrics import error_metrics
from qfa.tools.models import load_model, resolve_model
from qfa.tools.text import read_text

CAPTURE_NAME = "qfa_capture"


@dataclasses.dataclass
class Capture:
    """One layer's attention inputs (BNSD, as the model's dtype) and its softmax scale."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float


@dataclasses.dataclass
class Row:
    method: str
    smooth_k: Optional[bool]
    cosine: float
    rel_l2: float
    worst_rel_l2: float
    worst_layer: int
    seconds: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="transformers model folder (or the folder holding --gguf), .gguf file, or packaged model")
    parser.add_argument("--gguf", default=None, help="GGUF file name inside --model (dequantised on load)")
    parser.add_argument("--text", default=None, help="UTF-8 text file (gzip read transparently)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of --text to run (default 512)")
    parser.add_argument("--skip-tokens", type=int, default=0, help="tokens to skip at the start of --text")
    parser.add_argument("--layers", default="all", help="'all' or a list like '0,3,8-12' (default all)")
    parser.add_argument("--rules", default=None, help="comma-separated calibration rules (default: all registered)")
    parser.add_argument("--backend", default=None, choices=("torch", "triton"), help="quant_flash_attn backend")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="model dtype (default bfloat16)")
    parser.add_argument("--save-captures", default=None, metavar="FILE",
                        help="also save the recorded Q/K/V to FILE (torch.save) for later runs")
    parser.add_argument("--load-captures", default=None, metavar="FILE",
                        help="measure Q/K/V saved by --save-captures instead of running a model")


# ----------------------------------------------------------------------------- inputs

def parse_layers(spec: str, num_layers: int) -> list[int]:
    """'all' or '0,3,8-12' -> sorted layer indices, each checked against ``num_layers``."""
    if spec.strip().lower() == "all":
        return list(range(num_layers))
    layers: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            layers.update(range(int(lo), int(hi) + 1))
        else:
            layers.add(int(part))
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad or not layers:
        raise ValueError(f"--layers must name layers in [0, {num_layers - 1}], got {spec!r}")
    return sorted(layers)


def capture_attention_inputs(model, input_ids: torch.Tensor, layers: Optional[Iterable[int]] = None) -> list[Capture]:
    """Run ``model`` once and record each selected layer's attention inputs (post-RoPE Q, K, V).

    Registers an attention function (``qfa_capture``) with transformers' ``AttentionInterface``
    that copies its inputs and then runs SDPA, so the forward pass itself is unchanged.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    wanted = None if layers is None else set(layers)
    records: list[Capture] = []

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        idx = getattr(module, "layer_idx", len(records))
        if wanted is None or idx in wanted:
            scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
            records.append(Capture(idx, query.detach().clone(), key.detach().clone(), value.detach().clone(),
                                   float(scale)))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(CAPTURE_NAME, capture)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE_NAME, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return records


# ----------------------------------------------------------------------------- measuring

def exact_attention(c: Capture) -> torch.Tensor:
    """fp32 causal attention on the unquantised inputs (BNSD, GQA), the reference."""
    return torch.nn.functional.scaled_dot_product_attention(
        c.q.float(), c.k.float(), c.v.float(), is_causal=True, scale=c.scaling, enable_gqa=True
    )


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(cosine, relative L2) of a layer's output against its reference."""
    return error_metrics(out, ref)[:2]


def _row(method, smooth_k, per_layer: list[tuple[int, float, float]], seconds) -> Row:
    worst = max(per_layer, key=lambda t: t[2])
    n = len(per_layer)
    return Row(method, smooth_k, sum(t[1] for t in per_layer) / n, sum(t[2] for t in per_layer) / n,
               worst[2], worst[0], seconds)


#: Suffix of the rows measured with the Hadamard rotation.
ROTATED = " + rotation"


def measure(captures: Sequence[Capture], rules: Sequence[str], smooth_options: Sequence[bool] = (False, True),
            backend: Optional[str] = None, progress: bool = False) -> list[Row]:
    """Rows of the table: bf16 SDPA, then each (rule, smooth_k), errors against exact fp32 attention."""
    from qfa.attention import hif8_attention

    refs = [exact_attention(c) for c in captures]
    rows = []
    t0 = time.perf_counter()
    base = []
    for c, ref in zip(captures, refs):
        out = torch.nn.functional.scaled_dot_product_attention(
            c.q.bfloat16(), c.k.bfloat16(), c.v.bfloat16(), is_causal=True, scale=c.scaling, enable_gqa=True
        )
        base.append((c.layer, *_errors(out, ref)))
    rows.append(_row("bf16 SDPA (no quantisation)", None, base, time.perf_counter() - t0))
    try:  # the per-tensor FP8 E4M3 emulation (amax / 448, P scaled by 448), for scale
        from qfa.dropin.fp8_emulation import fp8_e4m3_attention
    except ImportError:
        fp8_e4m3_attention = None
    # The Hadamard rotation (the drop-in's default) is measured with K smoothing only.
    variants = [(smooth, False) for smooth in smooth_options] + [(True, True)] * (True in smooth_options)
    if fp8_e4m3_attention is not None:
        for smooth, rotate in variants:
            t0 = time.perf_counter()
            per_layer = [(c.layer, *_errors(fp8_e4m3_attention(c.q, c.k, c.v, is_causal=True, scale=c.scaling,
                                                                smooth_k=smooth, rotate=rotate), ref))
                         for c, ref in zip(captures, refs)]
            rows.append(_row("FP8 E4M3 amax/448 (emulated)" + ROTATED * rotate, smooth, per_layer,
                             time.perf_counter() - t0))
    for rule in rules:
        for smooth, rotate in variants:
            t0 = time.perf_counter()
            per_layer = []
            for c, ref in zip(captures, refs):
                out = hif8_attention(c.q, c.k, c.v, is_causal=True, softmax_scale=c.scaling, calibration=rule,
                                     smooth_k=smooth, backend=backend, rotate=rotate)
                per_layer.append((c.layer, *_errors(out, ref)))
            rows.append(_row(f"HiF8 {rule}" + ROTATED * rotate, smooth, per_layer, time.perf_counter() - t0))
            if progress:
                r = rows[-1]
                print(f"  {r.method:<12} smooth_k={smooth!s:<5} rel L2 {r.rel_l2:.5f}", file=sys.stderr, flush=True)
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """Markdown table of ``rows``."""
    lines = [
        "| method | K smoothing | mean cosine | mean rel. L2 | worst layer rel. L2 (layer) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        smooth = "-" if r.smooth_k is None else ("yes" if r.smooth_k else "no")
        lines.append(f"| {r.method} | {smooth} | {r.cosine:.6f} | {r.rel_l2:.5f} | {r.worst_rel_l2:.5f} ({r.worst_layer}) |")
    return "\n".join(lines)


def best_rule(rows: Sequence[Row], smooth_k: bool = True) -> Optional[str]:
    """The rule with the lowest mean relative L2 error for the given smoothing setting."""
    cands = [r for r in rows if r.smooth_k is smooth_k and r.method.startswith("HiF8 ")]
    if not cands:
        return None
    return min(cands, key=lambda r: r.rel_l2).method.removeprefix("HiF8 ").removesuffix(ROTATED)


# ----------------------------------------------------------------------------- the command

def _load_and_capture(args) -> tuple[list[Capture], str]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.model or not args.text:
        raise ValueError("--model and --text are required (unless --load-captures is given)")
    if args.tokens < 2:
        raise ValueError(f"--tokens must be at least 2, got {args.tokens}")
    folder, gguf, label = resolve_model(args.model, args.gguf)
    t0 = time.perf_counter()
    print(f"loading {label} ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model(folder, gguf, getattr(torch, args.dtype))
    print(f"loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    ids = tokenizer(read_text(args.text), return_tensors="pt").input_ids
    ids = ids[:, args.skip_tokens: args.skip_tokens + args.tokens]
    if ids.shape[1] < args.tokens:
        print(f"warning: {args.text} holds only {ids.shape[1]} tokens after skipping", file=sys.stderr)
    cfg = model.config
    layers = parse_layers(args.layers, cfg.num_hidden_layers)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    captures = capture_attention_inputs(model, ids, layers)
    del model
    gc.collect()
    desc = (
        f"model {label}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q heads, "
        f"{cfg.num_key_value_heads} kv heads, head_dim {head_dim}; text {os.path.basename(args.text)}, "
        f"{ids.shape[1]} tokens (skipped {args.skip_tokens}); {len(captures)} layers measured"
    )
    return captures, desc


def run(args: argparse.Namespace) -> int:
    from qfa.dropin import calibration as cal

    rules = list(cal.RULES) if args.rules is None else [r.strip() for r in args.rules.split(",") if r.strip()]
    for r in rules:
        cal.get_rule(r)  # ValueError naming unknown rules before the slow load
    if args.load_captures:
        saved = torch.load(args.load_captures)
        captures = [Capture(**c) for c in saved["captures"]]
        desc = saved["desc"]
        if args.layers != "all":
            keep = set(parse_layers(args.layers, max(c.layer for c in captures) + 1))
            captures = [c for c in captures if c.layer in keep]
    else:
        captures, desc = _load_and_capture(args)
    if args.save_captures:
        torch.save({"desc": desc, "captures": [dataclasses.asdict(c) for c in captures]}, args.save_captures)
    print(f"{desc}; errors vs exact fp32 attention on the unquantised inputs, causal, p_scale 1", flush=True)
    rows = measure(captures, rules, backend=args.backend, progress=True)
    print(format_table(rows))
    print(f"\nlowest mean rel. L2 with K smoothing: {best_rule(rows, True)}; "
          f"without: {best_rule(rows, False)}; current default: {cal.DEFAULT_RULE}")
    return 0
