"""Packaging. ``kernels/``, ``tiling/`` and ``csrc/`` are installed as ``qfa.kernels``,
``qfa.tiling`` and ``qfa.csrc``: they stay top-level folders like an Ascend op's ``op_kernel/``
and ``op_host/``, but never become top-level import names (``kernels`` is a real PyPI package
that transformers probes for). ``csrc``'s C++ sources and the headers they include ship as package
data: the native CPU kernels are compiled from them on first use, in editable and regular installs alike.
"""

from setuptools import find_packages, setup

qfa_packages = find_packages(include=["qfa", "qfa.*"])
mapped = {"qfa.kernels": "kernels", "qfa.tiling": "tiling", "qfa.csrc": "csrc"}

setup(
    packages=qfa_packages + list(mapped),
    package_dir={"": ".", **mapped},
    package_data={"qfa.csrc": ["*.cpp", "*.h"]},
)
