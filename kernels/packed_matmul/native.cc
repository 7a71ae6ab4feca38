// A float32 matmul with pre-packed weights for XLA:CPU, as an XLA FFI custom call.
//
// What: y[M, N] = x[M, K] . W, with W stored as column panels: packed[p, k, j] = W[k, 32 p + j]
// (zero past N), the layout `rlvr.kernels.packed_matmul.pack_weight` makes once per weight load.
// Why: inside the rollout engine's decode loop XLA:CPU's matmul packs ("transposes") each weight
// again at every step before multiplying, a pass over the weights that does no arithmetic and
// does not overlap it: the realistic shape's products ran at ~0.55-0.7 of the machine's FMA rate
// (the output projection, 64 rows x 512 x 32768, ~120 GFLOP/s against ~216 at 1024^3). Packed
// once, each panel is one contiguous stretch of memory that streams in while the previous is
// multiplied.
// How: a tile of 8 rows of x x 32 columns keeps its 16 vector accumulators in registers while k
// runs, each step one load of the panel's 32 weights and, per row, a broadcast x value times each
// half (x is read in place: packing it per call cost more than it saved at these sizes); the
// first row block of a panel prefetches the next panel. Work items are runs of consecutive
// panels, two per thread, taken from a shared counter by the caller and XLA's intra-op threads.

#include <algorithm>
#include <cstdint>

#include "native_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 8, kCols = 32;
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // loads and stores at any float address

// c[:rows, :cols] (row stride ldc) = x[:rows] (row stride k_size; rows past `rows` repeat the
// last, computed and not stored) . panel [K][32]; `next` (or null): prefetched.
void Tile(const float* x, int64_t k_size, const float* panel, float* c, int64_t ldc, int rows, int cols,
          const float* next) {
  const float* a[kRows];
  for (int i = 0; i < kRows; ++i) a[i] = x + std::min(i, rows - 1) * k_size;
  v16 lo[kRows] = {}, hi[kRows] = {};
  for (int64_t k = 0; k < k_size; ++k) {
    const v16 b0 = *reinterpret_cast<const v16u*>(panel + k * kCols);
    const v16 b1 = *reinterpret_cast<const v16u*>(panel + k * kCols + 16);
    if (next != nullptr) {
      __builtin_prefetch(next + k * kCols);
      __builtin_prefetch(next + k * kCols + 16);
    }
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      lo[i] += a[i][k] * b0;
      hi[i] += a[i][k] * b1;
    }
  }
  if (cols == kCols) {
    for (int i = 0; i < rows; ++i) {
      *reinterpret_cast<v16u*>(c + i * ldc) = lo[i];
      *reinterpret_cast<v16u*>(c + i * ldc + 16) = hi[i];
    }
    return;
  }
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) c[i * ldc + j] = j < 16 ? lo[i][j] : hi[i][j - 16];
  }
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                        ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions();
  const auto wd = packed.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kCols || wd[1] != xd[1] || yd[0] != xd[0] ||
      yd[1] > wd[0] * kCols || yd[1] <= (wd[0] - 1) * kCols) {
    return ffi::Error::InvalidArgument("rlvr_packed_matmul: x [M, K], packed [ceil(N/32), K, 32], y [M, N] expected");
  }
  const int64_t m = xd[0], k_size = xd[1], n = yd[1], panels = wd[0], blocks = (m + kRows - 1) / kRows;
  if (m == 0 || n == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* wp = packed.typed_data();
  float* yp = y->typed_data();
  // Runs of consecutive panels (the next one prefetched), two per thread.
  const int64_t items = std::min<int64_t>(panels, 2 * std::max<int64_t>(pool.num_threads(), 1));
  struct NoScratch {};
  rlvr::ParallelFor<NoScratch>(pool, items, [=](int64_t item, NoScratch&) {
    const int64_t first = panels * item / items, last = panels * (item + 1) / items;
    for (int64_t p = first; p < last; ++p) {
      const float* panel = wp + p * k_size * kCols;
      const int cols = static_cast<int>(std::min<int64_t>(kCols, n - p * kCols));
      for (int64_t r = 0; r < blocks; ++r) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r * kRows));
        Tile(xp + r * kRows * k_size, k_size, panel, yp + r * kRows * n + p * kCols, n, rows, cols,
             r == 0 && p + 1 < last ? panel + k_size * kCols : nullptr);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlvrPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
