"""The platform table: the on-chip budget, core counts and launch limits every tiling reads.

Both the cast and the attention tilings size their tiles and grids from one of these entries,
the way an Ascend op's host tiling reads the SoC's UB size and core count:

* ``atlas-a2`` (Ascend 910B) and ``atlas-a3`` (Ascend 910_93, per die): 192 KB unified buffer
  (UB) per AI-vector core, 48 vector cores, 24 cube cores, grid <= 65535, and a persistent grid
  (one program per core, each looping over its share) as triton-ascend recommends.
* ``ascend-950``: native HiF8 in hardware. Its UB and core figures are NOT verified here (see
  ``assumed``); the A2 figures stand in as the conservative choice until someone checks them.
* ``cuda``: upstream Triton on NVIDIA GPUs. There is no UB: ``ub_bytes`` is a per-program tile
  budget (what one program keeps in registers), tables stay in global memory (read through the
  caches), and the SM count is read at run time by :func:`platform_for`.
* ``cpu-interpreter``: Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, for tests.
  Programs run one after another in Python, so big tiles and few programs are what make it fast;
  the budget is chosen so that the cast's tiles reach the 65536-element cap (every DataCopy
  branch is reachable) and the persistent loop is exercised.

``platform_for(device)`` picks the entry for a device; ``$QFA_PLATFORM`` forces one by name.
Nothing here imports ``torch_npu`` unless the device really is an NPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

ENV_VAR = "QFA_PLATFORM"


@dataclass(frozen=True)
class Platform:
    """One target's figures for host tiling (all per core / per program, bytes and counts)."""

    #: Key in :data:`PLATFORMS`.
    name: str
    #: Usable on-chip bytes per core (program) for one tile: the UB on Ascend, a tile budget elsewhere.
    ub_bytes: int
    #: Vector cores (AIV on Ascend, SMs on CUDA). ``None``: read at run time (see ``platform_for``).
    vector_cores: int | None
    #: Cube (matmul) cores (AIC on Ascend, SMs on CUDA). ``None``: read at run time.
    cube_cores: int | None
    #: Most programs one launch may have along the grid axis the tilings use.
    max_grid: int
    #: True: grid = number of cores, every program loops over its share (persistent kernel).
    #: False: one program per tile (or per few tiles when the grid would exceed ``max_grid``).
    persistent: bool
    #: Whether a kernel's lookup tables live in the on-chip budget (so a tiling subtracts them).
    lut_on_chip: bool = True
    #: Threads per warp (CUDA); ``None`` where the notion does not apply.
    warp_size: int | None = None
    #: ``num_warps`` launch option for Triton; ``None``: leave Triton's default.
    num_warps: int | None = None
    #: The hardware converts to/from HiF8 itself (the Triton kernels still use the tables).
    native_hif8: bool = False
    #: Names of the fields above that are assumptions, not checked against vendor documents.
    assumed: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.ub_bytes <= 0 or self.max_grid <= 0:
            raise ValueError(f"platform {self.name!r}: ub_bytes and max_grid must be positive")
        for name in ("vector_cores", "cube_cores"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"platform {self.name!r}: {name} must be positive or None")

    @property
    def cores(self) -> int:
        """Vector cores, or a ValueError when the count is still to be read at run time."""
        if self.vector_cores is None:
            raise ValueError(
                f"platform {self.name!r} has no core count until it is resolved for a device: "
                "use qfa.tiling.platform_for(device)"
            )
        return self.vector_cores


_ASCEND_A2_FIGURES = dict(ub_bytes=196608, vector_cores=48, cube_cores=24, max_grid=65535, persistent=True)

PLATFORMS: dict[str, Platform] = {
    p.name: p
    for p in (
        Platform(name="atlas-a2", **_ASCEND_A2_FIGURES),
        Platform(name="atlas-a3", **_ASCEND_A2_FIGURES),  # 910_93: same figures per die
        # ASSUMPTION: Ascend 950's UB size and core counts are not verified here; the A2 figures
        # are used as the conservative stand-in (a tile that fits A2's UB fits a larger one).
        Platform(
            name="ascend-950",
            **_ASCEND_A2_FIGURES,
            native_hif8=True,
            assumed=("ub_bytes", "vector_cores", "cube_cores", "max_grid"),
        ),
        # 12 KiB per program: 4096 elements at 3 bytes each (fp16/bf16 <-> uint8), 8 warps x 32
        # threads x 16 elements. CUDA's grid x-limit is 2^31 - 1. SM count read at run time.
        Platform(
            name="cuda",
            ub_bytes=12288,
            vector_cores=None,
            cube_cores=None,
            max_grid=2**31 - 1,
            persistent=False,
            lut_on_chip=False,
            warp_size=32,
            num_warps=8,
        ),
        # Interpreter: (229376 - 32768) / 3 = 65536-element tiles for fp16/bf16 <-> uint8.
        Platform(
            name="cpu-interpreter",
            ub_bytes=229376,
            vector_cores=4,
            cube_cores=4,
            max_grid=65535,
            persistent=True,
        ),
    )
}


def get_platform(name: str, *, source: str | None = None) -> Platform:
    """The table entry called ``name``, or a ValueError listing the known names; ``source``
    (e.g. ``$QFA_PLATFORM``'s name) says in the message where the name came from."""
    try:
        return PLATFORMS[name]
    except KeyError:
        given = f"{source}={name!r}" if source else repr(name)
        raise ValueError(f"unknown platform {given}; known platforms: {', '.join(PLATFORMS)}") from None


def resolve_platform(platform: "Platform | str | None", device: torch.device | str | None = None) -> Platform:
    """A :class:`Platform`, from itself, its name, or (None) the device's entry (:func:`platform_for`)."""
    if isinstance(platform, Platform):
        return platform
    if isinstance(platform, str):
        return get_platform(platform)
    if platform is None and device is not None:
        return platform_for(device)
    raise TypeError(f"platform must be a Platform or a platform name, got {type(platform).__name__}")


def _npu_platform(device: torch.device) -> Platform:
    """A2 unless torch_npu names an A3 (910_93) or a 950; imported only for NPU devices."""
    try:
        import torch_npu

        npu = torch_npu.npu
        index = device.index if device.index is not None else npu.current_device()
        soc = str(npu.get_device_name(index))  # e.g. "Ascend910B2", "Ascend910_9391"
    except Exception:  # torch_npu missing or too old to say: the A2 figures are the safe default
        return PLATFORMS["atlas-a2"]
    if "910_93" in soc:
        return PLATFORMS["atlas-a3"]
    if "950" in soc:
        return PLATFORMS["ascend-950"]
    return PLATFORMS["atlas-a2"]


def _with_cuda_cores(platform: Platform, device: torch.device) -> Platform:
    if platform.vector_cores is not None or device.type != "cuda":
        return platform
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return replace(platform, vector_cores=sms, cube_cores=sms)


def platform_for(device: torch.device | str) -> Platform:
    """The platform entry for tensors on ``device``; ``$QFA_PLATFORM`` forces one by name."""
    device = torch.device(device)
    forced = os.environ.get(ENV_VAR)
    if forced:
        return _with_cuda_cores(get_platform(forced, source=ENV_VAR), device)
    if device.type == "npu":
        return _npu_platform(device)
    if device.type == "cuda":
        return _with_cuda_cores(PLATFORMS["cuda"], device)
    if device.type == "cpu":
        return PLATFORMS["cpu-interpreter"]
    raise ValueError(f"no platform entry for device type {device.type!r} (set {ENV_VAR} to force one)")
