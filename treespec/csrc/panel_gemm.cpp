// Panel GEMM for the fp32 tree pass on AVX2 + FMA CPUs: y[M, N] = x[M, K] @ W[N, K]^T.
//
// Glossary
//   panel   16 output columns of W stored k-major: wp[p, k, j] = W[16 p + j, k], so one pass over
//           a panel is one sequential read (the hardware prefetcher's favourite pattern).
//   tile    R <= 6 rows of x times one panel: 2 R accumulators of 8 floats stay in registers
//           (12 of AVX2's 16 ymm registers at R = 6, plus 2 for the weights and 1 broadcast).
//   chunk   KC values of k. Every row block of a panel runs over one chunk before the next chunk
//           is read, so a panel comes from DRAM once whatever M is, and the next chunk is
//           prefetched while the current one is multiplied.
//
// Exactness: each output is one FMA chain over k = 0 .. K-1 in order, starting from 0 (partial
// sums are stored and reloaded between chunks, which is exact). The order does not depend on M or
// on which tile a row falls in, so a row's result is bit-identical whether it is multiplied alone
// (a 1-token decode step) or among 63 other rows (a tree pass).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kChunk = 64;            // k values per chunk (4 KiB of one panel)
constexpr int64_t kPrefetch = 64 * 16;    // prefetch distance in floats: one chunk ahead

#define TS_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

template <int R>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t k0,
                 int64_t k1, float* __restrict y, int64_t ldy, bool prefetch) {
  // Named accumulators (not an array): GCC keeps arrays of vectors in memory and stores them on
  // every iteration, which cost 2.5x here.
#define TS_INIT(i)                                                        \
  __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps();    \
  if (R > i && k0 > 0) {                                                  \
    a##i##0 = _mm256_loadu_ps(y + i * ldy);                               \
    a##i##1 = _mm256_loadu_ps(y + i * ldy + 8);                           \
  }
  TS_ROWS(TS_INIT)
  const float* xk = x + k0;
  for (int64_t k = k0; k < k1; ++k, ++xk) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + kPanel * k + kPrefetch), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + kPanel * k);
    const __m256 w1 = _mm256_loadu_ps(w + kPanel * k + 8);
#define TS_FMA(i)                                           \
  if (R > i) {                                              \
    const __m256 xv = _mm256_broadcast_ss(xk + i * ldx);    \
    a##i##0 = _mm256_fmadd_ps(xv, w0, a##i##0);             \
    a##i##1 = _mm256_fmadd_ps(xv, w1, a##i##1);             \
  }
    TS_ROWS(TS_FMA)
  }
#define TS_STORE(i)                                 \
  if (R > i) {                                      \
    _mm256_storeu_ps(y + i * ldy, a##i##0);         \
    _mm256_storeu_ps(y + i * ldy + 8, a##i##1);     \
  }
  TS_ROWS(TS_STORE)
}

// Rows r .. M-1 (fewer than 6) of one chunk of one panel.
inline void tail(int64_t rows, const float* x, int64_t K, const float* w, int64_t k0, int64_t k1,
                 float* y, int64_t ldy, bool prefetch) {
  switch (rows) {
    case 5: tile<5>(x, K, w, k0, k1, y, ldy, prefetch); break;
    case 4: tile<4>(x, K, w, k0, k1, y, ldy, prefetch); break;
    case 3: tile<3>(x, K, w, k0, k1, y, ldy, prefetch); break;
    case 2: tile<2>(x, K, w, k0, k1, y, ldy, prefetch); break;
    case 1: tile<1>(x, K, w, k0, k1, y, ldy, prefetch); break;
    default: break;
  }
}

}  // namespace

// x [M, K] float32 contiguous; wp [P, K, 16] float32 contiguous -> y [M, 16 P].
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
    for (int64_t p = p0; p < p1; ++p) {
      const float* wq = w + p * K * kPanel;
      float* yq = yp + kPanel * p;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t k1 = std::min(K, k0 + kChunk);
        int64_t r = 0;
        for (; r + 6 <= M; r += 6) tile<6>(xp + r * K, K, wq, k0, k1, yq + r * ldy, ldy, r == 0);
        tail(M - r, xp + r * K, K, wq, k0, k1, yq + r * ldy, ldy, r == 0);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_linear", &panel_linear, "y = x @ W^T with W stored as 16-column panels");
}
