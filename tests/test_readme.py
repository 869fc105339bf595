"""The README stays true: CI runs its test command, and its code examples run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def quick_start_commands() -> list[str]:
    block = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_quick_start_is_two_commands_and_ci_runs_the_test_one():
    commands = quick_start_commands()
    assert len(commands) == 2
    assert "qfa demo" in commands[0] and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, "'.ci/run' must run the README's test command verbatim"


def python_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_cast_and_op_examples_run():
    cast_example, op_example = python_examples()[:2]
    namespace: dict = {}
    exec(cast_example, namespace)
    assert namespace["codes"].shape == namespace["x"].shape
    exec(op_example, namespace)
    out, lse = namespace["out"], namespace["lse"]
    assert out.shape == (1, 32, 512, 128) and lse.shape == (1, 32, 512)


def test_drop_in_example_runs():
    namespace: dict = {}
    exec(python_examples()[2], namespace)
    out, q, attn = namespace["out"], namespace["q"], namespace["attn"]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert attn.frozen and set(namespace["state"]) >= {"q_scale", "k_scale", "v_scale"}
