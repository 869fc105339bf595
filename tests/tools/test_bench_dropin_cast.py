"""``qfa bench dropin`` and ``qfa bench cast``: their tables and verdicts from a fake clock (the
real calls run once each, nothing is timed)."""

from __future__ import annotations

import argparse

import pytest
import torch

from qfa.attention.backends import cpu_prepare
from qfa.tools.bench import cast as bench_cast
from qfa.tools.bench import dropin as bench_dropin

pytestmark = pytest.mark.skipif(not cpu_prepare.available(), reason="the native CPU preparation is not built")


def _args(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_bench_dropin_rows_and_verdicts(monkeypatch, capsys):
    """Per row: qfa / SDPA, the preparation's share, and under --load both busy / quiet ratios;
    the verdicts count rows from TARGET_MIN_SEQ up."""
    quiet = {128: {"qfa": 0.010, "sdpa": 0.008, "prep": 0.004},  # below the targets' S: not counted
             1024: {"qfa": 0.020, "sdpa": 0.025, "prep": 0.002}}
    busy = {128: {"qfa": 0.02, "sdpa": 0.01, "prep": 0.004}, 1024: {"qfa": 0.030, "sdpa": 0.050, "prep": 0.003}}
    seen = []

    def fake_medians(fns, clock):
        seq = seen[-1]
        for fn in fns.values():  # each call really runs once
            fn()
        table = busy if fake_medians.calls % 2 else quiet  # each row: quiet, then (--load) busy
        fake_medians.calls += 1
        return table[seq]

    fake_medians.calls = 0

    real_inputs = bench_dropin.inputs
    monkeypatch.setattr(bench_dropin, "inputs", lambda dtype, seq, heads: (seen.append(seq), real_inputs(dtype, seq, heads))[1])
    monkeypatch.setattr(bench_dropin, "_medians", fake_medians)

    class Loop:
        def terminate(self):
            pass

        def wait(self):
            pass

    from qfa.tools.bench import attention as bench_attention

    monkeypatch.setattr(bench_attention, "busy_loop", lambda seconds: Loop())
    monkeypatch.setattr(bench_dropin.time, "sleep", lambda s: None)
    args = _args(bench_dropin, ["--seqs", "128,1024", "--dtypes", "bf16", "--heads", "2:1", "--load", "--no-first-call"])
    assert bench_dropin.run(args) == 0
    out = capsys.readouterr().out
    assert "| bf16 | 1024 | 20.0 | 25.0 | 0.80x | 2.00 | 10.0% | 30.0 | 1.50x | 50.0 | 2.00x | 1.50x |" in out
    assert "| bf16 | 128 | 10.0 | 8.0 | 1.25x | 4.00 | 40.0% |" in out
    assert "speed target (qfa <= 1.0x SDPA from S = 1024): 1/1 rows met" in out
    assert "preparation target (<= 15% of the call from S = 1024): 1/1 rows met" in out
    assert "load target (qfa busy / quiet <= SDPA busy / quiet from S = 1024): 1/1 rows met" in out


def test_prep_clock_times_the_preparation_inside_the_drop_in_call():
    """The clock counts the native passes run inside each drop-in call (and nothing else: SDPA's
    calls record nothing), and puts the module's functions back, also when a call raises."""
    from qfa.dropin import prepare

    saved = prepare.quantized_inputs, prepare.restore_output
    q, k, v = bench_dropin.inputs(torch.float32, 256, (2, 1))
    clock = bench_dropin.PrepClock()
    fns = bench_dropin.row_calls(q, k, v, clock)
    with clock.installed():
        start = bench_dropin.time.perf_counter()
        fns["qfa"]()
        whole = bench_dropin.time.perf_counter() - start
        fns["sdpa"]()
    assert len(clock.calls) == 1 and 0 < clock.calls[0] < whole and clock.declined == 0
    assert (prepare.quantized_inputs, prepare.restore_output) == saved
    with pytest.raises(ZeroDivisionError), clock.installed():
        1 / 0
    assert (prepare.quantized_inputs, prepare.restore_output) == saved
    fns["qfa"]()  # outside the block nothing is counted
    assert len(clock.calls) == 2 and clock.calls[1] == 0.0


def test_bench_dropin_refuses_a_share_of_the_materialised_path(monkeypatch):
    """Where the native passes decline (here: forced to), the drop-in runs the materialised
    path, which the clock does not see: the bench says so instead of reporting its share."""
    from qfa.dropin import prepare

    monkeypatch.setattr(prepare, "quantized_inputs", lambda *args, **kwargs: None)
    q, k, v = bench_dropin.inputs(torch.float32, 128, (2, 1))
    clock = bench_dropin.PrepClock()
    with pytest.raises(RuntimeError, match="did not run"):
        bench_dropin._medians(bench_dropin.row_calls(q, k, v, clock), clock)


def test_bench_cast_names_the_path_and_counts_sizes_from_1m(monkeypatch, capsys):
    def fake_medians(fns, **kwargs):
        for fn in fns.values():
            fn()
        # encode twice as fast as the fp8 cast: 2.0x everywhere
        return {name: (1.0 if name.startswith("encode") else 2.0) for name in fns}

    monkeypatch.setattr(bench_cast, "interleaved_medians", fake_medians)
    args = _args(bench_cast, ["--sizes", "4K,1M", "--levels"])
    assert bench_cast.run(args) == 0
    out = capsys.readouterr().out
    level = cpu_prepare.ISA_NAMES[cpu_prepare.isa_level()]
    assert f"encode: native encoder, {level}" in out
    assert "encode torch path ratio" in out
    assert "encode target (>= 1.5x the fp8 cast from 1M elements): 1/1 sizes met" in out
    assert torch.get_num_threads() >= 1
