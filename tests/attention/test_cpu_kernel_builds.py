"""The native kernel's other builds: the machines this project runs on differ (AVX2 EPYCs,
AVX-512 Xeons, AVX512_BF16 EPYCs), and each builds only its own capability. Here every vector
build's source is compiled (not run: that needs such a CPU; the AVX512_BF16 one's bf16 dot
products run in test_cpu_kernel_bf16.py where the CPU has them) and the scalar build (no vector
ISA: MKL GEMMs, table decode, scalar rounding) is built and run against the torch path, like the
build this CPU uses."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig

import pytest
import torch

from qfa.attention.backends import cpu_kernel, torch_path
from qfa.cast import luts
from test_attention_reference import check_against_reference
from test_cpu_kernel import CASES, make, needs_kernel, v_max

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")


@needs_kernel
@needs_compiler
@pytest.mark.parametrize("capability", ["AVX512_BF16", "AVX512", "AVX2", "DEFAULT"])
def test_every_capability_compiles(capability):
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    flags = cpu_kernel._COMMON_FLAGS + cpu_kernel._VECTOR_FLAGS.get(capability, [])
    done = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-fopenmp", "-DTORCH_EXTENSION_NAME=qfa_check",
                           *flags, *includes, str(cpu_kernel.SOURCE)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@needs_kernel
@needs_compiler
def test_the_bf16_build_has_bf16_dot_products(tmp_path):
    """Compiled to assembly (which -fsyntax-only does not reach: intrinsics are checked against
    the target flags only when inlined), the AVX512_BF16 build holds vdpbf16ps, and the plain
    AVX-512 build, compiled the same way, holds none."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    for capability, want in (("AVX512_BF16", True), ("AVX512", False)):
        flags = [f for f in cpu_kernel._COMMON_FLAGS if not f.startswith("-O")] + cpu_kernel._VECTOR_FLAGS[capability]
        asm = tmp_path / f"{capability}.s"
        done = subprocess.run(["g++", "-std=c++17", "-O0", "-S", "-fPIC", "-DTORCH_EXTENSION_NAME=qfa_check", *flags,
                               *includes, str(cpu_kernel.SOURCE), "-o", str(asm)], capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("vdpbf16ps" in asm.read_text()) == want, capability


@pytest.fixture(scope="module")
def scalar_build():
    from torch.utils.cpp_extension import load

    return load(name=f"{cpu_kernel.build_name()}_scalar_test", sources=cpu_kernel.sources(),
                extra_cflags=cpu_kernel._COMMON_FLAGS, extra_ldflags=["-lgomp"], verbose=False)


@needs_kernel
@needs_compiler
@pytest.mark.parametrize("name", ["gqa6-37x257-p128", "gqa4-255x513-causal-bsnd-p15", "decode-1x4097",
                                  "fused-3x3000-causal-p15", "decode-B2-16x4096-causal-bsnd"])
def test_scalar_build_matches_torch_path(name, scalar_build, monkeypatch):
    monkeypatch.setenv("QFA_COMPILE", "0")
    assert not scalar_build.simd_decoder(luts.decode_lut(torch.float32).view(torch.float32))  # really scalar
    plan, args = make(**CASES[name])
    want_out, want_lse = torch_path.forward(plan, *args)
    monkeypatch.setattr(cpu_kernel, "_module", scalar_build)
    out, lse = cpu_kernel.forward(plan, *args)
    check_against_reference(out, lse, want_out.to(torch.float64).numpy(), want_lse.numpy(), v_max(args),
                            plan.return_lse)
