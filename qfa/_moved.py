"""Module paths that moved when the drop-in got its own package (issue 19), kept importable.

Code outside qfa imports ``qfa.attention.calibration``, ``qfa.attention.dropin`` and the rest
by their old paths. Each old path is an alias of the new module object (one module, one set of
globals: a monkeypatch through either name is seen by both), created only when it is imported,
so the attention layer never loads the drop-in at import time.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

#: old import path -> new import path. The one source of truth for the moves.
MOVED = {
    **{f"qfa.attention.{name}": f"qfa.attention.backends.{name}"
       for name in ("torch_path", "scaled_torch_path", "cpu_kernel", "cpu_gemm", "cpu_prepare", "paged")},
    **{f"qfa.attention.{old}": f"qfa.dropin.{new}" for old, new in {
        "dropin": "function", "dropin_module": "module", "dropin_call": "call", "dropin_eager": "eager",
        "dropin_inputs": "inputs", "dropin_op": "custom_op", "dropin_scaled": "scaled", "prepare": "prepare",
        "calibration": "calibration", "smoothing": "smoothing", "rotation": "rotation",
        "distributed": "distributed", "fp8_emulation": "fp8_emulation"}.items()},
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias's spec on the shared module: give it back its own,
        # so that reloads, pickling by qualified name and tracebacks see the new path.
        module.__spec__ = self.own_spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(MOVED[fullname]))


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
