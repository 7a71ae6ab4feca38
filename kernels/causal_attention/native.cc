// Causal attention of the training path for XLA:CPU as XLA FFI custom calls: forward and backward.
//
// What: out[b, i, h, :] = softmax_j(scale * q[b, i, h] . k[b, j, h/G]) v[b, j, h/G] over the keys
// j <= i that mask[b, i, j] allows (G = H / KVH query heads per kv head), and its log-sum-exp; the
// backward gives dq, dk, dv from the output's cotangent (FlashAttention-2's equations: the
// probabilities are recomputed from the saved log-sum-exp, never stored).
// Why: XLA:CPU runs the plain-jnp attention (`rlvr.models.layers.dot_product_attention`, cut into
// query blocks by `causal_attention`) as many small products plus masks, softmaxes, transposes and the
// pads that sum the key blocks' gradients: at the SFT benchmark's shape about a fifth of the train
// step's single-thread time, twice its FLOPs at the machine's multiply-add rate.
// How: one work item per (row, kv head) on XLA's intra-op threads; the item copies its keys and values
// into contiguous and transposed scratch once, then runs its G heads' queries six at a time: scores
// as one broadcast query value times a vector of 16 keys (no horizontal sums), only over the key tiles
// in which some query of the pass sees a key (a packed row's earlier documents and a shared prompt's
// sibling branches are skipped, as are the keys after the pass's last query),
// an exact masked softmax in float32 (masked keys weigh exactly 0), and the weighted values (forward)
// or the dk/dv sums (backward, kept in the item's scratch: each item owns its kv head's keys) with
// vectors along the head dimension. A query with no visible key (padding) gets a zero output,
// log-sum-exp -inf and zero gradients.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "native_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace rlvr;  // v8, Splat, Max, ExpNonPositive, ParallelFor (native_parallel.h)
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // an unaligned load or store
constexpr int kRows = 6;                  // queries per pass
constexpr int kKeys = 16;                 // keys per score tile (two vectors)
constexpr float kHidden = -3.0e38f;       // a masked score
constexpr float kVisible = -1.0e38f;      // scores above this are visible

inline v8 LoadU(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void StoreU(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }

struct Dims {
  int64_t batch, length, heads, kv_heads, dim;
  int64_t padded;  // length rounded up to kKeys: the transposed scratch's row stride
  const float *cos = nullptr, *sin = nullptr;  // RoPE tables [B, T, D] when q and k come unrotated
};

// y = (x * cos + rotate_half(x) * sin) * factor, HF's rotate-half RoPE of token (b, i); a copy without tables.
void Rope(const float* x, const Dims& s, int64_t b, int64_t i, float factor, float* y) {
  if (!s.cos) {
    for (int64_t d = 0; d < s.dim; ++d) y[d] = x[d] * factor;
    return;
  }
  const float *c = s.cos + (b * s.length + i) * s.dim, *n = s.sin + (b * s.length + i) * s.dim;
  const int64_t half = s.dim / 2;
  for (int64_t d = 0; d < half; ++d) y[d] = (x[d] * c[d] - x[d + half] * n[d]) * factor;
  for (int64_t d = half; d < s.dim; ++d) y[d] = (x[d] * c[d] + x[d - half] * n[d]) * factor;
}

// `Rope`'s transpose (the gradient of the unrotated input from the rotated one's), scaled by factor.
void RopeTranspose(const float* dy, const Dims& s, int64_t b, int64_t i, float factor, float* dx) {
  if (!s.cos) {
    for (int64_t d = 0; d < s.dim; ++d) dx[d] = dy[d] * factor;
    return;
  }
  const float *c = s.cos + (b * s.length + i) * s.dim, *n = s.sin + (b * s.length + i) * s.dim;
  const int64_t half = s.dim / 2;
  for (int64_t d = 0; d < half; ++d) dx[d] = (dy[d] * c[d] + dy[d + half] * n[d + half]) * factor;
  for (int64_t d = half; d < s.dim; ++d) dx[d] = (dy[d] * c[d] - dy[d - half] * n[d - half]) * factor;
}

struct Run {
  int64_t begin, end;  // keys [begin, end), multiples of kKeys
};

struct Scratch {
  std::vector<float> kt, vt, k, v, dk, dv, rows;
  std::vector<Run> runs;       // VisibleRuns of the current pass
  std::vector<int64_t> first;  // FirstVisible
};

// The item's keys (or values) of kv head `kh` in row `b` (rotated by RoPE when `rotate` and the tables
// are given): [length, dim] contiguous, and transposed [dim, padded] with zeros past `length`.
void Gather(const float* x, const Dims& s, int64_t b, int64_t kh, bool rotate, float* flat, float* transposed) {
  std::vector<float> row(s.dim);
  for (int64_t j = 0; j < s.length; ++j) {
    const float* src = x + ((b * s.length + j) * s.kv_heads + kh) * s.dim;
    if (rotate && s.cos) {
      Rope(src, s, b, j, 1.0f, row.data());
      src = row.data();
    }
    if (flat) std::memcpy(flat + j * s.dim, src, s.dim * sizeof(float));
    if (transposed) {
      for (int64_t d = 0; d < s.dim; ++d) transposed[d * s.padded + j] = src[d];
    }
  }
  if (transposed) {
    for (int64_t d = 0; d < s.dim; ++d) std::fill(transposed + d * s.padded + s.length, transposed + (d + 1) * s.padded, 0.0f);
  }
}

// out[r * padded + j] = sum_d a[r][d] * bt[d * padded + j] for r < kRows, begin <= j < keys (multiples of kKeys).
void Products(const float* const a[kRows], const float* bt, const Dims& s, int64_t begin, int64_t keys, float* out) {
  for (int64_t j = begin; j < keys; j += kKeys) {
    v8 lo[kRows] = {}, hi[kRows] = {};
    for (int64_t d = 0; d < s.dim; ++d) {
      const v8 b0 = LoadU(bt + d * s.padded + j), b1 = LoadU(bt + d * s.padded + j + kLanes);
      for (int r = 0; r < kRows; ++r) {
        const v8 x = Splat(a[r][d]);
        lo[r] += x * b0;
        hi[r] += x * b1;
      }
    }
    for (int r = 0; r < kRows; ++r) {
      StoreU(out + r * s.padded + j, lo[r]);
      StoreU(out + r * s.padded + j + kLanes, hi[r]);
    }
  }
}

// Scores of query i < length in [begin, keys) hidden where key j > i or the mask forbids it (the mask
// is read only up to i: in bounds); returns the row's maximum (kHidden when nothing is visible).
float Hide(float* score, const uint8_t* mask_row, int64_t i, int64_t begin, int64_t keys) {
  typedef uint8_t u8x8 __attribute__((vector_size(8)));
  const int64_t end = std::min(keys, i + 1);
  v8 top = Splat(kHidden);
  int64_t j = begin;
  for (; j + kLanes <= end; j += kLanes) {
    u8x8 bytes;
    std::memcpy(&bytes, mask_row + j, sizeof(bytes));
    const v8 kept = __builtin_convertvector(bytes, v8i) != 0 ? LoadU(score + j) : Splat(kHidden);
    StoreU(score + j, kept);
    top = Max(top, kept);
  }
  float row_top = kHidden;
  for (int l = 0; l < kLanes; ++l) row_top = std::max(row_top, top[l]);
  for (; j < end; ++j) {
    score[j] = mask_row[j] ? score[j] : kHidden;
    row_top = std::max(row_top, score[j]);
  }
  for (; j < keys; ++j) score[j] = kHidden;
  return row_top;
}

// The first j in [from, limit) with row[j] != 0 (limit when none): eight bytes at a time while all are zero.
int64_t FirstSet(const uint8_t* row, int64_t from, int64_t limit) {
  int64_t j = from;
  for (uint64_t word = 0; j + 8 <= limit; j += 8) {
    std::memcpy(&word, row + j, sizeof(word));
    if (word) break;
  }
  while (j < limit && !row[j]) ++j;
  return j;
}

// The first key each query of row b may see ([T]; i + 1 when it sees none): a pass of queries starts at
// its earliest one, so the keys of a packed row's earlier segments are skipped, never multiplied.
void FirstVisible(const uint8_t* mask, const Dims& s, int64_t b, std::vector<int64_t>& first) {
  first.resize(s.length);
  for (int64_t i = 0; i < s.length; ++i) first[i] = FirstSet(mask + (b * s.length + i) * s.length, 0, i + 1);
}

// The first key of the pass of queries i0 .. i0 + kRows - 1: their earliest visible one, rounded down to a tile.
int64_t PassBegin(const std::vector<int64_t>& first, int64_t i0, const Dims& s) {
  int64_t begin = first[i0];
  for (int r = 1; r < kRows && i0 + r < s.length; ++r) begin = std::min(begin, first[i0 + r]);
  return begin / kKeys * kKeys;
}

// Runs of 16-key tiles [begin, end) in [first, keys) (`first`: PassBegin) in which some query of the pass
// i0 .. i0 + kRows - 1 (of row b) sees a key: only they are multiplied, so a shared prompt's sibling
// branches are skipped too. The mask is read up to each query's own index: in bounds.
void VisibleRuns(const uint8_t* mask, const Dims& s, int64_t b, int64_t i0, int64_t first, int64_t keys,
                 std::vector<Run>& runs) {
  runs.clear();
  for (int64_t t0 = first; t0 < keys; t0 += kKeys) {
    bool needed = false;
    for (int r = 0; r < kRows && i0 + r < s.length && !needed; ++r) {
      const int64_t limit = std::min(t0 + kKeys, i0 + r + 1);
      needed = FirstSet(mask + (b * s.length + i0 + r) * s.length, t0, limit) < limit;
    }
    if (!needed) continue;
    if (!runs.empty() && runs.back().end == t0) {
      runs.back().end = t0 + kKeys;
    } else {
      runs.push_back({t0, t0 + kKeys});
    }
  }
}

// p[j] = exp(score[j] - shift) where visible, exactly 0 where hidden; returns the sum.
float Exponentiate(float* score, float shift, int64_t keys) {
  v8 total = {};
  for (int64_t j = 0; j < keys; j += kLanes) {
    const v8 x = LoadU(score + j);
    const v8 p = ExpNonPositive(x - Splat(shift));
    const v8 kept = x > Splat(kVisible) ? p : Splat(0.0f);
    StoreU(score + j, kept);
    total += kept;
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += total[l];
  return sum;
}

// acc[r * dim + d] += sum_j w[r * padded + j] * x[j * dim + d] for the kRows rows, begin <= j < keys: V
// vectors of the head dim at a time, the rows' sums in registers.
template <int V>
void WeightedChunk(const float* w, const float* x, const Dims& s, int64_t begin, int64_t keys, int64_t c,
                   float* acc) {
  v8 sum[kRows][V];
  for (int r = 0; r < kRows; ++r) {
    for (int u = 0; u < V; ++u) sum[r][u] = LoadU(acc + r * s.dim + c + u * kLanes);
  }
  for (int64_t j = begin; j < keys; ++j) {
    v8 xj[V];
    for (int u = 0; u < V; ++u) xj[u] = LoadU(x + j * s.dim + c + u * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const v8 wr = Splat(w[r * s.padded + j]);
      for (int u = 0; u < V; ++u) sum[r][u] += wr * xj[u];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int u = 0; u < V; ++u) StoreU(acc + r * s.dim + c + u * kLanes, sum[r][u]);
  }
}

void Weighted(const float* w, const float* x, const Dims& s, int64_t begin, int64_t keys, float* acc) {
  int64_t c = 0;
  for (; c + 2 * kLanes <= s.dim; c += 2 * kLanes) WeightedChunk<2>(w, x, s, begin, keys, c, acc);
  if (c < s.dim) WeightedChunk<1>(w, x, s, begin, keys, c, acc);
}

// acc[j * dim + d] += sum_r w[r * padded + j] * x[r * dim + d] for begin <= j < keys: V vectors of the head
// dim at a time, the rows' x in registers.
template <int V>
void OuterChunk(const float* w, const float* x, const Dims& s, int64_t begin, int64_t keys, int64_t c, float* acc) {
  v8 xr[kRows][V];
  for (int r = 0; r < kRows; ++r) {
    for (int u = 0; u < V; ++u) xr[r][u] = LoadU(x + r * s.dim + c + u * kLanes);
  }
  for (int64_t j = begin; j < keys; ++j) {
    v8 a[V];
    for (int u = 0; u < V; ++u) a[u] = LoadU(acc + j * s.dim + c + u * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const v8 wr = Splat(w[r * s.padded + j]);
      for (int u = 0; u < V; ++u) a[u] += wr * xr[r][u];
    }
    for (int u = 0; u < V; ++u) StoreU(acc + j * s.dim + c + u * kLanes, a[u]);
  }
}

void Outer(const float* w, const float* x, const Dims& s, int64_t begin, int64_t keys, float* acc) {
  int64_t c = 0;
  for (; c + 2 * kLanes <= s.dim; c += 2 * kLanes) OuterChunk<2>(w, x, s, begin, keys, c, acc);
  if (c < s.dim) OuterChunk<1>(w, x, s, begin, keys, c, acc);
}

inline int64_t KeysUpTo(int64_t last_query, const Dims& s) {
  return std::min<int64_t>((last_query / kKeys + 1) * kKeys, s.padded);
}

const float* Row(const float* x, const Dims& s, int64_t b, int64_t i, int64_t h) {
  return x + ((b * s.length + i) * s.heads + h) * s.dim;
}

void ForwardItem(const Dims& s, float scale, const float* q, const float* k, const float* v, const uint8_t* mask,
                 int64_t b, int64_t kh, float* out, float* lse, Scratch& w) {
  const int64_t groups = s.heads / s.kv_heads;
  w.kt.resize(s.dim * s.padded), w.v.resize(s.length * s.dim), w.rows.resize(kRows * s.padded + 2 * kRows * s.dim);
  Gather(k, s, b, kh, true, nullptr, w.kt.data());
  Gather(v, s, b, kh, false, w.v.data(), nullptr);
  FirstVisible(mask, s, b, w.first);
  float* scores = w.rows.data();
  float* scaled = scores + kRows * s.padded;
  float* outs = scaled + kRows * s.dim;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t h = kh * groups + g;
    for (int64_t i0 = 0; i0 < s.length; i0 += kRows) {
      const float* rows[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = std::min(i0 + r, s.length - 1);
        Rope(Row(q, s, b, i, h), s, b, i, scale, scaled + r * s.dim);
        rows[r] = scaled + r * s.dim;
      }
      VisibleRuns(mask, s, b, i0, PassBegin(w.first, i0, s), KeysUpTo(std::min(i0 + kRows - 1, s.length - 1), s),
                  w.runs);
      for (const Run& run : w.runs) Products(rows, w.kt.data(), s, run.begin, run.end, scores);
      float inverse[kRows] = {};
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = i0 + r;
        float* score = scores + r * s.padded;
        float top = kHidden;
        for (const Run& run : w.runs) {
          if (i >= s.length) break;  // past the row's end: no mask row, nothing visible
          top = std::max(top, Hide(score, mask + (b * s.length + i) * s.length, i, run.begin, run.end));
        }
        if (top <= kVisible) {  // nothing visible (a padding query) or past the end: zero weights
          for (const Run& run : w.runs) std::fill(score + run.begin, score + run.end, 0.0f);
          if (i < s.length) lse[(b * s.heads + h) * s.length + i] = -std::numeric_limits<float>::infinity();
          continue;
        }
        float total = 0.0f;
        for (const Run& run : w.runs) total += Exponentiate(score + run.begin, top, run.end - run.begin);
        inverse[r] = 1.0f / total;  // applied to the weighted values
        lse[(b * s.heads + h) * s.length + i] = top + std::log(total);
      }
      std::fill(outs, outs + kRows * s.dim, 0.0f);
      for (const Run& run : w.runs) Weighted(scores, w.v.data(), s, run.begin, std::min(run.end, s.length), outs);
      for (int r = 0; r < kRows && i0 + r < s.length; ++r) {
        float* o = out + ((b * s.length + i0 + r) * s.heads + h) * s.dim;
        for (int64_t d = 0; d < s.dim; ++d) o[d] = outs[r * s.dim + d] * inverse[r];
      }
    }
  }
}

void BackwardItem(const Dims& s, float scale, const float* q, const float* k, const float* v, const uint8_t* mask,
                  const float* out, const float* lse, const float* dout, int64_t b, int64_t kh, float* dq, float* dk,
                  float* dv, Scratch& w) {
  const int64_t groups = s.heads / s.kv_heads;
  w.kt.resize(s.dim * s.padded), w.vt.resize(s.dim * s.padded), w.k.resize(s.length * s.dim);
  w.dk.assign(s.padded * s.dim, 0.0f), w.dv.assign(s.padded * s.dim, 0.0f);
  w.rows.resize(2 * kRows * s.padded + 3 * kRows * s.dim);
  Gather(k, s, b, kh, true, w.k.data(), w.kt.data());
  Gather(v, s, b, kh, false, nullptr, w.vt.data());
  FirstVisible(mask, s, b, w.first);
  float* probs = w.rows.data();
  float* grads = probs + kRows * s.padded;
  float* scaled = grads + kRows * s.padded;
  float* douts = scaled + kRows * s.dim;
  float* dqs = douts + kRows * s.dim;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t h = kh * groups + g;
    for (int64_t i0 = 0; i0 < s.length; i0 += kRows) {
      const float *qrows[kRows], *drows[kRows];
      float delta[kRows];
      for (int r = 0; r < kRows; ++r) {
        const bool real = i0 + r < s.length;
        const int64_t i = std::min(i0 + r, s.length - 1);
        const float* dsrc = Row(dout, s, b, i, h);
        const float* osrc = Row(out, s, b, i, h);
        Rope(Row(q, s, b, i, h), s, b, i, scale, scaled + r * s.dim);
        float dot = 0.0f;
        for (int64_t d = 0; d < s.dim; ++d) {
          douts[r * s.dim + d] = real ? dsrc[d] : 0.0f;
          dot += douts[r * s.dim + d] * osrc[d];
        }
        delta[r] = dot;
        qrows[r] = scaled + r * s.dim, drows[r] = douts + r * s.dim;
      }
      VisibleRuns(mask, s, b, i0, PassBegin(w.first, i0, s), KeysUpTo(std::min(i0 + kRows - 1, s.length - 1), s),
                  w.runs);
      for (const Run& run : w.runs) {
        Products(qrows, w.kt.data(), s, run.begin, run.end, probs);
        Products(drows, w.vt.data(), s, run.begin, run.end, grads);
      }
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = i0 + r;
        float* p = probs + r * s.padded;
        float* ds = grads + r * s.padded;
        const float row_lse = i < s.length ? lse[(b * s.heads + h) * s.length + i] : -INFINITY;
        if (!(row_lse > -INFINITY)) {  // a padding query, or past the end: no gradient
          for (const Run& run : w.runs) {
            std::fill(p + run.begin, p + run.end, 0.0f), std::fill(ds + run.begin, ds + run.end, 0.0f);
          }
          continue;
        }
        for (const Run& run : w.runs) {
          Hide(p, mask + (b * s.length + i) * s.length, i, run.begin, run.end);
          Exponentiate(p + run.begin, row_lse, run.end - run.begin);
          for (int64_t j = run.begin; j < run.end; ++j) ds[j] = p[j] * (ds[j] - delta[r]);
        }
      }
      std::fill(dqs, dqs + kRows * s.dim, 0.0f);
      for (const Run& run : w.runs) Weighted(grads, w.k.data(), s, run.begin, std::min(run.end, s.length), dqs);
      for (int r = 0; r < kRows && i0 + r < s.length; ++r) {
        RopeTranspose(dqs + r * s.dim, s, b, i0 + r, scale, dq + ((b * s.length + i0 + r) * s.heads + h) * s.dim);
      }
      for (const Run& run : w.runs) {
        Outer(probs, douts, s, run.begin, run.end, w.dv.data());
        Outer(grads, scaled, s, run.begin, run.end, w.dk.data());  // scaled holds q * scale: dk = scale * ds^T q
      }
    }
  }
  for (int64_t j = 0; j < s.length; ++j) {
    RopeTranspose(w.dk.data() + j * s.dim, s, b, j, 1.0f, dk + ((b * s.length + j) * s.kv_heads + kh) * s.dim);
    std::memcpy(dv + ((b * s.length + j) * s.kv_heads + kh) * s.dim, w.dv.data() + j * s.dim, s.dim * sizeof(float));
  }
}

// Why the buffers cannot be attended ("" if they can). Checked here too: the target can be called directly.
std::string Invalid(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                    ffi::Buffer<ffi::U8>& mask) {
  const auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || md.size() != 3) return "q [B, T, H, D], k/v [B, T, KVH, D], mask [B, T, T] expected";
  if (!(v.dimensions() == kd)) return "v must have k's shape [B, T, KVH, D]";
  if (kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3]) return "k [B, T, KVH, D] must match q [B, T, H, D] in B, T and D";
  if (kd[2] == 0 || qd[2] % kd[2] != 0) return "q's heads H must be a multiple of k's kv heads KVH > 0";
  if (qd[3] % kLanes != 0) return "the head dim D must be a multiple of 8";
  if (md[0] != qd[0] || md[1] != qd[1] || md[2] != qd[1]) return "mask must be [B, T, T]";
  return "";
}

// The dims, with the RoPE tables when `rope` (then cos and sin must be [B, T, D], D even): `error` says
// what is wrong, else it is left empty.
Dims DimsOf(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& cos,
            ffi::Buffer<ffi::F32>& sin, bool rope, std::string& error) {
  const auto qd = q.dimensions();
  Dims s{qd[0], qd[1], qd[2], k.dimensions()[2], qd[3], (qd[1] + kKeys - 1) / kKeys * kKeys};
  if (!rope) return s;
  const auto cd = cos.dimensions();
  if (cd.size() != 3 || cd[0] != qd[0] || cd[1] != qd[1] || cd[2] != qd[3] || !(sin.dimensions() == cd)) {
    error = "cos and sin must be [B, T, D]";
  } else if (qd[3] % 2) {
    error = "RoPE needs an even head dim";
  }
  s.cos = cos.typed_data(), s.sin = sin.typed_data();
  return s;
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::U8> mask, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, float scale,
                   bool rope, ffi::Result<ffi::Buffer<ffi::F32>> out,
                   ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  std::string invalid = Invalid(q, k, v, mask);
  Dims s{};
  if (invalid.empty()) s = DimsOf(q, k, cos, sin, rope, invalid);
  if (!invalid.empty()) return ffi::Error::InvalidArgument("rlvr_causal_attention_fwd: " + invalid);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const uint8_t* mp = mask.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();
  rlvr::ParallelFor<Scratch>(pool, s.batch * s.kv_heads, [=](int64_t item, Scratch& w) {
    ForwardItem(s, scale, qp, kp, vp, mp, item / s.kv_heads, item % s.kv_heads, op, lp, w);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::U8> mask, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                    ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout, float scale,
                    bool rope, ffi::Result<ffi::Buffer<ffi::F32>> dq,
                    ffi::Result<ffi::Buffer<ffi::F32>> dk, ffi::Result<ffi::Buffer<ffi::F32>> dv) {
  std::string invalid = Invalid(q, k, v, mask);
  Dims s{};
  if (invalid.empty()) s = DimsOf(q, k, cos, sin, rope, invalid);
  if (!invalid.empty()) return ffi::Error::InvalidArgument("rlvr_causal_attention_bwd: " + invalid);
  if (!(out.dimensions() == q.dimensions()) || !(dout.dimensions() == q.dimensions())) {
    return ffi::Error::InvalidArgument("rlvr_causal_attention_bwd: out and dout must have q's shape");
  }
  if (static_cast<int64_t>(lse.element_count()) != s.batch * s.heads * s.length) {
    return ffi::Error::InvalidArgument("rlvr_causal_attention_bwd: lse must be [B, H, T]");
  }
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *op = out.typed_data();
  const float *lp = lse.typed_data(), *dop = dout.typed_data();
  const uint8_t* mp = mask.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  rlvr::ParallelFor<Scratch>(pool, s.batch * s.kv_heads, [=](int64_t item, Scratch& w) {
    BackwardItem(s, scale, qp, kp, vp, mp, op, lp, dop, item / s.kv_heads, item % s.kv_heads, dqp, dkp, dvp, w);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlvrCausalAttentionFwd, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("rope")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlvrCausalAttentionBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("rope")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
