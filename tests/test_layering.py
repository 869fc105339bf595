"""The layers are one-way: host tiling imports no cast API and no kernel; kernels import only
the format's constants, the host LUT builders and the plans they run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "tiling").glob("*.py")), ids=lambda p: p.name)
def test_tiling_imports_no_cast_api_no_kernel_and_no_backend(path):
    bad = {m for m in imports_of(path) if m.startswith(("qfa.cast.api", "qfa.kernels", "qfa.attention", "triton"))}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted((ROOT / "kernels").glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_only_format_luts_and_plans(path):
    allowed = ("qfa.cast.format", "qfa.cast.luts", "qfa.cast.luts.", "qfa.kernels", "qfa.tiling")
    qfa_imports = {m for m in imports_of(path) if m.startswith("qfa")}
    bad = {m for m in qfa_imports if not m.startswith(allowed) and m not in ("qfa.cast",)}
    # ``from qfa.cast import luts`` / ``format as fmt`` appear as qfa.cast.luts / qfa.cast.format
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_the_library_does_not_import_the_tools():
    for path in (ROOT / "qfa").rglob("*.py"):
        if "tools" in path.relative_to(ROOT / "qfa").parts or path.name in ("cli.py", "__main__.py"):
            continue
        bad = {m for m in imports_of(path) if m.startswith("qfa.tools")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_op_registration_modules_import_one_way():
    """No cycle between the modules that register ops and the drop-in: qfa.attention.custom_ops
    (the op's) and qfa.cast.custom_ops (the cast's) import nothing of the drop-in, and no drop-in
    module imports either of them."""
    dropin = sorted((ROOT / "qfa" / "attention").glob("dropin*.py")) + [ROOT / "qfa" / "attention" / "smoothing.py"]
    assert len(dropin) >= 6
    for registrar in (ROOT / "qfa" / "attention" / "custom_ops.py", ROOT / "qfa" / "cast" / "custom_ops.py"):
        assert not any("dropin" in name or "smoothing" in name for name in imports_of(registrar)), registrar
    for path in dropin:
        assert not any(name.endswith("custom_ops") for name in imports_of(path)), path
