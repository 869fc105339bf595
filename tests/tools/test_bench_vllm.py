"""``qfa bench vllm``: its measures on synthetic logprob rows and step traces, its tables, and one
end-to-end run of the command on a tiny random Qwen2 (every engine in its own process)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import statistics
from dataclasses import asdict

import pytest

from qfa.tools.bench import vllm as bv


# ----------------------------------------------------------------------------- perplexity and KL

def _softmax_logs(logits):
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


def _rows(dists, ids, k):
    """vLLM-shaped prompt_logprobs rows from full distributions: None first, then each row's top k
    plus the actual token."""
    rows = [None]
    for i in range(1, len(ids)):
        lp = dists[i]
        keep = set(sorted(range(len(lp)), key=lambda t: -lp[t])[:k]) | {ids[i]}
        rows.append({t: lp[t] for t in keep})
    return rows


def _random_dists(n, vocab, seed, scale=3.0):
    rng = random.Random(seed)
    return [_softmax_logs([rng.gauss(0, scale) for _ in range(vocab)]) for _ in range(n)]


def test_actual_logprobs_and_perplexity_are_the_actual_tokens():
    ids = [5, 1, 2, 0]
    dists = _random_dists(4, 8, seed=1)
    rows = _rows(dists, ids, k=2)
    lp = bv.actual_logprobs(rows, ids)
    assert lp == [dists[i][ids[i]] for i in (1, 2, 3)]
    assert bv.perplexity(lp) == pytest.approx(math.exp(-sum(lp) / 3), rel=1e-15)
    assert bv.perplexity([math.log(0.25)] * 5) == pytest.approx(4.0, rel=1e-12)


def test_actual_logprobs_refuses_rows_that_do_not_fit():
    ids = [1, 2, 3]
    rows = [None, {2: -0.1}, {4: -0.2}]
    with pytest.raises(ValueError, match=r"rows\[2\] must hold the actual token 3"):
        bv.actual_logprobs(rows, ids)
    with pytest.raises(ValueError, match="same length"):
        bv.actual_logprobs(rows[:2], ids)
    with pytest.raises(ValueError, match="at least one next token"):
        bv.actual_logprobs([None], [1])
    with pytest.raises(ValueError, match="at least one value"):
        bv.perplexity([])


def test_paired_delta_is_the_ppl_ratio_with_the_paired_error():
    ref = [-1.0, -2.0, -0.5, -1.5]
    shifted = [x - 0.1 for x in ref]  # every NLL 0.1 larger: ppl x e^0.1, no spread
    delta, se = bv.paired_delta(shifted, ref)
    assert delta == pytest.approx(math.expm1(0.1), rel=1e-12)
    assert se == pytest.approx(0.0, abs=1e-12)
    assert bv.perplexity(shifted) / bv.perplexity(ref) - 1 == pytest.approx(delta, rel=1e-12)
    noisy = [-1.1, -1.9, -0.5, -1.5]
    d = [r - x for x, r in zip(noisy, ref)]
    mean = sum(d) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 3)
    assert bv.paired_delta(noisy, ref) == pytest.approx((math.expm1(mean), math.exp(mean) * sd / 2), rel=1e-12)
    with pytest.raises(ValueError, match="same tokens"):
        bv.paired_delta(ref[:3], ref)


def test_topk_kl_is_exact_when_the_support_is_everything():
    vocab = 6
    ids = [0, 1, 2, 3, 4]
    p, q = _random_dists(5, vocab, seed=2), _random_dists(5, vocab, seed=3)
    kl, filled = bv.topk_kl(_rows(p, ids, vocab), _rows(q, ids, vocab), k=vocab)
    exact = sum(sum(math.exp(a) * (a - b) for a, b in zip(p[i], q[i])) for i in range(1, 5)) / 4
    assert filled == 0
    assert kl == pytest.approx(exact, rel=1e-12)


def test_topk_kl_renormalises_on_the_references_top_k_and_fills_missing_tokens():
    ref = [None, {0: math.log(0.5), 1: math.log(0.3), 2: math.log(0.2)}]
    # k=2: support {0, 1}; p restricted = (0.625, 0.375). q has token 0, not 1: 1 gets q's floor.
    got = [None, {0: math.log(0.6), 3: math.log(0.1)}]
    kl, filled = bv.topk_kl(ref, got, k=2)
    p = (0.5 / 0.8, 0.3 / 0.8)
    q = (0.6 / 0.7, 0.1 / 0.7)
    assert filled == 1
    assert kl == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)), rel=1e-12)
    same, none = bv.topk_kl(ref, ref, k=3)
    assert (same, none) == (pytest.approx(0.0, abs=1e-15), 0)
    with pytest.raises(ValueError, match="same positions"):
        bv.topk_kl(ref, [ref[1], ref[1]])
    with pytest.raises(ValueError, match="k must be >= 1"):
        bv.topk_kl(ref, ref, k=0)


def test_top1_agreement_counts_matching_argmax():
    ref = [None, {1: -0.1, 2: -3.0}, {4: -0.2, 5: -2.0}, {7: -0.5, 8: -0.9}]
    got = [None, {1: -0.2, 2: -2.0}, {5: -0.1, 4: -2.5}, {7: -0.4}]
    assert bv.top1_agreement(ref, got) == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- speed

def test_generation_rates_time_decode_after_every_request_started():
    # batch 2: request 0 gets its first token at 1.0 s, request 1 at 1.5 s (one token each then 2
    # and 1: 3 tokens); one token per request per 0.25 s step after that, up to 4 each.
    snaps = [(0.5, 0, 0), (1.0, 1, 1), (1.5, 3, 2), (1.75, 5, 2), (2.0, 7, 2), (2.25, 8, 2)]
    r = bv.generation_rates(snaps, batch=2)
    assert r.prefill_s == 1.5
    assert r.decode_tok_s == pytest.approx((8 - 3) / (2.25 - 1.5))
    assert r.throughput_tok_s == pytest.approx(8 / 2.25)
    assert r.tokens == 8
    assert r.step_tok_s == pytest.approx((8.0, 8.0, 4.0))  # each step after 1.5 s: its tokens over 0.25 s
    assert bv.median_step([asdict(r)]) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="all 3 requests"):
        bv.generation_rates(snaps, batch=3)
    with pytest.raises(ValueError, match="no token after its prefill"):
        bv.generation_rates([(1.0, 1, 1)], batch=1)
    with pytest.raises(ValueError, match="time order"):
        bv.generation_rates([(2.0, 1, 1), (1.0, 2, 1)], batch=1)


def test_speed_prompts_share_the_prefix_and_differ_in_the_tail():
    ids = list(range(100))
    ps = bv.speed_prompts(ids, context=20, batch=3, tail=4)
    assert [len(p) for p in ps] == [20, 20, 20]
    assert all(p[:16] == ids[:16] for p in ps)
    assert [p[16:] for p in ps] == [ids[16:20], ids[20:24], ids[24:28]]
    assert bv.speed_prompts(ids, 20, 1, 4) == [ids[:20]]
    with pytest.raises(ValueError, match="must hold 28 tokens"):
        bv.speed_prompts(ids[:27], 20, 3, 4)
    with pytest.raises(ValueError, match="tail must be in"):
        bv.speed_prompts(ids, 20, 2, 20)


# ----------------------------------------------------------------------------- tables

def _table_rows(table):
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_capacity_table_ratios_and_verdict():
    cap = {"bf16": {"num_gpu_blocks": 10, "block_size": 128, "cache_dtype": "auto"},
           "fp8": {"num_gpu_blocks": 20, "block_size": 128, "cache_dtype": "fp8_e4m3"},
           "hif8": {"num_gpu_blocks": 20, "block_size": 128, "cache_dtype": "fp8"}}
    table, verdict = bv.capacity_table(cap)
    rows = _table_rows(table)
    assert [r[4] for r in rows] == ["1280", "2560", "2560"]
    assert [r[5] for r in rows] == ["1.00x", "2.00x", "2.00x"]
    assert verdict == ["capacity target (hif8: 2.0x bf16 and equal to fp8_e4m3): met (2560 tokens = 2.00x bf16, "
                       "fp8_e4m3 2560)"]
    cap["hif8"] = {"num_gpu_blocks": 19, "block_size": 128}
    assert "NOT met" in bv.capacity_table(cap)[1][0]


def _cell(config, delta, text="a.txt", tokens=4):
    return bv.Cell(text, tokens, config, 2.0, delta, 0.001, 1.0, 0.0, 0)


def test_accuracy_cells_from_rows_and_the_verdict():
    ids = [3, 1, 4, 1, 5]
    ref_d = _random_dists(5, 8, seed=4)
    other_d = [_softmax_logs([x + 0.3 * ((7 * t) % 3) for t, x in enumerate(d)]) for d in ref_d]
    rows = {"bf16": {"t": _rows(ref_d, ids, 3)}, "hif8": {"t": _rows(other_d, ids, 3)}}
    cells = bv.accuracy_cells(rows, {"t": ids}, scored=[3, 5], k=3)
    assert [(c.tokens, c.config) for c in cells] == [(3, "bf16"), (3, "hif8"), (5, "bf16"), (5, "hif8")]
    ref5 = bv.actual_logprobs(rows["bf16"]["t"], ids)
    got3 = bv.actual_logprobs(rows["hif8"]["t"][:3], ids[:3])
    assert cells[1].ppl == pytest.approx(bv.perplexity(got3))
    assert cells[2].ppl == pytest.approx(bv.perplexity(ref5)) and cells[2].delta == 0 and cells[2].kl == 0
    assert cells[3].kl == pytest.approx(bv.topk_kl(rows["bf16"]["t"], rows["hif8"]["t"], 3)[0])
    with pytest.raises(ValueError, match="reference configuration"):
        bv.accuracy_cells({"hif8": rows["hif8"]}, {"t": ids}, [3])
    with pytest.raises(ValueError, match="exceeds"):
        bv.accuracy_cells(rows, {"t": ids}, [6])

    good = [_cell("bf16", 0.0), _cell("hif8", 0.001), _cell("fp8", 0.02), _cell("fp8-calc", -0.003)]
    lines = bv.accuracy_verdict(good)
    assert lines == ["hif8: |Δppl| <= 0.5 % in every cell: met (worst 0.10 %)",
                     "hif8: |Δppl| below fp8's in every cell: met (1 cells)",
                     "hif8: |Δppl| below fp8-calc's in every cell: met (1 cells)"]
    bad = [_cell("bf16", 0.0), _cell("hif8", -0.006), _cell("fp8-calc", 0.004)]
    assert bv.accuracy_verdict(bad) == [
        "hif8: |Δppl| <= 0.5 % in every cell: NOT met (worst 0.60 %)",
        "hif8: |Δppl| below fp8-calc's in every cell: NOT met (a.txt@4: -0.60 % vs +0.40 %)"]
    table, _ = bv.accuracy_table(good)
    assert _table_rows(table)[1][:5] == ["a.txt", "4", "HiF8, calibration file (qfa)", "2.0000", "+0.10 ± 0.10 %"]


def test_speed_table_ratios_against_bf16_and_the_decode_verdict():
    def run(ctx, batch, decode, thr, *round_steps):
        """A merged row whose round i timed one run of decode steps ``round_steps[i]``."""
        rounds = [[_speed_row(ctx, batch, (1.0, decode, thr, steps))] for steps in round_steps]
        return bv.merge_rounds(rounds)[0]

    # per round, HiF8's median step over bf16's: batch 1 (2/2.5, 3/2, 1/2) -> median 0.8; batch 8 1.2, 1.2
    speed = {"bf16": [run(4096, 1, 2.0, 0.5, (2.5,), (2.0,), (2.0,)), run(4096, 8, 8.0, 4.0, (10.0,), (5.0,))],
             "hif8": [run(4096, 1, 2.2, 0.4, (2.0,), (3.0,), (1.0,)), run(4096, 8, 6.0, 4.0, (12.0,), (6.0,))]}
    table, verdict = bv.speed_table(speed)
    rows = _table_rows(table)
    assert [(r[1], r[2], r[5], r[7], r[8], r[10]) for r in rows] == [
        ("1", "bf16 cache (CPU_ATTN)", "1.00x", "1.00x", "1.00x", "1.00x"),
        ("1", "HiF8, calibration file (qfa)", "1.10x", "1.00x", "0.80x", "0.80x"),
        ("8", "bf16 cache (CPU_ATTN)", "1.00x", "1.00x", "1.00x", "1.00x"),
        ("8", "HiF8, calibration file (qfa)", "0.75x", "1.20x", "1.20x", "1.00x")]
    # pooled, batch 1's medians are equal (2.0 each); paired by round HiF8 is 0.8x
    assert verdict == ["decode target (HiF8 >= 1.0x CPU_ATTN bf16 at 4096 context, median decode step paired by "
                       "round): NOT met (batch 1: 0.80x, batch 8: 1.20x)"]


def test_paired_ratio_pairs_runs_by_round():
    runs = [{"round": 0, "step_tok_s": (2.0,)}, {"round": 1, "step_tok_s": (3.0, 3.0)}, {"round": 2, "step_tok_s": (9.0,)}]
    ref = [{"round": 0, "step_tok_s": (4.0,)}, {"round": 1, "step_tok_s": (2.0,)}]
    assert bv.paired_ratio(runs, ref) == pytest.approx(statistics.median([0.5, 1.5]))  # round 2 has no partner
    with pytest.raises(ValueError, match="share at least one round"):
        bv.paired_ratio(runs[2:], ref)


def test_round_order_reverses_every_other_round_so_mean_positions_match():
    engines = ["bf16", "fp8", "hif8"]
    assert bv.round_order(engines, 0) == engines and bv.round_order(engines, 2) == engines
    assert bv.round_order(engines, 1) == ["hif8", "fp8", "bf16"]
    positions = {e: sum(bv.round_order(engines, r).index(e) for r in range(2)) for e in engines}
    assert len(set(positions.values())) == 1
    with pytest.raises(ValueError, match="index must be >= 0, got -1"):
        bv.round_order(engines, -1)


def _speed_row(ctx, batch, *runs):
    """A speed row as ``_speed`` returns it: ``runs`` are (prefill s, decode tok/s, throughput tok/s,
    decode steps' tok/s)."""
    rates = [{"prefill_s": p, "decode_tok_s": d, "throughput_tok_s": t, "tokens": 8, "step_tok_s": steps}
             for p, d, t, steps in runs]
    return {"context": ctx, "batch": batch, "prefill_s": rates[0]["prefill_s"],
            "decode_tok_s": max(r["decode_tok_s"] for r in rates), "median_step_tok_s": bv.median_step(rates),
            "throughput_tok_s": rates[0]["throughput_tok_s"], "cached_tokens_first_run": 0, "runs": rates}


def test_merge_rounds_keeps_every_run_and_takes_the_best_decode_and_the_first_prefill():
    first = [_speed_row(1024, 1, (9.0, 1.0, 0.5, (1.0, 1.2))),
             _speed_row(1024, 8, (2.0, 6.0, 3.0, (6.0, 7.0)), (1.5, 6.5, 3.2, (6.5,)))]
    second = [_speed_row(1024, 1, (1.0, 1.4, 0.9, (1.4, 1.1, 1.3))),
              _speed_row(1024, 8, (1.0, 5.0, 2.5, (5.0, 2.0)), (1.1, 5.5, 2.6, (5.5,)))]
    merged = bv.merge_rounds([first, second])
    assert [m["decode_tok_s"] for m in merged] == [1.4, 6.5]
    # the median over every step of every run: (1.0, 1.2, 1.4, 1.1, 1.3) and (6.0, 7.0, 6.5, 5.0, 2.0, 5.5)
    assert [m["median_step_tok_s"] for m in merged] == [pytest.approx(1.2), pytest.approx(5.75)]
    assert [m["prefill_s"] for m in merged] == [9.0, 2.0] and [m["throughput_tok_s"] for m in merged] == [0.5, 3.0]
    assert [[r["decode_tok_s"] for r in m["runs"]] for m in merged] == [[1.0, 1.4], [6.0, 6.5, 5.0, 5.5]]
    assert [[r["round"] for r in m["runs"]] for m in merged] == [[0, 1], [0, 0, 1, 1]]
    assert first[0]["runs"] == [{"prefill_s": 9.0, "decode_tok_s": 1.0, "throughput_tok_s": 0.5, "tokens": 8,
                                 "step_tok_s": (1.0, 1.2)}]
    one = bv.merge_rounds([first])  # one round: the same rows, each run tagged round 0
    assert one == [dict(row, runs=[dict(r, round=0) for r in row["runs"]]) for row in first]
    with pytest.raises(ValueError, match="round 1 timed other rows than round 0"):
        bv.merge_rounds([first, second[:1]])
    with pytest.raises(ValueError, match="at least one round"):
        bv.merge_rounds([])


def test_runs_table_lists_each_run_in_order():
    speed = {"bf16": [_speed_row(4096, 1, (3.0, 1.25, 0.5, (1.0, 2.0, 1.5)), (2.0, 1.5, 0.6, (1.5,)))],
             "hif8": [_speed_row(4096, 1, (2.5, 1.75, 0.7, (1.75,)), (1.0, 1.5, 0.6, (1.0, 2.0)))]}
    assert _table_rows(bv.runs_table(speed)) == [
        ["4096", "1", "bf16 cache (CPU_ATTN)", "1.25, 1.50", "1.50, 1.50", "3.0, 2.0"],
        ["4096", "1", "HiF8, calibration file (qfa)", "1.75, 1.50", "1.75, 1.50", "2.5, 1.0"]]


def test_arguments_are_checked(capsys):
    parser = argparse.ArgumentParser()
    bv.add_arguments(parser)
    args = parser.parse_args(["--engines", "hif8,bf16", "--tokens", "8,16"])
    assert args.engines == ["bf16", "hif8"] and args.tokens == [8, 16]
    assert (args.rounds, args.repeats) == (bv.ROUNDS, bv.REPEATS)
    for rounds in ("0", "3"):  # an odd count above 1 would leave the engines' places in the order uneven
        bad = parser.parse_args(["--rounds", rounds])
        assert bv.run(bad) == 2
        assert "--rounds must be" in capsys.readouterr().err
    for bad in (["--engines", "hif8"], ["--engines", "bf16,nope"], ["--tokens", "0"], ["--batches", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_engine_arguments_select_each_cache():
    assert bv.engine_arguments("bf16", None) == {}
    assert bv.engine_arguments("fp8", None) == {"kv_cache_dtype": "fp8_e4m3"}
    hif8 = bv.engine_arguments("hif8-first-write", None)
    assert hif8["attention_backend"] == "CUSTOM" and hif8["kv_cache_dtype"] == "fp8"
    with pytest.raises(ValueError, match="calibration file"):
        bv.engine_arguments("hif8", None)
    with pytest.raises(ValueError, match="engine must be one of"):
        bv.engine_arguments("fp16", None)


# ----------------------------------------------------------------------------- end to end

TEXT = ("The quick brown fox jumps over the lazy dog while the cache keeps every key and value it has seen. "
        "Licenses grant permission to copy, modify and distribute the work under stated conditions. ") * 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Qwen2 with hidden = 2 heads x 128 (vLLM derives head_dim from hidden / heads), a
    small BPE tokenizer in its own folder, and three texts."""
    pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, decoders, models as tk_models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("bench_vllm")
    model_dir, tok_dir = root / "model", root / "tokenizer"
    tok = Tokenizer(tk_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(tok_dir)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
    texts = []
    for i, seed in enumerate((1, 2, 3)):
        words = TEXT.split()
        random.Random(seed).shuffle(words)
        path = root / f"text{i}.txt"
        path.write_text(" ".join(words))
        texts.append(str(path))
    return model_dir, tok_dir, texts


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install 'qfa[vllm]')")
def test_the_command_runs_every_engine_on_a_tiny_model(tiny_model, tmp_path, capsys):
    model_dir, tok_dir, texts = tiny_model
    out = tmp_path / "report.md"
    parser = argparse.ArgumentParser()
    bv.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--tokenizer", str(tok_dir), "--texts", ",".join(texts[:2]),
                              "--calibration-text", texts[2], "--calibration-tokens", "48", "--tokens", "32,64",
                              "--contexts", "48", "--batches", "1,2", "--tail", "8", "--decode-tokens", "3",
                              "--repeats", "1", "--rounds", "2", "--kv-space", "1", "--max-batched-tokens", "64",
                              "--work-dir", str(tmp_path / "work"), "--output", str(out), "--no-progress"])
    assert bv.run(args) == 0
    report = out.read_text()
    assert report == capsys.readouterr().out.rstrip("\n") + "\n"
    sections = {title: report.split(f"### {title}")[1].split("###")[0] for title in
                ("Capacity", "Accuracy through vLLM", "Speed")}
    cap = {r[1]: r for r in _table_rows("\n".join(l for l in sections["Capacity"].splitlines() if l.startswith("|")))}
    tokens = {dtype: int(r[4]) for dtype, r in cap.items()}
    # vLLM's own fp8 cache needs AVX-512 or AMX on x86: without them its engine is skipped, and said so
    no_fp8 = bv.engine_unavailable("fp8")
    assert (f"engines skipped: fp8 ({no_fp8})" in report) == (no_fp8 is not None)
    ran = [c for c, (_, engine) in bv.CONFIGS.items() if not (no_fp8 and engine == "fp8")]
    # the same KV space holds twice the tokens in a 1-byte cache (up to one block of rounding)
    assert set(tokens) == {"auto", "fp8"} | (set() if no_fp8 else {"fp8_e4m3"})
    if not no_fp8:
        assert tokens["fp8"] == tokens["fp8_e4m3"]
    assert abs(tokens["fp8"] - 2 * tokens["auto"]) <= int(cap["fp8"][3])
    acc = _table_rows("\n".join(l for l in sections["Accuracy through vLLM"].splitlines() if l.startswith("|")))
    assert len(acc) == 2 * 2 * len(ran)  # texts x lengths x caches
    for row in acc:
        if row[2] == bv.CONFIGS["bf16"][0]:
            assert row[4].startswith("+0.00 ± 0.00") and row[5] == "1.0000" and float(row[6]) == 0.0
        else:
            assert math.isfinite(float(row[3])) and float(row[6]) >= 0.0
    ppl = {(r[0], r[1], r[2]): r[3] for r in acc}
    if not no_fp8:  # the calculated scales reached CPU_ATTN: the same engine scores differently after they are set
        assert any(ppl[(t, n, bv.CONFIGS["fp8"][0])] != ppl[(t, n, bv.CONFIGS["fp8-calc"][0])] for t, n, _ in ppl)
        assert "fp8_e4m3 calculated scales: k " in report
    best, each = sections["Speed"].split("Each timed run")
    speed = _table_rows("\n".join(l for l in best.splitlines() if l.startswith("|")))
    timed = sorted((str(b), bv.CONFIGS[e][0]) for b in (1, 2) for e in bv.SPEED_ENGINES if not (no_fp8 and e == "fp8"))
    assert sorted((r[1], r[2]) for r in speed) == timed
    assert all(float(r[4]) > 0 and float(r[6]) > 0 and float(r[9]) > 0 for r in speed)
    assert all(r[8] == "1.00x" for r in speed if r[2] == bv.CONFIGS["bf16"][0])  # each round paired with itself
    runs = _table_rows("\n".join(l for l in each.splitlines() if l.startswith("|")))
    assert sorted((r[1], r[2]) for r in runs) == timed
    decode = {(r[1], r[2]): r[3].split(", ") for r in runs}
    assert all(len(v) == 2 for v in decode.values())  # two rounds of one run each
    for r in speed:  # the table's decode is the best of every run
        assert r[4] == max(decode[(r[1], r[2])], key=float)
    later = sorted(p.name for p in (tmp_path / "work").glob("*.round1.result.json"))
    assert later == sorted(f"{e}.round1.result.json" for e in bv.SPEED_ENGINES if not (no_fp8 and e == "fp8"))


def test_cpu_line_names_the_model_and_the_kernel_flags():
    info = "processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n"
    line = bv.cpu_line(info)
    assert line.startswith("AMD EPYC (family 26, model 2); flags: avx2 fma avx512f avx512_bf16; absent: f16c")
    assert "amx_tile" in line.split("absent:")[1]
    assert bv.cpu_line("").startswith("unknown CPU (family ?, model ?); flags: none of the kernel flags")
