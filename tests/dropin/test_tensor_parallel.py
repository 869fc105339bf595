"""Tensor parallel (issue 11 section 3): heads sharded over 2 ``gloo`` ranks on CPU give exactly
the bits of the unsharded call, for the drop-in and for HiF8Attention's calibration.

Two worker processes (this file run as a script, loopback only, bounded time) each hold a
contiguous half of the heads of a GQA call (Nq=8, Nkv=4: 4 q heads and 2 kv heads per rank) and
compute both the sharded call (``process_group=``) and the unsharded one; they save the tensors
and the parent's tests compare them. The heads of rank 1 are several times larger than rank 0's,
so a rank's own statistic is not the tensor's: without ``process_group`` the sharded results
differ (the controls below), so the exact-equality tests can fail.

The native CPU kernel's per-head bits do not depend on the number of heads (its key split
depends only on one item's shape): ``test_per_head_bits_do_not_depend_on_the_head_count``
checks that, so the workers run the default CPU backend.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

NQ, NKV, WORLD = 8, 4, 2
RULES = ("rms", "amax", "mse")
LAYOUTS = ("BNSD", "TND")
TIMEOUT_S = 240
# Rank 1's heads are larger than rank 0's by these factors (q, k, v). Chosen so that neither the
# whole tensors' log2(rms) nor a shard's sits near a rounding tie (the tests check the former).
GAIN = (6.0, 3.0, 5.0)


# ---------------------------------------------------------------------------------------------
# data, shared by the workers and the parent


def _tensors(seed: int, layout: str):
    """Full (unsharded) q, k, v and the length tensors of one case."""
    g = torch.Generator().manual_seed(seed)
    d = 128

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    if layout == "BNSD":
        b, s = 2, 24  # under 2^16 elements per tensor: the cast runs eagerly (no one-off compile)
        q, k, v = rnd(b, NQ, s, d), rnd(b, NKV, s, d) + 0.7, rnd(b, NKV, s, d)
        lengths = dict(seqused_q=torch.tensor([24, 15], dtype=torch.int32),
                       seqused_kv=torch.tensor([24, 15], dtype=torch.int32))
    else:
        cu = torch.tensor([0, 24, 40, 60], dtype=torch.int32)
        t = int(cu[-1])
        q, k, v = rnd(t, NQ, d), rnd(t, NKV, d) + 0.7, rnd(t, NKV, d)
        used = torch.tensor([24, 9, 13], dtype=torch.int32)  # padding at the end of two sequences
        lengths = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, seqused_q=used, seqused_kv=used)
    axis = 1
    out = []
    for x, gain in zip((q, k, v), GAIN):
        n = x.shape[axis]
        factor = torch.ones(n)
        factor[n // 2:] = gain
        shape = [1] * x.dim()
        shape[axis] = n
        out.append((x * factor.view(shape)).to(torch.bfloat16))
    return (*out, lengths)


def _shard(x: torch.Tensor, rank: int, axis: int = 1) -> torch.Tensor:
    n = x.shape[axis] // WORLD
    return x.narrow(axis, rank * n, n).contiguous()


def _lse_axis(layout: str) -> int:
    return 0 if layout == "TND" else 1


# ---------------------------------------------------------------------------------------------
# the worker (this file run as a script)


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    import qfa
    from qfa.dropin.smoothing import prepare, valid_parts

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    pg = dist.group.WORLD
    res: dict = {}
    for rule in RULES:
        for layout in LAYOUTS:
            q, k, v, lengths = _tensors(seed=1, layout=layout)
            opts = dict(calibration=rule, is_causal=True, layout=layout, return_softmax_lse=True, **lengths)
            full, full_lse = qfa.hif8_attention(q, k, v, **opts)
            shards = [_shard(x, rank) for x in (q, k, v)]
            res[rule, layout] = dict(
                sharded=qfa.hif8_attention(*shards, process_group=pg, **opts),
                alone=qfa.hif8_attention(*shards, **opts),  # the control: this rank's own statistics
                full=(_shard(full, rank), _shard(full_lse, rank, _lse_axis(layout))),
            )
            if rule == "rms":  # how far the whole tensors' log2(rms) is from a rounding tie
                tensors, _ = prepare(q, k, v, layout=layout, cu_seqlens_kv=lengths.get("cu_seqlens_kv"),
                                     seqused_kv=lengths["seqused_kv"])
                parts = valid_parts(tensors, layout, lengths.get("cu_seqlens_q"), lengths.get("cu_seqlens_kv"),
                                    lengths["seqused_q"], lengths["seqused_kv"])
                res["log2_rms", layout] = [math.log2(float(p.double().square().mean().sqrt())) for p in parts]

    # HiF8Attention: calibrate over 2 batches (forward inside calibrate), freeze, then serve.
    batches = [_tensors(seed=10 + i, layout="BNSD") for i in range(2)]
    for rule in RULES:
        modules = dict(sharded=qfa.HiF8Attention(calibration=rule, is_causal=True, process_group=pg),
                       alone=qfa.HiF8Attention(calibration=rule, is_causal=True),
                       full=qfa.HiF8Attention(calibration=rule, is_causal=True))
        outs = {name: [] for name in modules}
        for name, m in modules.items():
            with m.calibrate():
                for q, k, v, lengths in batches:
                    x = (q, k, v) if name == "full" else tuple(_shard(t, rank) for t in (q, k, v))
                    outs[name].append(m(*x, **lengths))
            q, k, v, lengths = batches[0]
            x = (q, k, v) if name == "full" else tuple(_shard(t, rank) for t in (q, k, v))
            outs[name].append(m(*x, **lengths))  # frozen: static scales
        outs["full"] = [_shard(o, rank) for o in outs["full"]]
        res["module", rule] = {name: dict(scales=[m.q_scale.clone(), m.k_scale.clone(), m.v_scale.clone()],
                                          frozen=m.frozen, outputs=outs[name]) for name, m in modules.items()}

    q, k, v = (_shard(x, rank) for x in _tensors(seed=1, layout="BNSD")[:3])
    try:  # a gathering rule with unequal shards: refused on every rank (none left waiting)
        heads = 4 if rank == 0 else 2
        qfa.hif8_attention(q[:, :heads], k[:, :heads // 2], v[:, :heads // 2], calibration="mse", process_group=pg)
        res["unequal"] = "no error"
    except Exception as e:  # noqa: BLE001
        res["unequal"] = f"{type(e).__name__}: {e}"

    def f(q, k, v):
        return qfa.hif8_attention(q, k, v, process_group=pg)

    # plain torch.compile: the graph breaks at the group and the call runs eagerly (both ranks:
    # it runs the collectives)
    res["compile_eager"] = (torch.compile(f)(q, k, v), f(q, k, v))
    if rank == 0:  # fullgraph: refused before any collective, so rank 1 does not wait for it
        def g(q, k, v):  # another code object: dynamo's cache of f's frame (run eagerly) is not reused
            return qfa.hif8_attention(q, k, v, process_group=pg)

        try:
            torch.compile(g, fullgraph=True)(q, k, v)
            res["compile"] = "no error"
        except Exception as e:  # noqa: BLE001  (the message is what the parent checks)
            res["compile"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    dist.destroy_process_group()
    q, k, v, _ = _tensors(seed=1, layout="BNSD")
    try:
        qfa.hif8_attention(q, k, v, process_group=pg)  # a group object left after destroy
        res["uninitialised"] = "no error"
    except Exception as e:  # noqa: BLE001
        res["uninitialised"] = f"{type(e).__name__}: {e}"
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


# ---------------------------------------------------------------------------------------------
# the parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               QFA_COMPILE="0")  # the workers' few small casts: eager is cheaper than a one-off compile
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed (rc {p.returncode}):\n{log[-4000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rule", RULES)
def test_sharded_call_gives_the_unsharded_bits(ranks, rule, layout):
    for r, res in enumerate(ranks):
        case = res[rule, layout]
        out, lse = case["sharded"]
        full_out, full_lse = case["full"]
        assert out.shape == full_out.shape and lse.shape == full_lse.shape
        assert torch.equal(out, full_out), f"rank {r}: output differs from the unsharded call's heads"
        assert torch.equal(lse, full_lse), f"rank {r}: LSE differs from the unsharded call's heads"
    # the control: rank 0's own (smaller) heads give other scales, hence other bits (rank 1 holds
    # the tensor's maximum, so with "amax" its own statistic is the tensor's)
    assert not torch.equal(ranks[0][rule, layout]["alone"][0], ranks[0][rule, layout]["full"][0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_rms_data_is_not_at_a_rounding_tie(ranks, layout):
    """A float64 sum of squares summed in another order can move log2(rms) in its last bits;
    only a tie of log2(rms) with a half-integer would let that change the power of two."""
    for value in ranks[0]["log2_rms", layout]:
        assert abs(value - math.floor(value) - 0.5) > 1e-6, value


@pytest.mark.parametrize("rule", ["rms", "amax"])
def test_sharded_calibration_freezes_the_unsharded_scales(ranks, rule):
    for r, res in enumerate(ranks):
        m = res["module", rule]
        assert m["sharded"]["frozen"] and m["full"]["frozen"]
        assert _equal(m["sharded"]["scales"], m["full"]["scales"]), f"rank {r}: {m['sharded']['scales']}"
        # forward while calibrating (dynamic, reduced) and frozen: the unsharded heads' bits
        assert _equal(m["sharded"]["outputs"], m["full"]["outputs"]), f"rank {r}: outputs differ"
        assert all(torch.equal(s, ranks[0]["module", rule]["sharded"]["scales"][i])
                   for i, s in enumerate(m["sharded"]["scales"])), "ranks froze different scales"
    control = ranks[0]["module", rule]
    assert not _equal(control["alone"]["scales"], control["full"]["scales"]), "rank 0's own scales matched"


def test_pool_based_calibration_freezes_one_scale_on_every_rank(ranks):
    """"mse" has no reducible form: the gathered pools are a sample of every shard, the same
    on both ranks (the scale need not be the unsharded module's, as documented)."""
    scales = [res["module", "mse"]["sharded"]["scales"] for res in ranks]
    assert all(res["module", "mse"]["sharded"]["frozen"] for res in ranks)
    assert _equal(scales[0], scales[1])
    assert all(math.isfinite(float(s)) and float(s) > 0 for s in scales[0])
    # the dynamic forward while calibrating is reduced like the drop-in: the unsharded bits
    for r, res in enumerate(ranks):
        m = res["module", "mse"]
        assert _equal(m["sharded"]["outputs"][:2], m["full"]["outputs"][:2]), f"rank {r}"


def test_process_group_is_refused_under_fullgraph_compile_and_runs_eagerly_otherwise(ranks):
    for res in ranks:
        compiled, eager = res["compile_eager"]
        assert torch.equal(compiled, eager)
    assert "process_group is not supported under torch.compile" in ranks[0]["compile"], ranks[0]["compile"]


def test_unequal_shards_are_refused_on_every_rank_for_a_gathering_rule(ranks):
    for res in ranks:
        assert res["unequal"].startswith("ValueError") and "same shard shape" in res["unequal"], res["unequal"]


def test_a_group_without_torch_distributed_initialised_is_an_error(ranks):
    for res in ranks:
        assert res["uninitialised"].startswith("RuntimeError") and "not initialised" in res["uninitialised"]


def test_process_group_must_be_a_process_group():
    import qfa

    q, k, v, _ = _tensors(seed=1, layout="BNSD")
    for bad in ("WORLD", 1, object()):
        with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
            qfa.hif8_attention(q, k, v, process_group=bad)
        with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
            qfa.HiF8Attention(process_group=bad)


def test_per_head_bits_do_not_depend_on_the_head_count():
    """What lets the workers use the default CPU kernel: a call on half the heads (same static
    scales) gives the same bits as those heads of the whole call."""
    import qfa

    q, k, v, lengths = _tensors(seed=2, layout="BNSD")
    opts = dict(is_causal=True, scales=(0.5, 0.25, 1.0), return_softmax_lse=True, **lengths)
    full, full_lse = qfa.hif8_attention(q, k, v, **opts)
    for r in range(WORLD):
        out, lse = qfa.hif8_attention(*(_shard(x, r) for x in (q, k, v)), **opts)
        assert torch.equal(out, _shard(full, r)) and torch.equal(lse, _shard(full_lse, r))


# ---------------------------------------------------------------------------------------------
# the reducible forms, in one process


def _pieces(x: torch.Tensor, cuts) -> list[torch.Tensor]:
    flat = x.reshape(-1).float()
    bounds = [0, *cuts, flat.numel()]
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("rule", ["amax", "rms"])
def test_statistics_of_pieces_give_the_rule_of_the_whole(rule):
    """Merged statistics of any split (an empty piece included) finish to the rule's scale of
    the whole tensor: exactly for amax, and for rms off a rounding tie (checked here)."""
    from qfa.dropin import calibration as cal

    g = torch.Generator().manual_seed(3)
    fn = cal.RULES[rule]
    red = cal.reduction_of(fn)
    for trial in range(20):
        x = torch.randn(3000, generator=g) * 2.0 ** (trial - 10)
        x[int(torch.randint(3000, (1,), generator=g))] *= 50  # an outlier somewhere
        cuts = sorted(int(c) for c in torch.randint(0, 3001, (3,), generator=g))
        stats = [red.statistics(p) for p in _pieces(x, cuts)]
        merged = stats[0]
        for st in stats[1:]:
            merged = red.merge(merged, st)
        if rule == "rms":
            e = math.log2(float(x.double().square().mean().sqrt()))
            assert abs(e - math.floor(e) - 0.5) > 1e-6
        assert torch.equal(red.finish(merged, "x"), fn(x)), (trial, cuts)
    zeros = red.statistics(torch.zeros(10))
    assert torch.equal(red.finish(zeros, "x"), torch.ones(1))  # as the rules: 1.0 for all zeros


@pytest.mark.parametrize("rule", ["amax", "rms"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_survive_the_reduction_and_are_refused_after_it(rule, bad):
    from qfa.dropin import calibration as cal

    red = cal.reduction_of(cal.RULES[rule])
    x = torch.ones(8)
    x[3] = bad
    merged = red.merge(red.statistics(torch.ones(5)), red.statistics(x))
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        red.finish(merged, "k")


def test_mse_has_no_reducible_form_and_a_user_rule_may_register_one():
    from qfa.dropin import calibration as cal

    assert cal.reduction_of(cal.mse_scale) is None

    def half_amax(x):
        return (x.detach().abs().amax().float() / 2).reshape(1)

    reduction = cal.Reduction(("max",), lambda flat: flat.abs().amax().double().reshape(1),
                              lambda st, name: (st[0] / 2).float().reshape(1))
    cal.register_rule("_tp_half_amax", half_amax, reduction=reduction)
    try:
        obs = cal.ScaleObserver("_tp_half_amax")
        assert obs.reduction is reduction
        batches = [torch.randn(100) * (1 + i) for i in range(3)]
        for b in batches:
            obs.observe(b)
        assert torch.equal(obs.scale(), half_amax(torch.cat(batches)))
        with pytest.raises(TypeError, match="reduction must be"):
            cal.register_rule("_tp_bad", half_amax, reduction=("max",))
        with pytest.raises(ValueError, match="reduction.ops"):
            cal.register_rule("_tp_bad", half_amax, reduction=cal.Reduction(("min",), reduction.statistics,
                                                                             reduction.finish))
    finally:
        del cal.RULES["_tp_half_amax"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
