"""The platform table (``qfa.tiling.platform``): its figures, validation, and which entry a
device gets (``platform_for``, ``$QFA_PLATFORM``, Ascend SoC detection without importing
torch_npu for other devices)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types

import pytest
import torch

from qfa.tiling import PLATFORMS, Platform, get_platform, platform_for
from qfa.tiling import platform as tp


def test_platform_table_figures():
    assert set(PLATFORMS) == {"atlas-a2", "atlas-a3", "ascend-950", "cuda", "cpu-interpreter"}
    for name in ("atlas-a2", "atlas-a3"):
        p = PLATFORMS[name]
        assert (p.ub_bytes, p.vector_cores, p.cube_cores, p.max_grid, p.persistent) == (196608, 48, 24, 65535, True)
        assert p.assumed == () and not p.native_hif8
    p950 = PLATFORMS["ascend-950"]
    assert p950.native_hif8 and p950.persistent and p950.max_grid == 65535
    assert {"ub_bytes", "vector_cores", "cube_cores"} <= set(p950.assumed)
    cuda = PLATFORMS["cuda"]
    assert cuda.warp_size == 32 and cuda.vector_cores is None and not cuda.persistent and not cuda.lut_on_chip
    cpu = PLATFORMS["cpu-interpreter"]
    assert cpu.persistent and cpu.vector_cores >= 1
    for name, p in PLATFORMS.items():
        assert p.name == name
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.ub_bytes = 1  # type: ignore[misc]


def test_platform_validation():
    with pytest.raises(ValueError, match="positive"):
        Platform(name="x", ub_bytes=0, vector_cores=1, cube_cores=1, max_grid=1, persistent=True)
    with pytest.raises(ValueError, match="vector_cores"):
        Platform(name="x", ub_bytes=1, vector_cores=0, cube_cores=1, max_grid=1, persistent=True)
    with pytest.raises(ValueError, match="platform_for"):
        PLATFORMS["cuda"].cores
    with pytest.raises(ValueError, match="unknown platform 'nope'.*atlas-a2"):
        get_platform("nope")


def test_platform_for_devices(monkeypatch):
    monkeypatch.delenv(tp.ENV_VAR, raising=False)
    assert platform_for(torch.device("cpu")) is PLATFORMS["cpu-interpreter"]
    assert platform_for("cpu").name == "cpu-interpreter"
    with pytest.raises(ValueError, match="no platform entry for device type 'meta'"):
        platform_for("meta")
    # CUDA: SM count read at run time from the device properties.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(multi_processor_count=132))
    cuda = platform_for(torch.device("cuda"))
    assert cuda.name == "cuda" and cuda.vector_cores == 132 and cuda.cores == 132 and cuda.warp_size == 32


def test_platform_env_override(monkeypatch):
    monkeypatch.setenv(tp.ENV_VAR, "atlas-a3")
    assert platform_for("cpu") is PLATFORMS["atlas-a3"]
    monkeypatch.setenv(tp.ENV_VAR, "atlas-a9")
    with pytest.raises(ValueError, match="unknown platform QFA_PLATFORM='atlas-a9'; known platforms: atlas-a2"):
        platform_for("cpu")
    monkeypatch.setenv(tp.ENV_VAR, "")
    assert platform_for("cpu").name == "cpu-interpreter"


def test_npu_platform_detection(monkeypatch):
    npu_dev = types.SimpleNamespace(type="npu", index=0)
    # No torch_npu at all: A2, and nothing is left imported.
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    assert tp._npu_platform(npu_dev) is PLATFORMS["atlas-a2"]
    for soc, expected in [("Ascend910B2", "atlas-a2"), ("Ascend910_9391", "atlas-a3"), ("Ascend950PR", "ascend-950")]:
        fake = types.ModuleType("torch_npu")
        fake.npu = types.SimpleNamespace(current_device=lambda: 0, get_device_name=lambda i, soc=soc: soc)
        monkeypatch.setitem(sys.modules, "torch_npu", fake)
        assert tp._npu_platform(npu_dev).name == expected
        assert tp._npu_platform(types.SimpleNamespace(type="npu", index=None)).name == expected


def test_torch_npu_is_imported_only_for_npu_devices(tmp_path):
    # A torch_npu that explodes on import: the tiling must work for CPU without touching it.
    (tmp_path / "torch_npu.py").write_text("raise RuntimeError('torch_npu imported')\n")
    code = (
        "import sys, torch, qfa, qfa.tiling as t\n"
        "p = t.platform_for('cpu'); t.cast_plan('encode', 10, torch.float16, p, 'saturate')\n"
        "assert 'torch_npu' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop(tp.ENV_VAR, None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
