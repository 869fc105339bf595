// The parallel region a call runs in: SingleThreadedBlas (a worker's GEMMs on its own thread),
// Region (items handed out by an atomic counter), the kernel's own Pool, the choice between it and
// torch's OpenMP team (run_items: OpenMP unless a worker arrived late recently), and the clocks
// and spin helpers they use. It runs whatever items it is given, each with its thread's Scratch,
// and knows nothing of attention: which thread runs an item never changes what it computes.
//
// Only cpu_attention.cpp includes this header: the kernel is one translation unit, and the
// anonymous namespace gives everything here the internal linkage it had when the kernel was one
// file (nothing exported beside the entry points, the optimiser free to inline and drop as before).

#pragma once

#include "thread_scratch.h"

#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

// torch enables nested OpenMP (max-active-levels), so a GEMM called inside the region would
// open a team of its own on every call: on 2 cores, 4 spinning threads, and under load each
// call waits for its slowest one. A worker's GEMMs run on the worker's thread alone: OpenMP's
// setting, and MKL's own (torch sets MKL's thread count, which MKL reads instead of OpenMP's,
// so the OpenMP setting alone leaves every GEMM in a worker a nested team of torch's size).
// MKL's per-thread setting (its C entry point; the lower-case symbol is the Fortran one, by
// pointer) is looked up at run time: torch builds without MKL have none.
// Restored on exit: the calling thread runs a share of the region (or all of it, inline), and
// its OpenMP setting is torch.get_num_threads() for the rest of the process.
using MklSetLocal = int (*)(int);
MklSetLocal mkl_set_local() {
  static const MklSetLocal f = [] {
    void* self = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    void* sym = self ? dlsym(self, "MKL_Set_Num_Threads_Local") : nullptr;
    if (!sym) sym = dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local");
    return reinterpret_cast<MklSetLocal>(sym);
  }();
  return f;
}

struct SingleThreadedBlas {
  int saved = omp_get_max_threads();
  int saved_mkl = 0;
  SingleThreadedBlas() {
    omp_set_num_threads(1);
    if (MklSetLocal f = mkl_set_local()) saved_mkl = f(1);
  }
  ~SingleThreadedBlas() {
    omp_set_num_threads(saved);
    if (MklSetLocal f = mkl_set_local()) f(saved_mkl);
  }
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// ---- the workers ------------------------------------------------------------------------------
// A region of n items, handed out by an atomic counter to the threads that run it (torch's
// OpenMP team, or the caller and the kernel's own pool: see run_items). On the pool the caller
// waits only for items that some thread has taken: a pool thread that is slow to wake (the core
// is busy with another process) finds the counter spent and takes nothing, where an OpenMP
// region waits at its closing barrier for every thread of the team. Items are the unit of work;
// which thread runs one never changes what it computes.
struct Region {
  std::function<void(int64_t, Scratch&)> fn;
  int64_t n = 0;
  int64_t helpers = 0;  // pool threads that may join (min(threads, n) - 1)
  std::atomic<int64_t> next{0}, done{0}, joined{0};
  std::mutex m;
  std::condition_variable cv;
  std::exception_ptr error;

  void drain(Scratch& sc) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      try {
        fn(i, sc);
      } catch (...) {
        std::lock_guard<std::mutex> lk(m);
        if (!error) error = std::current_exception();
      }
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lk(m);
        cv.notify_all();
      }
    }
  }
};

class Pool {
 public:
  static Pool& get() {
    static std::once_flag registered;
    std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, [] { instance() = nullptr; }); });
    Pool*& p = instance();
    if (!p) p = new Pool();  // never destroyed: its threads sleep until the process exits
    return *p;
  }

  // Runs fn on every item with up to threads - 1 pool threads beside the caller.
  template <typename F>
  void run(int64_t n, int64_t threads, const F& fn) {
    if (n <= 0) return;
    auto r = std::make_shared<Region>();
    r->fn = fn;
    r->n = n;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    // A second concurrent call (another Python thread) runs alone on its own thread.
    r->helpers = busy.owns_lock() ? std::min<int64_t>(threads, n) - 1 : 0;
    if (r->helpers > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      while (static_cast<int64_t>(threads_.size()) < r->helpers) {
        threads_.emplace_back([this] { work(); });
        steered_for_ = -1;
      }
      steer();
      region_ = r;
      ++generation_;
    }
    if (r->helpers > 0) cv_.notify_all();
    {
      SingleThreadedBlas one;
      r->drain(thread_scratch());
    }
    {
      std::unique_lock<std::mutex> lk(r->m);
      r->cv.wait(lk, [&] { return r->done.load() == r->n; });
    }
    if (r->helpers > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      region_.reset();
    }
    if (r->error) std::rethrow_exception(r->error);
  }

 private:
  static Pool*& instance() {
    static Pool* p = nullptr;
    return p;
  }

  // The pool's threads may run on any of the caller's CPUs but the one it is on. The caller wakes
  // them, and when no CPU is idle (torch's OpenMP worker spins for milliseconds after each of
  // torch's own parallel ops, so in a model there is none) the scheduler places a woken thread
  // on the waker's CPU: the caller and its helper then share one core while the other spins
  // (measured on the 2-core EPYC: 9 calls in 10, and a decode call took 1.2 ms instead of 0.6).
  // Set again only when the caller has moved. Under mu_.
  void steer() {
    const int cpu = sched_getcpu();
    if (cpu < 0 || cpu == steered_for_) return;
    // The caller's CPUs now, not when the pool was made: a restriction since (taskset -a, a
    // launcher pinning every thread, a cpuset change) is kept.
    cpu_set_t others;
    CPU_ZERO(&others);
    if (sched_getaffinity(0, sizeof(others), &others) != 0 || !CPU_ISSET(cpu, &others) || CPU_COUNT(&others) < 2)
      return;
    CPU_CLR(cpu, &others);
    for (auto& t : threads_) pthread_setaffinity_np(t.native_handle(), sizeof(others), &others);
    steered_for_ = cpu;
  }

  void work() {
    SingleThreadedBlas one;  // for the thread's life
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Region> r;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        r = region_;
      }
      if (!r || r->joined.fetch_add(1) >= r->helpers) continue;
      r->drain(thread_scratch());
    }
  }

  std::mutex busy_;  // held by the call whose region the pool runs
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
  std::shared_ptr<Region> region_;
  uint64_t generation_ = 0;
  int steered_for_ = -1;    // the caller CPU the threads' affinity excludes, -1 for none yet
};

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

inline int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Runs fn on items [0, n) on torch's OpenMP team of `threads`; returns how late (us) the latest of
// its other threads arrived.
template <typename F>
int64_t run_on_openmp(int64_t n, int64_t threads, const F& fn) {
  Region r;
  r.fn = fn;
  r.n = n;
  const int64_t t0 = now_us();
  std::atomic<int64_t> late{0};
  last_entered.store(0);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t) {
    last_entered.fetch_add(1);
    if (first > 0) {
      const int64_t us = now_us() - t0;
      for (int64_t cur = late.load(); us > cur && !late.compare_exchange_weak(cur, us);) {}
    }
    SingleThreadedBlas one;
    r.drain(thread_scratch());
    // Wait for the items others have taken asleep once past a short spin: a thread spinning in
    // the closing barrier holds its core, and a straggler on a busy core could not move there.
    for (int spins = 0; r.done.load() != r.n && spins < 2000; ++spins) cpu_relax();
    std::unique_lock<std::mutex> lk(r.m);
    r.cv.wait(lk, [&] { return r.done.load() == r.n; });
  });
  if (r.error) std::rethrow_exception(r.error);
  return late.load();
}

// Hands items out costliest first to whichever thread asks next; one region.
// us: every region runs on the own pool until then. One for all regions (a static local of
// run_items would be one per lambda type: prefill's predecode region would keep its own).
std::atomic<int64_t> own_until{0};

// Regions the current call has run (one per call: see forward), for the tests.
std::atomic<int> regions{0};

template <typename F>
void run_items(int64_t n, const F& fn) {
  regions.fetch_add(1);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  const Team team = team_setting();
  if (threads <= 1 || team == Team::own || (team == Team::automatic && now_us() < own_until.load())) {
    last_team.store(threads <= 1 ? 0 : 1);
    Pool::get().run(n, threads, fn);
    return;
  }
  last_team.store(2);
  // The whole team, not `threads` of it: torch's region starts every thread and its closing
  // barrier waits for each, so each one's lateness must count (those past n take no item).
  const int64_t late = run_on_openmp(n, at::get_num_threads(), fn);
  if (team == Team::automatic && late > kLateUs) own_until.store(now_us() + kOwnPoolMs * 1000);
}

}  // namespace
