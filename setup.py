"""Packaging. ``kernels/`` and ``tiling/`` are installed as ``qfa.kernels`` and ``qfa.tiling``:
they stay top-level folders like an Ascend op's ``op_kernel/`` and ``op_host/``, but never
become top-level import names (``kernels`` is a real PyPI package that transformers probes for).
"""

from setuptools import find_packages, setup

qfa_packages = find_packages(include=["qfa", "qfa.*"])
mapped = {"qfa.kernels": "kernels", "qfa.tiling": "tiling"}

setup(
    packages=qfa_packages + list(mapped),
    package_dir={"": ".", **mapped},
)
