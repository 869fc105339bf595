"""The CLI runs end to end on small workloads (the real figures come from the full commands)."""

import re
import subprocess
import sys

import pytest

from qfa.cli import build_parser


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
    out = qfa("demo", "--seq", "128", "--heads", "4:2", "--out", str(chart))
    assert "HiF8" in out and "FP8 E4M3" in out and "cosine" in out and "(Nq, Nkv)=(4, 2), S=128" in out
    assert "first call" in out and "median" in out
    from qfa.attention.backends import cpu_kernel

    # the one-time native build is done and reported before anything is timed
    want = f"native CPU kernels ({cpu_kernel.cpu_capability()} build): ready in" if cpu_kernel.available() else \
        "native CPU kernels: "
    assert want in out.split("Codec round trip")[0], out[:500]
    assert chart.exists() and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(chart) in out


def test_bench_cast_small_sizes():
    """The --sizes format --help shows (K suffixes) and a plain integer, end to end."""
    out = qfa("bench", "cast", "--sizes", "1K,4096")
    rows = [line for line in out.splitlines() if line.startswith("| 1K") or line.startswith("| 4K")]
    assert len(rows) == 2
    for row in rows:  # every throughput cell is a positive number
        cells = [c.strip().rstrip("x") for c in row.strip("|").split("|")[1:]]
        assert all(float(c) > 0 for c in cells)


def test_bench_cast_sizes_parse_as_help_shows(capsys):
    argv = ["bench", "cast", "--help"]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    assert "1K,64K,1M,4M" in " ".join(capsys.readouterr().out.split())
    argv = ["bench", "cast", "--sizes", "1K,64K,1M,4M"]
    assert build_parser(argv).parse_args(argv).sizes == [1 << 10, 1 << 16, 1 << 20, 1 << 22]
    argv = ["bench", "cast", "--sizes", "1024,3"]
    assert build_parser(argv).parse_args(argv).sizes == [1024, 3]


def test_bench_attention_small():
    out = qfa("bench", "attention", "--seqs", "128", "--memory-seq", "256", "--accuracy-seq", "128", "--decode-skv", "0")
    assert "SDPA fp32" in out and "peak memory" in out and "FP8 E4M3" in out


def test_bench_attention_heads_smoke():
    """--heads sets the table's rows; with no S >= 2048 there is no verdict to print (the verdict
    itself is tested in-process in test_tools.py, without timing S = 2048)."""
    out = qfa("bench", "attention", "--heads", "2:1,4:2", "--seqs", "64", "--memory-seq", "0", "--accuracy-seq", "0",
              "--decode-skv", "0")
    rows = [line.split("|")[1:3] for line in out.splitlines() if re.match(r"\| \(\d+, \d+\) \|", line)]
    assert [(h.strip(), s.strip()) for h, s in rows] == [("(2, 1)", "64"), ("(4, 2)", "64")]
    assert "speed target" not in out and "peak memory" not in out and "accuracy" not in out


def test_unknown_command_fails():
    done = subprocess.run([sys.executable, "-m", "qfa", "nope"], capture_output=True, text=True)
    assert done.returncode == 2 and "invalid choice" in done.stderr


@pytest.mark.parametrize("args", [["bench", "cast", "--sizes", "x"], ["bench", "cast", "--sizes", "1.5K"],
                                  ["bench", "cast", "--sizes", "4G"], ["bench", "cast", "--sizes", "1K,0"],
                                  ["demo", "--seq", "-"], ["demo", "--heads", "12:5"], ["demo", "--heads", "12"],
                                  ["demo", "--heads", "12:2,4:1"],
                                  ["bench", "attention", "--heads", "12:5"], ["bench", "attention", "--heads", "12"]])
def test_bad_arguments_fail_cleanly(args):
    done = subprocess.run([sys.executable, "-m", "qfa", *args], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr


@pytest.mark.parametrize("args, message", [
    (["demo", "--seq", "-5"], "--seq: expected a positive integer, got -5"),
    (["demo", "--seq", "0"], "--seq: expected a positive integer, got 0"),
    (["bench", "dropin", "--seqs", "-3"], "--seqs: expected comma-separated positive integers, got -3"),
    (["bench", "dropin", "--seqs", ""], "--seqs: expected comma-separated positive integers, got ''"),
    (["bench", "attention", "--accuracy-seq", "-3"], "--accuracy-seq: expected an integer >= 0, got -3"),
    (["bench", "attention", "--memory-seq", "-4"], "--memory-seq: expected an integer >= 0, got -4"),
    (["bench", "attention", "--backend", "bogus"], "--backend: invalid choice: 'bogus'"),
    (["bench", "cast", "--backend", "bogus"], "--backend: invalid choice: 'bogus'"),
    (["bench", "cast", "--device", "bogus"], "--device: expected a torch device"),
    (["bench", "cast", "--threads", "0"], "--threads: expected a positive integer, got 0"),
    (["bench", "dropin", "--threads", "-1"], "--threads: expected a positive integer, got -1"),
    (["bench", "vllm-layer", "--threads", "0"], "--threads: expected a positive integer, got 0"),
    (["bench", "vllm", "--batches", "0"], "--batches: expected comma-separated positive integers, got 0"),
    (["eval-ppl", "--text", "t", "--tokens="], "--tokens: expected comma-separated positive integers, got ''"),
    (["eval-ppl", "--text", "t", "--window", "0"], "--window: expected a positive integer, got 0"),
    (["eval-ppl", "--text", "t", "--stride", "0"], "--stride: expected a positive integer, got 0"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens: expected a positive integer, got 0"),
])
def test_bad_values_exit_2_naming_the_argument(args, message, capsys):
    """They used to run into a traceback (a RuntimeError, a subprocess's CalledProcessError), exit
    1 with a bare line (--threads), or be ignored (an empty list: an empty table)."""
    with pytest.raises(SystemExit) as done:
        build_parser(args).parse_args(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "usage: qfa" in err and message in err
