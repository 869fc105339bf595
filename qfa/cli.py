"""``python -m qfa`` / ``qfa``: the demo, the benchmarks, the perplexity evaluation and generation.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) ->
int``; this file only wires them up, importing a module when its command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: command -> (module, one-line help)
COMMANDS = {
    "demo": ("qfa.tools.demo", "HiF8 vs FP8 E4M3 on a built-in LLM-like workload: codec and attention error, speed, chart"),
    "eval-ppl": ("qfa.tools.eval_ppl", "perplexity / top-1 agreement / KL of attention implementations on a local model"),
    "generate": ("qfa.tools.generate", "prefill + greedy decode per attention implementation: tokens/s, KV-cache bytes, "
                 "agreement"),
    "calibrate": ("qfa.tools.calibrate", "measure each layer's HiF8 KV-cache scales and key means for the vLLM plugin"),
}
#: Commands whose arguments go to another program's parser as they are.
PASSTHROUGH = {"serve": ("qfa.integrations.vllm.serve", "vLLM's OpenAI-compatible server with qfa's HiF8 KV cache "
                         "(qfa serve MODEL [--calibration FILE] [vllm serve arguments])")}
BENCHES = {
    "cast": ("qfa.tools.bench.cast", "HiF8 encode/decode throughput vs torch's native fp8 cast and a copy"),
    "attention": ("qfa.tools.bench.attention", "quant_flash_attn torch path vs SDPA: time, GFLOP/s, memory, accuracy"),
    "calibration": ("qfa.tools.bench.calibration", "calibration rules measured on a real model's attention activations"),
    "vllm": ("qfa.tools.bench.vllm", "vLLM with qfa's HiF8 KV cache vs its bf16 and fp8 caches: capacity, accuracy, speed"),
    "vllm-layer": ("qfa.tools.bench.vllm_layer", "one attention layer's step in vLLM: qfa's backend vs CPU_ATTN's "
                   "bf16 and fp8 caches"),
    "dropin": ("qfa.tools.bench.dropin", "qfa.hif8_attention with its defaults vs SDPA in the same dtype: time, "
               "preparation share, load"),
}


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_text: str, chosen: bool) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module)
    if chosen:  # only the command that runs is imported; heavy imports wait for its run()
        importlib.import_module(module).add_arguments(parser)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    words = [w for w in argv if not w.startswith("-")]
    parser = argparse.ArgumentParser(prog="qfa", description="HiFloat8 quantized attention for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text, chosen=words[:1] == [name])
    for name, (_, help_text) in PASSTHROUGH.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks (ratios against references measured in the same run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHES.items():
        _add(bench_sub, name, module, help_text, chosen=words[:2] == ["bench", name])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in PASSTHROUGH:
        return int(importlib.import_module(PASSTHROUGH[argv[0]][0]).main(argv[1:]) or 0)
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)
