"""``cpu_kernel.run_bound``: the kernel on a plan an op call checked, run on other tensors of its
geometry with the scalars given (what the vLLM backend runs for a step's later layers). Exact
tests: its out is the op's on the same tensors, bit for bit, un-rotated in every dtype by the
kernel's epilogue as ``cpu_prepare.rotate_rows`` un-rotates the op's bf16 out, for one thread and
two; a second set of tensors of the same geometry (another layer's cache and scales) gives that
set's op out. What it cannot run it refuses, naming the argument, with ``out`` untouched."""

from __future__ import annotations

import math

import pytest
import torch

import qfa
from qfa.attention.backends import cpu_kernel, cpu_prepare
from qfa.dropin import prepare
from qfa.tiling.attention import bind, bound_plan
from test_attention_paged import make_case, page_out
from test_cpu_kernel_epilogue import same

pytestmark = pytest.mark.skipif(not (cpu_kernel.available() and cpu_prepare.available()),
                                reason="the native CPU kernel or preparation is not built here")

C = prepare.ROTATION_C
Q_LENS, KV_LENS = (1, 16, 1, 40), (300, 77, 1, 40)  # decodes, a chunk, a prefill: vLLM's mixes
SOFTMAX = 0.0883883


class Step:
    """One step's paged batch (TND queries, PA_BNBD pools), planned once, and a layer's tensors."""

    def __init__(self, seed: int = 0):
        self.q, ks, vs, q_args, _, gen = make_case(Q_LENS, KV_LENS, nq=6, nkv=2, layout="TND", seed=seed)
        self.k, self.table = page_out(ks, 16, "PA_BNBD", gen)
        self.v, _ = page_out(vs, 16, "PA_BNBD", gen, table=self.table)
        self.own_table = self.table
        self.seqused = torch.tensor(KV_LENS, dtype=torch.int32)
        self.cu = q_args["cu_seqlens_q"]
        self.meta = qfa.quant_flash_attn_metadata(6, 2, layout_q="TND", layout_kv="PA_BNBD", layout_out="TND",
                                                  cu_seqlens_q=self.cu, seqused_kv=self.seqused, mask_mode=3)
        self.scales = (torch.tensor([0.03125]), torch.tensor([0.0625]), torch.tensor([0.75]))

    def op(self, q=None, k=None, v=None, scales=None) -> torch.Tensor:
        q, k, v = (self.q if q is None else q), (self.k if k is None else k), (self.v if v is None else v)
        return qfa.quant_flash_attn(q, k, v, *(scales or self.scales), 0, block_table=self.table,
                                    cu_seqlens_q=self.cu, seqused_kv=self.seqused, metadata=self.meta,
                                    softmax_scale=SOFTMAX, mask_mode=3, layout_q="TND", layout_kv="PA_BNBD",
                                    layout_out="TND")[0]

    def plan(self):
        """The plan the op bound for the step's own tensors."""
        plan = bound_plan(self.meta, self.q, self.k, self.v, softmax_scale=SOFTMAX, block_table=self.own_table)
        assert plan is not None, "no op call bound a plan for these tensors"
        return plan

    def run(self, out, scales=None, q=None, k=None, v=None, rotate_c=C, **kw) -> None:
        qd, kd, vd = scales or self.scales
        plan = self.plan()
        args = dict(q_descale=float(qd), k_descale=float(kd), v_descale=float(vd), block_table=self.table,
                    rotate_c=rotate_c)
        args.update(kw)
        cpu_kernel.run_bound(plan, self.q if q is None else q, self.k if k is None else k,
                             self.v if v is None else v, out, **args)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", cpu_kernel.ROTATED_DTYPES, ids=str)
def test_the_bound_run_is_the_op_and_its_un_rotation(dtype, threads):
    step = Step()
    want_plain = step.op()  # binds the plan (and checks every argument)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full(step.q.shape, float("nan"), dtype=dtype)
        step.run(out)
        plain = torch.full(step.q.shape, float("nan"), dtype=torch.bfloat16)
        step.run(plain, rotate_c=0.0)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(plain, want_plain)
    assert same(out, cpu_prepare.rotate_rows(want_plain, dtype, C))


def test_another_layers_tensors_of_the_same_geometry_give_their_op():
    step, other = Step(seed=0), Step(seed=1)  # the same shapes, other codes and block placement
    step.op()
    scales = (torch.tensor([0.5]), torch.tensor([2.0 ** -7]), torch.tensor([3.0]))
    out = torch.empty(step.q.shape, dtype=torch.bfloat16)
    # step's plan on other's codes and table (its values checked by other's op call below)
    step.table = other.table
    step.run(out, scales=scales, q=other.q, k=other.k, v=other.v, rotate_c=0.0)
    assert torch.equal(out, other.op(scales=scales))


def _refused(step: Step, pattern: str, out=None, **kw) -> None:
    out = torch.full(step.q.shape, 7.0) if out is None else out
    before = out.clone()
    with pytest.raises(ValueError, match=pattern):
        step.run(out, **kw)
    assert torch.equal(out, before), "a refused run wrote into out"


def test_tensors_the_plan_was_not_bound_for_are_refused_naming_them():
    step = Step()
    step.op()
    _refused(step, "^k must have the geometry the plan was bound for", k=step.k[:-1])
    _refused(step, "^v must have the geometry", v=step.v.transpose(0, 1).contiguous().transpose(0, 1))
    _refused(step, "^q must have the geometry", q=torch.cat([step.q, step.q]))
    step.table = torch.cat([step.table, step.table], dim=1)
    _refused(step, "^block_table must have the geometry")
    step.table = step.own_table
    _refused(step, "q, k and v must be uint8 HiF8 codes", q=step.q.view(torch.int8))


def test_only_a_plan_an_op_call_bound_runs():
    """A lookup binds nothing: before any op call there is no plan to run, and a plan bound by
    hand for other tensors is refused for these."""
    step = Step()
    assert bound_plan(step.meta, step.q, step.k, step.v, softmax_scale=SOFTMAX, block_table=step.table) is None
    step.op()
    assert step.plan() is bind(step.meta, step.q, step.k, step.v, softmax_scale=SOFTMAX, block_table=step.table)
    other = bind(step.meta, step.q, step.k[:-1], step.v[:-1], softmax_scale=SOFTMAX, block_table=step.table)
    out = torch.full(step.q.shape, 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^k must have the geometry the plan was bound for"):
        cpu_kernel.run_bound(other, step.q, step.k, step.v, out, q_descale=1.0, k_descale=1.0, v_descale=1.0,
                             block_table=step.table)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("case", ["dtype", "shape", "strided", "bf16 only unrotated"])
def test_an_out_it_cannot_fill_is_refused(case):
    step = Step()
    step.op()
    if case == "dtype":
        out, kw = torch.zeros(step.q.shape, dtype=torch.float64), {}
    elif case == "shape":
        out, kw = torch.zeros(step.q.shape[0] - 1, *step.q.shape[1:]), {}
    elif case == "strided":
        out, kw = torch.zeros(step.q.shape[0], 12, 128)[:, ::2], {}
    else:
        out, kw = torch.zeros(step.q.shape), {"rotate_c": 0.0}
    _refused(step, "out must be a contiguous CPU tensor of q's shape", out=out, **kw)


@pytest.mark.parametrize("name, value, pattern", [
    ("q_descale", 0.0, "q_descale must be a finite value > 0"),
    ("k_descale", math.nan, "k_descale must be a finite value > 0"),
    ("v_descale", math.inf, "v_descale must be a finite value > 0"),
    ("v_descale", -1.0, "v_descale must be a finite value > 0"),
    ("k_descale", 1e30, r"softmax_scale \* q_descale \* k_descale must be <="),
    ("v_descale", 1e35, "v_descale must be <= .* for this call"),
    ("rotate_c", -1.0, "rotate_c must be 0"),
    ("rotate_c", math.inf, "rotate_c must be 0"),
])
def test_scalars_the_op_refuses_are_refused(name, value, pattern):
    step = Step()
    step.op()
    if name.endswith("descale"):  # the op itself refuses the same values
        scales = [t.clone() for t in step.scales]
        scales["qkv".index(name[0])].fill_(value)
        with pytest.raises(ValueError, match=pattern):
            step.op(scales=tuple(scales))
    _refused(step, pattern, **{name: value})
