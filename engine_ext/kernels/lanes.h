// A dot product in a fixed order whatever the compiler's vector width: 16 running lanes,
// the tail, then the lanes in order (built with -ffp-contract=off, so each step is a
// rounded product and a rounded sum). The kernels use it where a result must not depend
// on anything but its own inputs.
#pragma once
#include <cstdint>

inline float lane_dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float sum = 0.f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}
