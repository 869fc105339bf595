"""The README stays true: CI runs its test command, the CPU-build instruction pins the same torch,
every python example runs (each in a fresh namespace) and computes what it says, the layout it
draws exists, and it stays short enough to read in five minutes."""

import re
from pathlib import Path

import pytest
import torch


def repo_root() -> Path:
    """The folder holding pyproject.toml, wherever under tests/ this file sits."""
    return next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


ROOT = repo_root()
README = (ROOT / "README.md").read_text()
#: The README is the five-minute page; the rest lives in docs/.
MAX_LINES = 250


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


def test_readme_is_at_most_250_lines():
    assert len(README.splitlines()) <= MAX_LINES


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
    exec(python_examples()[index][1], {})


def test_the_three_entry_points_each_have_an_example():
    headings = [h for h, _ in python_examples()]
    assert headings == ["The op, with scales", "Drop-in attention",
                        "Serving: a HiF8 KV cache, in transformers and in vLLM"]


def relative_l2_to_exact(out: torch.Tensor, q, k, v) -> float:
    """Relative L2 distance of ``out`` to exact causal attention (GQA) of the float q, k, v.

    HiF8's rounding (at most 2^-4 relative per element with 3 mantissa bits, less than 2^-3 with
    2) leaves a few % of relative L2 error, while attention of unrelated data is off by ~1 (sqrt 2
    for independent outputs of equal norm); 0.25 tells the two apart for any draw of randn."""
    q, k, v = (t.float() for t in (q, k, v))
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return ((out.float() - exact).norm() / exact.norm()).item()


def test_op_example():
    ns = run_example("The op, with scales")
    q, out8, lse = ns["q"], ns["out8"], ns["lse"]
    assert out8.shape == q.shape and out8.dtype == torch.bfloat16
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert relative_l2_to_exact(out8, q, ns["k"], ns["v"]) < 0.25


def test_drop_in_example():
    ns = run_example("Drop-in attention")
    out, q, k, v, attn, fixed = ns["out"], ns["q"], ns["k"], ns["v"], ns["attn"], ns["fixed"]
    assert out.dtype == q.dtype and out.shape == q.shape and ns["lse"].shape == q.shape[:3]
    assert relative_l2_to_exact(out, q, k, v) < 0.25
    assert attn.frozen and set(ns["state"]) >= {"q_scale", "k_scale", "v_scale"}
    assert torch.equal(fixed(q, k, v), attn(q, k, v))  # the same static scales give the same output


def test_serving_example():
    ns = run_example("Serving: a HiF8 KV cache, in transformers and in vLLM")
    config, cache, tokens = ns["config"], ns["cache"], ns["tokens"]
    assert ns["model"].config._attn_implementation == "qfa_hif8"
    assert tokens.shape == (1, 48 + 16)
    # What a bf16 cache of the same tokens holds: K and V, 2 bytes per element. The HiF8 codes
    # are 1 byte, plus per layer two scales and the fp32 key means: about half.
    bf16 = 2 * config.num_hidden_layers * tokens.shape[1] * config.num_key_value_heads * 128 * 2
    assert 0.4 * bf16 < cache.nbytes() < 0.55 * bf16
    assert len(cache.saturated) == config.num_hidden_layers
    assert ns["kwargs"]["attention_backend"] == "CUSTOM" and ns["kwargs"]["kv_cache_dtype"] == "fp8"


def test_the_layout_names_folders_that_exist():
    block = README.split("## Layout", 1)[1].split("```", 2)[1]
    paths = [re.split(r"\s{2,}", line)[0] for line in block.strip().splitlines()]  # the first column
    assert len(paths) >= 10
    for entry in paths:
        for path in entry.split(","):
            assert (ROOT / path.strip()).exists(), f"README's layout names {path.strip()!r}, which does not exist"
