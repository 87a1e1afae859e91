// Decode attention over the paged KV cache: one query per sequence, read straight from the
// cache slots (no gather into a padded batch, no mask).
//
// Why: torch's path gathers each sequence's keys and values into a padded (B, L) copy per
// layer (index_select) and then runs SDPA; at decode's one query per sequence that copy and
// the per-op overhead cost more than the attention itself.
//
// Exactness: each (sequence, head) is computed in one fixed order (scores in key order,
// each a lanes.h dot product; built with -ffp-contract=off), so a sequence's output is
// bitwise the same alone or in any batch.
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "lanes.h"


extern "C" {

// q (B, H, D); k, v (slots, KVH, D); slots (B, Lmax): sequence b's keys in position order,
// the first lengths[b] of them real; out (B, H, D). Query head h reads KV head h / (H / KVH).
void kq_decode_attention(const float* q, const float* k, const float* v, const int64_t* slots,
                         const int64_t* lengths, float* out, int64_t B, int64_t H, int64_t KVH,
                         int64_t D, int64_t Lmax, float scale, int threads) {
  const int64_t group = H / KVH;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> p(static_cast<size_t>(Lmax));
#pragma omp for schedule(static)
    for (int64_t task = 0; task < B * H; ++task) {
      const int64_t b = task / H, h = task % H, g = h / group;
      const float* qh = q + task * D;
      const int64_t* row = slots + b * Lmax;
      const int64_t len = lengths[b];
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < len; ++l) {
        p[l] = lane_dot(qh, k + (row[l] * KVH + g) * D, D) * scale;
        top = p[l] > top ? p[l] : top;
      }
      float total = 0.f;
      for (int64_t l = 0; l < len; ++l) {
        p[l] = std::exp(p[l] - top);
        total += p[l];
      }
      float* o = out + task * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t l = 0; l < len; ++l) {
        const float* vr = v + (row[l] * KVH + g) * D;
        const float w = p[l];
        for (int64_t d = 0; d < D; ++d) o[d] += w * vr[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

}  // extern "C"
