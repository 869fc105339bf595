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


def test_a_shared_prefix_is_the_same_blocks_written_once():
    bs = bl.BLOCK_SIZE
    step = bl.Step([(300, 1), (260, 1), (400, 1)], seed=4, shared_blocks=2)
    assert all(t[:2] == step.tables[0][:2] for t in step.tables)
    rest = [b for t in step.tables for b in t[2:]]
    assert sorted(step.tables[0][:2] + rest) == list(range(step.num_blocks)) and step.num_blocks == 2 + 1 + 1 + 2
    assert step.context_slots.shape == (300 + (260 - 2 * bs) + (400 - 2 * bs),)
    all_slots = torch.cat([step.context_slots, step.slots])
    assert all_slots.unique().numel() == all_slots.numel()  # the shared tokens written once
    # sequence 2's token 2 * bs (its first own token) sits in its first own block
    assert int(step.context_slots[300 + 260 - 2 * bs]) == step.tables[2][2] * bs
    for bad in (-1, 3):  # 3 full blocks would pass the 260-token context
        with pytest.raises(ValueError, match=f"shared_blocks must be in \\[0, 2\\].*got {bad}"):
            bl.Step([(300, 1), (260, 1)], shared_blocks=bad)
    names = [name for name, _ in bl.steps([1, 8], [100, 4096], mixed=False)]  # 100 tokens: no full block to share
    assert names == ["decode, 1 x 100", "decode, 8 x 100", "decode, 1 x 4096", "decode, 8 x 4096",
                     "decode, 8 x 4096, prefix shared"]
    shared = dict(bl.steps([8], [4096], mixed=False))["decode, 8 x 4096, prefix shared"]
    assert shared.shared_blocks == (4096 - bl.TAIL_TOKENS) // bs


@pytest.mark.skipif(not cpu_prepare.available(), reason="the native CPU preparation is not built")
@pytest.mark.parametrize("shared_blocks", [0, 1])
def test_qfa_and_cpu_attn_compute_the_same_attention(shared_blocks):
    """The bench compares like with like: on one step the two backends' outputs agree to HiF8's
    rounding (a wrong slot, block table or head order would decorrelate them)."""
    import contextlib

    step = bl.Step([(200, 1), (130, 1), (140, 24)], seed=5, shared_blocks=shared_blocks)
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
    assert bl.run(argparse.Namespace(batches=[2], contexts=[200], mixed=True, threads=None)) == 0
    out = capsys.readouterr().out
    assert "back to back:" in out and "after an MLP-sized matmul:" in out
    rows = [line for line in out.splitlines() if line.startswith("| decode, 2 x 200") or line.startswith("| mixed")]
    assert len(rows) == 6  # decode, decode with its prefix shared, mixed; in each table
    for line in rows:
        ratio = float(line.split("|")[4].strip().rstrip("x"))
        assert ratio > 0
