"""``qfa bench vllm-layer``: its steps are what they say (slots, block tables, lengths), the two
backends it times compute the same attention on them, and the command prints its tables."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM extra is not installed (pip install 'qfa[vllm]')")

from qfa.attention.backends import cpu_prepare  # noqa: E402
from qfa.tools.bench import vllm_layer as bl  # noqa: E402


def test_a_step_places_every_token_in_its_own_blocks():
    step = bl.Step([(300, 1), (5, 130)], seed=3)
    bs = bl.BLOCK_SIZE
    assert step.num_blocks == 3 + 2 and sorted(b for t in step.tables for b in t) == list(range(step.num_blocks))
    assert step.query_start_loc.tolist() == [0, 1, 131] and step.seq_lens.tolist() == [301, 135]
    assert step.slots.shape == (131,) and step.context_slots.shape == (305,)
    all_slots = torch.cat([step.context_slots, step.slots])
    assert all_slots.unique().numel() == all_slots.numel()  # no slot written twice
    # token j of sequence b sits in its table's block j // bs, at offset j % bs
    assert int(step.slots[0]) == step.tables[0][300 // bs] * bs + 300 % bs
    assert int(step.slots[-1]) == step.tables[1][134 // bs] * bs + 134 % bs
    for b, table in enumerate(step.tables):
        assert step.block_table[b, :len(table)].tolist() == table


@pytest.mark.skipif(not cpu_prepare.available(), reason="the native CPU preparation is not built")
def test_qfa_and_cpu_attn_compute_the_same_attention():
    """The bench compares like with like: on one step the two backends' outputs agree to HiF8's
    rounding (a wrong slot, block table or head order would decorrelate them)."""
    import contextlib

    step = bl.Step([(200, 1), (100, 1), (40, 24)], seed=5)
    with contextlib.ExitStack() as stack:
        runs = [bl.qfa_layer(step, stack), bl.cpu_attn_layer(step, "auto")]
        for run in runs:
            run()
    qfa_out, ref_out = (run.output.float() for run in runs)
    assert torch.isfinite(qfa_out).all() and qfa_out.abs().sum() > 0
    cos = torch.nn.functional.cosine_similarity(qfa_out.flatten(), ref_out.flatten(), dim=0)
    assert cos > 0.99, cos


@pytest.mark.skipif(not cpu_prepare.available(), reason="the native CPU preparation is not built")
def test_the_command_prints_both_tables(capsys, monkeypatch):
    monkeypatch.setattr(bl, "MIN_RUNS", 2)
    monkeypatch.setattr(bl, "MIN_TOTAL_SECONDS", 0.0)
    monkeypatch.setattr(bl, "MAX_RUNS", 2)
    assert bl.run(argparse.Namespace(batches=[2], contexts=[130], mixed=True, threads=None)) == 0
    out = capsys.readouterr().out
    assert "back to back:" in out and "after an MLP-sized matmul:" in out
    rows = [line for line in out.splitlines() if line.startswith("| decode, 2 x 130") or line.startswith("| mixed")]
    assert len(rows) == 4
    for line in rows:
        ratio = float(line.split("|")[4].strip().rstrip("x"))
        assert ratio > 0
