"""``qfa generate`` on a tiny random model saved to a temporary folder (the fixture of test_eval_ppl)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from test_eval_ppl import tiny_model_dir  # noqa: E402,F401  (the fixture: 2 layers, 4 q / 2 kv heads, D 128)

from qfa.cli import main  # noqa: E402
from qfa.tools import eval_ppl, generate, models  # noqa: E402

LAYERS, NKV, D = 2, 2, 128
COLUMNS = ["model", "prompt", "context", "attention", "cache", "prefill tok/s", "decode tok/s", "decode vs ref",
           "KV bytes", "KV vs ref", "saturated", "greedy prefix", "greedy equal"]


def _rows(out: str) -> list[dict]:
    lines = [line for line in out.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == COLUMNS
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def _dynamic_bytes(tokens: int, element_size: int) -> int:
    return LAYERS * 2 * NKV * tokens * D * element_size  # K and V of every layer


def _hif8_bytes(tokens: int) -> int:
    # per layer: 1-byte K and V codes, fp32 k and v scales, the fp32 (B, Nkv, D) key mean, int64 lengths (B,)
    return LAYERS * (2 * NKV * tokens * D + 2 * 4 + NKV * D * 4 + 8)


def test_generate_prints_the_fields(tiny_model_dir, capsys):  # noqa: F811
    prompt, new = 40, 6
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt-file", str(tiny_model_dir / "text.txt.gz"),
                 "--prompt-tokens", str(prompt), "--max-new-tokens", str(new), "--attn", "sdpa,sdpa,qfa_hif8"]) == 0
    ref, again, hif8 = _rows(capsys.readouterr().out)
    stored = prompt + new - 1  # the last generated token is never fed back
    for row in (ref, again, hif8):
        assert row["context"] == str(prompt)
        assert float(row["prefill tok/s"]) > 0 and float(row["decode tok/s"]) > 0
    assert (ref["cache"], again["cache"], hif8["cache"]) == ("DynamicCache", "DynamicCache", "HiF8Cache")
    # a run against itself (the second sdpa against the first): total agreement, same bytes
    for row in (ref, again):
        assert row["greedy prefix"] == f"{new}/{new}" and row["greedy equal"] == "1.000"
        assert int(row["KV bytes"]) == _dynamic_bytes(stored, 2) and row["KV vs ref"] == "1.000x"
        assert row["saturated"] == "-"
    assert int(hif8["KV bytes"]) == _hif8_bytes(stored) < int(ref["KV bytes"])
    assert float(hif8["KV vs ref"].rstrip("x")) == pytest.approx(_hif8_bytes(stored) / _dynamic_bytes(stored, 2),
                                                                 abs=5e-4)
    assert int(hif8["saturated"]) >= 0
    prefix, of = map(int, hif8["greedy prefix"].split("/"))
    assert of == new and 0 <= prefix <= new and 0.0 <= float(hif8["greedy equal"]) <= 1.0


def test_dynamic_cache_option_and_repeat(tiny_model_dir, capsys):  # noqa: F811
    """--cache dynamic: qfa_hif8 on a bf16 DynamicCache (the bytes of sdpa's); --repeat checks
    that repeats generate the same tokens and keeps one row per implementation; --profile."""
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt-file", str(tiny_model_dir / "text.txt.gz"),
                 "--prompt-tokens", "24,32", "--max-new-tokens", "3", "--attn", "sdpa,qfa_hif8", "--cache", "dynamic",
                 "--repeat", "2", "--no-warmup", "--profile", "5"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert [(r["context"], r["attention"], r["cache"]) for r in rows] == [
        (c, a, "DynamicCache") for c in ("24", "32") for a in ("sdpa", "qfa_hif8")]
    for r in rows:
        assert int(r["KV bytes"]) == _dynamic_bytes(int(r["context"]) + 2, 2)
    # --profile: one profiled step per row, after the table
    assert out.count("### one decode step after the run") == 4 and "Ordered by: cumulative time" in out


@pytest.mark.parametrize("kind", ["dynamic", "hif8"])
def test_the_greedy_loop_is_transformers_generate(tiny_model_dir, kind):  # noqa: F811
    """generate_greedy's prefill + one-token steps give the tokens of model.generate(do_sample=False)
    on the same kind of cache (positions and cache handling are transformers' own)."""
    from transformers import DynamicCache

    from qfa.serving import HiF8Cache

    name = "qfa_hif8" if kind == "hif8" else "sdpa"
    eval_ppl.register_implementations(eval_ppl.parse_attn(name))
    model, tok = models.load_model(str(tiny_model_dir), None, torch.float32, name)
    prompt = tok("This program is free software: you can redistribute it", return_tensors="pt").input_ids
    make = (lambda: HiF8Cache(config=model.config)) if kind == "hif8" else (lambda: DynamicCache(config=model.config))
    cache = make()
    run = generate.generate_greedy(model, prompt, 7, cache)
    with torch.inference_mode():
        expected = model.generate(prompt, past_key_values=make(), max_new_tokens=7, min_new_tokens=7, do_sample=False,
                                  pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert run.tokens == expected
    assert len(run.step_s) == 6 and run.prefill_tokens == prompt.shape[1]
    assert run.kv_bytes == generate.cache_nbytes(cache) > 0


def test_agreement():
    assert generate.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (4, 1.0)
    assert generate.agreement([1, 2, 9, 4], [1, 2, 3, 4]) == (2, 0.75)
    assert generate.agreement([9, 2, 3, 4], [1, 2, 3, 4]) == (0, 0.75)
    with pytest.raises(ValueError, match="equal lengths"):
        generate.agreement([1], [1, 2])


def test_the_thread_count_survives_the_runs(tiny_model_dir):  # noqa: F811
    """The thread count after the runs is the one before, and every layer runs on it: an
    attention call that drops it to 1 (as the native kernel once did) is undone after each
    attention module, so no later layer or run is timed on one thread."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen = []

    def dropping(module, *args, **kwargs):
        seen.append(torch.get_num_threads())
        torch.set_num_threads(1)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("qfa_test_drops_threads", dropping)
    AttentionMaskInterface.register("qfa_test_drops_threads", sdpa_mask)
    specs = eval_ppl.parse_attn("qfa_test_drops_threads,qfa_hif8,sdpa")
    eval_ppl.register_implementations(specs)
    model, tok = models.load_model(str(tiny_model_dir), None, torch.bfloat16, "sdpa")
    ids = tok("GNU General Public License " * 4, return_tensors="pt").input_ids[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rows = generate.run_all(model, ids, [16], specs, max_new_tokens=3, warmup=False, progress=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert seen == [2] * (LAYERS * 3)  # 3 forward passes of 2 layers, each entered with 2 threads
    assert [r.cache for r in rows] == ["DynamicCache", "HiF8Cache", "DynamicCache"]


@pytest.mark.parametrize("bad", [["--max-new-tokens", "0"], ["--max-new-tokens", "x"], ["--cache", "int8"],
                                 ["--attn", ","], ["--attn", "sdpa:x=1"], ["--prompt-tokens", "0"],
                                 ["--prompt-tokens", "12,a"], ["--repeat", "0"], ["--dtype", "fp64"]])
def test_bad_arguments_are_argparse_errors(tiny_model_dir, bad, capsys):  # noqa: F811
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(tiny_model_dir), "--prompt-file", str(tiny_model_dir / "text.txt.gz"), *bad])
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def test_errors_found_when_running_are_reported(tiny_model_dir, capsys):  # noqa: F811
    base = ["generate", "--prompt-file", str(tiny_model_dir / "text.txt.gz")]
    assert main(base + ["--model", str(tiny_model_dir / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(base + ["--model", str(tiny_model_dir), "--prompt-tokens", "100000"]) == 2
    assert "fewer than the 100000" in capsys.readouterr().err
    assert main(base + ["--model", str(tiny_model_dir), "--attn", "sdpa,qfa_hif8:calibraton=amax"]) == 2
    assert "calibraton" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt-file", str(tiny_model_dir / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err


def test_bad_arguments_fail_without_a_traceback(tiny_model_dir):  # noqa: F811
    done = subprocess.run([sys.executable, "-m", "qfa", "generate", "--model", str(tiny_model_dir),
                           "--prompt-file", str(tiny_model_dir / "text.txt.gz"), "--max-new-tokens", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--max-new-tokens" in done.stderr and "Traceback" not in done.stderr
