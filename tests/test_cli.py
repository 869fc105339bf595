"""The CLI runs end to end on small workloads (the real figures come from the full commands)."""

import subprocess
import sys

import pytest


def qfa(*args: str, timeout: int = 600) -> str:
    done = subprocess.run([sys.executable, "-m", "qfa", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_help_lists_every_command():
    out = qfa("--help")
    for command in ("demo", "eval-ppl", "bench"):
        assert command in out


def test_demo_prints_both_formats_and_writes_the_chart(tmp_path):
    chart = tmp_path / "demo.png"
    out = qfa("demo", "--seq", "128", "--out", str(chart))
    assert "HiF8" in out and "FP8 E4M3" in out and "cosine" in out
    assert chart.exists() and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(chart) in out


def test_bench_cast_small_sizes():
    out = qfa("bench", "cast", "--sizes", "1024,4096")
    rows = [line for line in out.splitlines() if line.startswith("| 1K") or line.startswith("| 4K")]
    assert len(rows) == 2
    for row in rows:  # every throughput cell is a positive number
        cells = [c.strip().rstrip("x") for c in row.strip("|").split("|")[1:]]
        assert all(float(c) > 0 for c in cells)


def test_bench_attention_small():
    out = qfa("bench", "attention", "--seqs", "128", "--memory-seq", "256", "--accuracy-seq", "128")
    assert "SDPA fp32" in out and "peak memory" in out and "FP8 E4M3" in out


def test_bench_attention_heads_and_target_verdict():
    out = qfa("bench", "attention", "--heads", "2:1", "--seqs", "64,2048", "--memory-seq", "0", "--accuracy-seq", "0")
    rows = [line for line in out.splitlines() if line.startswith("| (2, 1)")]
    assert [row.split("|")[2].strip() for row in rows] == ["64", "2048"]
    assert "speed target" in out and "of 1 rows" in out  # only S >= 2048 counts
    assert "peak memory" not in out and "accuracy" not in out


def test_unknown_command_fails():
    done = subprocess.run([sys.executable, "-m", "qfa", "nope"], capture_output=True, text=True)
    assert done.returncode == 2 and "invalid choice" in done.stderr


@pytest.mark.parametrize("args", [["bench", "cast", "--sizes", "x"], ["demo", "--seq", "-"],
                                  ["bench", "attention", "--heads", "12:5"], ["bench", "attention", "--heads", "12"]])
def test_bad_arguments_fail_cleanly(args):
    done = subprocess.run([sys.executable, "-m", "qfa", *args], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
