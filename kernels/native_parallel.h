// What the native XLA:CPU kernels share (paged_attention, packed_matmul, causal_attention): ParallelFor over
// XLA's intra-op threads, and 8-float vectors with an exp for the softmaxes.
#pragma once

#include <algorithm>
#include <cstring>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace rlvr {

typedef float v8 __attribute__((vector_size(32)));  // any ISA: GCC/Clang split what the CPU lacks
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int kLanes = 8;

inline v8 Splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline v8i SplatInt(int32_t x) { return v8i{x, x, x, x, x, x, x, x}; }
inline v8 Max(v8 a, v8 b) { return a > b ? a : b; }

// exp(x) for x <= 0 (the softmaxes' exponents), 8 at a time: Cody-Waite range reduction and a
// degree-6 polynomial (Cephes' expf), ~2 ulp; round-to-nearest by the 1.5 * 2^23 trick.
inline v8 ExpNonPositive(v8 x) {
  x = Max(x, Splat(-87.0f));
  const v8 shifted = x * Splat(1.44269504088896341f) + Splat(12582912.0f);
  const v8 n = shifted - Splat(12582912.0f);
  v8 r = x - n * Splat(0.693359375f);
  r = r - n * Splat(-2.12194440e-4f);
  v8 p = Splat(1.9875691500e-4f);
  p = p * r + Splat(1.3981999507e-3f);
  p = p * r + Splat(8.3334519073e-3f);
  p = p * r + Splat(4.1665795894e-2f);
  p = p * r + Splat(1.6666665459e-1f);
  p = p * r + Splat(5.0000001201e-1f);
  p = p * r * r + r + Splat(1.0f);
  v8i exponent;
  std::memcpy(&exponent, &shifted, sizeof(exponent));
  exponent = (exponent - SplatInt(0x4B400000) + SplatInt(127)) << 23;  // the integer n, as 2^n's bits
  v8 scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return p * scale;
}

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
