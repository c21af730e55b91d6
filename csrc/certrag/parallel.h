// A minimal parallel-for over [0, n) on std::threads.
//
// Work is handed out in small blocks from an atomic counter so that uneven items (HNSW insertions) balance. The first
// exception thrown by any worker stops further blocks from starting and is rethrown in the caller.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace certrag {

inline unsigned resolve_threads(int requested) {
  if (requested > 0) return static_cast<unsigned>(requested);
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1u : hw;
}

// Calls fn(i, worker) for every i in [0, n); worker in [0, workers_for(n, num_threads, block)) identifies the
// thread, so that callers can give each thread its own scratch space.
template <class Fn>
void parallel_for_workers(std::size_t n, int num_threads, std::size_t block, Fn&& fn) {
  if (n == 0) return;
  block = std::max<std::size_t>(block, 1);
  const std::size_t blocks = (n + block - 1) / block;
  const unsigned threads = static_cast<unsigned>(std::min<std::size_t>(resolve_threads(num_threads), blocks));
  if (threads <= 1) {
    for (std::size_t i = 0; i < n; ++i) fn(i, 0u);
    return;
  }
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&](unsigned id) {
    while (!failed.load(std::memory_order_relaxed)) {
      const std::size_t b = next.fetch_add(1, std::memory_order_relaxed);
      if (b >= blocks) return;
      const std::size_t end = std::min(n, (b + 1) * block);
      try {
        for (std::size_t i = b * block; i < end; ++i) fn(i, id);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true);
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker, t);
  worker(0u);
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

inline unsigned workers_for(std::size_t n, int num_threads, std::size_t block) {
  block = std::max<std::size_t>(block, 1);
  return static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(resolve_threads(num_threads),
                                                                                (n + block - 1) / block)));
}

template <class Fn>
void parallel_for(std::size_t n, int num_threads, std::size_t block, Fn&& fn) {
  parallel_for_workers(n, num_threads, block, [&fn](std::size_t i, unsigned) { fn(i); });
}

}  // namespace certrag
