// Weight-only quantized products for decode: y[M,N] = x[M,K] @ W^T with fp32 activations.
//
// Why: a decode step multiplies a few rows by every weight, so its time is the time the
// weights take to stream from memory. Stored as 4 bits (Q4_1) or 8 bits (Q8_0) per weight,
// they stream 4-5x (2-3x) fewer bytes than fp32; oneDNN and MKL have no such fp32-activation
// product on CPU.
//
// Layouts (the GGUF ones, per block of 32 weights along K):
//   Q4_1: 16 bytes, byte j holds element j (low nibble) and j + 16 (high); w = d*q + m.
//   Q8_0: 32 signed bytes; w = d*q.
// d and m are fp32 (N, K/32). The AVX-512 path multiplies each weight's value as a rounded
// product then a rounded sum (d*q, + m), as torch's elementwise ops compute it (this file
// is built with -ffp-contract=off), so the dense copy the engine prefills with
// (engine_ext/kernels/quant.py) holds the very values it multiplies. The AVX2 path takes
// the same weights reassociated, d * sum(q*x) + m * sum(x) per block (why: at its
// definition); its results differ from the dense product by fp32 rounding of the sums.
//
// Exactness: each output (row, column) is accumulated in one fixed order (lanes across
// blocks, then one reduction), whatever the number of rows or threads, so a row's result
// is bitwise the same alone or in a batch.
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kColumnsPerTask = 16;
constexpr int kRowTile = 8;

#if defined(__AVX512F__)
constexpr int kIsa = 2;
constexpr bool kBlockSums = false;  // q4_tile's xs is not read: weights are looked up by code

inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

// A tile of M rows by C adjacent columns: each x vector loaded serves C columns. From
// kPairRows rows on, x loads rather than weight bytes set the pace, and columns go in
// pairs (measured: lm_head at 8 rows 2.2-2.8 ms against 3.2-3.6; at 1 row, where the
// weights' stream sets it, pairs were slower). Each (row, column) still takes its blocks
// in order, w0 then w1: the same bits whatever C.
constexpr int kPairRows = 4;
template <int M, int C, typename Dequant>
void columns(const float* x, float* y, int64_t K, int64_t N, int64_t n, Dequant dequant) {
  __m512 acc[C][M];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < M; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m512 w0[C], w1[C];  // each column's block: weights 0-15 and 16-31
    for (int c = 0; c < C; ++c) dequant(n + c, b, w0[c], w1[c]);
    for (int r = 0; r < M; ++r) {
      const float* xr = x + r * K + b * kBlock;
      const __m512 xa = _mm512_loadu_ps(xr), xb = _mm512_loadu_ps(xr + 16);
      for (int c = 0; c < C; ++c) {
        acc[c][r] = _mm512_fmadd_ps(w0[c], xa, acc[c][r]);
        acc[c][r] = _mm512_fmadd_ps(w1[c], xb, acc[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < M; ++r) y[r * N + n + c] = reduce(acc[c][r]);
}

template <int M, int C>
void q4_columns(const float* x, const uint8_t* q, const float* d, const float* m, float* y,
                int64_t K, int64_t N, int64_t n) {
  const int64_t nb = K / kBlock;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m128i low = _mm_set1_epi8(0x0F);
  columns<M, C>(x, y, K, N, n, [&](int64_t col, int64_t b, __m512& w0, __m512& w1) {
    const int64_t i = col * nb + b;
    // The block's 16 possible weights, t[v] = d*v + m; each weight is t[nibble].
    const __m512 t = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d[i])), _mm512_set1_ps(m[i]));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * 16));
    w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)), t);
    w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)), t);
  });
}

template <int M, int C>
void q8_columns(const float* x, const int8_t* q, const float* d, float* y, int64_t K, int64_t N, int64_t n) {
  const int64_t nb = K / kBlock;
  columns<M, C>(x, y, K, N, n, [&](int64_t col, int64_t b, __m512& w0, __m512& w1) {
    const __m512 dv = _mm512_set1_ps(d[col * nb + b]);
    const __m128i* src = reinterpret_cast<const __m128i*>(q + col * K + b * kBlock);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src))), dv);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1))), dv);
  });
}

template <int M>
void q4_tile(const float* x, const float*, const uint8_t* q, const float* d, const float* m, float* y,
             int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if constexpr (M >= kPairRows)
    for (; n + 2 <= n1; n += 2) q4_columns<M, 2>(x, q, d, m, y, K, N, n);
  for (; n < n1; ++n) q4_columns<M, 1>(x, q, d, m, y, K, N, n);
}

template <int M>
void q8_tile(const float* x, const int8_t* q, const float* d, float* y,
             int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if constexpr (M >= kPairRows)
    for (; n + 2 <= n1; n += 2) q8_columns<M, 2>(x, q, d, y, K, N, n);
  for (; n < n1; ++n) q8_columns<M, 1>(x, q, d, y, K, N, n);
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kIsa = 1;

inline float reduce(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// AVX2 has no 16-entry permute to look weights up by code, and dequantizing each weight
// (convert, d*q, + m: three operations before its one multiply-add) made the products
// compute-bound at 7 GB/s on two cores. So a block's codes are multiplied as integers
// converted to fp32 and its scale and minimum applied once per block:
//   sum_k (d*q_k + m) * x_k = d * sum_k q_k*x_k + m * sum_k x_k,
// the same weights, reassociated (the error stays at fp32 rounding of the sums). The sums
// of x over each block (`xs`) are taken once per call, for all columns.
// Each (row, column) is accumulated in one fixed order (per block: its four groups of 8
// into one vector, then d times that into the column's accumulator; one reduction; then
// the minimums' term), whatever the number of rows or threads.
constexpr bool kBlockSums = true;

// The 32-bit lane l of pshufb(broadcast block bytes, spread(h)) holds byte 8h + l (zero
// above it): its low nibble is element 8h + l, its high nibble element 16 + 8h + l.
inline __m256i spread(int h) {
  const int b = 8 * h;
  return _mm256_setr_epi8(b, -1, -1, -1, b + 1, -1, -1, -1, b + 2, -1, -1, -1, b + 3, -1, -1, -1,
                          b + 4, -1, -1, -1, b + 5, -1, -1, -1, b + 6, -1, -1, -1, b + 7, -1, -1, -1);
}

template <int M>
void q4_tile(const float* x, const float* xs, const uint8_t* q, const float* d, const float* m, float* y,
             int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / kBlock;
  const __m256i low = _mm256_set1_epi32(0x0F), spread0 = spread(0), spread1 = spread(1);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* qn = q + n * nb * 16;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + b * 16)));
      const __m256i half0 = _mm256_shuffle_epi8(bytes, spread0), half1 = _mm256_shuffle_epi8(bytes, spread1);
      const __m256 w[4] = {  // codes of elements 0-7, 8-15, 16-23, 24-31
          _mm256_cvtepi32_ps(_mm256_and_si256(half0, low)), _mm256_cvtepi32_ps(_mm256_and_si256(half1, low)),
          _mm256_cvtepi32_ps(_mm256_srli_epi32(half0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(half1, 4))};
      const __m256 dv = _mm256_set1_ps(d[n * nb + b]);
      for (int r = 0; r < M; ++r) {
        const float* xr = x + r * K + b * kBlock;
        __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
        for (int g = 1; g < 4; ++g) s = _mm256_fmadd_ps(w[g], _mm256_loadu_ps(xr + 8 * g), s);
        acc[r] = _mm256_fmadd_ps(dv, s, acc[r]);
      }
    }
    const float* mn = m + n * nb;
    for (int r = 0; r < M; ++r) {
      const float* xsr = xs + r * nb;
      __m256 macc = _mm256_setzero_ps();
      int64_t b = 0;
      for (; b + 8 <= nb; b += 8) macc = _mm256_fmadd_ps(_mm256_loadu_ps(mn + b), _mm256_loadu_ps(xsr + b), macc);
      float total = reduce(acc[r]) + reduce(macc);
      for (; b < nb; ++b) total += mn[b] * xsr[b];
      y[r * N + n] = total;
    }
  }
}

// Q8_0: w = d*q; per block, the codes times x in four groups of 8, then d times that.
template <int M>
void q8_tile(const float* x, const int8_t* q, const float* d, float* y,
             int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    const int8_t* qn = q + n * K;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w[4];
      for (int g = 0; g < 4; ++g)
        w[g] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qn + b * kBlock + g * 8))));
      const __m256 dv = _mm256_set1_ps(d[n * nb + b]);
      for (int r = 0; r < M; ++r) {
        const float* xr = x + r * K + b * kBlock;
        __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
        for (int g = 1; g < 4; ++g) s = _mm256_fmadd_ps(w[g], _mm256_loadu_ps(xr + 8 * g), s);
        acc[r] = _mm256_fmadd_ps(dv, s, acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) y[r * N + n] = reduce(acc[r]);
  }
}

#else
#error "quant_linear.cpp needs AVX-512F or AVX2+FMA; the loader builds it only where the CPU has one"
#endif

// Runs tile<M>(x + rows r0.., y + rows r0.., n0, n1) for every 8-row tile and 16-column task.
template <typename Tile>
void for_tiles(int64_t rows, int64_t N, int threads, Tile tile) {
  const int64_t tasks = (N + kColumnsPerTask - 1) / kColumnsPerTask;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
    const int tile_rows = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t n0 = t * kColumnsPerTask;
      tile(r0, tile_rows, n0, std::min<int64_t>(N, n0 + kColumnsPerTask));
    }
  }
}

#define KQ_DISPATCH(FN, ...)                                   \
  switch (tile_rows) {                                         \
    case 1: FN<1>(__VA_ARGS__); break;                         \
    case 2: FN<2>(__VA_ARGS__); break;                         \
    case 3: FN<3>(__VA_ARGS__); break;                         \
    case 4: FN<4>(__VA_ARGS__); break;                         \
    case 5: FN<5>(__VA_ARGS__); break;                         \
    case 6: FN<6>(__VA_ARGS__); break;                         \
    case 7: FN<7>(__VA_ARGS__); break;                         \
    default: FN<8>(__VA_ARGS__); break;                        \
  }

}  // namespace

extern "C" {

int kq_isa() { return kIsa; }

void kq_q4_linear(const float* x, int64_t rows, int64_t K, const uint8_t* q, const float* d,
                  const float* m, int64_t N, float* y, int threads) {
  const int64_t nb = K / kBlock;
  std::vector<float> xs(kBlockSums ? rows * nb : 0);  // (rows, K/32): each block's sum of x
  for (int64_t i = 0; i < static_cast<int64_t>(xs.size()); ++i) {
    const float* xb = x + i * kBlock;  // rows are K = nb blocks apart: block i is at i * 32
    float total = 0.0f;
    for (int64_t k = 0; k < kBlock; ++k) total += xb[k];
    xs[i] = total;
  }
  for_tiles(rows, N, threads, [&](int64_t r0, int tile_rows, int64_t n0, int64_t n1) {
    KQ_DISPATCH(q4_tile, x + r0 * K, xs.data() + r0 * nb, q, d, m, y + r0 * N, K, N, n0, n1)
  });
}

void kq_q8_linear(const float* x, int64_t rows, int64_t K, const int8_t* q, const float* d,
                  int64_t N, float* y, int threads) {
  for_tiles(rows, N, threads, [&](int64_t r0, int tile_rows, int64_t n0, int64_t n1) {
    KQ_DISPATCH(q8_tile, x + r0 * K, q, d, y + r0 * N, K, N, n0, n1)
  });
}

}  // extern "C"
