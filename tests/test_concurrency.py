"""Four threads calling the cast, the op and the drop-in at once get the bits of sequential
calls: nothing in qfa keeps per-call state where another thread can see it (plans cached in
metadata, compiled-function records, the recompile-limit scope, LUT caches).

The second test runs in a fresh interpreter, so that the first compilation of every compiled
step (the cast's, the torch path's softmax and normalisation) happens inside the threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

#: Builds the work items and runs them sequentially or in 4 threads; shared by both tests.
WORKLOAD = textwrap.dedent('''
    import threading
    import torch
    import qfa

    D = 128

    def work_items():
        g = torch.Generator().manual_seed(7)
        x = torch.randn(1 << 17, generator=g)  # above the cast's compile threshold (2^16)
        q, k, v = (torch.randn(1, 4, 300, D, generator=g) for _ in range(3))
        # codes without a cast (which would compile before the threads): finite codes of both signs
        finite = torch.tensor([c for c in range(256) if c not in (0x80, 0x6F, 0xEF)], dtype=torch.uint8)
        codes = [finite[torch.randint(0, finite.numel(), (1, 4, 300, D), generator=g)] for _ in range(3)]
        one, small = torch.ones(1), torch.tensor([2.0 ** -12])
        cu = torch.tensor([0, 100, 100, 300], dtype=torch.int32)
        tq, tk, tv = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
        return [
            ("encode", lambda: (qfa.encode_to_hifloat8(x),)),
            ("decode", lambda: (qfa.decode_from_hifloat8(qfa.encode_to_hifloat8(x), torch.float32),)),
            ("op", lambda: qfa.quant_flash_attn(*codes, small, small, one, mask_mode=3, return_softmax_lse=True)),
            ("op tnd", lambda: qfa.quant_flash_attn(
                qfa.encode_to_hifloat8(tq), qfa.encode_to_hifloat8(tk), qfa.encode_to_hifloat8(tv), one, one, one,
                layout="TND", cu_seqlens_q=cu, cu_seqlens_kv=cu, return_softmax_lse=True)),
            ("dropin", lambda: qfa.hif8_attention(q, k, v, is_causal=True, return_softmax_lse=True)),
            ("dropin tnd", lambda: (qfa.hif8_attention(tq, tk, tv, layout="TND", cu_seqlens_q=cu,
                                                       cu_seqlens_kv=cu),)),
        ]

    def bits(t):
        return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t

    def run_threads(items, threads=4, rounds=2):
        """Every item ``rounds`` times, spread over ``threads`` threads started together."""
        results, errors = {}, []
        barrier = threading.Barrier(threads)
        jobs = [(name, fn) for _ in range(rounds) for name, fn in items]

        def worker(i):
            barrier.wait()
            for j in range(i, len(jobs), threads):
                name, fn = jobs[j]
                try:
                    results.setdefault(name, []).append([bits(t).clone() for t in fn()])
                except BaseException as exc:  # noqa: BLE001  (reported below)
                    errors.append((name, repr(exc)))

        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return results, errors

    def compare(items, results, errors):
        assert not errors, errors
        sequential = {name: [bits(t) for t in fn()] for name, fn in items}
        for name, runs in results.items():
            for run in runs:
                assert all(torch.equal(a, b) for a, b in zip(run, sequential[name])), name
        return sorted(results)
''')


def _run(script: str, env_extra: dict) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), **env_extra)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)


def test_threads_get_the_bits_of_sequential_calls():
    namespace: dict = {}
    exec(WORKLOAD, namespace)  # noqa: S102  (the test's own code, shared with the subprocess)
    items = namespace["work_items"]()
    for _, fn in items:  # warm: compiled already, so this part tests the steady state
        fn()
    results, errors = namespace["run_threads"](items)
    assert namespace["compare"](items, results, errors) == sorted(name for name, _ in items)


def test_first_compilation_inside_threads_gives_the_bits_of_sequential_calls():
    """A fresh interpreter on the pure-torch path (its compiled steps) and the native kernel:
    the first compile of each step happens in 4 threads at once, and no compile may fail (a
    failure would run that signature eagerly, whose exp differs in the last ulp)."""
    script = WORKLOAD + textwrap.dedent('''
        import warnings
        from qfa import _compile
        warnings.simplefilter("error", UserWarning)  # a failed compile warns: make it an error
        items = work_items()
        assert not _compile._compiled, "something compiled before the threads"
        results, errors = run_threads(items)
        assert not _compile._failed and not _compile._failed_signatures, (_compile._failed, _compile._failed_signatures)
        print("ok", len(_compile._compiled), compare(items, results, errors))
    ''')
    # compiled: the torch path's cast and attention steps; with native code only the decode's
    # gather (the encode and the attention run natively)
    for native, compiled in (("0", 2), ("1", 1)):
        done = _run(script, {"QFA_NATIVE": native, "QFA_COMPILE": "1"})
        assert done.returncode == 0, done.stderr[-4000:]
        assert done.stdout.startswith("ok"), done.stdout
        assert int(done.stdout.split()[1]) >= compiled, done.stdout


def test_threads_leave_the_users_dynamo_config():
    """The recompile-limit scope of concurrent calls restores each thread's own setting."""
    namespace: dict = {}
    exec(WORKLOAD, namespace)  # noqa: S102
    before = torch._dynamo.config.recompile_limit
    namespace["run_threads"](namespace["work_items"]()[:3])
    assert torch._dynamo.config.recompile_limit == before
