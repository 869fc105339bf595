// The parallel region a call runs in: the choice between torch's OpenMP team and the kernel's own
// pool (item_pool.h) for each region (run_items: OpenMP unless a worker arrived late recently),
// each item run with its thread's Scratch. It knows nothing of attention: which thread runs an
// item never changes what it computes.
//
// Only cpu_attention.cpp includes this header: the kernel is one translation unit, and the
// anonymous namespace gives everything here the internal linkage it had when the kernel was one
// file (nothing exported beside the entry points, the optimiser free to inline and drop as before).

#pragma once

#include "item_pool.h"
#include "thread_scratch.h"

#include <omp.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>

namespace {

// Which threads run a region. Torch's own OpenMP team by default: after each of torch's parallel
// ops its worker spins for about 10 ms (measured here), so in a model, where torch ops surround
// every attention call, a thread of the kernel's own would share a core with that spinning worker
// (a B = 8 decode call took 1.3-1.5x its time alone), while the spinning worker itself takes
// items within microseconds. But an OpenMP region ends in a barrier that waits for every thread
// of the team to arrive, and with another process busy on a core a worker is often a scheduler
// slice late (1-5 ms in a quarter of the calls here; a 4 ms call took 3x its quiet time). So a
// region whose worker arrived late sends the calls of the next kOwnPoolMs to the kernel's own
// pool, whose caller waits only for items a thread has taken, then OpenMP is tried again.
// QFA_POOL=omp or own pins the choice (the tests run both). Never a difference in the bits.
enum class Team { automatic, own, omp };
constexpr int64_t kLateUs = 500;
constexpr int64_t kOwnPoolMs = 200;

// libgomp's team does not survive fork (a child's first parallel region hangs, torch's own ops
// included); the kernel's pool starts afresh there, so a forked child always runs on it.
std::atomic<bool> forked_child{false};
const int fork_watch = pthread_atfork(nullptr, nullptr, [] { forked_child.store(true); });

Team team_setting() {
  static const Team t = [] {
    const char* e = std::getenv("QFA_POOL");
    const std::string v = e ? e : "";
    return v == "own" ? Team::own : v == "omp" ? Team::omp : Team::automatic;
  }();
  return forked_child.load() ? Team::own : t;
}

// The last region's team (0 the caller alone, 1 the own pool, 2 OpenMP) and, for OpenMP, how
// many threads entered it: for the tests.
std::atomic<int> last_team{0}, last_entered{0};

// Runs fn on items [0, n) on torch's OpenMP team of `threads` (torch.get_num_threads(), read by
// the bindings); returns how late (us) the latest of its other threads arrived. The region is the
// one torch's at::parallel_for(0, threads, 1, ...) opens (this file includes no ATen header, see
// simd_vec.h): `omp parallel` without a num_threads clause (torch avoids it for a bug in GOMP's
// thread pool, pytorch#32008), thread t running share t; or, `nested` inside another parallel
// region (at::in_parallel_region(), read by the bindings), the caller alone, as at::parallel_for.
template <typename F>
int64_t run_on_openmp(int64_t n, int64_t threads, bool nested, const F& fn) {
  Region r;
  r.fn = [&fn](int64_t i) { fn(i, thread_scratch()); };
  r.n = n;
  const int64_t t0 = now_us();
  std::atomic<int64_t> late{0};
  last_entered.store(0);
  auto share = [&](int64_t first) {
    last_entered.fetch_add(1);
    if (first > 0) {
      const int64_t us = now_us() - t0;
      for (int64_t cur = late.load(); us > cur && !late.compare_exchange_weak(cur, us);) {}
    }
    SingleThreadedBlas one;
    r.drain();
    // Wait for the items others have taken asleep once past a short spin: a thread spinning in
    // the closing barrier holds its core, and a straggler on a busy core could not move there.
    for (int spins = 0; r.done.load() != r.n && spins < 2000; ++spins) cpu_relax();
    std::unique_lock<std::mutex> lk(r.m);
    r.cv.wait(lk, [&] { return r.done.load() == r.n; });
  };
  if (nested || threads <= 1) {
    share(0);
    if (r.error) std::rethrow_exception(r.error);
    return 0;
  }
#pragma omp parallel
  {
    const int64_t tid = omp_get_thread_num();
    // Nothing may leave an OpenMP region by an exception: the items' own are in r.error.
    try {
      if (tid < threads) share(tid);
    } catch (...) {
      std::lock_guard<std::mutex> lk(r.m);
      if (!r.error) r.error = std::current_exception();
    }
  }
  if (r.error) std::rethrow_exception(r.error);
  return late.load();
}

// Hands items out costliest first to whichever thread asks next; one region.
// us: every region runs on the own pool until then. One for all regions (a static local of
// run_items would be one per lambda type: prefill's predecode region would keep its own).
std::atomic<int64_t> own_until{0};

// Regions the current call has run (one per call: see forward), for the tests.
std::atomic<int> regions{0};

// `torch_threads`, `nested`: torch.get_num_threads() and at::in_parallel_region(), read by the
// bindings.
template <typename F>
void run_items(int64_t n, int64_t torch_threads, bool nested, const F& fn) {
  regions.fetch_add(1);
  const int64_t threads = std::min<int64_t>(torch_threads, n);
  const Team team = team_setting();
  if (threads <= 1 || team == Team::own || (team == Team::automatic && now_us() < own_until.load())) {
    last_team.store(threads <= 1 ? 0 : 1);
    Pool::get().run(n, threads, [&fn](int64_t i) { fn(i, thread_scratch()); });
    return;
  }
  last_team.store(2);
  // The whole team, not `threads` of it: torch's region starts every thread and its closing
  // barrier waits for each, so each one's lateness must count (those past n take no item).
  const int64_t late = run_on_openmp(n, torch_threads, nested, fn);
  if (team == Team::automatic && late > kLateUs) own_until.store(now_us() + kOwnPoolMs * 1000);
}

}  // namespace
