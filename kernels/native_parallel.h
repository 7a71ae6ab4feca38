// ParallelFor for the native XLA:CPU kernels (paged_attention/native.cc, packed_matmul/native.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace rlvr {

// Runs work(item, scratch) for item in [0, count) on the caller and up to pool.num_threads() - 1
// pool tasks, each taking items from a shared counter with a Scratch of its own reused across
// them; returns when all are done. The shared state is reference counted: a task that starts
// after the caller finished everything finds no work and exits.
template <typename Scratch, typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, F work) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto drain = [state, count, work]() {
    Scratch scratch;
    for (int64_t item; (item = state->next.fetch_add(1)) < count;) {
      work(item, scratch);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), count) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = drain;
    pool.Schedule(std::move(task));
  }
  drain();
  while (state->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace rlvr
