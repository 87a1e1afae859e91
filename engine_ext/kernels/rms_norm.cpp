// RMSNorm over rows: out = x / sqrt(mean(x^2) + eps) * w, fp32.
//
// Why: torch's fp32 rms_norm on CPU runs as ~8 small ops (pow, mean, add, rsqrt, mul,
// casts); at decode's few rows that is ~30 us a call, 61 calls a step. One pass here.
//
// Exactness: each row's sum of squares runs in one fixed order (lanes.h), so a row's
// result does not depend on the rows beside it.
#include <omp.h>
#include <cmath>
#include <cstdint>

#include "lanes.h"

extern "C" {

void kq_rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps,
                 int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 8)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const float sum = lane_dot(xr, xr, dim);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
    float* o = out + r * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = (xr[d] * inv) * w[d];
  }
}

}  // extern "C"
