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
    dropin = sorted((ROOT / "qfa" / "dropin").glob("*.py"))
    assert len(dropin) >= 13
    for registrar in (ROOT / "qfa" / "attention" / "custom_ops.py", ROOT / "qfa" / "cast" / "custom_ops.py"):
        assert not any(name.startswith("qfa.dropin") for name in imports_of(registrar)), registrar
    for path in dropin:
        bad = {name for name in imports_of(path) if name.endswith(("cast.custom_ops", "attention.custom_ops"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


#: The library's layers, lowest first: a module may import its own layer and those below it.
#: Host tiling and the Triton kernels sit with the cast, under the op that plans and runs them.
LAYERS = [
    ("cast", ("qfa.cast", "qfa.tiling", "qfa.kernels")),
    ("attention", ("qfa.attention",)),
    ("dropin", ("qfa.dropin",)),
    ("serving", ("qfa.serving",)),
    ("integrations", ("qfa.integrations", "qfa.compat")),
    ("tools", ("qfa.tools", "qfa.cli", "qfa.__main__")),
]
#: Shared by every layer: backend choice, the compile helper, the moved-path aliases, C++ sources,
#: the environment switches' reader, when native code may take tensors.
BASE = ("qfa.backends", "qfa._compile", "qfa._moved", "qfa.csrc", "qfa._environ", "qfa._plain_memory")
#: (importing layer, imported module) pairs allowed to point upward, each with its reason:
#: the cast's CPU encode runs the native encoder, which shares the attention kernel's build (and
#: is imported on first use only, so that importing the cast loads no attention module).
ALLOWED_UPWARD = {("cast", "qfa.attention.backends.cpu_prepare")}


def allowed_upward(layer: str, name: str) -> bool:
    # ``from a.b import c`` reads as both a.b and a.b.c: the package half of an allowed import is allowed
    return any(lay == layer and (mod == name or mod.startswith(name + ".")) for lay, mod in ALLOWED_UPWARD)


def layer_of(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("kernels", "tiling", "csrc"):
        parts = ["qfa", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


LIBRARY = sorted(p for d in ("qfa", "kernels", "tiling") for p in (ROOT / d).rglob("*.py"))


def test_every_library_module_has_a_layer():
    unplaced = [module_name(p) for p in LIBRARY
                if layer_of(module_name(p)) is None and not module_name(p).startswith(BASE)
                and module_name(p) not in ("qfa",)]
    assert not unplaced, f"modules outside every layer (add them to LAYERS or BASE): {unplaced}"


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_layers_import_downward_only(path):
    me = layer_of(module_name(path))
    if me is None:
        return  # the package facade (qfa/__init__) and the shared base may import any layer
    upward = set()
    for name in imports_of(path):
        rank = layer_of(name)
        if rank is not None and rank > me and not allowed_upward(LAYERS[me][0], name):
            upward.add(name)
    assert not upward, f"{module_name(path)} ({LAYERS[me][0]}) imports a higher layer: {sorted(upward)}"


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_imports_no_moved_path(path):
    """The old paths exist for users; the library imports every module by its own path."""
    from qfa._moved import MOVED

    bad = sorted(name for name in imports_of(path) if name in MOVED)
    assert not bad, f"{module_name(path)} imports moved paths {bad}; use {[MOVED[b] for b in bad]}"


@pytest.mark.parametrize("path", sorted((ROOT / "qfa" / "attention" / "backends").glob("*.py")),
                         ids=lambda p: p.name)
def test_backends_import_nothing_of_the_op_above_them(path):
    """The op chooses among the backends; a backend never reaches back into the op's modules."""
    bad = {name for name in imports_of(path)
           if name.startswith("qfa.attention") and not name.startswith("qfa.attention.backends")}
    assert not bad, f"{path.name} imports {sorted(bad)}"
