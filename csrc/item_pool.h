// A pool of threads that run a region's items beside the caller, where the caller waits only for
// the items some thread has taken (Region, Pool), and the helpers both native libraries' regions
// use (SingleThreadedBlas, cpu_relax, now_us). Shared by the attention kernel (parallel_region.h,
// which chooses between this pool and torch's OpenMP team) and the preparation library
// (cpu_prepare.cpp, the same choice for its passes): one implementation of the pool, its thread
// placement and its fork handling. No torch header: the preparation library builds without them.
//
// Each library includes it into its own anonymous namespace, so each has a pool of its own (one
// thread on 2 cores, asleep between regions).

#pragma once

#include <dlfcn.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace {

inline int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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
  std::function<void(int64_t)> fn;
  int64_t n = 0;
  int64_t helpers = 0;  // pool threads that may join (min(threads, n) - 1)
  std::atomic<int64_t> next{0}, done{0}, joined{0};
  std::mutex m;
  std::condition_variable cv;
  std::exception_ptr error;

  void drain() {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      try {
        fn(i);
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
    std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, [] { instance().store(nullptr); }); });
    std::atomic<Pool*>& p = instance();
    Pool* cur = p.load(std::memory_order_acquire);
    if (!cur) {
      // Two threads' first regions at once (the preparation's passes run without the GIL): one
      // pool is kept, the other deleted before it started a thread. Never destroyed: its
      // threads sleep until the process exits.
      Pool* made = new Pool();
      if (p.compare_exchange_strong(cur, made, std::memory_order_acq_rel)) {
        cur = made;
      } else {
        delete made;
      }
    }
    return *cur;
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
      published_.store(generation_, std::memory_order_release);
    }
    if (r->helpers > 0) cv_.notify_all();
    {
      SingleThreadedBlas one;
      r->drain();
    }
    // An item a helper still runs usually ends within microseconds: spin before sleeping.
    for (const int64_t until = now_us() + kSpinUs; r->done.load() != r->n && now_us() < until;) cpu_relax();
    if (r->done.load() != r->n) {
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
  static std::atomic<Pool*>& instance() {
    static std::atomic<Pool*> p{nullptr};
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
      // The next region often follows within microseconds (a pass's statistics, then its
      // encode): spin for it before sleeping, as an OpenMP worker does, so its wake-up costs
      // no futex round trip through the hypervisor.
      for (const int64_t until = now_us() + kSpinUs;
           published_.load(std::memory_order_acquire) == seen && now_us() < until;)
        cpu_relax();
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        r = region_;
      }
      if (!r || r->joined.fetch_add(1) >= r->helpers) continue;
      r->drain();
    }
  }

  std::mutex busy_;  // held by the call whose region the pool runs
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
  std::shared_ptr<Region> region_;
  uint64_t generation_ = 0;
  std::atomic<uint64_t> published_{0};  // generation_, read without mu_ by spinning threads
  static constexpr int64_t kSpinUs = 50;
  int steered_for_ = -1;    // the caller CPU the threads' affinity excludes, -1 for none yet
};

}  // namespace
