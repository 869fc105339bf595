"""``qfa bench cast``: HiF8 encode/decode throughput beside torch's native fp8 cast and a copy.

Throughput is (input bytes + output bytes) / time, the Ascend cast op's formula. Every figure
is the median of several runs measured in the same process as its references, and the ratios
are what to compare across machines.
"""

from __future__ import annotations

import argparse

import torch

from qfa.tools.bench.timing import human_count, markdown_table, median_seconds, parse_count
from qfa.cast import decode_from_hifloat8, encode_to_hifloat8

DEFAULT_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
FP8 = torch.float8_e4m3fn


def _sizes(text: str) -> list[int]:
    try:
        return [parse_count(item) for item in text.split(",")]
    except ValueError as exc:  # argparse prints this message, with usage, and exits 2
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=_sizes, default=list(DEFAULT_SIZES),
                        help="comma-separated element counts, plain or with K/M (2^10/2^20) suffixes "
                             f"(default: {','.join(human_count(n) for n in DEFAULT_SIZES)})")
    parser.add_argument("--backend", default=None, help="torch or triton (default: by device)")
    parser.add_argument("--device", default="cpu")


def measure(n: int, device: str = "cpu", backend: str | None = None) -> dict[str, float]:
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

    def timed(fn):
        return lambda: (fn(), sync())

    return {name: bytes_per * n / median_seconds(timed(fn)) / 1e9 for name, (fn, bytes_per) in ops.items()}


def run(args: argparse.Namespace) -> int:
    rows = []
    from tqdm import tqdm

    for n in tqdm(args.sizes, desc="bench cast", unit="size", leave=False):
        r = measure(n, args.device, args.backend)
        rows.append([
            human_count(n),
            f"{r['encode']:.2f}", f"{r['fp8 encode']:.2f}", f"{r['encode'] / r['fp8 encode']:.2f}x",
            f"{r['decode']:.2f}", f"{r['fp8 decode']:.2f}", f"{r['decode'] / r['fp8 decode']:.2f}x",
            f"{r['round trip']:.2f}", f"{r['fp8 round trip']:.2f}", f"{r['round trip'] / r['fp8 round trip']:.2f}x",
            f"{r['copy']:.2f}",
        ])
    print(f"HiF8 cast throughput on {args.device} (GB/s = (input + output bytes) / median time; bf16 input)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratios against torch's native "
          "float8_e4m3fn cast measured in the same run")
    print(markdown_table(
        ["elements", "encode", "fp8 encode", "ratio", "decode", "fp8 decode", "ratio",
         "round trip", "fp8 round trip", "ratio", "copy"], rows))
    return 0
