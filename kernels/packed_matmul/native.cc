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

// work(first, last) for runs of consecutive panels [first, last) of `panels`, two runs per thread,
// taken by the caller and XLA's intra-op threads (a run prefetches its next panel as it goes).
template <typename F>
void ForPanelRuns(ffi::ThreadPool& pool, int64_t panels, F work) {
  const int64_t items = std::min<int64_t>(panels, 2 * std::max<int64_t>(pool.num_threads(), 1));
  struct NoScratch {};
  rlvr::ParallelFor<NoScratch>(pool, items, [=](int64_t item, NoScratch&) {
    work(panels * item / items, panels * (item + 1) / items);
  });
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
  ForPanelRuns(pool, panels, [=](int64_t first, int64_t last) {
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

// exp(x), 16 at a time: Cephes' expf (Cody-Waite range reduction, a degree-6 polynomial, ~2 ulp),
// x clamped to [-87, 88] (the float range; the sigmoid below needs nothing wider).
inline v16 Exp(v16 x) {
  const v16 zero = {};
  x = x < zero + 88.0f ? x : zero + 88.0f;
  x = x > zero - 87.0f ? x : zero - 87.0f;
  const v16 shifted = x * 1.44269504088896341f + 12582912.0f;  // round(x / ln 2) in the low mantissa bits
  const v16 n = shifted - 12582912.0f;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  typedef int32_t v16i __attribute__((vector_size(64)));
  v16i bits;
  __builtin_memcpy(&bits, &shifted, sizeof(bits));
  bits = (bits - 0x4B400000 + 127) << 23;  // 2^n
  v16 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// y[M, I] = silu(x . W[:, :I]) * (x . W[:, I:]) (a SwiGLU MLP's hidden layer) from W [K, 2I] packed
// as above, I a multiple of 32: per 8-row block, gate panel p and up panel p + I/32 into two tiles
// on the stack, combined before they are stored. Why: XLA:CPU ran the elementwise silu(gate) * up
// of the fixed benchmark's decode at ~40 us per layer and step for 32 x 1024 values (6% of the
// decode call), a pass over the matmul's output that this does while it is in registers and L1.
ffi::Error PackedSwiglu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                        ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions();
  const auto wd = packed.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kCols || wd[1] != xd[1] || yd[0] != xd[0] ||
      yd[1] % kCols != 0 || wd[0] * kCols != 2 * yd[1]) {
    return ffi::Error::InvalidArgument(
        "rlvr_packed_swiglu: x [M, K], packed [2I/32, K, 32], y [M, I] with I a multiple of 32 expected");
  }
  const int64_t m = xd[0], k_size = xd[1], half = yd[1], gates = wd[0] / 2, blocks = (m + kRows - 1) / kRows;
  if (m == 0 || half == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* wp = packed.typed_data();
  float* yp = y->typed_data();
  ForPanelRuns(pool, gates, [=](int64_t first, int64_t last) {
    alignas(64) float gate[kRows * kCols], up[kRows * kCols];
    for (int64_t p = first; p < last; ++p) {
      const float* gate_panel = wp + p * k_size * kCols;
      const float* up_panel = wp + (p + gates) * k_size * kCols;
      for (int64_t r = 0; r < blocks; ++r) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r * kRows));
        const float* xr = xp + r * kRows * k_size;
        Tile(xr, k_size, gate_panel, gate, kCols, rows, kCols, r == 0 ? up_panel : nullptr);
        Tile(xr, k_size, up_panel, up, kCols, rows, kCols, r == 0 && p + 1 < last ? gate_panel + k_size * kCols : nullptr);
        for (int i = 0; i < rows; ++i) {
          for (int h = 0; h < kCols; h += 16) {
            const v16 a = *reinterpret_cast<const v16u*>(gate + i * kCols + h);
            const v16 b = *reinterpret_cast<const v16u*>(up + i * kCols + h);
            *reinterpret_cast<v16u*>(yp + (r * kRows + i) * half + p * kCols + h) = a / (1.0f + Exp(-a)) * b;
          }
        }
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlvrPackedSwiglu, PackedSwiglu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlvrPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
