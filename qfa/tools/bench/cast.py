"""``qfa bench cast``: HiF8 encode/decode throughput beside torch's native fp8 cast and a copy.

Throughput is (input bytes + output bytes) / time, the Ascend cast op's formula. Every figure
is the median of several rounds that time each operation once in turn, in the same process as
its references (a shared host's slow minutes fall on all alike), and the ratios are what to
compare across machines. The header names the CPU and the encode path that ran (on
CPU the native encoder at the best SIMD level the CPU has, see qfa.attention.backends.cpu_prepare);
``--levels`` adds the encode ratio of every lower native level and of the torch path (the
compiled table gather), so one run shows what each path gives on this CPU. The verdict line is
the target: encode >= 1.5x the native fp8 cast from 1M elements.
"""

from __future__ import annotations

import argparse

import torch

from qfa.tools import argtypes
from qfa.tools.bench.timing import human_count, interleaved_medians, markdown_table, parse_count, set_threads
from qfa.cast import decode_from_hifloat8, encode_to_hifloat8

DEFAULT_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
FP8 = torch.float8_e4m3fn
#: The encode target: at least this many times the fp8 cast's throughput, from TARGET_MIN elements.
TARGET_RATIO = 1.5
TARGET_MIN = 1 << 20


def _sizes(text: str) -> list[int]:
    try:
        return [parse_count(item) for item in text.split(",")]
    except ValueError as exc:  # argparse prints this message, with usage, and exits 2
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=_sizes, default=list(DEFAULT_SIZES),
                        help="comma-separated element counts, plain or with K/M (2^10/2^20) suffixes "
                             f"(default: {','.join(human_count(n) for n in DEFAULT_SIZES)})")
    parser.add_argument("--backend", default=None, choices=("torch", "triton"), help="default: by device")
    parser.add_argument("--device", type=argtypes.device, default="cpu")
    parser.add_argument("--threads", type=argtypes.positive_int, default=None,
                        help="torch's thread count for every operation (default: torch's own)")
    parser.add_argument("--levels", action="store_true",
                        help="CPU: also the encode of every lower native SIMD level and of the torch path")


def _encode_variants(device: str, backend: str | None) -> dict:
    """Extra encode paths for ``--levels``: name -> a context manager factory that selects it
    (each lower native level, and the torch path)."""
    import contextlib
    import os

    from qfa.attention.backends import cpu_kernel, cpu_prepare

    @contextlib.contextmanager
    def level(isa: int):
        before = cpu_prepare.ISA
        cpu_prepare.ISA = isa
        try:
            yield
        finally:
            cpu_prepare.ISA = before

    @contextlib.contextmanager
    def torch_path():
        before = os.environ.get(cpu_kernel.ENV_VAR)
        os.environ[cpu_kernel.ENV_VAR] = "0"
        try:
            yield
        finally:
            if before is None:
                del os.environ[cpu_kernel.ENV_VAR]
            else:
                os.environ[cpu_kernel.ENV_VAR] = before

    out = {}
    if device == "cpu" and backend in (None, "torch") and cpu_prepare.available():
        out.update({f"encode {cpu_prepare.ISA_NAMES[i]}": (lambda i=i: level(i)) for i in range(cpu_prepare.isa_level())})
        out["encode torch path"] = torch_path
    return out


def encode_path(device: str, backend: str | None) -> str:
    """What ``encode_to_hifloat8`` runs for a large bf16 tensor on ``device``."""
    from qfa import backends

    chosen = backends.resolve(torch.device(device), backend)
    if chosen == "triton":
        return "Triton kernel"
    from qfa.attention.backends import cpu_prepare

    if device == "cpu" and cpu_prepare.available():
        level = cpu_prepare.isa_level()
        how = "vpermi2w register tables" if cpu_prepare.ISA_NAMES[level] == "AVX-512" else "a 65536-entry code table"
        pages = ("huge pages asked for" if cpu_prepare.huge_pages()
                 else "no huge-page hint: this guest's balloon reports free pages")
        return f"native encoder, {cpu_prepare.ISA_NAMES[level]} ({how}; large outputs: {pages})"
    return "torch path (a table gather, TorchInductor-compiled)"


def measure(n: int, device: str = "cpu", backend: str | None = None, levels: bool = False) -> dict[str, float]:
    """GB/s of each operation on ``n`` bf16 elements (2 bytes in, 1 byte out per direction)."""
    x = (torch.randn(n, device=device) * 4).to(torch.bfloat16)
    codes = encode_to_hifloat8(x, backend=backend)
    fp8 = x.to(FP8)
    ops = {
        "encode": (lambda: encode_to_hifloat8(x, backend=backend), 3),
        "decode": (lambda: decode_from_hifloat8(codes, torch.bfloat16, backend=backend), 3),
        "round trip": (lambda: decode_from_hifloat8(encode_to_hifloat8(x, backend=backend), backend=backend), 4),
        "fp8 encode": (lambda: x.to(FP8), 3),
        "fp8 decode": (lambda: fp8.to(torch.bfloat16), 3),
        "fp8 round trip": (lambda: x.to(FP8).to(torch.bfloat16), 4),
        "copy": (lambda: x.clone(), 4),
    }
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(fn, setting=None):
        def call():
            if setting is None:
                fn()
            else:
                with setting():
                    fn()
            sync()
        return call

    fns = {name: timed(fn) for name, (fn, _) in ops.items()}
    volume = {name: bytes_per for name, (_, bytes_per) in ops.items()}
    if levels:
        for name, setting in _encode_variants(device, backend).items():
            fns[name], volume[name] = timed(ops["encode"][0], setting), 3
    medians = interleaved_medians(fns, min_runs=7, min_total=0.5, max_runs=60)
    return {name: volume[name] * n / seconds / 1e9 for name, seconds in medians.items()}


def run(args: argparse.Namespace) -> int:
    rows = []
    from pathlib import Path

    from tqdm import tqdm

    from qfa.tools.bench.attention import cpu_description

    set_threads(args.threads)
    extra: list[str] = []
    met = []
    for n in tqdm(args.sizes, desc="bench cast", unit="size", leave=False):
        r = measure(n, args.device, args.backend, args.levels)
        extra = [name for name in r if name.startswith("encode ")]
        ratio = r["encode"] / r["fp8 encode"]
        if n >= TARGET_MIN:
            met.append(ratio >= TARGET_RATIO)
        rows.append([
            human_count(n),
            f"{r['encode']:.2f}", f"{r['fp8 encode']:.2f}", f"{ratio:.2f}x",
            *[f"{r[name] / r['fp8 encode']:.2f}x" for name in extra],
            f"{r['decode']:.2f}", f"{r['fp8 decode']:.2f}", f"{r['decode'] / r['fp8 decode']:.2f}x",
            f"{r['round trip']:.2f}", f"{r['fp8 round trip']:.2f}", f"{r['round trip'] / r['fp8 round trip']:.2f}x",
            f"{r['copy']:.2f}",
        ])
    cpuinfo = Path("/proc/cpuinfo")
    where = cpu_description(cpuinfo.read_text()) if args.device == "cpu" and cpuinfo.exists() else args.device
    print(f"HiF8 cast throughput on {where} (GB/s = (input + output bytes) / median time; bf16 input)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; encode: {encode_path(args.device, args.backend)}; "
          "ratios against torch's native float8_e4m3fn cast measured in the same run")
    print(markdown_table(
        ["elements", "encode", "fp8 encode", "ratio", *[f"{name} ratio" for name in extra], "decode", "fp8 decode",
         "ratio", "round trip", "fp8 round trip", "ratio", "copy"], rows))
    if met:
        print(f"encode target (>= {TARGET_RATIO}x the fp8 cast from {human_count(TARGET_MIN)} elements): "
              f"{sum(met)}/{len(met)} sizes {'met' if all(met) else 'NOT all met'}")
    return 0
