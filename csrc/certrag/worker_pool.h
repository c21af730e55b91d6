// A process-wide pool of worker threads for kernels called many times a second (the decoder's matrix products:
// about 170 calls per generated token), where starting threads per call (parallel.h) costs more than it saves.
//
// run(parts, fn) calls fn(part) for part in [0, parts) with part 0 on the calling thread, and returns when all are
// done. Workers wait for a job spinning briefly (a decode step's calls come back to back), then sleep on a
// condition variable, so an idle pool costs no CPU. One job runs at a time (callers are serialised). A child
// process made by fork() has none of its parent's threads: the pool notices the new pid and starts its own.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

namespace certrag {

class WorkerPool {
 public:
  static constexpr int kSpinMicros = 200;  // how long an idle worker polls before it sleeps

  // The pool for `threads` threads in all (the caller included); grown on demand, never shrunk.
  static WorkerPool& instance(unsigned threads) {
    static std::mutex m;
    static std::unique_ptr<WorkerPool> pool;
    std::lock_guard<std::mutex> lock(m);
    if (!pool || pool->pid_ != getpid() || pool->workers_.size() + 1 < threads) {
      if (pool && pool->pid_ != getpid()) pool.release();  // a forked child: the threads are the parent's
      const unsigned want = std::max<unsigned>(threads, pool ? static_cast<unsigned>(pool->workers_.size() + 1) : 1);
      pool.reset(new WorkerPool(want));
    }
    return *pool;
  }

  void run(unsigned parts, const std::function<void(unsigned)>& fn) {
    if (parts <= 1) {
      fn(0);
      return;
    }
    std::lock_guard<std::mutex> caller(call_mutex_);
    parts = std::min<unsigned>(parts, static_cast<unsigned>(workers_.size() + 1));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      parts_ = parts;
      remaining_.store(parts - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    std::exception_ptr error;
    try {
      fn(0);
    } catch (...) {
      error = std::current_exception();
    }
    while (remaining_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    if (!error) error = worker_error_;
    worker_error_ = nullptr;
    if (error) std::rethrow_exception(error);
  }

  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  explicit WorkerPool(unsigned threads) : pid_(getpid()) {
    for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this, i] { loop(i); });
  }

  void loop(unsigned id) {
    std::uint64_t seen = 0;  // the generation at construction: a job posted before this thread ran is still new
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
      }
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      const std::function<void(unsigned)>* job;
      unsigned parts;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stop_) return;
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
        parts = parts_;
      }
      if (id < parts) {
        try {
          (*job)(id);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex_);
          if (!worker_error_) worker_error_ = std::current_exception();
        }
        remaining_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<unsigned> remaining_{0};
  const std::function<void(unsigned)>* job_ = nullptr;
  unsigned parts_ = 0;
  bool stop_ = false;
  std::exception_ptr worker_error_;
};

}  // namespace certrag
