"""``qfa bench dropin``: ``qfa.hif8_attention`` with its defaults beside SDPA in the same dtype.

The drop-in takes float Q/K/V, so its time includes the preparation (K means, rotation, scales,
encoding) and the output's un-rotation and cast; ``quant_flash_attn`` alone is measured by
``qfa bench attention``. Each row (one dtype, one S; B = 1, causal, BNSD, ``--heads``) times, in
turns (one call of each per round, median of rounds: a shared host's slow minutes fall on all
alike): the drop-in and ``scaled_dot_product_attention`` on the same tensors. The drop-in's
preparation (:func:`qfa.dropin.prepare.quantized_inputs`: q, k and v's passes) is timed inside
those same calls (:class:`PrepClock`), so its share compares like with like: a preparation timed
apart, after SDPA, ran cache-cold against a call timed warm after it. Where the native attention
kernel runs, it un-rotates the output as it writes it
(:class:`~qfa.attention.backends.cpu_kernel.RotatedOutput`), inside the op's time; elsewhere the
preparation includes that pass too (:func:`~qfa.dropin.prepare.restore_output`). ``--load``
times them again while a busy-loop process occupies one core, beside their quiet times. The first-call line runs one call in a fresh process (extensions already built) and says
whether anything was compiled by TorchInductor there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qfa.tools import argtypes
from qfa.tools.bench.timing import interleaved_medians, markdown_table, set_threads
from qfa.tools.workloads import head_pairs, llm_like_qkv

SEQS = (1024, 2048)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
HEADS = (12, 2)
#: The targets: the drop-in at most this many times SDPA in the same dtype, from TARGET_MIN_SEQ
#: up; its preparation at most PREP_TARGET of the call; under --load, its busy / quiet time no
#: worse than SDPA's in the same run.
TARGET_RATIO = 1.0
TARGET_MIN_SEQ = 1024
PREP_TARGET = 0.15
MIN_RUNS, MIN_TOTAL_SECONDS, MAX_RUNS = 5, 1.0, 40


def _list(convert):
    def parse(text: str):
        try:
            return [convert(item.strip()) for item in text.split(",") if item.strip()]
        except (ValueError, KeyError) as exc:
            raise argparse.ArgumentTypeError(f"bad list item in {text!r}: {exc}") from None
    return parse


def _dtype(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"expected one of {sorted(DTYPES)}, got {name!r}")
    return name


def _heads(text: str) -> tuple[int, int]:
    try:
        return head_pairs(text)[0]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seqs", type=argtypes.positive_ints, default=list(SEQS),
                        help=f"sequence lengths (default: {','.join(map(str, SEQS))})")
    parser.add_argument("--dtypes", type=_list(_dtype), default=["bf16", "fp32"],
                        help="input dtypes, of bf16, fp32, fp16 (default: bf16,fp32)")
    parser.add_argument("--heads", type=_heads, default=HEADS, help="q and kv heads as Nq:Nkv (default: 12:2)")
    parser.add_argument("--load", action="store_true",
                        help="also time each row with one core kept busy by another process")
    parser.add_argument("--threads", type=argtypes.positive_int, default=None,
                        help="torch's thread count for the drop-in and SDPA alike (default: torch's own)")
    parser.add_argument("--no-first-call", dest="first_call", action="store_false",
                        help="skip the fresh-process first-call line")


def inputs(dtype: torch.dtype, seq: int, heads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.to(dtype) for t in llm_like_qkv(1, heads[0], heads[1], seq, seed=seq))


class PrepClock:
    """The drop-in's preparation timed inside its own calls: the native passes
    (:func:`qfa.dropin.prepare.quantized_inputs`) and the output's un-rotation where it is a pass
    of its own (:func:`~qfa.dropin.prepare.restore_output`); one total per timed call."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.declined = 0  # quantized_inputs returning None: the materialised path ran, untimed
        self._spent = 0.0

    def _timed(self, fn, may_decline: bool = False):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self._spent += time.perf_counter() - start
            if may_decline and result is None:
                self.declined += 1
            return result
        return timed

    @contextlib.contextmanager
    def installed(self):
        """The preparation's functions timed while the block runs (the drop-in looks them up on
        the module at each call), restored after."""
        from qfa.dropin import prepare

        saved = prepare.quantized_inputs, prepare.restore_output
        prepare.quantized_inputs = self._timed(saved[0], may_decline=True)
        prepare.restore_output = self._timed(saved[1])
        try:
            yield self
        finally:
            prepare.quantized_inputs, prepare.restore_output = saved

    def counting(self, fn):
        """``fn`` recording the preparation time spent in each of its calls."""
        def call():
            self._spent = 0.0
            result = fn()
            self.calls.append(self._spent)
            return result
        return call


def row_calls(q, k, v, clock: PrepClock) -> dict:
    """The timed calls of a row: the drop-in (its preparation counted by ``clock``) and SDPA."""
    import qfa

    return {
        "qfa": clock.counting(lambda: qfa.hif8_attention(q, k, v, is_causal=True)),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }


def _medians(fns: dict, clock: PrepClock) -> dict[str, float]:
    """Median seconds of each call in turns, and ``"prep"``: the median preparation inside the
    drop-in's timed calls (its warm-up call left out)."""
    clock.calls.clear()
    clock.declined = 0
    with clock.installed():
        medians = interleaved_medians(fns, min_runs=MIN_RUNS, min_total=MIN_TOTAL_SECONDS, max_runs=MAX_RUNS)
    if clock.declined or not any(clock.calls):
        raise RuntimeError("the native preparation did not run (not built, QFA_NATIVE=0, or declined the inputs): "
                           "its share would be of another path")
    # interleaved_medians calls each function once before the timed rounds: calls[0]
    return {**medians, "prep": statistics.median(clock.calls[1:])}


def measure_row(q, k, v, load: bool) -> tuple[dict[str, float], dict[str, float] | None]:
    """Median seconds of each call quiet, and of the drop-in and SDPA with one core busy."""
    from qfa.tools.bench.attention import busy_loop

    clock = PrepClock()
    fns = row_calls(q, k, v, clock)
    quiet = _medians(fns, clock)
    if not load:
        return quiet, None
    loop = busy_loop(10 * (quiet["qfa"] + quiet["sdpa"]) * MAX_RUNS + 30)  # stops by itself
    try:
        time.sleep(0.1)
        return quiet, _medians(fns, clock)
    finally:
        loop.terminate()
        loop.wait()


_FIRST_CALL = """
import json, sys, time
import torch
import qfa
from qfa import _compile
q, k, v = (torch.randn(1, h, 1024, 128, dtype=torch.bfloat16) for h in (12, 2, 2))
start = time.perf_counter()
qfa.hif8_attention(q, k, v, is_causal=True)
first = time.perf_counter() - start
start = time.perf_counter()
qfa.hif8_attention(q, k, v, is_causal=True)
print(json.dumps({"first": first, "second": time.perf_counter() - start,
                  "compiled": sorted(f.__name__ for f in _compile._compiled)}))
"""


def first_call() -> dict:
    """A fresh process's first and second default call (bf16, S = 1024), and the functions
    TorchInductor compiled in it."""
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _verdict(name: str, ok: list[bool]) -> str:
    if not ok:
        return f"{name}: no row covered"
    return f"{name}: {sum(ok)}/{len(ok)} rows {'met' if all(ok) else 'NOT all met'}"


def run(args: argparse.Namespace) -> int:
    from qfa.attention.backends import cpu_prepare
    from qfa.tools.bench.attention import cpu_description

    if not cpu_prepare.available():
        print("the native CPU preparation is not available (see qfa.attention.backends.cpu_prepare): nothing to measure")
        return 1
    set_threads(args.threads)
    cpu = cpu_description(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
    rows, speed_ok, prep_ok, load_ok = [], [], [], []
    headers = ["dtype", "S", "qfa ms", "SDPA ms", "qfa / SDPA", "prep ms", "prep share"]
    if args.load:
        headers += ["qfa ms, 1 core busy", "qfa busy / quiet", "SDPA ms, 1 core busy", "SDPA busy / quiet",
                    "prep busy / quiet"]
    for name in args.dtypes:
        for seq in args.seqs:
            q, k, v = inputs(DTYPES[name], seq, args.heads)
            t, busy = measure_row(q, k, v, args.load)
            ratio, share = t["qfa"] / t["sdpa"], t["prep"] / t["qfa"]
            row = [name, seq, f"{t['qfa'] * 1e3:.1f}", f"{t['sdpa'] * 1e3:.1f}", f"{ratio:.2f}x",
                   f"{t['prep'] * 1e3:.2f}", f"{share:.1%}"]
            if seq >= TARGET_MIN_SEQ:
                speed_ok.append(ratio <= TARGET_RATIO)
                prep_ok.append(share <= PREP_TARGET)
            if busy is not None:
                mine, theirs = busy["qfa"] / t["qfa"], busy["sdpa"] / t["sdpa"]
                row += [f"{busy['qfa'] * 1e3:.1f}", f"{mine:.2f}x", f"{busy['sdpa'] * 1e3:.1f}", f"{theirs:.2f}x",
                        f"{busy['prep'] / t['prep']:.2f}x"]
                if seq >= TARGET_MIN_SEQ:
                    load_ok.append(mine <= theirs)
            rows.append(row)
    print(f"qfa.hif8_attention (defaults: rms, smooth_k, rotate; causal, BNSD, heads {args.heads[0]}:{args.heads[1]}) "
          f"vs SDPA in the same dtype on {cpu}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; native preparation: "
          f"{cpu_prepare.ISA_NAMES[cpu_prepare.isa_level()]} (torch's OpenMP team; the calling thread for small "
          "passes, its own pool after a late thread); times are medians of rounds taking one call of each in turn")
    from qfa.attention.backends import cpu_kernel

    print("prep: the K means, rotation, statistic and encode of q, k and v, timed inside the drop-in's calls; "
          "the output's un-rotation "
          + ("runs in the attention kernel's epilogue, within the op" if cpu_kernel.available()
             else "is a pass of its own, counted in prep"))
    print(markdown_table(headers, rows))
    print(_verdict(f"speed target (qfa <= {TARGET_RATIO:.1f}x SDPA from S = {TARGET_MIN_SEQ})", speed_ok))
    print(_verdict(f"preparation target (<= {PREP_TARGET:.0%} of the call from S = {TARGET_MIN_SEQ})", prep_ok))
    if args.load:
        print(_verdict(f"load target (qfa busy / quiet <= SDPA busy / quiet from S = {TARGET_MIN_SEQ})", load_ok))
    if args.first_call:
        first = first_call()
        compiled = ", ".join(first["compiled"]) or "nothing"
        print(f"first call in a fresh process (bf16, S = 1024, extensions built): {first['first'] * 1e3:.0f} ms, "
              f"second {first['second'] * 1e3:.0f} ms; compiled by TorchInductor: {compiled}")
    return 0
