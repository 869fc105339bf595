"""The Triton kernels through the real Triton compiler, to PTX for sm_90 (H100/H200).

The interpreter (``TRITON_INTERPRET=1``, which the other Triton tests run under) accepts more
than the compiler does, so each kernel is also compiled here. No GPU is needed, only Triton's
bundled ptxas; the compiles run in a subprocess because conftest.py turns the interpreter on
for this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

#: The attention kernel's shared memory at SUB_M = 64, measured when this test was written.
ATTENTION_SHARED_BYTES = 80 * 1024
#: Most shared memory one block may use on H100/H200 (sm_90): 227 KiB (opt-in maximum).
SM90_MAX_SHARED_BYTES = 227 * 1024

_CAST_SCRIPT = textwrap.dedent(
    """
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qfa.kernels import cast as K
    from qfa.kernels import hif8

    target = GPUTarget("cuda", 90, 32)

    def comp(fn, sig, consts):
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
        assert "ld.global" in k.asm["ptx"]

    common = {"numel": "i32", "per_program": "i32", "TILE": "constexpr", "BLOCK": "constexpr",
              "SUB": "constexpr", "INT64": "constexpr", "DECODE": "constexpr"}
    for src in ("*i16", "*fp32"):
        for i64 in (False, True):
            comp(K._cast_kernel, {"src_ptr": src, "dst_ptr": "*u8", "lut_ptr": "*u8", **common,
                                  "numel": "i64" if i64 else "i32"},
                 {"TILE": 2432, "BLOCK": 2048, "SUB": 2, "INT64": i64, "DECODE": False})
    for dst in ("*i16", "*i32"):
        comp(K._cast_kernel, {"src_ptr": "*u8", "dst_ptr": dst, "lut_ptr": dst, **common},
             {"TILE": 4096, "BLOCK": 4096, "SUB": 1, "INT64": False, "DECODE": True})

    @triton.jit
    def helpers(x_ptr, y_ptr, c_ptr, v_ptr, lut, dlut, n, BLOCK: tl.constexpr, DT: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        tl.store(y_ptr + offs, hif8.hif8_round_sat(x.to(tl.float32)), mask=m)
        c = hif8.hif8_encode(x, lut)
        tl.store(c_ptr + offs, c.to(tl.uint8), mask=m)
        tl.store(v_ptr + offs, hif8.hif8_decode(c, dlut, DT), mask=m)

    for xt, dt, dl in (("*fp32", tl.float32, "*i32"), ("*fp16", tl.float16, "*i16"), ("*bf16", tl.bfloat16, "*i16")):
        comp(helpers, {"x_ptr": xt, "y_ptr": "*fp32", "c_ptr": "*u8", "v_ptr": xt, "lut": "*u8", "dlut": dl,
                       "n": "i32", "BLOCK": "constexpr", "DT": "constexpr"}, {"BLOCK": 1024, "DT": dt})
    print("compiled")
    """
)

# The attention kernel's signature is read from the kernel itself (its parameter names and
# constexpr markers), so it follows the kernel as its argument list changes; only the type of
# each argument comes from here, keyed by name. A new argument this does not know fails the
# test with its name rather than compiling against a stale copy of the signature.
_ATTENTION_SCRIPT = textwrap.dedent(
    """
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qfa.kernels import attention as A
    from qfa.tiling.attention import BLOCK_M, BLOCK_N
    from qfa.tiling.spec import HEAD_DIM

    # HiF8 codes in, bf16 output stored as int16 bits, fp32 LSE; the fp16 decode LUT as int16
    # bits; (dScale, ln p_scale, v_descale) as fp32; the per-batch table as int32.
    POINTERS = {"q_ptr": "*u8", "k_ptr": "*u8", "v_ptr": "*u8", "out_ptr": "*i16", "lse_ptr": "*fp32",
                "lut_ptr": "*i16", "scalars_ptr": "*fp32", "seq_ptr": "*i32", "table_ptr": "*i32"}
    INTEGERS = {"batch", "heads_q", "group", "n_tiles", "page", "stt", "stc"}
    STRIDE = re.compile(r"s[qkvol][bhsd]")  # sqb, skh, sos, ... (batch, head, sequence, dim)

    def signature(kernel, constexprs):
        sig, consts = {}, {}
        for p in kernel.params:
            if p.is_constexpr:
                if p.name not in constexprs:
                    sys.exit(f"constexpr {p.name!r} of {kernel.__name__} has no value in this test: add it")
                sig[p.name], consts[p.name] = "constexpr", constexprs[p.name]
            elif p.name in POINTERS:
                sig[p.name] = POINTERS[p.name]
            elif p.name in INTEGERS or STRIDE.fullmatch(p.name):
                sig[p.name] = "i32"
            else:
                sys.exit(f"argument {p.name!r} of {kernel.__name__} has no type in this test: add it")
        return sig, consts

    launch = A.LAUNCH["cuda"]
    options = {k: v for k, v in (("num_warps", launch.num_warps), ("num_stages", launch.num_stages)) if v is not None}
    results = []
    for causal, lse, paged in ((True, True, False), (False, False, False), (True, False, True)):
        consts = {"BLOCK_M": BLOCK_M, "SUB_M": min(launch.sub_m, BLOCK_M), "BLOCK_N": BLOCK_N,
                  "HEAD_DIM": HEAD_DIM, "CAUSAL": causal, "RETURN_LSE": lse, "PAGED": paged}
        sig, consts = signature(A._attention_kernel, consts)
        k = triton.compile(ASTSource(fn=A._attention_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options=options)
        ptx = k.asm["ptx"]
        results.append({"causal": causal, "lse": lse, "paged": paged, "sub_m": consts["SUB_M"], "options": options,
                        "wgmma": ptx.count("wgmma.mma_async"), "shared": k.metadata.shared,
                        "num_warps": k.metadata.num_warps, "num_stages": k.metadata.num_stages})
    print(json.dumps(results))
    """
)


def _compile(tmp_path, script: str) -> str:
    path = tmp_path / "compile.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 and ("ptxas" in run.stderr and "not found" in run.stderr.lower()):
        pytest.skip("Triton's CUDA toolchain (ptxas) is not available here")
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def test_cast_kernels_compile_for_sm90(tmp_path):
    """The cast kernels and the ``qfa.kernels.hif8`` helpers compile for sm_90."""
    assert "compiled" in _compile(tmp_path, _CAST_SCRIPT)


def test_attention_kernel_compiles_for_sm90_with_wgmma(tmp_path):
    """The attention kernel compiles for sm_90 with ``LAUNCH["cuda"]``'s options, its dots become
    Hopper wgmma instructions, and its shared memory fits one H100/H200 block."""
    from qfa.kernels.attention import LAUNCH

    results = json.loads(_compile(tmp_path, _ATTENTION_SCRIPT).strip().splitlines()[-1])
    launch = LAUNCH["cuda"]
    assert len(results) == 3  # causal + LSE, plain, paged
    for r in results:
        # The launch options reached the compiler (num_stages is what sizes the shared buffers).
        assert r["num_warps"] == (launch.num_warps or r["num_warps"])
        assert r["num_stages"] == (launch.num_stages or r["num_stages"])
        assert r["wgmma"] > 0, f"no wgmma in the PTX: {r}"
        assert 0 < r["shared"] <= SM90_MAX_SHARED_BYTES, f"shared memory over the sm_90 limit: {r}"
        # 80 KiB at SUB_M = 64 (two blocks per SM); the rare NaN/Inf-in-V path must not add dots.
        assert r["shared"] <= ATTENTION_SHARED_BYTES, f"shared memory grew past 80 KiB: {r}"
    print(json.dumps(results))  # the figures, for ``pytest -s``


#: quant_mode 1 / 6 (``qfa.kernels.scaled_attention``): the kernel's signature is read from the
#: kernel as above; the three compiles are the largest shared-memory case (mode 1, D = 256:
#: fp32 operand chunks), D = 72's padded block on paged K/V, and mode 6's fp16 dots.
_SCALED_ATTENTION_SCRIPT = textwrap.dedent(
    """
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qfa.kernels import scaled_attention as S
    from qfa.tiling.attention import BLOCK_M
    from qfa.tiling.spec import KEY_BLOCK, QuantMode

    # float8 q/k/v as uint8 bytes; E8M0 descales as uint8 (mode 1) or fp32 scales (mode 6);
    # bf16 out as int16 bits; the per-batch table, block table and v_descale rows as int32.
    def pointers(mode):
        scale = "*u8" if mode == 1 else "*fp32"
        return {"q_ptr": "*u8", "k_ptr": "*u8", "v_ptr": "*u8", "qs_ptr": scale, "ks_ptr": scale, "vs_ptr": scale,
                "out_ptr": "*i16", "lse_ptr": "*fp32", "scalars_ptr": "*fp32", "seq_ptr": "*i32",
                "table_ptr": "*i32", "vrow_ptr": "*i32"}
    INTEGERS = {"batch", "heads_q", "group", "n_tiles", "page", "stt", "stc"}
    STRIDE = re.compile(r"s[qkvol][bhsd]|[qkv]s[a-z2]")  # sqb, ... and the descales' qsn, ks2, vsr, ...

    def signature(kernel, constexprs, ptrs):
        sig, consts = {}, {}
        for p in kernel.params:
            if p.is_constexpr:
                if p.name not in constexprs:
                    sys.exit(f"constexpr {p.name!r} of {kernel.__name__} has no value in this test: add it")
                sig[p.name], consts[p.name] = "constexpr", constexprs[p.name]
            elif p.name in ptrs:
                sig[p.name] = ptrs[p.name]
            elif p.name in INTEGERS or STRIDE.fullmatch(p.name):
                sig[p.name] = "i32"
            else:
                sys.exit(f"argument {p.name!r} of {kernel.__name__} has no type in this test: add it")
        return sig, consts

    launch = S.LAUNCH["cuda"]
    options = {k: v for k, v in (("num_warps", launch.num_warps), ("num_stages", launch.num_stages)) if v is not None}
    results = []
    for mode, d, causal, lse, paged in ((1, 256, True, True, False), (1, 72, False, False, True),
                                        (6, 128, True, True, True)):
        consts = {"BLOCK_M": BLOCK_M, "SUB_M": min(launch.sub_m, BLOCK_M), "BLOCK_N": KEY_BLOCK[QuantMode(mode)],
                  "CHUNK": launch.chunk, "HEAD_DIM": d, "D_PAD": triton.next_power_of_2(d), "MODE": mode,
                  "CAUSAL": causal, "RETURN_LSE": lse, "PAGED": paged}
        sig, consts = signature(S._scaled_attention_kernel, consts, pointers(mode))
        k = triton.compile(ASTSource(fn=S._scaled_attention_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options=options)
        ptx = k.asm["ptx"]
        results.append({"mode": mode, "d": d, "causal": causal, "lse": lse, "paged": paged, "options": options,
                        "wgmma": ptx.count("wgmma.mma_async"), "shared": k.metadata.shared,
                        "num_warps": k.metadata.num_warps, "num_stages": k.metadata.num_stages,
                        "loads": ptx.count("ld.global")})
    print(json.dumps(results))
    """
)


def test_scaled_attention_kernel_compiles_for_sm90(tmp_path):
    """The quant_mode 1 / 6 kernel compiles for sm_90 with ``LAUNCH["cuda"]``'s options (64-key
    chunks, two passes per 512-key block) and its shared memory fits one H100/H200 block. Mode
    6's fp16 dots become wgmma; mode 1's dots are fp32 "ieee" (exact for 2^-127-scaled
    operands), so they run on FMA units, not on wgmma."""
    from qfa.kernels.scaled_attention import LAUNCH

    results = json.loads(_compile(tmp_path, _SCALED_ATTENTION_SCRIPT).strip().splitlines()[-1])
    launch = LAUNCH["cuda"]
    assert [(r["mode"], r["d"]) for r in results] == [(1, 256), (1, 72), (6, 128)]
    for r in results:
        assert r["num_warps"] == (launch.num_warps or r["num_warps"])
        assert r["num_stages"] == (launch.num_stages or r["num_stages"])
        assert r["loads"] > 0
        assert 0 < r["shared"] <= SM90_MAX_SHARED_BYTES, f"shared memory over the sm_90 limit: {r}"
        assert (r["wgmma"] > 0) == (r["mode"] == 6), f"wgmma exactly in mode 6's fp16 dots: {r}"
    print(json.dumps(results))  # the figures, for ``pytest -s``
