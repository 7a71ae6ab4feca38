// Paged decode attention for XLA:CPU as an XLA FFI custom call (the "native" implementation).
//
// What: out[b, i, h, :] = softmax over the visible keys of row b of (q[b, i, h] . k) times v, the
// keys and values read where they lie in the page pool [L, N, P, KVH, D] through the row's page
// table; query i of Q sees positions <= lengths[b] - Q + i (and, with a sliding window W, > that - W),
// the keys read up to the table's R·P positions (lengths may go past it: the padded end of a
// prefill chunk, whose queries there are padding).
// Why: XLA:CPU runs the plain-jnp decode attention (gathers, products a few columns wide, a
// softmax along a short axis) far below the machine's FMA rate and memory bandwidth: 4-5 ms per
// layer and step at the realistic rollout shape, a third of the decode time.
// How: rows that share the start of their page lists (a group's prompt, kept once by the prefix
// cache) form a cluster; a cluster's queries are work items on XLA's intra-op threads (a decode's
// one query per row: the whole cluster; a prefill chunk's: slices of ~64 lanes, each reading only
// the keys its queries see, so the threads share a chunk and skip its causal upper half). Its query rows sit
// along the lanes of 8-float vectors (per kv head), so scoring a page is, per key token and
// channel, one broadcast key value times a vector of queries (no horizontal sums, no transpose of
// the keys), and the weighted values likewise. Per page index, the rows holding the same page are
// one pass (a shared prompt page is read once for all of them, every kv head while it is in
// cache); per pass an online softmax (running max, exp-sum, weighted values) per lane. Float32
// softmax and accumulation; pages may be float32, bfloat16, or bfloat16 stored as uint16 bits
// (rlvr.kernels.bits). A row alone with at most 4 queries per kv head (lanes the cluster layout
// would mostly leave empty: 2 of 8 with a 4:2 GQA model) runs AttendRow instead, its products
// along the head dimension, pages outer and kv heads inner with the next page prefetched (at the
// fixed benchmark's 32 unshared rows: 1.4x the first version's, which went head by head, one
// multiply-add chain per query).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "native_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMask = -0.7f * 3.4028234663852886e38f;  // reference.py's MASK_VALUE

using namespace rlvr;  // v8, Splat, Max, ExpNonPositive, ParallelFor (native_parallel.h)

inline float Load(const float* p) { return *p; }
inline float Load(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;  // bfloat16 bits -> float32
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

struct Shape {
  int64_t batch, queries, heads, dim, layers, pages, page_size, kv_heads, table_width;
};

struct Options {
  int64_t sliding_window;
  float softcap, scale;
};

// Cache lines of the next pass's pages requested a few at a time between the products: a whole
// page's worth at once fills the core's miss buffers and stalls the products behind it.
struct Prefetcher {
  const char* at[2] = {nullptr, nullptr};
  const char* end[2] = {nullptr, nullptr};
  void Reset(const void* k, const void* v, int64_t bytes) {
    at[0] = static_cast<const char*>(k), end[0] = at[0] + bytes;
    at[1] = static_cast<const char*>(v), end[1] = at[1] + bytes;
  }
  void Step(int lines) {
    for (int i = 0; i < 2 && lines > 0; ++i) {
      for (; at[i] < end[i] && lines > 0; at[i] += 64, --lines) __builtin_prefetch(at[i]);
    }
  }
};
constexpr int kPrefetchLines = 8;  // per tile of products (4-16 measured alike; 0 or 32: 1.4-1.6x slower)

constexpr int kTile = 8;  // independent accumulators per loop (hides the multiply-add latency)

// score[t, b] = sum_c key[t, c] * query[c, b] for the page's `tokens` keys (rows `stride` apart)
// and blocks [lo, hi): kTile tokens at a time, their sums in registers.
template <typename T>
void Scores(const T* key, int64_t stride, int64_t tokens, int64_t d, const v8* query, int64_t blocks, int64_t lo,
            int64_t hi, v8* score, Prefetcher& ahead) {
  int64_t t0 = 0;
  for (; t0 + kTile <= tokens; t0 += kTile) {
    for (int64_t b = lo; b < hi; ++b) {
      v8 sum[kTile] = {};
      for (int64_t c = 0; c < d; ++c) {
        const v8 qc = query[c * blocks + b];
        for (int u = 0; u < kTile; ++u) sum[u] += Splat(Load(key + (t0 + u) * stride + c)) * qc;
      }
      for (int u = 0; u < kTile; ++u) score[(t0 + u) * blocks + b] = sum[u];
      ahead.Step(kPrefetchLines);
    }
  }
  for (; t0 < tokens; ++t0) {
    for (int64_t b = lo; b < hi; ++b) {
      v8 sum = {};
      for (int64_t c = 0; c < d; ++c) sum += Splat(Load(key + t0 * stride + c)) * query[c * blocks + b];
      score[t0 * blocks + b] = sum;
    }
  }
}

// acc[c, b] += sum_t value[t, c] * weight[t, b]: kTile channels at a time, their sums in registers.
template <typename T>
void Values(const T* value, int64_t stride, int64_t tokens, int64_t d, const v8* weight, int64_t blocks, int64_t lo,
            int64_t hi, v8* acc, Prefetcher& ahead) {
  for (int64_t b = lo; b < hi; ++b) {
    int64_t c0 = 0;
    for (; c0 + kTile <= d; c0 += kTile) {
      v8 sum[kTile];
      for (int u = 0; u < kTile; ++u) sum[u] = acc[(c0 + u) * blocks + b];
      for (int64_t t = 0; t < tokens; ++t) {
        const v8 w = weight[t * blocks + b];
        for (int u = 0; u < kTile; ++u) sum[u] += Splat(Load(value + t * stride + c0 + u)) * w;
      }
      for (int u = 0; u < kTile; ++u) acc[(c0 + u) * blocks + b] = sum[u];
      ahead.Step(kPrefetchLines);
    }
    for (; c0 < d; ++c0) {
      v8 sum = acc[c0 * blocks + b];
      for (int64_t t = 0; t < tokens; ++t) sum += Splat(Load(value + t * stride + c0)) * weight[t * blocks + b];
      acc[c0 * blocks + b] = sum;
    }
  }
}

// Rows attended together: rows that share at least a quarter of the shorter one's pages from the
// start (a group's prompt, kept once by the prefix cache: a shared system prompt alone is not
// enough), at most kMaxCluster of them; every other row alone. Idle rows are left out. The rows
// are sorted by their page lists, so rows sharing a prefix are neighbours.
constexpr int64_t kMaxCluster = 16;
// Query lanes per work item (rows x queries x GQA group; see Attend): 8 vectors per kv head.
constexpr int64_t kItemLanes = 64;

std::vector<std::vector<int64_t>> Clusters(const Shape& s, const int32_t* table, const int32_t* lengths) {
  auto held = [&](int64_t b) {
    return std::min<int64_t>((static_cast<int64_t>(lengths[b]) + s.page_size - 1) / s.page_size, s.table_width);
  };
  auto pages = [&](int64_t b) { return table + b * s.table_width; };
  std::vector<int64_t> order;
  for (int64_t b = 0; b < s.batch; ++b) {
    if (lengths[b] > 0) order.push_back(b);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(pages(a), pages(a) + held(a), pages(b), pages(b) + held(b));
  });
  std::vector<std::vector<int64_t>> clusters;
  for (int64_t b : order) {
    bool join = !clusters.empty() && static_cast<int64_t>(clusters.back().size()) < kMaxCluster;
    if (join) {
      const int64_t first = clusters.back().front(), shorter = std::min(held(first), held(b));
      const int64_t common = std::mismatch(pages(first), pages(first) + shorter, pages(b)).first - pages(first);
      join = 4 * common >= shorter;
    }
    if (!join) clusters.emplace_back();
    clusters.back().push_back(b);
  }
  auto work = [&](const std::vector<int64_t>& rows) {
    int64_t sum = 0;
    for (int64_t b : rows) sum += lengths[b];
    return sum;
  };
  // The largest first: threads that take the next cluster as they finish end close together.
  std::stable_sort(clusters.begin(), clusters.end(), [&](const auto& a, const auto& b) { return work(a) > work(b); });
  return clusters;
}

// One cluster of rows: per kv head h, the cluster's query rows that read it (row m, query i, head
// j of h's group: lane (m * Q + i) * G + j) in `blocks` blocks of 8 lanes (block h * blocks + b of
// the state), the scores and the weighted values kept with query rows along the vector lanes, so
// no product needs a horizontal sum. Per page index, the rows holding the same page are scored
// against its keys once (lanes of the others masked): a shared prompt page is read once for the
// whole cluster, and all its kv heads while it is in cache.
template <typename T>
void AttendCluster(const Shape& s, const Options& o, const float* q, const T* k_pool, const T* v_pool,
                   const int32_t* table, const int32_t* lengths, int32_t layer, const std::vector<int64_t>& rows,
                   int64_t q_lo, int64_t q_hi, float* out, std::vector<v8>& scratch) {
  const int64_t g = s.heads / s.kv_heads, nq = s.queries, d = s.dim, p = s.page_size, m = rows.size();
  const int64_t count = q_hi - q_lo;  // the queries [q_lo, q_hi) of each row
  const int64_t lanes = m * count * g, blocks = (lanes + kLanes - 1) / kLanes, all = s.kv_heads * blocks;
  scratch.assign(all * (2 * d + p + 2) + 3 * blocks, Splat(0.0f));
  v8* query = scratch.data();          // [D, all]: query rows transposed, scaled
  v8* acc = query + d * all;           // [D, all]: their weighted values, transposed
  v8* score = acc + d * all;           // [P, all]
  v8* peak = score + p * all;          // [all]
  v8* total = peak + all;              // [all]
  v8* lo = total + all;                // [blocks] first visible position (as float: exact below 2^24)
  v8* hi = lo + blocks;                // [blocks] one past the last
  v8* holds = hi + blocks;             // [blocks] 1 where the lane's row holds the page being read
  std::vector<int64_t> length(m), reach(m);  // one past the row's last query; the keys its queries see
  int64_t last = 0, first = INT64_MAX;
  for (int64_t r = 0; r < m; ++r) {
    length[r] = lengths[rows[r]];
    reach[r] = std::clamp<int64_t>(length[r] - nq + q_hi, 0, s.table_width * p);
    last = std::max(last, reach[r]);
    for (int64_t i = q_lo; i < q_hi; ++i) {
      const int64_t top = length[r] - nq + i + 1;
      const int64_t bottom = o.sliding_window > 0 ? std::max<int64_t>(0, top - o.sliding_window) : 0;
      first = std::min(first, bottom);
      for (int64_t j = 0; j < g; ++j) {
        const int64_t lane = (r * count + i - q_lo) * g + j;
        for (int64_t h = 0; h < s.kv_heads; ++h) {
          const float* src = q + ((rows[r] * nq + i) * s.heads + h * g + j) * d;
          for (int64_t c = 0; c < d; ++c) query[c * all + h * blocks + lane / kLanes][lane % kLanes] = src[c] * o.scale;
        }
        lo[lane / kLanes][lane % kLanes] = static_cast<float>(bottom);
        hi[lane / kLanes][lane % kLanes] = static_cast<float>(top);
      }
    }
  }
  for (int64_t b = 0; b < all; ++b) peak[b] = Splat(kMask);
  for (int64_t lane = lanes; lane < blocks * kLanes; ++lane) hi[blocks - 1][lane % kLanes] = -1.0f;  // no query row
  const int64_t token_stride = s.kv_heads * d, page_stride = p * token_stride;
  const T* k_layer = k_pool + layer * s.pages * page_stride;
  const T* v_layer = v_pool + layer * s.pages * page_stride;
  const int64_t lane_rows = count * g;  // lanes per row
  // The passes, in order: per page index, one per distinct page among the rows holding that index
  // (its rows as a bit mask), so that the pages of the passes ahead can be prefetched.
  struct Pass {
    int64_t page_index, page;
    uint32_t rows;
  };
  std::vector<Pass> passes;
  for (int64_t page_index = first / p; page_index * p < last; ++page_index) {
    uint32_t left = 0;
    for (int64_t r = 0; r < m; ++r) left |= (reach[r] > page_index * p ? 1u : 0u) << r;
    while (left) {
      const int32_t page_id = table[rows[__builtin_ctz(left)] * s.table_width + page_index];
      uint32_t holders = 0;
      for (uint32_t bits = left; bits; bits &= bits - 1) {
        const int64_t r = __builtin_ctz(bits);
        if (table[rows[r] * s.table_width + page_index] == page_id) holders |= 1u << r;
      }
      passes.push_back({page_index, std::clamp<int64_t>(page_id, 0, s.pages - 1), holders});
      left &= ~holders;
    }
  }
  const int64_t page_bytes = page_stride * static_cast<int64_t>(sizeof(T));
  Prefetcher ahead;
  if (!passes.empty()) {
    ahead.Reset(k_layer + passes[0].page * page_stride, v_layer + passes[0].page * page_stride, page_bytes);
    ahead.Step(1 << 30);
  }
  for (size_t i = 0; i < passes.size(); ++i) {
    const Pass& pass = passes[i];
    if (i + 1 < passes.size()) {
      ahead.Step(1 << 30);  // what is left of this pass's pages
      ahead.Reset(k_layer + passes[i + 1].page * page_stride, v_layer + passes[i + 1].page * page_stride, page_bytes);
    }
    const int64_t start = pass.page_index * p;
    int64_t block_lo = blocks, block_hi = 0;  // the blocks holding the lanes of the pass's rows
    for (int64_t b = 0; b < blocks; ++b) holds[b] = Splat(0.0f);
    for (uint32_t bits = pass.rows; bits; bits &= bits - 1) {
      const int64_t r = __builtin_ctz(bits);
      for (int64_t lane = r * lane_rows; lane < (r + 1) * lane_rows; ++lane) holds[lane / kLanes][lane % kLanes] = 1.0f;
      block_lo = std::min(block_lo, r * lane_rows / kLanes);
      block_hi = std::max(block_hi, ((r + 1) * lane_rows - 1) / kLanes + 1);
    }
    const T* k_page = k_layer + pass.page * page_stride;
    const T* v_page = v_layer + pass.page * page_stride;
    const int64_t tokens = std::min<int64_t>(p, last - start);
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t lo_block = h * blocks + block_lo, hi_block = h * blocks + block_hi;
      Scores(k_page + h * d, token_stride, tokens, d, query, all, lo_block, hi_block, score, ahead);
      for (int64_t b = lo_block; b < hi_block; ++b) {  // mask, online softmax
        const int64_t lane_block = b - h * blocks;
        v8 page_peak = Splat(kMask);
        for (int64_t t = 0; t < tokens; ++t) {
          v8 x = score[t * all + b];
          if (o.softcap > 0.0f) {
            for (int l = 0; l < kLanes; ++l) x[l] = o.softcap * std::tanh(x[l] / o.softcap);
          }
          const v8 pos = Splat(static_cast<float>(start + t));
          x = (pos >= lo[lane_block]) & (pos < hi[lane_block]) & (holds[lane_block] > Splat(0.0f)) ? x : Splat(kMask);
          score[t * all + b] = x;
          page_peak = Max(page_peak, x);
        }
        const v8 new_peak = Max(peak[b], page_peak);
        const v8 correction = ExpNonPositive(peak[b] - new_peak);
        peak[b] = new_peak;
        v8 sum = Splat(0.0f);
        for (int64_t t = 0; t < tokens; ++t) {
          const v8 x = score[t * all + b];
          const v8 w = x == Splat(kMask) ? Splat(0.0f) : ExpNonPositive(x - new_peak);
          score[t * all + b] = w;
          sum += w;
        }
        total[b] = total[b] * correction + sum;
        for (int64_t c = 0; c < d; ++c) acc[c * all + b] *= correction;
      }
      Values(v_page + h * d, token_stride, tokens, d, score, all, lo_block, hi_block, acc, ahead);
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = q_lo; i < q_hi; ++i) {
      for (int64_t j = 0; j < g; ++j) {
        const int64_t lane = (r * count + i - q_lo) * g + j, l = lane % kLanes;
        for (int64_t h = 0; h < s.kv_heads; ++h) {
          const int64_t b = h * blocks + lane / kLanes;
          float* dst = out + ((rows[r] * nq + i) * s.heads + h * g + j) * d;
          const float inverse = total[b][l] > 0.0f ? 1.0f / total[b][l] : 0.0f;
          for (int64_t c = 0; c < d; ++c) dst[c] = acc[c * all + b][l] * inverse;
        }
      }
    }
  }
}

inline v8 LoadVector(const float* p) {
  v8 out;
  std::memcpy(&out, p, sizeof(out));
  return out;
}
inline v8 LoadVector(const uint16_t* p) {  // 8 bfloat16 bits -> float32
  typedef uint16_t v8u16 __attribute__((vector_size(16)));
  v8u16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  const v8i wide = __builtin_convertvector(bits, v8i) << 16;
  v8 out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}
inline float Sum(v8 x) {
  typedef float v4 __attribute__((vector_size(16)));
  v4 half = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
  half += __builtin_shufflevector(half, half, 2, 3, 0, 1);
  half += __builtin_shufflevector(half, half, 1, 0, 3, 2);
  return half[0];
}

// Queries of one kv head per row that AttendRow takes (lanes AttendCluster would leave empty).
constexpr int64_t kRowQueries = 4;

// The sums of 8 vectors' lanes, as one vector (lane u: x[u]'s sum): three levels of pairwise
// shuffles and adds (14 shuffles for 8 sums, not 8 separate horizontal sums).
inline v8 Sums8(const v8* x) {
  v8 pair[4], quad[2];
  for (int i = 0; i < 4; ++i) {
    pair[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
              __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {
    quad[i] = __builtin_shufflevector(pair[2 * i], pair[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
              __builtin_shufflevector(pair[2 * i], pair[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
  }
  return __builtin_shufflevector(quad[0], quad[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(quad[0], quad[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

inline float Peak(v8 x) {
  float m = x[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, x[l]);
  return m;
}

// The raw scores of 8 key rows (`keys[u]`, d = 8 * dv channels) against M queries [M][dv]: per
// channel block a key vector is loaded once for the M queries, 8 * M independent sums in flight.
template <int M, typename T>
inline void ScoreKeys(const T* const* keys, int64_t dv, const v8* query, v8* out) {
  v8 sum[M][kLanes] = {};
  for (int64_t c = 0; c < dv; ++c) {
    for (int u = 0; u < kLanes; ++u) {
      const v8 key = LoadVector(keys[u] + c * kLanes);
      for (int m = 0; m < M; ++m) sum[m][u] += key * query[m * dv + c];
    }
  }
  for (int m = 0; m < M; ++m) out[m] = Sums8(sum[m]);
}

// acc[m][c0 + u] += sum_t weight[m][t] * value[t][c0 + u] for K channel blocks from c0 and M
// queries: K * M sums held in registers across the page's tokens.
template <int M, int K, typename T>
inline void WeighValues(const T* value, int64_t stride, int64_t tokens, int64_t c0, int64_t dv, const float* weight,
                        int64_t width, v8* acc) {
  v8 sum[M][K];
  for (int m = 0; m < M; ++m) {
    for (int u = 0; u < K; ++u) sum[m][u] = acc[m * dv + c0 + u];
  }
  for (int64_t t = 0; t < tokens; ++t) {
    v8 w[M];
    for (int m = 0; m < M; ++m) w[m] = Splat(weight[m * width + t]);
    for (int u = 0; u < K; ++u) {
      const v8 v = LoadVector(value + t * stride + (c0 + u) * kLanes);
      for (int m = 0; m < M; ++m) sum[m][u] += w[m] * v;
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int u = 0; u < K; ++u) acc[m * dv + c0 + u] = sum[m][u];
  }
}

template <int M, typename T>
inline void WeighAllValues(const T* value, int64_t stride, int64_t tokens, int64_t dv, const float* weight,
                           int64_t width, v8* acc) {
  int64_t c0 = 0;
  for (; c0 + kLanes <= dv; c0 += kLanes) WeighValues<M, kLanes>(value, stride, tokens, c0, dv, weight, width, acc);
  for (; c0 < dv; ++c0) WeighValues<M, 1>(value, stride, tokens, c0, dv, weight, width, acc);
}

// A row alone (a cluster of one) whose N queries per kv head are at most kRowQueries:
// AttendCluster would fill at most half of each vector's lanes, so here the products run along the
// head dimension instead, 8 channels per vector. Scores: 8 keys at a time, each key vector loaded
// once for (at most 2 of) the head's queries, their sums reduced together (`Sums8`); weighted
// values: per token, every query's weight times the value vectors, the sums in registers. So
// neither product waits on one multiply-add chain (the first version's, one chain per query).
// Pages outer, kv heads inner: a page's keys and values are read once, in address order, while
// the next page's are prefetched a few lines per block of products. Same masks, softcap and
// online softmax per page as AttendCluster.
template <int N, typename T>
void AttendRowPages(const Shape& s, const Options& o, const float* q, const T* k_layer, const T* v_layer,
                    const int32_t* table, int64_t row, int64_t length, int64_t end, float* out, v8* scratch) {
  const int64_t kvh = s.kv_heads, g = s.heads / kvh, nq = s.queries, d = s.dim, p = s.page_size, dv = d / kLanes;
  const int64_t token_stride = kvh * d, page_stride = p * token_stride;
  const int64_t blocks = (p + kLanes - 1) / kLanes, width = blocks * kLanes;  // a query's scores per page
  v8* query = scratch;               // [KVH][N][dv], scaled
  v8* acc = query + kvh * N * dv;    // [KVH][N][dv]
  v8* score = acc + kvh * N * dv;    // [N][blocks], one head at a time
  float* peak = reinterpret_cast<float*>(score + N * blocks);  // [KVH][N]
  float* total = peak + kvh * N;                                // [KVH][N]
  int64_t bottom[N], top[N], first = length;
  for (int qi = 0; qi < N; ++qi) {
    top[qi] = length - nq + qi / g + 1;
    bottom[qi] = o.sliding_window > 0 ? std::max<int64_t>(0, top[qi] - o.sliding_window) : 0;
    first = std::min(first, bottom[qi]);
  }
  for (int64_t h = 0; h < kvh; ++h) {
    for (int qi = 0; qi < N; ++qi) {
      const float* src = q + ((row * nq + qi / g) * s.heads + h * g + qi % g) * d;
      v8* dst = query + (h * N + qi) * dv;
      for (int64_t c = 0; c < dv; ++c) {
        acc[(h * N + qi) * dv + c] = Splat(0.0f);
        dst[c] = LoadVector(src + c * kLanes) * Splat(o.scale);
      }
      peak[h * N + qi] = kMask, total[h * N + qi] = 0.0f;
    }
  }
  const v8i lane = v8i{0, 1, 2, 3, 4, 5, 6, 7};
  const int64_t page_bytes = page_stride * static_cast<int64_t>(sizeof(T));
  const int64_t stops = kvh * (blocks + (N + 1) / 2);  // prefetch points per page
  const int lines = static_cast<int>((2 * page_bytes / 64 + stops - 1) / stops);
  Prefetcher ahead;
  for (int64_t start = first / p * p; start < end; start += p) {
    const int64_t page = std::clamp<int64_t>(table[row * s.table_width + start / p], 0, s.pages - 1);
    const int64_t tokens = std::min<int64_t>(p, end - start);
    if (start + p < end) {
      const int64_t next = std::clamp<int64_t>(table[row * s.table_width + start / p + 1], 0, s.pages - 1);
      ahead.Reset(k_layer + next * page_stride, v_layer + next * page_stride, page_bytes);
    } else {
      ahead.Reset(nullptr, nullptr, 0);
    }
    for (int64_t h = 0; h < kvh; ++h) {
      const T* k_page = k_layer + page * page_stride + h * d;
      const T* v_page = v_layer + page * page_stride + h * d;
      const v8* head_query = query + h * N * dv;
      v8* head_acc = acc + h * N * dv;
      for (int64_t b = 0; b < blocks; ++b) {  // scores, 8 tokens at a time (a short block repeats its last key)
        const int64_t t0 = b * kLanes;
        if (t0 >= tokens) {
          for (int qi = 0; qi < N; ++qi) score[qi * blocks + b] = Splat(kMask);
          continue;
        }
        const T* keys[kLanes];
        for (int u = 0; u < kLanes; ++u) keys[u] = k_page + std::min<int64_t>(t0 + u, tokens - 1) * token_stride;
        v8 raw[N];
        int qi = 0;
        for (; qi + 2 <= N; qi += 2) ScoreKeys<2>(keys, dv, head_query + qi * dv, raw + qi);
        if (qi < N) ScoreKeys<1>(keys, dv, head_query + qi * dv, raw + qi);
        ahead.Step(lines);
        const v8i position = SplatInt(static_cast<int32_t>(start + t0)) + lane;
        for (qi = 0; qi < N; ++qi) {
          v8 x = raw[qi];
          if (o.softcap > 0.0f) {
            for (int l = 0; l < kLanes; ++l) x[l] = o.softcap * std::tanh(x[l] / o.softcap);
          }
          const v8i seen = (position >= SplatInt(static_cast<int32_t>(bottom[qi]))) &
                           (position < SplatInt(static_cast<int32_t>(top[qi]))) &
                           (lane < SplatInt(static_cast<int32_t>(tokens - t0)));
          score[qi * blocks + b] = seen ? x : Splat(kMask);
        }
      }
      for (int qi = 0; qi < N; ++qi) {  // online softmax: the page's weights replace its scores
        v8* x = score + qi * blocks;
        float& running = peak[h * N + qi];
        v8 top_scores = x[0];
        for (int64_t b = 1; b < blocks; ++b) top_scores = Max(top_scores, x[b]);
        const float page_peak = Peak(top_scores);
        if (page_peak == kMask) {  // nothing visible here: weights 0
          for (int64_t b = 0; b < blocks; ++b) x[b] = Splat(0.0f);
          continue;
        }
        const float new_peak = std::max(running, page_peak);
        const float correction = ExpNonPositive(Splat(running - new_peak))[0];
        running = new_peak;
        v8 sum = Splat(0.0f);
        for (int64_t b = 0; b < blocks; ++b) {
          x[b] = x[b] == Splat(kMask) ? Splat(0.0f) : ExpNonPositive(x[b] - Splat(new_peak));
          sum += x[b];
        }
        total[h * N + qi] = total[h * N + qi] * correction + Sum(sum);
        for (int64_t c = 0; c < dv; ++c) head_acc[qi * dv + c] *= Splat(correction);
      }
      const float* weight = reinterpret_cast<const float*>(score);
      int qi = 0;
      for (; qi + 2 <= N; qi += 2) {
        WeighAllValues<2>(v_page, token_stride, tokens, dv, weight + qi * width, width, head_acc + qi * dv);
        ahead.Step(lines);
      }
      if (qi < N) {
        WeighAllValues<1>(v_page, token_stride, tokens, dv, weight + qi * width, width, head_acc + qi * dv);
        ahead.Step(lines);
      }
    }
    ahead.Step(1 << 30);  // what is left of the next page
  }
  for (int64_t h = 0; h < kvh; ++h) {
    for (int qi = 0; qi < N; ++qi) {
      float* dst = out + ((row * nq + qi / g) * s.heads + h * g + qi % g) * d;
      const float inverse = total[h * N + qi] > 0.0f ? 1.0f / total[h * N + qi] : 0.0f;
      for (int64_t c = 0; c < dv; ++c) {
        const v8 x = acc[(h * N + qi) * dv + c] * Splat(inverse);
        std::memcpy(dst + c * kLanes, &x, sizeof(x));
      }
    }
  }
}

template <typename T>
void AttendRow(const Shape& s, const Options& o, const float* q, const T* k_pool, const T* v_pool,
               const int32_t* table, const int32_t* lengths, int32_t layer, int64_t row, float* out,
               std::vector<v8>& scratch) {
  const int64_t n = s.queries * (s.heads / s.kv_heads), dv = s.dim / kLanes, blocks = (s.page_size + kLanes - 1) / kLanes;
  const int64_t page_stride = s.page_size * s.kv_heads * s.dim;
  scratch.resize(2 * s.kv_heads * n * dv + n * blocks + (2 * s.kv_heads * n + kLanes - 1) / kLanes);
  const int64_t length = lengths[row], end = std::min<int64_t>(length, s.table_width * s.page_size);
  const T* k_layer = k_pool + layer * s.pages * page_stride;
  const T* v_layer = v_pool + layer * s.pages * page_stride;
  switch (n) {
    case 1: AttendRowPages<1>(s, o, q, k_layer, v_layer, table, row, length, end, out, scratch.data()); break;
    case 2: AttendRowPages<2>(s, o, q, k_layer, v_layer, table, row, length, end, out, scratch.data()); break;
    case 3: AttendRowPages<3>(s, o, q, k_layer, v_layer, table, row, length, end, out, scratch.data()); break;
    default: AttendRowPages<4>(s, o, q, k_layer, v_layer, table, row, length, end, out, scratch.data()); break;
  }
}

template <typename T>
ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                  ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> layer,
                  const Options& options, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  Shape s{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], kd[3], page_table.dimensions()[1]};
  const int32_t layer_id = std::clamp<int32_t>(layer.typed_data()[0], 0, static_cast<int32_t>(s.layers - 1));
  const float* qp = q.typed_data();
  const T* kp = reinterpret_cast<const T*>(k_pages.untyped_data());
  const T* vp = reinterpret_cast<const T*>(v_pages.untyped_data());
  const int32_t* table = page_table.typed_data();
  const int32_t* lens = lengths.typed_data();
  float* op = out->typed_data();
  std::fill(op, op + s.batch * s.queries * s.heads * s.dim, 0.0f);  // idle rows: zeros
  const auto clusters = Clusters(s, table, lens);
  // Work items: a cluster's queries in slices of about kItemLanes lanes (a decode's one query per
  // row: the whole cluster; a prefill chunk's many: slices that the threads share, each reading
  // only the keys its queries see).
  struct Item {
    const std::vector<int64_t>* rows;
    int64_t q_lo, q_hi;
  };
  std::vector<Item> items;
  for (const auto& rows : clusters) {
    const int64_t per_query = static_cast<int64_t>(rows.size()) * (s.heads / s.kv_heads);
    const int64_t slice = std::max<int64_t>(1, kItemLanes / per_query);
    for (int64_t lo = s.queries; lo > 0; lo -= slice) items.push_back({&rows, std::max<int64_t>(lo - slice, 0), lo});
  }
  rlvr::ParallelFor<std::vector<v8>>(pool, static_cast<int64_t>(items.size()),
                                    [=, &items](int64_t index, std::vector<v8>& scratch) {
    const Item& item = items[index];
    const auto& rows = *item.rows;
    if (rows.size() == 1 && s.queries * (s.heads / s.kv_heads) <= kRowQueries && s.dim % kLanes == 0) {
      AttendRow<T>(s, options, qp, kp, vp, table, lens, layer_id, rows[0], op, scratch);
    } else {
      AttendCluster<T>(s, options, qp, kp, vp, table, lens, layer_id, rows, item.q_lo, item.q_hi, op, scratch);
    }
  });
  return ffi::Error::Success();
}

// Why the buffers cannot be attended (an empty string if they can): the shapes the kernel indexes
// by must agree, and the pool must hold a page to clamp page ids into (std::clamp of an empty range
// is undefined). Checked here, not only in Python: the FFI target can be called directly.
std::string InvalidInputs(ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k_pages, ffi::AnyBuffer& v_pages,
                          ffi::Buffer<ffi::S32>& page_table, ffi::Buffer<ffi::S32>& lengths,
                          ffi::Buffer<ffi::S32>& layer) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2) {
    return "q [B, Q, H, D], k_pages [L, N, P, KVH, D] and page_table [B, R] expected";
  }
  if (!(v_pages.dimensions() == kd)) return "v_pages must have k_pages' shape [L, N, P, KVH, D]";
  if (v_pages.element_type() != k_pages.element_type()) return "v_pages must have k_pages' dtype";
  if (kd[0] == 0) return "the pool has no layers (k_pages [L, N, P, KVH, D] with L = 0)";
  if (kd[1] == 0) return "the pool has no pages (k_pages [L, N, P, KVH, D] with N = 0)";
  if (kd[2] == 0) return "page size 0 (k_pages [L, N, P, KVH, D] with P = 0)";
  if (qd[3] != kd[4]) return "q's head dim D must be the pages' (q [B, Q, H, D], k_pages [L, N, P, KVH, D])";
  if (kd[3] == 0 || qd[2] % kd[3] != 0) return "q's heads H must be a multiple of the pages' kv heads KVH > 0";
  if (td[0] != qd[0]) return "page_table must have one row per query row (page_table [B, R], q [B, Q, H, D])";
  if (lengths.dimensions().size() != 1 || lengths.dimensions()[0] != qd[0]) return "lengths must be [B]";
  if (layer.element_count() != 1) return "layer must be one int32";
  return "";
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> lengths,
                          ffi::Buffer<ffi::S32> layer, int64_t sliding_window, float softcap, float scale,
                          ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const std::string invalid = InvalidInputs(q, k_pages, v_pages, page_table, lengths, layer);
  if (!invalid.empty()) return ffi::Error::InvalidArgument("rlvr_paged_attention: " + invalid);
  const Options options{sliding_window, softcap, scale};
  switch (k_pages.element_type()) {
    case ffi::F32:
      return Attend<float>(pool, q, k_pages, v_pages, page_table, lengths, layer, options, out);
    case ffi::BF16:
    case ffi::U16:
      return Attend<uint16_t>(pool, q, k_pages, v_pages, page_table, lengths, layer, options, out);
    default:
      return ffi::Error::InvalidArgument("rlvr_paged_attention: pages must be float32, bfloat16 or uint16 bits");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlvrPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("softcap")
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
