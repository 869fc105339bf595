"""The README stays true: CI runs its test command, the CPU-build instruction pins the same torch,
and every python example runs (each in a fresh namespace)."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: Sections whose examples need what the test machine does not have.
NOT_RUN = {"transformers": "needs a model folder (`path`); tests/test_transformers_integration.py covers it"}


def quick_start_commands() -> list[str]:
    block = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_quick_start_is_two_commands_and_ci_runs_the_test_one():
    commands = quick_start_commands()
    assert len(commands) == 2
    assert "qfa demo" in commands[0] and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, "'.ci/run' must run the README's test command verbatim"


def test_cpu_build_instruction_pins_the_quick_start_torch():
    """The CPU-wheel command names PyTorch's CPU index and the same torch as the quick start,
    so the quick-start commands find their pin satisfied by it."""
    pins = {re.search(r'"torch==([^"]+)"', c).group(1) for c in quick_start_commands()}
    cpu = re.findall(r'pip install "torch==([^"]+)" --index-url https://download\.pytorch\.org/whl/cpu', README)
    assert len(pins) == 1 and cpu == list(pins)


def python_examples() -> list[tuple[str, str]]:
    """(heading of the enclosing section, code) of every python block, in order."""
    examples, heading = [], ""
    for part in re.split(r"(```python\n.*?```)", README, flags=re.S):
        if part.startswith("```python\n"):
            examples.append((heading, part[len("```python\n"):-3]))
        else:
            headings = re.findall(r"^#{2,3} (.+)$", part, flags=re.M)
            heading = headings[-1] if headings else heading
    return examples


def run_example(heading: str) -> dict:
    codes = [code for h, code in python_examples() if h == heading]
    assert len(codes) == 1, f"expected one python example under {heading!r}, found {len(codes)}"
    namespace: dict = {}
    exec(codes[0], namespace)
    return namespace


@pytest.mark.parametrize("index", range(len(python_examples())),
                         ids=[h for h, _ in python_examples()])
def test_every_python_example_runs(index):
    heading, code = python_examples()[index]
    if heading in NOT_RUN:
        pytest.skip(NOT_RUN[heading])
    exec(code, {})


def test_where_to_start_example():
    ns = run_example("Where to start")
    q, out, out8, lse = ns["q"], ns["out"], ns["out8"], ns["lse"]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out8.shape == q.shape and out8.dtype == torch.bfloat16 and lse.shape == q.shape[:3]
    # Both entry points compute causal attention of the example's data: HiF8's rounding (at most
    # 2^-4 relative per element with 3 mantissa bits, less than 2^-3 with 2) leaves a few % of
    # relative L2 error, while attention of unrelated data is off by ~1 (sqrt 2 for independent
    # outputs of equal norm); 0.25 tells the two apart for any draw of the example's randn.
    exact = torch.nn.functional.scaled_dot_product_attention(q, ns["k"], ns["v"], is_causal=True, enable_gqa=True)
    for result in (out, out8.float()):
        assert ((result - exact).norm() / exact.norm()).item() < 0.25


def test_cast_example():
    ns = run_example("The cast")
    assert ns["codes"].shape == ns["x"].shape and ns["codes"].dtype == torch.uint8
    assert ns["back"].dtype == torch.float32 and torch.isinf(ns["back"]).sum() == 0
    assert torch.isinf(ns["qfa"].decode_from_hifloat8(ns["inf_codes"], torch.float32)).any()


def test_drop_in_example():
    ns = run_example("Drop-in attention")
    out, q, attn, fixed = ns["out"], ns["q"], ns["attn"], ns["fixed"]
    assert out.dtype == q.dtype and out.shape == q.shape and ns["lse"].shape == q.shape[:3]
    assert attn.frozen and set(ns["state"]) >= {"q_scale", "k_scale", "v_scale"}
    k, v = ns["k"], ns["v"]
    assert torch.equal(fixed(q, k, v), attn(q, k, v))  # the same static scales give the same output
