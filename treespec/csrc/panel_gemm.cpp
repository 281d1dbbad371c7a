// Panel GEMM for the fp32 tree pass on AVX2 + FMA CPUs: y[M, N] = x[M, K] @ W[N, K]^T.
//
// Glossary
//   panel   16 output columns of W stored k-major: wp[p, k, j] = W[16 p + j, k], so one pass over
//           a panel is one sequential read (the hardware prefetcher's favourite pattern).
//   tile    R rows of x times G adjacent panels (R G <= 6): 2 R G accumulators of 8 floats stay
//           in registers (12 of AVX2's 16 ymm registers at R G = 6).
//   chunk   KC values of k. Every row block of a panel runs over one chunk before the next chunk
//           is read, so a panel comes from DRAM once whatever M is, and the next chunk is
//           prefetched while the current one is multiplied.
//
// Exactness: each output is one FMA chain over k = 0 .. K-1 in order, starting from 0 (partial
// sums are stored and reloaded between chunks, which is exact). The order does not depend on M or
// on which tile or panel group a row falls in, so a row's result is bit-identical whether it is multiplied alone
// (a 1-token decode step) or among 63 other rows (a tree pass).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kChunk = 64;            // k values per chunk (4 KiB of one panel)
constexpr int64_t kPrefetch = 64 * 16;    // prefetch distance in floats: one chunk ahead

// R rows times G adjacent panels over k in [k0, k1): 2 R G accumulators of 8 floats in registers
// (R G <= 6, so at most 12 of AVX2's 16 ymm registers). Partial sums come from y when k0 > 0.
// The loops are fully unrolled so the accumulator array lives in registers (without the pragmas
// GCC keeps it on the stack and stores it every iteration, 2.5x slower).
template <int R, int G>
inline void tile(const float* __restrict x, int64_t K, const float* __restrict w, int64_t k0, int64_t k1,
                 float* __restrict y, int64_t ldy, bool prefetch) {
  __m256 a[R][2 * G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * G; ++j) a[r][j] = k0 > 0 ? _mm256_loadu_ps(y + r * ldy + 8 * j) : _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m256 wv[2 * G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const float* wg = w + g * K * kPanel + kPanel * k;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetch), _MM_HINT_T0);
      wv[2 * g] = _mm256_loadu_ps(wg);
      wv[2 * g + 1] = _mm256_loadu_ps(wg + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 16
      for (int j = 0; j < 2 * G; ++j) a[r][j] = _mm256_fmadd_ps(xv, wv[j], a[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * G; ++j) _mm256_storeu_ps(y + r * ldy + 8 * j, a[r][j]);
}

// All M rows times panels [p0, p1) in groups of G panels: chunk by chunk, every row block (R rows,
// then the rest) runs over the chunk while it is in cache; the first block prefetches ahead.
template <int R, int G>
int64_t panels(const float* x, int64_t M, int64_t K, const float* w, int64_t p0, int64_t p1, float* y,
               int64_t ldy) {
  int64_t p = p0;
  for (; p + G <= p1; p += G) {
    const float* wq = w + p * K * kPanel;
    float* yq = y + kPanel * p;
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t k1 = std::min(K, k0 + kChunk);
      int64_t r = 0;
      for (; r + R <= M; r += R) tile<R, G>(x + r * K, K, wq, k0, k1, yq + r * ldy, ldy, r == 0);
      const float* xr = x + r * K;
      float* yr = yq + r * ldy;
      const bool pf = r == 0;
      switch (M - r) {  // rows left, fewer than R
        case 5: if constexpr (R > 5) tile<5, G>(xr, K, wq, k0, k1, yr, ldy, pf); break;
        case 4: if constexpr (R > 4) tile<4, G>(xr, K, wq, k0, k1, yr, ldy, pf); break;
        case 3: if constexpr (R > 3) tile<3, G>(xr, K, wq, k0, k1, yr, ldy, pf); break;
        case 2: if constexpr (R > 2) tile<2, G>(xr, K, wq, k0, k1, yr, ldy, pf); break;
        case 1: if constexpr (R > 1) tile<1, G>(xr, K, wq, k0, k1, yr, ldy, pf); break;
        default: break;
      }
    }
  }
  return p;  // first panel not done (fewer than G left)
}

}  // namespace

// x [M, K] float32 contiguous; wp [P, K, 16] float32 contiguous -> y [M, 16 P].
// 1-3 rows are memory-bound: they read 4, 3 or 2 panels at once (more read streams in flight,
// 15-20 % faster here); more rows are compute-bound and use 6-row blocks over one panel.
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& wp) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == kPanel, "panel_linear: x [M, K], wp [P, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat, "panel_linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && wp.is_contiguous(), "panel_linear: contiguous inputs only");
  TORCH_CHECK(x.size(1) == wp.size(1), "panel_linear: x has K = ", x.size(1), ", the panels K = ", wp.size(1));
  const int64_t M = x.size(0), K = x.size(1), P = wp.size(0), ldy = kPanel * P;
  auto y = torch::empty({M, ldy}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) {
    int64_t p = p0;
    if (M == 1) p = panels<1, 4>(xp, M, K, w, p, p1, yp, ldy);
    else if (M == 2) p = panels<2, 3>(xp, M, K, w, p, p1, yp, ldy);
    else if (M == 3) p = panels<3, 2>(xp, M, K, w, p, p1, yp, ldy);
    panels<6, 1>(xp, M, K, w, p, p1, yp, ldy);  // every panel when M > 3, else the leftovers
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_linear", &panel_linear, "y = x @ W^T with W stored as 16-column panels");
}
