// Decode attention over the paged KV cache: one query per sequence, read straight from the
// cache slots (no gather into a padded batch, no mask).
//
// Why: torch's path gathers each sequence's keys and values into a padded (B, L) copy per
// layer (index_select) and then runs SDPA; at decode's one query per sequence that copy and
// the per-op overhead cost more than the attention itself.
//
// How: one task per (sequence, KV head) reads each key and value once for all the query
// heads that share it (GQA), scores a key with a vector product and one lane reduction,
// and takes e^x sixteen scores at a time (vec.h).
//
// Exactness: each (sequence, head) is computed in one fixed order (scores in key order, a
// weighted sum of values in key order; the fused multiply-adds written out), so a sequence's
// output is bitwise the same alone or in any batch, on any number of threads.
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

constexpr int kMaxGroup = 8;   // query heads per KV head
constexpr int kMaxDim = 256;
constexpr int kMaxChunks = kMaxDim / kLanes;

// Softmax of n scores in place, padded to whole vectors with -inf (weight exactly 0);
// returns the sum of the weights, which the caller divides by.
float softmax(float* p, int64_t n) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  std::fill(p + n, p + padded, -std::numeric_limits<float>::infinity());
  vf top = load(p);
  for (int64_t l = kLanes; l < padded; l += kLanes) {
    const vf x = load(p + l);
    top = x > top ? x : top;
  }
  const float m = lane_max(top);
  vf sum = {};
  for (int64_t l = 0; l < padded; l += kLanes) {
    const vf e = vexp(load(p + l) - m);
    store(p + l, e);
    sum += e;
  }
  return lane_sum(sum);
}

}  // namespace

extern "C" {

// q (B, H, D); k, v (slots, KVH, D); slots (B, Lmax): sequence b's keys in position order,
// the first lengths[b] of them real; out (B, H, D). Query head h reads KV head h / (H / KVH).
// Returns 0, touching nothing, for shapes it does not handle.
int kq_decode_attention(const float* q, const float* k, const float* v, const int64_t* slots,
                        const int64_t* lengths, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                        int64_t Lmax, float scale, int threads) {
  const int64_t group = H / KVH, chunks = D / kLanes;
  if (H % KVH != 0 || group > kMaxGroup || D % kLanes != 0 || D > kMaxDim) return 0;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> p(static_cast<size_t>(kMaxGroup * (Lmax + kLanes)));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * KVH; ++task) {
      const int64_t b = task / KVH, g = task % KVH, len = lengths[b], stride = Lmax + kLanes;
      const int64_t* row = slots + b * Lmax;
      const float* qg = q + (b * H + g * group) * D;  // the group's query heads, one after another
      vf qv[kMaxGroup][kMaxChunks];
      for (int64_t hh = 0; hh < group; ++hh)
        for (int64_t c = 0; c < chunks; ++c) qv[hh][c] = load(qg + hh * D + c * kLanes) * scale;
      for (int64_t l = 0; l < len; ++l) {
        const float* kr = k + (row[l] * KVH + g) * D;
        for (int64_t hh = 0; hh < group; ++hh) {
          vf acc = qv[hh][0] * load(kr);
          for (int64_t c = 1; c < chunks; ++c) acc = vfma(qv[hh][c], load(kr + c * kLanes), acc);
          p[hh * stride + l] = lane_sum(acc);
        }
      }
      float total[kMaxGroup];
      for (int64_t hh = 0; hh < group; ++hh) total[hh] = softmax(p.data() + hh * stride, len);
      vf o[kMaxGroup][kMaxChunks] = {};
      for (int64_t l = 0; l < len; ++l) {
        const float* vr = v + (row[l] * KVH + g) * D;
        for (int64_t hh = 0; hh < group; ++hh) {
          const vf w = splat(p[hh * stride + l]);
          for (int64_t c = 0; c < chunks; ++c) o[hh][c] = vfma(load(vr + c * kLanes), w, o[hh][c]);
        }
      }
      for (int64_t hh = 0; hh < group; ++hh) {
        const float inv = 1.f / total[hh];
        float* dst = out + (b * H + g * group + hh) * D;
        for (int64_t c = 0; c < chunks; ++c) store(dst + c * kLanes, o[hh][c] * inv);
      }
    }
  }
  return 1;
}

}  // extern "C"
