// The per-layer elementwise work of a forward pass, one pass each: rotary embedding of the
// query and key heads, and the SwiGLU gate.
//
// Why: torch runs rotary as ~7 ops (two slices, a negation, a cat, two products, a sum)
// and SwiGLU as a chunk, a silu and a product; at decode's few rows each op costs more in
// dispatch than in arithmetic (rotary ~34 us a layer), and at prefill each one streams its
// whole tensor through memory again.
//
// Exactness: rotary computes x*cos + (-x2)*sin (or + x1*sin) with each product and the sum
// rounded on their own (-ffp-contract=off): bitwise torch's result. SwiGLU's e^x is
// vec.h's (~1 ulp from torch's); each element depends only on its own inputs.
#include <omp.h>
#include <cstdint>

#include "vec.h"

extern "C" {

// x: rows of `heads` vectors of D floats, row r at x + r * x_stride (heads contiguous);
// cos, sin (rows, rd) or (1, rd) when cs_stride is 0; out (rows, heads, D) contiguous.
// The first rd channels of each head rotate by rotate_half; the rest are copied.
void kq_rotary(const float* x, int64_t x_stride, const float* cos, const float* sin, int64_t cs_stride,
               float* out, int64_t rows, int64_t heads, int64_t D, int64_t rd, int threads) {
  const int64_t half = rd / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * heads > 256)
  for (int64_t task = 0; task < rows * heads; ++task) {
    const int64_t r = task / heads, h = task % heads;
    const float* xh = x + r * x_stride + h * D;
    const float* c = cos + r * cs_stride;
    const float* s = sin + r * cs_stride;
    float* o = out + task * D;
    for (int64_t i = 0; i < half; ++i) o[i] = xh[i] * c[i] + (-xh[i + half]) * s[i];
    for (int64_t i = half; i < rd; ++i) o[i] = xh[i] * c[i] + xh[i - half] * s[i];
    for (int64_t i = rd; i < D; ++i) o[i] = xh[i];
  }
}

// silu(g) * u, with silu(g) = g / (1 + e^-g) computed from e^-|g| (the exponent never
// overflows): g / (1 + e^-g) for g >= 0, g e^g / (1 + e^g) below.
static inline vf swiglu(vf g, vf u) {
  const vf e = vexp(g < 0.f ? g : -g);  // e^-|g|, in (0, 1]
  return (g < 0.f ? g * e : g) / (e + 1.f) * u;
}

// gate_up (rows, 2 * I): each row's gate, then its up; out (rows, I) = silu(gate) * up.
void kq_swiglu(const float* gate_up, float* out, int64_t rows, int64_t I, int threads) {
  const int64_t full = I / kLanes * kLanes;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * I > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * I;
    const float* u = g + I;
    float* o = out + r * I;
    for (int64_t i = 0; i < full; i += kLanes) store(o + i, swiglu(load(g + i), load(u + i)));
    for (int64_t i = full; i < I; ++i) o[i] = swiglu(splat(g[i]), splat(u[i]))[0];  // the tail, lane 0
  }
}

}  // extern "C"
