// One vector of fp32 lanes for the kernels that compute more than dot products, written
// with GCC's vector extensions so one source builds for AVX-512 (a zmm) and AVX2 (a ymm),
// plus the few operations on it they share: lane reductions in a fixed tree, and e^x.
#pragma once
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#ifdef __AVX512F__
constexpr int kLanes = 16;  // one zmm
#else
constexpr int kLanes = 8;  // one ymm
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }
// a * b + c rounded once (the FMA instruction), for the attention kernels' dot products:
// half the operations of a rounded product and a rounded sum. The files build with
// -ffp-contract=off, so only this spelling fuses, and where a kernel writes it, it writes
// it the same way on every path (the weights of quant_linear.cpp and rotary never fuse).
inline vf vfma(vf a, vf b, vf c) {
#ifdef __AVX512F__
  return _mm512_fmadd_ps(a, b, c);
#else
  return _mm256_fmadd_ps(a, b, c);
#endif
}

// Lane reductions as a fixed tree: log2(kLanes) dependent steps, not kLanes.
inline float lane_max(vf x) {
  float a[kLanes];
  std::memcpy(a, &x, sizeof a);
  for (int step = kLanes / 2; step > 0; step /= 2)
    for (int i = 0; i < step; ++i) a[i] = a[i] > a[i + step] ? a[i] : a[i + step];
  return a[0];
}
// The same tree as halving vectors: 16 -> 8 -> 4 lanes, then (0 + 2) + (1 + 3). The halves
// are register shuffles: through memory, a 64-byte store read back as two halves stalls.
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
inline float lane_sum(vf x) {
#ifdef __AVX512F__
  const v8f s8 = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const v8f s8 = x;
#endif
  const v4f s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// e^x lane by lane for x <= 0 (Cephes expf: range reduction by ln 2, a degree-6
// polynomial, ~1 ulp); exactly 0 below -87.3, where 2^n would leave the normal range
// (a masked score is -inf).
inline vf vexp(vf x) {
  const vf low = splat(-87.3f);
  const vf xc = x < low ? low : x;
  const vf n = (xc * 1.44269504f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  vf r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < low ? splat(0.f) : p * two_n;
}
