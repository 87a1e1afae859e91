// Prefill attention: T queries over an L-token context in position order, query t seeing
// the keys at positions <= pos[t] (a prefill chunk: the last T positions; a reuse
// method's recomputed rows: any positions).
// Flash-style: keys in blocks of 128, a running max and sum per query row, no T x L
// score matrix and no mask tensor.
//
// Why: torch's CPU flash kernel skips masked blocks only for its own top-left causal
// mask, so a chunk after the first (or a prefix hit) needs a boolean mask, which costs a
// T x L `where` and computes every masked block; and its inner products run well below
// what two cores do. At 4096 tokens attention was ~2/3 of prefill.
//
// Exactness: a query row's result depends only on its own query and the keys it sees.
// Key blocks are aligned to position 0, scores are summed over D in one order, and a
// block a row cannot see leaves it bitwise unchanged (its weights are exactly 0). So a
// row is the same whether the prompt ran in one chunk, in several, or after a prefix hit,
// whatever the threads. The dot products' multiply-adds are fused where written (vec.h's
// vfma), nowhere else: the file builds with -ffp-contract=off.
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec.h"

namespace {

#ifdef __AVX512F__
constexpr int kRows = 4;  // rows per register tile: 4 x 4 accumulators and 4 keys of 32 zmm
#else
constexpr int kRows = 2;  // 2 x 4 accumulators and 4 keys of 16 ymm
#endif
constexpr int kBlockQ = 32;   // query rows per task
constexpr int kBlockK = 128;  // keys per block
constexpr int kTileK = 4 * kLanes;  // keys per register tile: 4 vectors
constexpr int kMaxDim = 256;

// s[i][0:kTileK] = qs[i] . kt[:, 0:kTileK] for kRows rows; kt is (D, kBlockK), s (kRows, kBlockK).
inline void scores_tile(const float* qs, const float* kt, int64_t D, float* s) {
  vf acc[kRows][4] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* kd = kt + d * kBlockK;
    const vf k0 = load(kd), k1 = load(kd + kLanes), k2 = load(kd + 2 * kLanes), k3 = load(kd + 3 * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const vf qb = splat(qs[r * D + d]);
      acc[r][0] = vfma(k0, qb, acc[r][0]);
      acc[r][1] = vfma(k1, qb, acc[r][1]);
      acc[r][2] = vfma(k2, qb, acc[r][2]);
      acc[r][3] = vfma(k3, qb, acc[r][3]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) store(s + r * kBlockK + c * kLanes, acc[r][c]);
}

// o[i][dc:dc+C*kLanes] += sum_j p[i][j] * v[j][dc:dc+C*kLanes] over `keys` keys, for kRows rows.
template <int C>
inline void values_tile(const float* p, const float* v, int64_t D, int64_t keys, float* o) {
  vf acc[kRows][C];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = load(o + r * D + c * kLanes);
  for (int64_t j = 0; j < keys; ++j) {
    vf vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load(v + j * D + c * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const vf w = splat(p[r * kBlockK + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(vv[c], w, acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < C; ++c) store(o + r * D + c * kLanes, acc[r][c]);
}

// Masks what row i (at position `pos`) cannot see, folds the block into its running max
// m and sum l, rescales its output row, and leaves the weights in s.
inline void softmax_row(float* s, int64_t j0, int64_t pos, float* m, float* l, float* o, int64_t D) {
  if (j0 + kBlockK - 1 > pos)
    for (int j = 0; j < kBlockK; ++j)
      if (j0 + j > pos) s[j] = -std::numeric_limits<float>::infinity();
  constexpr int kVectors = kBlockK / kLanes;
  vf top = load(s);
  for (int c = 1; c < kVectors; ++c) {
    const vf x = load(s + c * kLanes);
    top = x > top ? x : top;
  }
  const float m_new = std::max(*m, lane_max(top));  // finite: every row sees key 0 in block 0
  vf sum = {};
  for (int c = 0; c < kVectors; ++c) {
    const vf e = vexp(load(s + c * kLanes) - m_new);
    store(s + c * kLanes, e);
    sum += e;
  }
  const float block_sum = lane_sum(sum);
  if (m_new != *m) {  // the first block, or a larger score: rescale what came before
    const float alpha = std::exp(*m - m_new);  // 0 on the first block (m = -inf)
    *l *= alpha;
    for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
    *m = m_new;
  }
  *l += block_sum;
}

}  // namespace

extern "C" {

// q: T rows of H heads of D, row t at q + t * q_stride (a view into a fused projection
// needs no copy); kt (KVH, Lp / 128, D, 128): the keys in blocks of 128, each block
// transposed and contiguous (a plain (D, Lp) layout puts a block's D rows Lp floats apart,
// on the same few L1 sets); Lp a multiple of 128, keys from L on never weighted;
// v (KVH, L, D); pos (T,) each query's last visible key, in [0, L); out (T, H, D).
// Query head h reads KV head h / (H / KVH).
// Returns 0, touching nothing, for shapes it does not handle.
int kq_prefill_attention(const float* q, int64_t q_stride, const float* kt, const float* v, const int64_t* pos,
                         float* out, int64_t T, int64_t L, int64_t Lp, int64_t H, int64_t KVH, int64_t D, float scale,
                         int threads) {
  if (D % kLanes != 0 || D > kMaxDim || Lp % kBlockK != 0 || Lp < L || H % KVH != 0) return 0;
  for (int64_t t = 0; t < T; ++t)
    if (pos[t] < 0 || pos[t] >= L) return 0;
  const int64_t group = H / KVH;
  const int64_t q_blocks = (T + kBlockQ - 1) / kBlockQ;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float qs[kBlockQ * kMaxDim];
    alignas(64) float s[kBlockQ * kBlockK];
    alignas(64) float o[kBlockQ * kMaxDim];
    float m[kBlockQ], l[kBlockQ];
    // The last query blocks see the most keys: hand them out first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < H * q_blocks; ++task) {
      const int64_t h = task % H, t0 = (q_blocks - 1 - task / H) * kBlockQ;
      const int64_t rows = std::min<int64_t>(kBlockQ, T - t0);
      const int64_t tiled = (rows + kRows - 1) / kRows * kRows;
      const float* kg = kt + (h / group) * Lp * D;
      const float* vg = v + (h / group) * L * D;
      for (int64_t i = 0; i < tiled; ++i)
        for (int64_t d = 0; d < D; ++d) qs[i * D + d] = i < rows ? q[(t0 + i) * q_stride + h * D + d] * scale : 0.f;
      std::fill(o, o + tiled * D, 0.f);
      std::fill(m, m + kBlockQ, -std::numeric_limits<float>::infinity());
      std::fill(l, l + kBlockQ, 0.f);
      const int64_t keys_end = *std::max_element(pos + t0, pos + t0 + rows) + 1;  // no row sees beyond
      for (int64_t j0 = 0; j0 < keys_end; j0 += kBlockK) {
        for (int64_t i = 0; i < tiled; i += kRows)
          for (int64_t c = 0; c < kBlockK; c += kTileK)
            scores_tile(qs + i * D, kg + j0 * D + c, D, s + i * kBlockK + c);
        for (int64_t i = 0; i < rows; ++i) softmax_row(s + i * kBlockK, j0, pos[t0 + i], m + i, l + i, o + i * D, D);
        for (int64_t i = rows; i < tiled; ++i) std::fill(s + i * kBlockK, s + (i + 1) * kBlockK, 0.f);
        const int64_t keys = std::min<int64_t>(kBlockK, keys_end - j0);
        for (int64_t i = 0; i < tiled; i += kRows)
          for (int64_t dc = 0; dc < D; dc += 4 * kLanes) {
            const float* vb = vg + j0 * D + dc;
            float* ob = o + i * D + dc;
            switch ((D - dc) / kLanes) {
              case 1: values_tile<1>(s + i * kBlockK, vb, D, keys, ob); break;
              case 2: values_tile<2>(s + i * kBlockK, vb, D, keys, ob); break;
              case 3: values_tile<3>(s + i * kBlockK, vb, D, keys, ob); break;
              default: values_tile<4>(s + i * kBlockK, vb, D, keys, ob); break;
            }
          }
      }
      for (int64_t i = 0; i < rows; ++i) {
        const float inv = 1.f / l[i];
        float* dst = out + ((t0 + i) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = o[i * D + d] * inv;
      }
    }
  }
  return 1;
}

}  // extern "C"
