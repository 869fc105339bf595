"""The native kernel's parallel regions on torch's OpenMP team and on its own pool: the late-worker
fallback, the pool's CPU steering, fork, nesting, concurrency, items that raise.

Each scenario that changes process-wide state (QFA_POOL, the thread count, signal handlers,
affinity, a poisoned per-thread scratch, fork) runs in a subprocess of its own; the scripts
print one line that the test checks, and a hang shows as the subprocess's timeout.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from test_cpu_kernel import needs_kernel

pytestmark = needs_kernel

HERE = str(pathlib.Path(__file__).parent)
TEAMS = pytest.mark.parametrize("team", ["omp", "own"], ids=["openmp-team", "own-pool"])


def _run(script: str, *argv: str, team: str = "", timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "QFA_POOL": team}
    return subprocess.run([sys.executable, "-c", script, HERE, *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _last_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else ""


# ---- the late-worker fallback -----------------------------------------------------------------

_LATE_SCRIPT = r"""
import ctypes, os, sys, threading, time, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
mod = t.cpu_kernel
torch.set_num_threads(2)
# Prefill: one region (3 K/V blocks to decode, then 4 tiles), on OpenMP.
plan, args = t.make(**t.CASES["gqa4-255x513-causal-bsnd-p15"])
want = mod.forward(plan, *args)[0].view(torch.int16).clone()
assert mod._module.last_region() == ("omp", 2), mod._module.last_region()
dplan, dargs = t.make(**t.CASES["decode-1x4097"])  # made now: after the held call, 200 ms count
decode = (dplan, *dargs)
time.sleep(0.5)  # past any own-pool window the warm-up itself opened
libc = ctypes.CDLL(None, use_errno=True)
if not hasattr(libc, "tgkill"):
    print("skip: no tgkill"); sys.exit(0)
# A worker held up for one second, deterministically: SIGHUP (1) runs sleep(1) on the thread it
# is sent to. Every thread but this one is torch's OpenMP worker (no own pool exists yet).
libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.signal(1, ctypes.cast(libc.sleep, ctypes.c_void_p))
me = threading.get_native_id()
others = [int(x) for x in os.listdir("/proc/self/task") if int(x) != me]
assert others
for tid in others:
    assert libc.tgkill(os.getpid(), tid, 1) == 0
t0 = time.perf_counter()
got = mod.forward(plan, *args)[0].view(torch.int16)
took = time.perf_counter() - t0
assert torch.equal(got, want)
assert took > 0.5, took  # the region waited for the held-up worker
# Its worker arrived ~1 s late: the calls of the next 200 ms belong to the own pool, prefill's
# and decode's alike.
mod.forward(plan, *args)
first = mod._module.last_region()[0]
mod.forward(*decode)
print(first if first != "own" else mod._module.last_region()[0])
"""


def test_a_late_worker_sends_the_next_regions_of_every_kind_to_the_own_pool():
    """A region whose worker arrived late sends the calls of the next kOwnPoolMs to the kernel's
    own pool, of every kind: ``own_until`` was once a static local of a function template (one
    per lambda type), so prefill's predecode region (then a region of its own) and the decode
    calls' regions each kept their own window, and the fallback did not happen for them."""
    done = _run(_LATE_SCRIPT, team="", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    if _last_line(done).startswith("skip"):
        pytest.skip(_last_line(done))
    assert _last_line(done) == "own", (done.stdout, done.stderr[-2000:])


# ---- items that raise -------------------------------------------------------------------------

_RAISE_SCRIPT = r"""
import dataclasses, sys, threading, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
mod = t.cpu_kernel
torch.set_num_threads(int(sys.argv[2]))
plan, args = t.make(**t.CASES["decode-1x4097"])  # two items (kv heads), each split into chunks
box = []  # the reference, from a thread whose scratch nothing else touches
th = threading.Thread(target=lambda: box.append(mod.forward(plan, *args)[0].view(torch.int16).clone()))
th.start(); th.join()
# Blocks of 2^50 keys: one block per item, no split, and every scratch allocation for it fails
# inside the region (its items raise).
huge = dataclasses.replace(plan, block_n=1 << 50)
try:
    mod.forward(huge, *args)
    print("no error"); sys.exit(0)
except RuntimeError as e:
    assert "out of memory" in str(e), str(e)
print("raised", flush=True)
got = mod.forward(plan, *args)[0].view(torch.int16)  # the same thread's next, ordinary call
print("same" if torch.equal(got, box[0]) else "different")
"""


@pytest.mark.parametrize("threads,team", [(1, ""), (2, "omp"), (2, "own")],
                         ids=["caller-alone", "openmp-team", "own-pool"])
def test_items_whose_scratch_allocation_fails_raise_and_leave_the_threads_usable(threads, team):
    """Scratch::ensure records its new capacity before allocating. When an allocation throws,
    the thread's scratch claims buffers it does not have (null: the thread's first call), so the
    next item that thread takes, in the same region or the next call, skips the allocation and
    writes through them: a crash where the call should raise RuntimeError (the kernel's "out of
    memory" message) and leave every thread able to run the next call."""
    done = _run(_RAISE_SCRIPT, str(threads), team=team, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["raised", "same"], (
        done.returncode, done.stdout, done.stderr[-2000:])


# ---- the own pool's CPU steering --------------------------------------------------------------

_STEER_SCRIPT = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
mod = t.cpu_kernel
torch.set_num_threads(2)
plan, args = t.make(**t.CASES["decode-1x4097"])
a, b = sorted(os.sched_getaffinity(0))[:2]
mod.forward(plan, *args)  # the pool, made while the process has all its CPUs
assert mod._module.last_region()[0] == "own"
os.sched_setaffinity(0, {b})
mod.forward(plan, *args)  # steered for CPU b: the pool's threads may use every other CPU
tasks = lambda: [int(x) for x in os.listdir("/proc/self/task")]
for tid in tasks():  # the whole process restricted to CPU a (as taskset -a -p does)
    os.sched_setaffinity(tid, {a})
mod.forward(plan, *args)  # the caller has moved (b -> a)
outside = {tid: sorted(os.sched_getaffinity(tid)) for tid in tasks() if not os.sched_getaffinity(tid) <= {a}}
print(outside or "kept")
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to steer")
def test_steering_keeps_a_later_restriction_of_the_process():
    """Pool::steer computes the threads' CPUs from a snapshot taken when the pool was made: once
    the process has been restricted (every thread pinned to CPU a), the next call from a moved
    caller gives the pool's threads the snapshot's other CPUs, outside the restriction."""
    done = _run(_STEER_SCRIPT, team="own", timeout=120)
    assert done.returncode == 0 and _last_line(done) == "kept", (done.stdout, done.stderr[-2000:])


_STEER_NEW_THREADS_SCRIPT = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
mod = t.cpu_kernel
plan, args = t.make(**t.CASES["fused-mha-B3-1xskv-bsnd"])  # 3 items
tasks = lambda: {int(x) for x in os.listdir("/proc/self/task")}
base = os.sched_getaffinity(0)
ok, pool = True, set()
for n in (2, 3):  # a second call with more threads makes a new pool thread: steered too
    torch.set_num_threads(n)  # (which may start OpenMP workers: not the pool's)
    before = tasks()
    mod.forward(plan, *args)
    assert mod._module.last_region()[0] == "own"
    pool |= tasks() - before
    masks = [os.sched_getaffinity(tid) for tid in pool]
    ok = ok and len(pool) == n - 1 and all(len(base - m) == 1 and m < base for m in masks)
print(ok)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to steer")
def test_pool_threads_created_by_a_later_call_are_steered_too():
    done = _run(_STEER_NEW_THREADS_SCRIPT, team="own", timeout=120)
    assert done.returncode == 0 and _last_line(done) == "True", (done.stdout, done.stderr[-2000:])


# ---- fork -------------------------------------------------------------------------------------

_FORK_SCRIPT = r"""
import hashlib, os, sys, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
mod = t.cpu_kernel
torch.set_num_threads(2)
plan, args = t.make(**t.CASES["decode-B2-16x4096-causal-bsnd"])
digest = lambda: hashlib.sha1(mod.forward(plan, *args)[0].view(torch.int16).numpy().tobytes()).hexdigest()
before = digest() if sys.argv[2] == "ran" else None
r, w = os.pipe()
def child(depth):
    line = digest() + " " + mod._module.last_region()[0] + "\n"
    os.write(w, line.encode())
    ok = True
    if depth < 2:  # a grandchild: the pool the child made is reset again
        pid = os.fork()
        if pid == 0:
            child(depth + 1)
        _, st = os.waitpid(pid, 0)
        ok = os.waitstatus_to_exitcode(st) == 0
    os._exit(0 if ok else 3)
pid = os.fork()
if pid == 0:
    child(1)
_, st = os.waitpid(pid, 0)
os.close(w)
lines = os.fdopen(r).read().split("\n")[:-1]
after = digest()  # the parent's own team still works after the fork
want = after + " own"
print("child", os.waitstatus_to_exitcode(st), lines == [want, want] and before in (None, after), lines)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
@pytest.mark.parametrize("team", ["omp", "own", ""], ids=["openmp-team", "own-pool", "automatic"])
@pytest.mark.parametrize("before", ["ran", "fresh"])
def test_forked_children_and_grandchildren_run_on_a_fresh_own_pool(team, before):
    """A child forked after the parent ran the kernel (on either team: the parent's own pool
    threads do not exist in the child either) or before it ever did, and that child's child."""
    done = _run(_FORK_SCRIPT, before, team=team, timeout=180)
    assert done.returncode == 0 and _last_line(done).startswith("child 0 True"), (done.stdout, done.stderr[-2000:])


# ---- nesting and concurrency ------------------------------------------------------------------

_NEST_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <utility>
#include <vector>
// (OpenMP thread number, Linux thread id) of each thread of an n-thread region (one iteration each).
std::vector<std::pair<int64_t, int64_t>> omp_thread_ids(int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> ids(n, {-1, -1});
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ids[i] = {omp_get_thread_num(), static_cast<int64_t>(syscall(SYS_gettid))};
  });
  return ids;
}
// Runs f inside an at::parallel_for region of n iterations, on the thread given iteration `on`
// (0: the region's master, the calling thread), while the others wait in its closing barrier.
int64_t call_inside_parallel_for(py::function f, int64_t n, int64_t on) {
  std::atomic<int64_t> entered{0};
  {
    py::gil_scoped_release nogil;
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t) {
      entered.fetch_add(1);
      if (b == on) {
        py::gil_scoped_acquire gil;
        f();
      }
    });
  }
  return entered.load();
}
"""


@pytest.fixture(scope="module")
def nest_module_path():
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    from torch.utils.cpp_extension import load_inline

    mod = load_inline(name="qfa_parallel_nest", cpp_sources=[_NEST_SOURCE], functions=["call_inside_parallel_for", "omp_thread_ids"],
                      extra_cflags=["-O1", "-fopenmp"], extra_ldflags=["-lgomp"], verbose=False)
    return mod.__file__


_NEST_SCRIPT = r"""
import importlib.util, sys, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
mod = t.cpu_kernel
spec = importlib.util.spec_from_file_location("qfa_parallel_nest", sys.argv[2])
nest = importlib.util.module_from_spec(spec); spec.loader.exec_module(nest)
torch.set_num_threads(2)
results = []
for name in ("decode-1x4097", "gqa4-255x513-causal-bsnd-p15"):
    plan, args = t.make(**t.CASES[name])
    want = mod.forward(plan, *args)[0].view(torch.int16).clone()
    box = []
    def inner():
        try:
            box.append((mod.forward(plan, *args)[0].view(torch.int16).clone(), mod._module.last_region()))
        except BaseException as e:
            box.append(e)
    entered = nest.call_inside_parallel_for(inner, 2, int(sys.argv[4]))
    assert entered == 2, entered  # the outer region really ran on two threads
    got, region = box[0]
    results.append(torch.equal(got, want))
    # Inside a parallel region at::parallel_for runs on its caller alone.
    if sys.argv[3] == "omp":
        results.append(region == ("omp", 1))
print(all(results), results)
"""


@TEAMS
@pytest.mark.parametrize("on", [0, 1], ids=["on-its-master", "on-its-worker"])
def test_a_call_from_inside_an_openmp_region(team, on, nest_module_path):
    """The kernel called inside a running at::parallel_for region, on its master (the Python
    thread) or on its OpenMP worker (taking the GIL there), while the region's other thread waits
    in the closing barrier: no deadlock, the same bits; on the OpenMP team the nested region runs
    on the calling thread alone."""
    done = _run(_NEST_SCRIPT, nest_module_path, team, str(on), team=team, timeout=300)
    assert done.returncode == 0 and _last_line(done).startswith("True"), (done.stdout, done.stderr[-2000:])


_CONCURRENT_SCRIPT = r"""
import sys, threading, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
mod = t.cpu_kernel
torch.set_num_threads(2)
names = ("decode-1x4097", "fused-3x3000-causal-p15", "gqa4-255x513-causal-bsnd-p15")
cases = [t.make(**t.CASES[n]) for n in names]
want = [mod.forward(p, *a)[0].view(torch.int16).clone() for p, a in cases]
bad, stop = [], threading.Event()
def caller(k):
    for r in range(6):
        p, a = cases[(k + r) % len(cases)]
        got = mod.forward(p, *a)[0].view(torch.int16)
        if not torch.equal(got, want[(k + r) % len(cases)]):
            bad.append((k, r))
def torch_ops():  # torch's own OpenMP regions on a third thread, with the GIL released
    x = torch.randn(1 << 21)
    while not stop.is_set():
        torch.exp(x).sum()
threads = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
background = threading.Thread(target=torch_ops)
background.start()
for th in threads: th.start()
for th in threads: th.join()
stop.set(); background.join()
print("identical" if not bad else bad)
"""


@pytest.mark.parametrize("team", ["omp", "own", ""], ids=["openmp-team", "own-pool", "automatic"])
def test_two_python_threads_calling_beside_torch_ops(team):
    """Two Python threads calling the kernel in turn (each thread its own OpenMP team, the pool
    shared) while a third runs torch's own parallel ops: no deadlock, the bits of a lone call."""
    done = _run(_CONCURRENT_SCRIPT, team=team, timeout=300)
    assert done.returncode == 0 and _last_line(done) == "identical", (done.stdout, done.stderr[-2000:])


_IDLE_LATE_SCRIPT = r"""
import ctypes, importlib.util, os, sys, threading, time, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernel as t
mod = t.cpu_kernel
spec = importlib.util.spec_from_file_location("qfa_parallel_nest", sys.argv[2])
nest = importlib.util.module_from_spec(spec); spec.loader.exec_module(nest)
libc = ctypes.CDLL(None, use_errno=True)
if not hasattr(libc, "tgkill"):
    print("skip: no tgkill"); sys.exit(0)
torch.set_num_threads(3)
plan, args = t.make(2, 2, (1,), (256,))  # two items (kv heads), one block each: no split
want = mod.forward(plan, *args)[0].view(torch.int16).clone()
assert mod._module.last_region()[0] == "omp", mod._module.last_region()
ids = dict(nest.omp_thread_ids(3))  # libgomp gives a team of the same size the same threads
assert ids[0] == threading.get_native_id() and len(set(ids.values())) == 3, ids
time.sleep(0.5)
libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.signal(1, ctypes.cast(libc.sleep, ctypes.c_void_p))  # SIGHUP: sleep(1) on the thread it hits
assert libc.tgkill(os.getpid(), ids[2], 1) == 0  # team thread 2: no item of a 2-item region is its
t0 = time.perf_counter()
got = mod.forward(plan, *args)[0].view(torch.int16)
took = time.perf_counter() - t0
assert torch.equal(got, want) and took > 0.5, took  # the closing barrier waited for thread 2
mod.forward(plan, *args)
print(mod._module.last_region()[0])
"""


def test_a_late_team_thread_that_takes_no_part_is_noticed(nest_module_path):
    """With fewer items than torch's threads, run_on_openmp's region (at::parallel_for's: no
    num_threads clause) still starts the whole team and its closing barrier waits
    for every thread, but only threads 0..threads-1 enter the lambda and are timed: a late thread
    past them holds the call up and the own-pool fallback never hears of it."""
    done = _run(_IDLE_LATE_SCRIPT, nest_module_path, team="", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    if _last_line(done).startswith("skip"):
        pytest.skip(_last_line(done))
    assert _last_line(done) == "own", (done.stdout, done.stderr[-2000:])
