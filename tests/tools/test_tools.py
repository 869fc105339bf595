"""The tools' shared helpers (metrics, text reader, counts, the speed verdict) and the
benchmarks' pure parts, in-process and without timing anything (``qfa.tools``)."""

from __future__ import annotations

import argparse
import gzip
import math

import pytest
import torch

from qfa.tools import metrics, text
from qfa.tools.bench import attention as bench_attention
from qfa.tools.bench import calibration as bench_calibration
from qfa.tools.bench.timing import human_count, parse_count
from qfa.tools.workloads import head_pairs

# ----------------------------------------------------------------------------- metrics


def test_error_metrics_on_a_worked_example():
    """ref (3, 4), out (3, 5): |ref| = 5, |out - ref| = 1, cos = 29 / (5 sqrt 34)."""
    m = metrics.error_metrics(torch.tensor([[3.0, 5.0]]), torch.tensor([[3.0, 4.0]]))
    assert m.rel_l2 == pytest.approx(0.2, rel=1e-15) and m.max_abs == 1.0
    assert m.cosine == pytest.approx(29 / (5 * math.sqrt(34)), rel=1e-15)
    assert tuple(m) == (m.cosine, m.rel_l2, m.max_abs)  # unpacks as (cosine, rel L2, max abs)
    assert metrics.relative_l2(torch.tensor([3.0, 5.0]), torch.tensor([3.0, 4.0])) == m.rel_l2


def test_error_metrics_is_computed_in_float64():
    """A bf16 output against an fp32 reference: the figures are those of the values upcast to
    float64 (no bf16 or fp32 arithmetic in the metric)."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 64, generator=g)
    out = (ref + 1e-3 * torch.randn(4, 64, generator=g)).bfloat16()
    o, r = out.double().flatten(), ref.double().flatten()
    m = metrics.error_metrics(out, ref)
    assert m.max_abs == (o - r).abs().max().item()
    assert m.rel_l2 == pytest.approx(((o - r).norm() / r.norm()).item(), rel=1e-12)


def test_error_metrics_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"same shape, got \(2, 3\) and \(3, 2\)"):
        metrics.error_metrics(torch.zeros(2, 3), torch.zeros(3, 2))


# ----------------------------------------------------------------------------- text reader


def test_read_text_detects_gzip_by_content_not_name(tmp_path):
    body = "héllo\nwörld"
    files = {"plain.txt": body.encode(), "packed.gz": gzip.compress(body.encode()),
             "packed_without_suffix.txt": gzip.compress(body.encode()), "plain_named.gz": body.encode()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        assert text.read_text(tmp_path / name) == body, name
        assert text.read_text(str(tmp_path / name)) == body, name


def test_read_text_replaces_undecodable_bytes(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"ok \xff end")
    assert text.read_text(tmp_path / "bad.txt") == "ok \ufffd end"


# ----------------------------------------------------------------------------- element counts


def test_parse_count_accepts_suffixes_and_plain_integers():
    assert [parse_count(s) for s in ("1K", "64K", "1M", "4M", "4m", "1024", " 7 ")] == \
        [1024, 65536, 1 << 20, 1 << 22, 1 << 22, 1024, 7]
    for n in (1, 1000, 1024, 3 << 10, 1 << 20, 5 << 20, (1 << 20) + 1024):
        assert parse_count(human_count(n)) == n


@pytest.mark.parametrize("bad", ["", "x", "K", "1.5K", "0", "0K", "-1", "4G", "1KB", "1e3", "\u0661\u0662"])
def test_parse_count_rejects(bad):
    with pytest.raises(ValueError, match="positive element count"):
        parse_count(bad)


# ----------------------------------------------------------------------------- workloads


def test_head_pairs():
    assert head_pairs("12:2,32:8") == [(12, 2), (32, 8)] and head_pairs("4:4") == [(4, 4)]
    for bad, match in (("12", "Nq:Nkv pairs"), ("12:2:1", "Nq:Nkv pairs"), ("a:b", "Nq:Nkv pairs"),
                       ("12:5", "multiple"), ("2:4", "multiple"), ("0:0", "multiple"), ("12:2,", "Nq:Nkv")):
        with pytest.raises(ValueError, match=match):
            head_pairs(bad)


# ----------------------------------------------------------------------------- bench attention


def test_speed_verdict():
    head = f"speed target (qfa <= 1.0x fp32 SDPA for S >= {bench_attention.SPEED_TARGET_MIN_SEQ})"
    assert bench_attention.speed_verdict([0.8, 0.95]) == head + ": met, 2 of 2 rows within it (worst 0.95x)"
    assert bench_attention.speed_verdict([1.0]) == head + ": met, 1 of 1 rows within it (worst 1.00x)"  # the bound is met
    assert bench_attention.speed_verdict([0.7, 1.25, 0.9]) == head + ": NOT met, 2 of 3 rows within it (worst 1.25x)"
    assert bench_attention.decode_verdict([0.4, 0.6]).endswith(": NOT met, 1 of 2 rows within it (worst 0.60x)")
    assert bench_attention.load_verdict([1.5, 1.2]).endswith(": met, 2 of 2 rows within it (worst 1.50x)")
    with pytest.raises(ValueError, match="at least one"):
        bench_attention.speed_verdict([])
    tight = bench_attention.speed_verdict([0.45, 0.6], target=0.5)
    assert tight.startswith("speed target (qfa <= 0.5x") and tight.endswith(": NOT met, 1 of 2 rows within it (worst 0.60x)")
    bf16 = {"fp32_avx512": 500.0, "bf16_dot": 1000.0}
    assert bench_attention.speed_target(bf16) == 0.5 and bench_attention.speed_target(bf16, 1) == 1.0
    assert bench_attention.speed_target({"fp32_avx2": 250.0}) == 1.0


def test_at_peak_ratio_is_the_rows_flops_at_the_peak_of_its_fastest_kernel_over_sdpa():
    # the vLLM-shaped row on the AVX2 Zen 3: ~6.4 GFLOP, SDPA fp32 61 ms, peak 180 GFLOP/s
    peaks = {"fp32_avx2": 180.0}
    assert bench_attention.at_peak_ratio(6.4e9, ["AVX2", "scalar"], peaks, 0.061) == pytest.approx(0.5829, abs=1e-4)
    # the fastest family a row ran sets its bound
    both = {"fp32_avx2": 100.0, "bf16_dot": 400.0}
    assert bench_attention.at_peak_ratio(4e9, ["AVX512_BF16", "AVX2"], both, 0.1) == pytest.approx(0.1)
    assert bench_attention.at_peak_ratio(4e9, ["torch path"], both, 0.1) is None
    assert bench_attention.at_peak_ratio(4e9, ["AVX2"], {}, 0.1) is None
    assert bench_attention._at_peak_cell(0.5829) == "0.58x" and bench_attention._at_peak_cell(None) == "-"


def test_a_verdict_not_met_counts_the_failing_rows_bounded_above_it_at_the_peak():
    head = "vLLM-shaped batch target (qfa <= 0.50x fp32 SDPA over the same sequences): NOT met, 0 of 1 rows within it"
    # infeasible: even at the peak the row is at 0.58x, above the 0.5x target
    assert bench_attention.mixed_verdict([0.8], 0.5, [0.58]) == (
        head + " (worst 0.80x); 1 of 1 failing rows cannot meet it at the measured peak (best 0.58x)")
    # feasible: 0.2x at the peak, so the failure is the kernel's, not the CPU's
    assert bench_attention.mixed_verdict([0.8], 0.5, [0.2]) == (
        head + " (worst 0.80x); 0 of 1 failing rows cannot meet it at the measured peak")
    # no peak measured: nothing said; rows within the target are not counted
    assert bench_attention.mixed_verdict([0.8], 0.5, [None]) == head + " (worst 0.80x)"
    assert bench_attention.decode_verdict([0.4, 0.6, 0.7], [0.1, 0.3, 0.55]).endswith(
        ": NOT met, 1 of 3 rows within it (worst 0.70x); 1 of 2 failing rows cannot meet it at the measured peak "
        "(best 0.55x)")
    assert bench_attention.speed_verdict([0.9], [0.95]).endswith(": met, 1 of 1 rows within it (worst 0.90x)")
    with pytest.raises(ValueError, match=r"at_peak must hold one value per ratio \(2\), got 1"):
        bench_attention.decode_verdict([0.4, 0.6], [0.1])


def test_decode_verdicts_one_line_per_target_and_none_for_sq_16_without_bf16_dot():
    R = bench_attention.RowRatio
    rows = [(1, R(0.40, 0.10)), (1, R(0.45, 0.12)), (16, R(0.62, 0.41)), (16, R(0.30, 0.20)), (4, R(9.0, None))]
    avx2 = bench_attention.decode_verdicts(rows, {"fp32_avx2": 180.0})
    assert avx2 == [
        "decode target, Sq = 1 (qfa <= 0.50x fp32 SDPA): met, 2 of 2 rows within it (worst 0.45x)",
        "decode, Sq >= 16: no target on this ISA (its 0.35x is for AVX512_BF16 dot products; without them qfa's "
        "fp32 FMA rate bounds it as it bounds SDPA's); worst 0.62x fp32 SDPA over 2 rows"]
    bf16 = bench_attention.decode_verdicts(rows, {"fp32_avx2": 180.0, "bf16_dot": 445.0})
    assert bf16 == [
        avx2[0],
        "decode target, Sq >= 16, AVX512_BF16 (qfa <= 0.35x fp32 SDPA): NOT met, 1 of 2 rows within it (worst 0.62x); "
        "1 of 1 failing rows cannot meet it at the measured peak (best 0.41x)"]
    # the targets' constants are the ones the lines print
    assert f"{bench_attention.DECODE_TARGET_RATIO:.2f}x" in avx2[0]
    assert f"{bench_attention.DECODE_MULTI_TARGET_BF16:.2f}x" in bf16[1]
    assert bench_attention.decode_verdicts([(1, R(0.6, 0.2))], {}) == [
        "decode target, Sq = 1 (qfa <= 0.50x fp32 SDPA): NOT met, 0 of 1 rows within it (worst 0.60x); "
        "0 of 1 failing rows cannot meet it at the measured peak"]
    assert bench_attention.decode_verdicts([(4, R(0.6, 0.2))], {}) == []  # no target covers 1 < Sq < 16
    with pytest.raises(ValueError, match="at least one"):
        bench_attention.multi_decode_verdict([], {})


@pytest.fixture
def fake_clock(monkeypatch):
    """``median_seconds`` and ``interleaved_medians`` replaced by a clock that runs nothing: each
    row's three timings (qfa, fp32 SDPA, bf16 SDPA) come from ``times[seq]``, one per call timed."""
    times: dict[int, tuple[float, float, float]] = {}
    pending: list[float] = []

    def next_time() -> float:
        if not pending:
            seq = fake_medians.seqs.pop(0)
            pending.extend(times[seq])
        return pending.pop(0)

    def fake_medians(fns, **kwargs):
        return {name: next_time() for name in fns}

    fake_medians.seqs = []
    fake_medians.used = set()

    def fake_in_turns(fns, **kwargs):
        fake_medians.used.add("in turns")
        return fake_medians(fns)

    def fake_median(fn, **kwargs):
        fake_medians.used.add("one after the other")
        return next_time()

    monkeypatch.setattr(bench_attention, "interleaved_medians", fake_in_turns)
    monkeypatch.setattr(bench_attention, "median_seconds", fake_median)

    def use(table: dict[int, tuple[float, float, float]], seqs: list[int]) -> None:
        times.update(table)
        fake_medians.seqs[:] = list(seqs)

    use.used = fake_medians.used
    return use


def test_interleaved_medians_time_the_calls_in_turns(monkeypatch):
    """One warm-up call each, then rounds of one call each in order, until min_runs rounds and
    min_total seconds (or max_runs); the median of each call's own times."""
    from qfa.tools.bench import timing

    clock = [0.0]
    calls: list[str] = []
    cost = {"a": 0.010, "b": 0.030}

    def fn(name):
        def run():
            calls.append(name)
            clock[0] += cost[name] * (3 if len(calls) == 7 else 1)  # a's call of round 3 is slow
        return run

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    got = timing.interleaved_medians({"a": fn("a"), "b": fn("b")}, min_runs=3, min_total=0.15, max_runs=50)
    # warm-up a, b; then rounds of (a, b) until 3 rounds and 0.15 s (0.04, 0.06, 0.04 ...): 4 rounds
    assert calls == ["a", "b"] + ["a", "b"] * 4
    assert got["a"] == pytest.approx(0.010) and got["b"] == pytest.approx(0.030)
    assert len(timing.interleaved_medians({"a": fn("a")}, min_runs=2, min_total=10.0, max_runs=5)) == 1
    assert calls.count("a") == 5 + 1 + 5  # capped at max_runs rounds (plus its warm-up)
    with pytest.raises(ValueError, match="at least one"):
        timing.interleaved_medians({})


def test_speed_rows_count_only_long_sequences_toward_the_target(fake_clock):
    fake_clock({64: (0.5, 0.1, 0.2), 2048: (0.08, 0.1, 0.2), 4096: (0.3, 0.2, 0.4)}, [64, 2048, 4096])
    rows, ratios = bench_attention.speed_rows([64, 2048, 4096], "torch", heads=[(2, 1)])
    assert [r[1] for r in rows] == [64, 2048, 4096]
    assert [r[5] for r in rows] == ["5.00x", "0.80x", "1.50x"]  # qfa / fp32 SDPA
    assert [r[7] for r in rows] == ["2.50x", "0.40x", "0.75x"]  # qfa / bf16 SDPA
    assert ratios == pytest.approx([0.8, 1.5])  # S = 64 is below the target's minimum


@pytest.mark.parametrize("in_turns", [False, True], ids=["one-after-the-other", "in-turns"])
def test_bench_attention_run_prints_the_verdict(fake_clock, capsys, monkeypatch, in_turns):
    parser = argparse.ArgumentParser()
    bench_attention.add_arguments(parser)
    monkeypatch.setitem(bench_attention.TIMING, "in_turns", False)
    args = parser.parse_args(["--heads", "2:1", "--seqs", "64,2048", "--memory-seq", "0", "--accuracy-seq", "0",
                              "--decode-skv", "0"] + (["--in-turns"] if in_turns else []))
    fake_clock({64: (0.5, 0.1, 0.2), 2048: (0.3, 0.2, 0.4)}, [64, 2048])
    assert bench_attention.run(args) == 0
    assert fake_clock.used == {"in turns" if in_turns else "one after the other"}
    out = capsys.readouterr().out
    # only S = 2048 counts, against this CPU's target (the peaks the run measured)
    assert bench_attention.speed_verdict([1.5], target=bench_attention.speed_target(bench_attention.PEAKS)) in out
    assert "| at peak / fp32 |" in out
    assert "peak memory" not in out and "accuracy" not in out


# ----------------------------------------------------------------------------- bench calibration


def test_bench_layer_parsing_and_table():
    assert bench_calibration.parse_layers("all", 4) == [0, 1, 2, 3]
    assert bench_calibration.parse_layers("0,2-3", 4) == [0, 2, 3]
    with pytest.raises(ValueError, match="--layers"):
        bench_calibration.parse_layers("5", 4)
    Row = bench_calibration.Row
    rows = [Row("HiF8 rms", True, 0.99, 0.07, 0.1, 3, 0.1), Row("HiF8 amax", True, 0.9, 0.3, 0.5, 1, 0.1)]
    table = bench_calibration.format_table(rows)
    assert table.splitlines()[0].startswith("| method |") and "| HiF8 rms | yes | 0.990000 |" in table


def test_best_rule_picks_the_lowest_error_hif8_row_of_the_smoothing_setting():
    Row = bench_calibration.Row
    rows = [
        Row("bf16 SDPA (no quantisation)", None, 1.0, 0.001, 0.001, 0, 0.0),  # not a rule: ignored
        Row("FP8 E4M3 amax/448 (emulated)", True, 0.99, 0.01, 0.02, 0, 0.0),  # not HiF8: ignored
        Row("HiF8 amax", True, 0.9, 0.30, 0.5, 1, 0.0),
        Row("HiF8 rms", True, 0.99, 0.07, 0.1, 3, 0.0),
        Row("HiF8 mse" + bench_calibration.ROTATED, True, 0.99, 0.05, 0.1, 3, 0.0),  # rotated rows count
        Row("HiF8 rms", False, 0.98, 0.20, 0.3, 2, 0.0),
        Row("HiF8 amax", False, 0.97, 0.10, 0.2, 2, 0.0),
    ]
    assert bench_calibration.best_rule(rows, True) == "mse"
    assert bench_calibration.best_rule(rows, False) == "amax"
    assert bench_calibration.best_rule(rows[:2], True) is None


def test_bench_measure_on_synthetic_captures():
    """Rows in order, each the mean over layers of the per-layer errors, with the worst layer."""
    g = torch.Generator().manual_seed(1)
    caps = [
        bench_calibration.Capture(
            i, torch.randn(1, 4, 40, 128, generator=g).bfloat16(),
            (torch.randn(1, 2, 40, 128, generator=g) + 4 * torch.randn(128, generator=g)).bfloat16(),
            torch.randn(1, 2, 40, 128, generator=g).bfloat16(), 1 / math.sqrt(128))
        for i in range(2)
    ]
    rows = bench_calibration.measure(caps, ["amax", "rms"], smooth_options=(True,))
    by_name = {r.method: r for r in rows}
    assert list(by_name)[0] == "bf16 SDPA (no quantisation)"
    assert list(by_name)[-4:] == ["HiF8 amax", "HiF8 amax + rotation", "HiF8 rms", "HiF8 rms + rotation"]
    base, amax, rms = by_name["bf16 SDPA (no quantisation)"], by_name["HiF8 amax"], by_name["HiF8 rms"]
    assert base.rel_l2 < 0.01 < rms.rel_l2 < amax.rel_l2
    # The bf16 row recomputed layer by layer: mean cosine and rel L2, and the worst layer.
    per_layer = []
    for c in caps:
        exact = bench_calibration.exact_attention(c)
        out = torch.nn.functional.scaled_dot_product_attention(
            c.q.bfloat16(), c.k.bfloat16(), c.v.bfloat16(), is_causal=True, scale=c.scaling, enable_gqa=True)
        per_layer.append(metrics.error_metrics(out, exact))
    assert base.cosine == pytest.approx(sum(m.cosine for m in per_layer) / 2, rel=1e-12)
    assert base.rel_l2 == pytest.approx(sum(m.rel_l2 for m in per_layer) / 2, rel=1e-12)
    worst = max(range(2), key=lambda i: per_layer[i].rel_l2)
    assert (base.worst_layer, base.worst_rel_l2) == (caps[worst].layer, pytest.approx(per_layer[worst].rel_l2))
    assert bench_calibration.best_rule(rows, True) == min(
        (r for r in rows if r.method.startswith("HiF8")), key=lambda r: r.rel_l2).method.split()[1]


@pytest.mark.parametrize("mode", [1, 6])
@pytest.mark.parametrize("batch,sq,skv,causal", [(1, 40, 40, True), (2, 1, 200, False)])
def test_bench_rows_of_the_other_modes_time_the_same_attention(mode, batch, sq, skv, causal):
    """--quant-mode 1|6: the timed qfa call and the SDPA beside it attend over the same values
    (SDPA runs on the dequantised inputs), so their outputs differ only by E4M3's P rounding:
    each P within 2^-4 relative (3 mantissa bits), hence the output within 2^-4 of sum P|V| / l,
    which for these N(0, 1) values is below |out| in norm; a wrong layout or scale gives O(1)."""
    fns = bench_attention.row_timings(mode, batch, 4, 2, sq, skv, "torch", causal)
    out = fns["qfa"]()[0].float().view(batch, sq, 4, 128).transpose(1, 2)
    ref = fns["fp32"]()
    assert out.shape == ref.shape and float((out - ref).norm() / ref.norm()) < 2.0**-4


def test_gemm_load_reference_is_the_gemms_busy_over_quiet_time(fake_clock):
    # measure() times the GEMM and a no-op quiet, then both again beside the busy loop: four timings.
    fake_clock({1: (0.2, 0.01, 0.3), 2: (0.01, 0.0, 0.0)}, [1, 2])
    ratio = bench_attention.gemm_load_reference()
    assert ratio == pytest.approx(1.5)
    line = bench_attention.load_reference_line(ratio)
    assert "1.50x its quiet time with one core busy" in line and f"{bench_attention.REFERENCE_GEMM}^3" in line
