"""Host tiling (installed as ``qfa.tiling``): the platform table and the ops' plans.

Pure host arithmetic on Python ints and torch dtypes: no Triton, no device work, so the torch
path, the Triton kernels and tests can all share one plan.
"""

from qfa.tiling.cast import CastPlan, DataCopy, TileCopy, cast_plan, datacopy_plan, tile_elements
from qfa.tiling.platform import PLATFORMS, Platform, get_platform, platform_for

__all__ = [
    "PLATFORMS",
    "CastPlan",
    "DataCopy",
    "Platform",
    "TileCopy",
    "cast_plan",
    "datacopy_plan",
    "get_platform",
    "platform_for",
    "tile_elements",
]
