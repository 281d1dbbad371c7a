// Panel GEMM for the fp32 tree pass on AVX2 + FMA CPUs (AVX-512 ones and AMX tiles: see the end):
// y[M, N] = x[M, K] @ W[N, K]^T.
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
// Exactness: over fp32 panels each output is one FMA chain over k = 0 .. K-1 in order, starting
// from 0 (partial sums are stored and reloaded between chunks, which is exact); over integer
// blocks, the block sums of block_rows' comment. Neither order depends on M or on which tile or
// panel group a row falls in, so a row's result is bit-identical whether it is multiplied alone
// (a 1-token decode step) or among 63 other rows (a tree pass).
// The tensor type, at::empty and pybind11's tensor casters, not <torch/extension.h>: the whole C++
// frontend it pulls in doubled the time to parse this file (35 s of a 73 s build on a Zen 1 core).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include <memory>
#include <type_traits>

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace torch {   // the names this file uses, as <torch/extension.h> would give them
using at::Tensor;
using at::empty;
}  // namespace torch

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kChunk = 64;            // k values per chunk (4 KiB of one panel)
constexpr int64_t kPrefetch = 64 * 16;    // prefetch distance in floats: one chunk ahead
constexpr int64_t kBlock = 32;            // k values sharing one scale in block-quantized panels

// R rows times G adjacent panels over kc values of k: 2 R G accumulators of 8 floats in registers
// (R G <= 6, so at most 12 of AVX2's 16 ymm registers). x points at x[row 0, k0] (row stride ldx);
// w at panel 0's row k0 (panel g at w + g * wstride); partial sums come from y when accumulate.
// The loops are fully unrolled so the accumulator array lives in registers (without the pragmas
// GCC keeps it on the stack and stores it every iteration, 2.5x slower).
template <int R, int G>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t wstride, int64_t kc,
                 float* __restrict y, int64_t ldy, bool accumulate, bool prefetch) {
  __m256 a[R][2 * G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * G; ++j) a[r][j] = accumulate ? _mm256_loadu_ps(y + r * ldy + 8 * j) : _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m256 wv[2 * G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const float* wg = w + g * wstride + kPanel * k;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetch), _MM_HINT_T0);
      wv[2 * g] = _mm256_loadu_ps(wg);
      wv[2 * g + 1] = _mm256_loadu_ps(wg + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 16
      for (int j = 0; j < 2 * G; ++j) a[r][j] = _mm256_fmadd_ps(xv, wv[j], a[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * G; ++j) _mm256_storeu_ps(y + r * ldy + 8 * j, a[r][j]);
}

// The AVX2 tiles as a type, for the row and panel loops below (avx512::Tiles is the other).
struct Avx2Tiles {
  template <int R, int G>
  static inline void run(const float* x, int64_t ldx, const float* w, int64_t wstride, int64_t kc, float* y,
                         int64_t ldy, bool accumulate, bool prefetch) {
    tile<R, G>(x, ldx, w, wstride, kc, y, ldy, accumulate, prefetch);
  }
};

// Every row of x (M rows, stride K) over one chunk of G panels: blocks of R rows (R <= 8), then
// the rest. The first block prefetches ahead when prefetch is set.
template <class Tiles, int R, int G>
inline void rows(const float* x, int64_t M, int64_t K, int64_t k0, const float* w, int64_t wstride, int64_t kc,
                 float* y, int64_t ldy, bool prefetch) {
  const bool acc = k0 > 0;
  int64_t r = 0;
  for (; r + R <= M; r += R)
    Tiles::template run<R, G>(x + r * K + k0, K, w, wstride, kc, y + r * ldy, ldy, acc, prefetch && r == 0);
  const float* xr = x + r * K + k0;
  float* yr = y + r * ldy;
  const bool pf = prefetch && r == 0;
  switch (M - r) {  // rows left, fewer than R
    case 7: if constexpr (R > 7) Tiles::template run<7, G>(xr, K, w, wstride, kc, yr, ldy, acc, pf); break;
    case 6: if constexpr (R > 6) Tiles::template run<6, G>(xr, K, w, wstride, kc, yr, ldy, acc, pf); break;
    case 5: if constexpr (R > 5) Tiles::template run<5, G>(xr, K, w, wstride, kc, yr, ldy, acc, pf); break;
    case 4: if constexpr (R > 4) Tiles::template run<4, G>(xr, K, w, wstride, kc, yr, ldy, acc, pf); break;
    case 3: if constexpr (R > 3) Tiles::template run<3, G>(xr, K, w, wstride, kc, yr, ldy, acc, pf); break;
    case 2: if constexpr (R > 2) Tiles::template run<2, G>(xr, K, w, wstride, kc, yr, ldy, acc, pf); break;
    case 1: if constexpr (R > 1) Tiles::template run<1, G>(xr, K, w, wstride, kc, yr, ldy, acc, pf); break;
    default: break;
  }
}

// fp32 panels: all M rows times panels [p0, p1) in groups of G, chunk by chunk.
template <class Tiles, int R, int G>
int64_t panels(const float* x, int64_t M, int64_t K, const float* w, int64_t p0, int64_t p1, float* y,
               int64_t ldy) {
  int64_t p = p0;
  for (; p + G <= p1; p += G) {
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t kc = std::min(K, k0 + kChunk) - k0;
      rows<Tiles, R, G>(x, M, K, k0, w + p * K * kPanel + kPanel * k0, K * kPanel, kc, y + kPanel * p, ldy, true);
    }
  }
  return p;  // first panel not done (fewer than G left)
}

// Block-quantized panels (see panel_linear_blocks): one record per panel and block of 32 k values,
// d[16] and (4 bits) m[16], then the 32 rows of q. The scales are floats, or (4 bits, Half) fp16
// numbers, 64 bytes fewer a record, where every scale of the weight is one (GGUF Q4_1's are).
// Bits 6 is GGUF Q6_K's form: q a signed byte as for 8 bits, m = 0, and one scale per 16 k values
// (a sub-block): d[16] of rows 0-15, then d[16] of rows 16-31.
template <int Bits, bool Half>
constexpr int64_t scale_bytes() { return Bits == 4 ? (Half ? 64 : 128) : Bits == 6 ? 128 : 64; }
template <int Bits, bool Half>
constexpr int64_t record_bytes() { return scale_bytes<Bits, Half>() + kBlock * (Bits == 4 ? 8 : 16); }
// k values per scale: the whole block, or (6 bits) half of it
template <int Bits>
constexpr int64_t sub_rows() { return Bits == 6 ? kBlock / 2 : kBlock; }

// The x8 kernel's records in GGUF K-quants' own form ("x8k", kernels.x8_records; the x8
// namespace's comment): per panel and super-block of 8 blocks (256 k values) a header of fp32
// scales, s_d[16] and (4 bits) s_m[16], then 8 block records of int8 sub-scales and q.
constexpr int64_t kSuper = 8;
template <int Bits>
constexpr int64_t sub_header_bytes() { return Bits == 4 ? 128 : 64; }
template <int Bits>
constexpr int64_t sub_record_bytes() { return Bits == 4 ? 32 + 256 : 32 + 256 + 128; }
template <int Bits>
constexpr int64_t super_bytes() { return sub_header_bytes<Bits>() + kSuper * sub_record_bytes<Bits>(); }

// 8 fp16 numbers as floats (F16C's vcvtph2ps: exact, subnormals included; every CPU with AVX2
// has F16C, and panel_status checks for it).
inline __m256 half8_to_ps(const uint16_t* h) {
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// A record's scales (m = 0 for 8 bits); returns where its q rows start.
template <int Bits, bool Half>
inline const uint8_t* load_scales(const uint8_t* rec, __m256& d0, __m256& d1, __m256& m0, __m256& m1) {
  if constexpr (Bits == 4 && Half) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(rec);
    d0 = half8_to_ps(h);
    d1 = half8_to_ps(h + 8);
    m0 = half8_to_ps(h + 16);
    m1 = half8_to_ps(h + 24);
  } else {
    const float* s = reinterpret_cast<const float*>(rec);
    d0 = _mm256_load_ps(s);
    d1 = _mm256_load_ps(s + 8);
    m0 = Bits == 4 ? _mm256_load_ps(s + 16) : _mm256_setzero_ps();
    m1 = Bits == 4 ? _mm256_load_ps(s + 24) : _mm256_setzero_ps();
  }
  return rec + scale_bytes<Bits, Half>();
}

// Row k + Odd (k even) of a record's q as floats: q0 = columns 0-7, q1 = columns 8-15. 4 bits:
// 16 bytes a pair of rows, byte j = column j, row k in its low nibble and row k + 1 in its high
// one (the AVX-512 code widens a pair once and turns each row into a register with one table
// lookup; here the two rows' identical loads and widenings are left to the compiler to share).
// 8 bits: 16 signed bytes a row, in order.
template <int Bits, int Odd>
inline void unpack_row(const uint8_t* __restrict qb, int64_t k, __m256& q0, __m256& q1) {
  if constexpr (Bits == 4) {
    const uint8_t* pair = qb + k * 8;  // pair k / 2 starts at 16 (k / 2) bytes
    const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(pair)));
    const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(pair + 8)));
    if constexpr (Odd) {
      q0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
      q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
    } else {
      const __m256i low = _mm256_set1_epi32(15);
      q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, low));
      q1 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, low));
    }
  } else {
    const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(qb + (k + Odd) * 16));
    q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
  }
}

// Calls f(std::integral_constant<int, 0>) then f(std::integral_constant<int, 1>): the two rows of
// a pair, in k order, each with its row offset as a compile-time constant.
template <class F>
inline void for_pair(F&& f) {
  f(std::integral_constant<int, 0>{});
  f(std::integral_constant<int, 1>{});
}

// How the block kernels multiply (every ISA, tile and row count alike, so a row's result is
// bit-identical whether it is multiplied alone or in a tree pass, on AVX2 or AVX-512 code):
// W[16 p + j, k] = d q[k] + m over a block of 32 k values (d, m per column), so
//   y[r, j] = sum over blocks b of  d t[b] + m s[b],  t[b] = sum_k x[r, k] q[k],  s[b] = sum_k x[r, k].
// t is one FMA chain over the block's k in order from 0 (the integers are exact floats), s the
// row's plain sum over the block in k order (block_rows), and y starts at 0 and takes
// y = fma(d, t, fma(m, s, y)) block after block (8 bits, m = 0: y = fma(d, t, y); 6 bits: t of
// rows 0-15 and t of rows 16-31 are two chains, y = fma(d[1], t[1], fma(d[0], t[0], y))). The weights
// are the same fp32 numbers as the fp32 panels' (d q + m is exact in fp32); only the order of
// the additions differs: each block's 32 integer products are summed before one scaling, which
// saves the multiply-add that rebuilt every weight, and rounds less (tests/test_blocks.py).
//
// x reaches the kernels packed by block_rows: rows in groups, each group k-major ([K][rows]),
// so a tile broadcasts x[r, k] from one pointer at constant offsets (16 rows of x[r K + k] would
// need 16 address registers and spill them).
// sums may be null (8 bits: no offsets, so no block sums of x).
inline void block_rows(const float* x, int64_t M, int64_t K, int64_t group, float* xt, float* sums) {
  const int64_t blocks = K / kBlock;
  for (int64_t r0 = 0; r0 < M; r0 += group) {
    const int64_t g = std::min(group, M - r0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < g; ++r) xt[r0 * K + k * g + r] = x[(r0 + r) * K + k];
  }
  if (sums == nullptr) return;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      float s = 0.f;
      for (int64_t k = 0; k < kBlock; ++k) s += x[r * K + b * kBlock + k];
      sums[r * blocks + b] = s;
    }
}

// One row's 16 outputs yr[0..16) take a block: y = fma(d, t, fma(m, s, y)), s the row's block
// sum of x (8 bits, m = 0: y = fma(d, t, y)).
template <int Bits>
inline void add_block(float* yr, __m256 t0, __m256 t1, __m256 d0, __m256 d1, __m256 m0, __m256 m1, const float* s) {
  __m256 y0 = _mm256_loadu_ps(yr), y1 = _mm256_loadu_ps(yr + 8);
  if constexpr (Bits == 4) {
    const __m256 sv = _mm256_broadcast_ss(s);
    y0 = _mm256_fmadd_ps(m0, sv, y0);
    y1 = _mm256_fmadd_ps(m1, sv, y1);
  }
  _mm256_storeu_ps(yr, _mm256_fmadd_ps(d0, t0, y0));
  _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(d1, t1, y1));
}

// The R rows' block sums take row k of q (q0: columns 0-7, q1: 8-15): t[r] = fma(x[r, k], q, t[r]),
// xk pointing at x[0, k] of the group's packed x.
template <int R>
inline void add_products(__m256 (&t)[R][2], const float* xk, __m256 q0, __m256 q1) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const __m256 xv = _mm256_broadcast_ss(xk + r);
    t[r][0] = _mm256_fmadd_ps(xv, q0, t[r][0]);
    t[r][1] = _mm256_fmadd_ps(xv, q1, t[r][1]);
  }
}

// The R rows' outputs y[r ldy ..] take the block whose record is rec: add_block with its scales;
// s points at row 0's block sum of x, row r's is s[r blocks]. 6 bits: sub-block `sub` (0 or 1)
// with its own scale, y = fma(d[sub], t, y) (the first half's sums, then the second's).
template <int R, int Bits, bool Half>
inline void add_blocks(float* y, int64_t ldy, const __m256 (&t)[R][2], const uint8_t* rec, const float* s,
                       int64_t blocks, int sub = 0) {
  __m256 d0, d1, m0, m1;
  if constexpr (Bits == 6) {
    const float* d = reinterpret_cast<const float*>(rec) + sub * kPanel;
    d0 = _mm256_load_ps(d);
    d1 = _mm256_load_ps(d + 8);
    m0 = m1 = _mm256_setzero_ps();
  } else {
    load_scales<Bits, Half>(rec, d0, d1, m0, m1);
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) add_block<Bits>(y + r * ldy, t[r][0], t[r][1], d0, d1, m0, m1, s + r * blocks);
}

// R rows (R <= 4) times block-quantized panels [p0, p1), one panel at a time: each row of q is
// unpacked into two registers and multiplied into the rows' block sums t at once; the scales are
// applied once per block. xt is the group's packed x ([K][R]), sums its rows' block sums ([R][K /
// 32]). Registers: 2 R block sums, d and m (4, loaded at the block's end), the nibble mask, two q
// vectors and x: at most 2 R + 8 <= 16.
template <int R, int Bits, bool Half>
void fused_panels(const float* xt, const float* sums, int64_t K, const uint8_t* blob, int64_t p0, int64_t p1,
                  float* y, int64_t ldy) {
  constexpr int64_t kRec = record_bytes<Bits, Half>();
  constexpr int64_t kAheadBytes = 4 * kRec;  // prefetch distance: four records
  const int64_t blocks = K / kBlock;
  for (int64_t p = p0; p < p1; ++p) {
    float* yp = y + kPanel * p;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(yp + r * ldy, _mm256_setzero_ps());
      _mm256_storeu_ps(yp + r * ldy + 8, _mm256_setzero_ps());
    }
    const uint8_t* rec = blob + p * blocks * kRec;
    for (int64_t b = 0; b < blocks; ++b, rec += kRec) {
      for (int64_t line = 0; line < kRec; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + kAheadBytes + line), _MM_HINT_T0);
      const uint8_t* qb = rec + scale_bytes<Bits, Half>();
      const float* xb = xt + b * kBlock * R;
      for (int sub = 0; sub < kBlock / sub_rows<Bits>(); ++sub) {
        __m256 t[R][2];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
        for (int64_t k = sub * sub_rows<Bits>(); k < (sub + 1) * sub_rows<Bits>(); k += 2) {
          for_pair([&](auto odd) {  // row k, then row k + 1: each chain stays in k order
            constexpr int I = decltype(odd)::value;
            __m256 q0, q1;
            unpack_row<Bits, I>(qb, k, q0, q1);
            add_products<R>(t, xb + (k + I) * R, q0, q1);
          });
        }
        add_blocks<R, Bits, Half>(yp, ldy, t, rec, sums + b, blocks, sub);
      }
    }
  }
}

// fused_panels for a row count known at run time (1-4).
template <int Bits, bool Half, int R = 4>
void fused_group(const float* xt, const float* sums, int64_t rows, int64_t K, const uint8_t* blob, int64_t p0,
                 int64_t p1, float* y, int64_t ldy) {
  if constexpr (R > 0) {
    if (rows == R) fused_panels<R, Bits, Half>(xt, sums, K, blob, p0, p1, y, ldy);
    else fused_group<Bits, Half, R - 1>(xt, sums, rows, K, blob, p0, p1, y, ldy);
  }
}

// More than 4 rows: the q of kChunk values of k of a panel are unpacked once into an L1 buffer
// (floats, unscaled: buf[k][16]) and every group of up to kAvx2Rows rows reads them from there.
constexpr int64_t kAvx2Rows = 6;  // rows per group: 12 block sums + two q vectors + x

template <int Bits, bool Half>
inline void unpack_chunk(const uint8_t* __restrict rec, int64_t nb, float* __restrict buf) {
  constexpr int64_t kRec = record_bytes<Bits, Half>();
  for (int64_t b = 0; b < nb; ++b, rec += kRec) {
    const uint8_t* qb = rec + scale_bytes<Bits, Half>();
    float* wb = buf + b * kBlock * kPanel;
#pragma GCC unroll 2
    for (int64_t k = 0; k < kBlock; k += 2) {
      for_pair([&](auto odd) {
        constexpr int I = decltype(odd)::value;
        __m256 q0, q1;
        unpack_row<Bits, I>(qb, k, q0, q1);
        _mm256_store_ps(wb + (k + I) * kPanel, q0);
        _mm256_store_ps(wb + (k + I) * kPanel + 8, q1);
      });
    }
  }
}

// R rows (R <= kAvx2Rows) over nb blocks of one panel's unpacked q (buf), from block b0: the
// block sums, then the scales into y, as fused_panels does. rec is block b0's record.
template <int R, int Bits, bool Half>
inline void buffered_rows(const float* __restrict xt, const float* __restrict sums, int64_t blocks,
                          const float* __restrict buf, const uint8_t* __restrict rec, int64_t b0, int64_t nb,
                          float* __restrict y, int64_t ldy) {
  constexpr int64_t kRec = record_bytes<Bits, Half>();
  for (int64_t b = 0; b < nb; ++b, rec += kRec) {
    const float* xb = xt + (b0 + b) * kBlock * R;
    const float* qb = buf + b * kBlock * kPanel;
    for (int sub = 0; sub < kBlock / sub_rows<Bits>(); ++sub) {
      __m256 t[R][2];
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
      for (int64_t k = sub * sub_rows<Bits>(); k < (sub + 1) * sub_rows<Bits>(); ++k) {
        add_products<R>(t, xb + k * R, _mm256_load_ps(qb + k * kPanel), _mm256_load_ps(qb + k * kPanel + 8));
      }
      add_blocks<R, Bits, Half>(y, ldy, t, rec, sums + b0 + b, blocks, sub);
    }
  }
}

template <int Bits, bool Half, int R = kAvx2Rows>
inline void buffered_group(const float* xt, const float* sums, int64_t rows, int64_t blocks, const float* buf,
                           const uint8_t* rec, int64_t b0, int64_t nb, float* y, int64_t ldy) {
  if constexpr (R > 0) {
    if (rows == R) buffered_rows<R, Bits, Half>(xt, sums, blocks, buf, rec, b0, nb, y, ldy);
    else buffered_group<Bits, Half, R - 1>(xt, sums, rows, blocks, buf, rec, b0, nb, y, ldy);
  }
}

// The rows per packed group of x on the AVX2 code (block_rows): all of them up to 4, else kAvx2Rows.
inline int64_t avx2_group(int64_t M) { return M <= 4 ? 4 : kAvx2Rows; }

template <int Bits, bool Half>
void block_panels_avx2(const float* xt, const float* sums, int64_t M, int64_t K, const uint8_t* blob, int64_t p0,
                       int64_t p1, float* y, int64_t ldy) {
  if (M <= 4) return fused_group<Bits, Half>(xt, sums, M, K, blob, p0, p1, y, ldy);
  constexpr int64_t kRec = record_bytes<Bits, Half>();
  constexpr int64_t kChunkBlocks = kChunk / kBlock;
  alignas(64) float buf[kChunk * kPanel];
  const int64_t blocks = K / kBlock;
  for (int64_t p = p0; p < p1; ++p) {
    float* yp = y + kPanel * p;
    for (int64_t r = 0; r < M; ++r) {
      _mm256_storeu_ps(yp + r * ldy, _mm256_setzero_ps());
      _mm256_storeu_ps(yp + r * ldy + 8, _mm256_setzero_ps());
    }
    const uint8_t* prec = blob + p * blocks * kRec;
    for (int64_t b0 = 0; b0 < blocks; b0 += kChunkBlocks) {
      const int64_t nb = std::min(kChunkBlocks, blocks - b0);
      // the next chunk's records (past this panel's end: the next panel's first, which come next)
      for (int64_t line = 0; line < kChunkBlocks * kRec; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(prec + (b0 + kChunkBlocks) * kRec + line), _MM_HINT_T0);
      unpack_chunk<Bits, Half>(prec + b0 * kRec, nb, buf);
      for (int64_t r = 0; r < M; r += kAvx2Rows)
        buffered_group<Bits, Half>(xt + r * K, sums + r * blocks, std::min(kAvx2Rows, M - r), blocks, buf,
                                   prec + b0 * kRec, b0, nb, yp + r * ldy, ldy);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 8-bit activations (kernel "x8"; llama.cpp multiplies its 4-bit blocks this way). Each row of
// x is rounded per block of 32 k values to integers qx in [-127, 127] and one scale dx:
//   amax = the block's largest |x|,  qx = x (127 / amax) rounded to nearest (ties to even),
//   dx = amax / 127  (amax = 0: qx = 0, dx = 0; a NaN or inf in the block: dx = NaN);
// then every block of integers q is multiplied by qx exactly (32-bit sums) and scaled into y:
//   y = fma(d, dx t, fma(m, sx, y))  (8 bits: y = fma(d, dx t, y)),  block after block from 0,
// with t = sum_k q[k] qx[k], sx = dx sum_k qx[k], and dx t, sx rounded to fp32. Not the fp32
// product: x keeps 8 bits a block, so a model on it is a target of its own (like amx's bf16
// inputs), with the same bits for a row alone or among any others (a row's rounding and sums
// depend on that row only).
//
// Records: the header of panel_linear_blocks' (d, m), then q regrouped for VPMADDUBSW: 8 groups
// of 4 k values; 4 bits: 32 bytes a group, byte 4 c + i holding q[4 g + i][c] in its low nibble
// and q[4 g + i][8 + c] in its high one (c < 8); 8 bits: 64 bytes a group, byte 4 c + i =
// q[4 g + i][c] for c < 16 (6 bits the same, groups 0-3 summed and scaled by the first d, then
// groups 4-7 by the second). One multiply-add of 4 k values' bytes by a row's 4 bytes of qx gives
// each column's pair sums (at most 2 * 128 * 127 < 2^15: no saturation), and one more the
// column's 4-value sum as a 32-bit integer.
namespace x8 {

constexpr int kRows = 4;   // rows per group: 8 accumulators, the group's weights, x, the constant

// x [M, K] rounded (see above): qx [M, K], dx and sx [M, K / 32]; s16 (where not null) [M, K / 16]
// the integer sums of qx over each 16 k values. Vector code with the scalar definition's bits: the
// same fp32 products, rounded to nearest with ties to even (vroundps, as nearbyint in the default
// mode), the largest magnitude found exactly in any order (3.3 ns a value in scalar code, a tenth
// of an 8-row 8960-k matrix's product).
inline void round_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx, int32_t* s16) {
  const int64_t nb = K / kBlock;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   // packs' lane interleave undone
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kBlock;
      int8_t* qb = qx + r * K + b * kBlock;
      __m256 v[4], top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
        // x - x is 0 for finite x, NaN for an infinity or a NaN
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v[i], v[i]), _mm256_setzero_ps(), _CMP_NEQ_UQ));
      }
      const int64_t i = r * nb + b;
      if (_mm256_movemask_ps(bad)) {
        std::memset(qb, 0, kBlock);
        dx[i] = sx[i] = std::numeric_limits<float>::quiet_NaN();
        if (s16) s16[2 * i] = s16[2 * i + 1] = 0;
        continue;
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4];
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i q16 = _mm256_packs_epi32(q[0], q[1]), r16 = _mm256_packs_epi32(q[2], q[3]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, r16), order));
      // the halves' sums: k 0-15 (q[0], q[1]) and 16-31 (q[2], q[3]), as 32-bit integers
      const __m256i lo = _mm256_add_epi32(q[0], q[1]), hi = _mm256_add_epi32(q[2], q[3]);
      const __m256i pair = _mm256_hadd_epi32(lo, hi);             // lo0+lo1, lo2+lo3, hi.., per lane
      const __m256i quad = _mm256_hadd_epi32(pair, pair);         // lo's lane sum, hi's lane sum
      const __m128i both = _mm_add_epi32(_mm256_castsi256_si128(quad), _mm256_extracti128_si256(quad, 1));
      const int half0 = _mm_cvtsi128_si32(both), half1 = _mm_extract_epi32(both, 1);
      dx[i] = amax / 127.f;
      sx[i] = dx[i] * static_cast<float>(half0 + half1);
      if (s16) {
        s16[2 * i] = half0;
        s16[2 * i + 1] = half1;
      }
    }
}

// Pins a and b in registers at this point of the program. Integer sums are associative, so GCC
// otherwise regroups a block's 8 groups of sums into a tree: every product computed first, held
// on the stack (about 60 ymm stores and loads a block for 4 rows), then added: store-bound, at
// half the multiply rate. The empty asm keeps the sums as one running chain per register.
inline void in_register(__m256i& a, __m256i& b) { asm("" : "+x"(a), "+x"(b)); }

// 4 k values, 8 columns: w's bytes (4 a column) times x's 4 bytes. 4 bits (w in 0..15): the two
// pair sums of each column as 16-bit integers (at most 2 * 15 * 127, so a block's 8 groups add
// up to at most 30480 < 2^15 and are widened once a block: half the multiply instructions, the
// ones a core has fewest units for). 8 bits: |w| times x with w's sign, the column's 4-value sum
// as a 32-bit integer (a pair sum alone can reach 2 * 128 * 127).
template <int Bits>
inline __m256i dot4(__m256i w, __m256i wabs, __m256i x, __m256i ones) {
  if constexpr (Bits == 4) return _mm256_maddubs_epi16(w, x);
  else return _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w)), ones);
}

// 8 int8 sub-scales as floats.
inline __m256 int8x8_to_ps(const int8_t* a) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a))));
}

// The R rows' block sums t scaled into their outputs' accumulators: acc = fma(d, dx t, acc), dx the
// row's scale of block b (the m term, where there is one, is added before: see panel).
template <int R>
inline void add_scaled(__m256 (&acc)[R][2], const __m256i (&t)[R][2], __m256 d0, __m256 d1, const float* dx,
                       int64_t nb, int64_t b) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 e = _mm256_set1_ps(dx[r * nb + b]);
    acc[r][0] = _mm256_fmadd_ps(d0, _mm256_mul_ps(e, _mm256_cvtepi32_ps(t[r][0])), acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(d1, _mm256_mul_ps(e, _mm256_cvtepi32_ps(t[r][1])), acc[r][1]);
  }
}

// The R rows' 16 outputs stored at y (row stride ldy).
template <int R>
inline void store_rows(const __m256 (&acc)[R][2], float* y, int64_t ldy) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
  }
}

// panel's loop for 6-bit x8k records (GGUF Q6_K). A record's q: 8 groups of 32 bytes holding each
// value's low 4 bits (as 4-bit records do), then 4 of the top 2 bits, one for each pair of groups
// (bits 0-1 and 2-3: the even group's columns 0-7 and 8-15; bits 4-5 and 6-7: the odd one's). The
// pair's top bits are loaded once, and each row's products of the pair's two groups are added as
// 16-bit integers before one widening: (q + 32) in 0..63 times qx in -127..127 is a pair sum of at
// most 2 * 63 * 127 = 16002, two of them 32004 < 2^15. Integer sums are exact in any grouping, so
// the result is the namespace comment's arithmetic to the bit, for any row count.
template <int R>
inline void panel_q6k(const int8_t* qx, const float* dx, const int32_t* s16, int64_t K, const uint8_t* rec,
                      float* y, int64_t ldy) {
  constexpr int64_t kRec = sub_record_bytes<6>();
  const int64_t nb = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  __m256 acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* head = nullptr;
  for (int64_t b = 0; b < nb; ++b, rec += kRec) {
    if (b % kSuper == 0) {
      head = reinterpret_cast<const float*>(rec);
      rec += sub_header_bytes<6>();
    }
    for (int64_t line = 0; line < kRec; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * kRec + line), _MM_HINT_T0);
    const uint8_t* q = rec + 32;
#pragma GCC unroll 2
    for (int sub = 0; sub < 2; ++sub) {
      __m256i t[R][2];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int pair = 0; pair < 2; ++pair) {
        const int g = 4 * sub + 2 * pair;
        const __m256i h = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 256 + 32 * (2 * sub + pair)));
        const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 32 * g));
        const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 32 * g + 32));
        // w<i><j>: q + 32 of group g + i, columns 0-7 (j = 0) or 8-15 (j = 1)
        const __m256i w00 = _mm256_or_si256(_mm256_and_si256(v0, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
        const __m256i w01 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                                            _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
        const __m256i w10 = _mm256_or_si256(_mm256_and_si256(v1, low), _mm256_and_si256(h, top));
        const __m256i w11 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low),
                                            _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t f0, f1;
          std::memcpy(&f0, qx + r * K + b * kBlock + 4 * g, 4);
          std::memcpy(&f1, qx + r * K + b * kBlock + 4 * g + 4, 4);
          const __m256i x0 = _mm256_set1_epi32(f0), x1 = _mm256_set1_epi32(f1);
          const __m256i u0 = _mm256_add_epi16(_mm256_maddubs_epi16(w00, x0), _mm256_maddubs_epi16(w10, x1));
          const __m256i u1 = _mm256_add_epi16(_mm256_maddubs_epi16(w01, x0), _mm256_maddubs_epi16(w11, x1));
          t[r][0] = _mm256_add_epi32(t[r][0], _mm256_madd_epi16(u0, ones));
          t[r][1] = _mm256_add_epi32(t[r][1], _mm256_madd_epi16(u1, ones));
          in_register(t[r][0], t[r][1]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i off = _mm256_set1_epi32(32 * s16[r * 2 * nb + 2 * b + sub]);
        t[r][0] = _mm256_sub_epi32(t[r][0], off);
        t[r][1] = _mm256_sub_epi32(t[r][1], off);
      }
      const int8_t* a = reinterpret_cast<const int8_t*>(rec) + 16 * sub;
      const __m256 d0 = _mm256_mul_ps(_mm256_load_ps(head), int8x8_to_ps(a));
      const __m256 d1 = _mm256_mul_ps(_mm256_load_ps(head + 8), int8x8_to_ps(a + 8));
      add_scaled<R>(acc, t, d0, d1, dx, nb, b);
    }
  }
  store_rows<R>(acc, y, ldy);
}

// Rows [0, R) of a group (qx: row 0's, stride K) times panel p: y's 16 columns of each row.
// Sub: x8k records (rec: the panel's first super-block header); 6-bit ones go to panel_q6k, with
// s16 the rows' sums of qx per 16 k values.
template <int R, int Bits, bool Half, bool Sub>
inline void panel(const int8_t* qx, const float* dx, const float* sx, const int32_t* s16, int64_t K,
                  const uint8_t* rec, float* y, int64_t ldy) {
  if constexpr (Bits == 6 && Sub) {
    panel_q6k<R>(qx, dx, s16, K, rec, y, ldy);
    return;
  }
  constexpr int64_t kRec = Sub ? sub_record_bytes<Bits>() : record_bytes<Bits, Half>();
  constexpr int64_t kHead = Sub ? 32 : scale_bytes<Bits, Half>();   // a record's bytes before its q
  const int64_t nb = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
  __m256 acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* head = nullptr;   // Sub: the super-block's scales
  for (int64_t b = 0; b < nb; ++b, rec += kRec) {
    if constexpr (Sub) {
      if (b % kSuper == 0) {
        head = reinterpret_cast<const float*>(rec);
        rec += sub_header_bytes<Bits>();
      }
    }
    for (int64_t line = 0; line < kRec; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * kRec + line), _MM_HINT_T0);
    const uint8_t* q = rec + kHead;
    // 6 bits: groups 0-3 (k 0-15) are scaled by the first d, then groups 4-7 by the second
    constexpr int kGroups = sub_rows<Bits>() / 4;
    for (int sub = 0; sub < 8 / kGroups; ++sub) {
      __m256i t[R][2];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = sub * kGroups; g < (sub + 1) * kGroups; ++g) {
        __m256i w0, w1, a0, a1;
        if constexpr (Bits == 4) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 32 * g));
          a0 = w0 = _mm256_and_si256(v, low);
          a1 = w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        } else {
          w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 64 * g));
          w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 64 * g + 32));
          a0 = _mm256_abs_epi8(w0);
          a1 = _mm256_abs_epi8(w1);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, qx + r * K + b * kBlock + 4 * g, 4);
          const __m256i xv = _mm256_set1_epi32(four);
          if constexpr (Bits == 4) {
            t[r][0] = _mm256_add_epi16(t[r][0], dot4<Bits>(w0, a0, xv, ones));
            t[r][1] = _mm256_add_epi16(t[r][1], dot4<Bits>(w1, a1, xv, ones));
          } else {
            t[r][0] = _mm256_add_epi32(t[r][0], dot4<Bits>(w0, a0, xv, ones));
            t[r][1] = _mm256_add_epi32(t[r][1], dot4<Bits>(w1, a1, xv, ones));
          }
          in_register(t[r][0], t[r][1]);
        }
      }
      if constexpr (Bits == 4) {   // each column's two 16-bit lanes into its 32-bit sum
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          t[r][0] = _mm256_madd_epi16(t[r][0], ones);
          t[r][1] = _mm256_madd_epi16(t[r][1], ones);
        }
      }
      __m256 d0, d1, m0, m1;
      if constexpr (Sub) {         // d = s_d a (and m = s_m b): one fp32 product each
        const int8_t* a = reinterpret_cast<const int8_t*>(rec);   // 4 bits (6: panel_q6k)
        d0 = _mm256_mul_ps(_mm256_load_ps(head), int8x8_to_ps(a));
        d1 = _mm256_mul_ps(_mm256_load_ps(head + 8), int8x8_to_ps(a + 8));
        m0 = _mm256_mul_ps(_mm256_load_ps(head + 16), int8x8_to_ps(a + 16));
        m1 = _mm256_mul_ps(_mm256_load_ps(head + 24), int8x8_to_ps(a + 24));
      } else if constexpr (Bits == 6) {
        const float* d = reinterpret_cast<const float*>(rec) + sub * kPanel;
        d0 = _mm256_load_ps(d);
        d1 = _mm256_load_ps(d + 8);
      } else {
        load_scales<Bits, Half>(rec, d0, d1, m0, m1);
      }
      if constexpr (Bits == 4) {   // y = fma(d, dx t, fma(m, sx, y)): the m term first
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256 sr = _mm256_set1_ps(sx[r * nb + b]);
          acc[r][0] = _mm256_fmadd_ps(m0, sr, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(m1, sr, acc[r][1]);
        }
      }
      add_scaled<R>(acc, t, d0, d1, dx, nb, b);
    }
  }
  store_rows<R>(acc, y, ldy);
}

template <int Bits, bool Half, bool Sub, int R = kRows>
inline void panel_rows(int64_t rows, const int8_t* qx, const float* dx, const float* sx, const int32_t* s16,
                       int64_t K, const uint8_t* rec, float* y, int64_t ldy) {
  if constexpr (R > 0) {
    if (rows == R) panel<R, Bits, Half, Sub>(qx, dx, sx, s16, K, rec, y, ldy);
    else panel_rows<Bits, Half, Sub, R - 1>(rows, qx, dx, sx, s16, K, rec, y, ldy);
  }
}

// Panels [p0, p1), each for all M rows in groups of kRows (a panel's records, K / 32 of them,
// stay in cache from the first group to the last, so they come from memory once).
template <int Bits, bool Half, bool Sub>
void linear(const int8_t* qx, const float* dx, const float* sx, const int32_t* s16, int64_t M, int64_t K,
            const uint8_t* blob, int64_t p0, int64_t p1, float* y, int64_t ldy) {
  const int64_t nb = K / kBlock;
  const int64_t pstride = Sub ? nb / kSuper * super_bytes<Bits>() : nb * record_bytes<Bits, Half>();
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t r = 0; r < M; r += kRows)
      panel_rows<Bits, Half, Sub>(std::min<int64_t>(kRows, M - r), qx + r * K, dx + r * nb, sx + r * nb,
                                  s16 ? s16 + r * 2 * nb : nullptr, K, blob + p * pstride,
                                  y + r * ldy + kPanel * p, ldy);
}

}  // namespace x8

// ---------------------------------------------------------------------------------------------
// The same kernels for CPUs with AVX-512 F, compiled into this module under
// function-level target options and chosen at run time by the caller (the `isa` argument), never
// on a CPU without them. A panel is exactly one zmm register, so a weight row costs half the
// instructions, and the 32 zmm registers hold up to 16 rows of accumulators. Every output is
// still the same sequence of operations (an in-order FMA chain over k from 0 over fp32 panels;
// block_rows' arithmetic over blocks), so the results are bit-identical to the AVX2 kernels
// above, lane for lane.
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {

constexpr int kRows = 8;  // rows per tile over fp32 panels: 8 accumulators + 1 weight register

// R rows times G adjacent panels over kc values of k, R G zmm accumulators (see tile above).
template <int R, int G>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t wstride, int64_t kc,
                 float* __restrict y, int64_t ldy, bool accumulate, bool prefetch) {
  __m512 a[R][G];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) a[r][g] = accumulate ? _mm512_loadu_ps(y + r * ldy + kPanel * g) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m512 wv[G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const float* wg = w + g * wstride + kPanel * k;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetch), _MM_HINT_T0);
      wv[g] = _mm512_loadu_ps(wg);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) a[r][g] = _mm512_fmadd_ps(xv, wv[g], a[r][g]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(y + r * ldy + kPanel * g, a[r][g]);
}

// The AVX-512 tiles for the row and panel loops above (called, not inlined, from them: they are
// compiled without the AVX-512 target).
struct Tiles {
  template <int R, int G>
  static inline void run(const float* x, int64_t ldx, const float* w, int64_t wstride, int64_t kc, float* y,
                         int64_t ldy, bool accumulate, bool prefetch) {
    tile<R, G>(x, ldx, w, wstride, kc, y, ldy, accumulate, prefetch);
  }
};

void panel_linear(const float* x, int64_t M, int64_t K, const float* w, int64_t p0, int64_t p1, float* y,
                  int64_t ldy) {
  // 1-3 rows over fp32 panels read 4 bytes a weight and are bound by that: the AVX2 tiles were
  // as fast or 3-5 % faster there (eagle3-head shapes, one AMX core), so they keep those passes.
  int64_t p = p0;
  if (M == 1) p = panels<Avx2Tiles, 1, 4>(x, M, K, w, p, p1, y, ldy);
  else if (M == 2) p = panels<Avx2Tiles, 2, 3>(x, M, K, w, p, p1, y, ldy);
  else if (M == 3) p = panels<Avx2Tiles, 3, 2>(x, M, K, w, p, p1, y, ldy);
  panels<Tiles, kRows, 1>(x, M, K, w, p, p1, y, ldy);
}

// Rows k and k + 1 (k even) of a record's q as 16 floats each, column j in lane j. 4 bits: the
// pair's 16 bytes zero-extended into the 16 lanes (one shuffle for two rows); the table lookup
// reads each lane's low 4 bits, so row k needs no mask and row k + 1 one shift.
template <int Bits>
inline void unpack_pair(const uint8_t* __restrict qb, int64_t k, __m512 levels, __m512& even, __m512& odd) {
  if constexpr (Bits == 4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(qb + k * 8)));
    even = _mm512_permutexvar_ps(v, levels);
    odd = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), levels);
  } else {
    even = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(qb + k * 16))));
    odd = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(qb + k * 16 + 16))));
  }
}

// A record's d (16 scales) and m (16 offsets; 0 for 8 bits) as floats: fp16 ones converted
// exactly (vcvtph2ps, AVX-512 F), float ones loaded.
template <int Bits, bool Half>
inline void record_scales(const uint8_t* __restrict rec, __m512& d, __m512& m) {
  if constexpr (Bits == 4 && Half) {
    d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(rec)));
    m = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(rec + 32)));
  } else {
    const float* s = reinterpret_cast<const float*>(rec);
    d = _mm512_load_ps(s);
    m = Bits == 4 ? _mm512_load_ps(s + 16) : _mm512_setzero_ps();
  }
}

// One row's 16 outputs y[0..16) take a block (add_block above, one register wide).
template <int Bits>
inline void add_block(float* y, __m512 t, __m512 d, __m512 m, const float* s) {
  __m512 acc = _mm512_loadu_ps(y);
  if constexpr (Bits == 4) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(*s), acc);
  _mm512_storeu_ps(y, _mm512_fmadd_ps(d, t, acc));
}

// R rows (R <= 16) times one block-quantized panel over all of k: each row of q is unpacked into
// a register and multiplied into the R block sums at once; the scales are applied into y once per
// block (the arithmetic of block_rows' comment). rec is the panel's first record; xt the group's
// packed x ([K][R]), sums its rows' block sums ([R][K / 32]); the rows' outputs are y[r ldy ..].
template <int R, int Bits, bool Half>
inline void fused_panel(const float* __restrict xt, const float* __restrict sums, int64_t K,
                        const uint8_t* __restrict rec, float* __restrict y, int64_t ldy) {
  constexpr int64_t kRec = record_bytes<Bits, Half>();
  constexpr int64_t kAheadBytes = 4 * kRec;
  const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t blocks = K / kBlock;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_setzero_ps());
  for (int64_t b = 0; b < blocks; ++b, rec += kRec) {
    for (int64_t line = 0; line < kRec; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + kAheadBytes + line), _MM_HINT_T0);
    const uint8_t* qb = rec + scale_bytes<Bits, Half>();
    const float* xb = xt + b * kBlock * R;
    __m512 t[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t k = 0; k < kBlock; k += 2) {
      __m512 q[2];
      unpack_pair<Bits>(qb, k, levels, q[0], q[1]);
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {  // row k, then row k + 1
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) t[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[(k + i) * R + r]), q[i], t[r]);
      }
    }
    __m512 d, m;
    record_scales<Bits, Half>(rec, d, m);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) add_block<Bits>(y + r * ldy, t[r], d, m, sums + r * blocks + b);
  }
}

// 1-3 rows times 4 adjacent block-quantized panels over all of k. With one panel a row's block
// sum is one FMA chain, 4 cycles a k step whatever else runs: a 1-row pass would wait on that
// latency. Four panels are four independent chains and four read streams, and each output's
// arithmetic is unchanged (a 1-row pass: 0.81x the time of one panel at a time,
// benchmarks/results/kernel_isa_amx.md). rec is panel 0's first record, pstride the bytes from one
// panel's records to the next's.
template <int R, int Bits, bool Half>
inline void fused_four(const float* __restrict xt, const float* __restrict sums, int64_t K,
                       const uint8_t* __restrict rec, int64_t pstride, float* __restrict y, int64_t ldy) {
  constexpr int64_t kRec = record_bytes<Bits, Half>();
  constexpr int64_t kAheadBytes = 4 * kRec;
  const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const uint8_t* const recs[4] = {rec, rec + pstride, rec + 2 * pstride, rec + 3 * pstride};
  const int64_t blocks = K / kBlock;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(y + r * ldy + kPanel * g, _mm512_setzero_ps());
  for (int64_t b = 0, off = 0; b < blocks; ++b, off += kRec) {
    for (int64_t line = 0; line < kRec; line += 64)
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) _mm_prefetch(reinterpret_cast<const char*>(recs[g] + off + kAheadBytes + line), _MM_HINT_T0);
    const int64_t qoff = off + scale_bytes<Bits, Half>();
    const float* xb = xt + b * kBlock * R;
    __m512 t[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = t[r][2] = t[r][3] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t k = 0; k < kBlock; k += 2) {
      __m512 q[4][2];
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) unpack_pair<Bits>(recs[g] + qoff, k, levels, q[g][0], q[g][1]);
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {  // row k, then row k + 1
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(xb[(k + i) * R + r]);
#pragma GCC unroll 4
          for (int g = 0; g < 4; ++g) t[r][g] = _mm512_fmadd_ps(xv, q[g][i], t[r][g]);
        }
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      __m512 d, m;
      record_scales<Bits, Half>(recs[g] + off, d, m);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) add_block<Bits>(y + r * ldy + kPanel * g, t[r][g], d, m, sums + r * blocks + b);
    }
  }
}

constexpr int64_t kFusedRows = 16;  // rows per fused group: 16 block sums + d, m, levels, q

template <int Bits, bool Half, int R = kFusedRows>
inline void fused_rows(const float* xt, const float* sums, int64_t rows, int64_t K, const uint8_t* rec, float* y,
                       int64_t ldy) {
  if constexpr (R > 0) {
    if (rows == R) fused_panel<R, Bits, Half>(xt, sums, K, rec, y, ldy);
    else fused_rows<Bits, Half, R - 1>(xt, sums, rows, K, rec, y, ldy);
  }
}

// Block-quantized panels [p0, p1) for all M rows (xt: block_rows' packing in groups of
// kFusedRows): 1-3 rows four panels at a time, more rows (and the last 1-3 panels) one panel
// and 16 rows at a time (the panel's records are in L1 after the first group of rows).
template <int Bits, bool Half>
void block_panels(const float* xt, const float* sums, int64_t M, int64_t K, const uint8_t* blob, int64_t p0,
                  int64_t p1, float* y, int64_t ldy) {
  constexpr int64_t kRec = record_bytes<Bits, Half>();
  const int64_t blocks = K / kBlock, pstride = blocks * kRec;
  int64_t p = p0;
  if (M <= 3) {
    for (; p + 4 <= p1; p += 4) {
      const uint8_t* rec = blob + p * pstride;
      float* yp = y + kPanel * p;
      if (M == 1) fused_four<1, Bits, Half>(xt, sums, K, rec, pstride, yp, ldy);
      else if (M == 2) fused_four<2, Bits, Half>(xt, sums, K, rec, pstride, yp, ldy);
      else fused_four<3, Bits, Half>(xt, sums, K, rec, pstride, yp, ldy);
    }
  }
  for (; p < p1; ++p) {
    const uint8_t* rec = blob + p * pstride;
    for (int64_t r = 0; r < M; r += kFusedRows)
      fused_rows<Bits, Half>(xt + r * K, sums + r * blocks, std::min(kFusedRows, M - r), K, rec,
                             y + r * ldy + kPanel * p, ldy);
  }
}

}  // namespace avx512
#pragma GCC pop_options

// AMX: integer blocks times x rounded to bf16, on the CPU's tile unit (amx_linear_blocks below).
// Each block's 32 products of one row go through one TDPBF16PS into a fresh tile (q as bf16 is
// exact: |q| < 256), then the block is scaled into y as on the vector code:
// y = fma(d, t, fma(m, sx, y)) (8 bits: fma(d, t, y)), where t is the tile's dot product and sx
// the block's sum of the rounded x (fp32, k order). A tile row's dot product depends only on
// that row and the weights, so a row gets the same bits alone or among 15 others in a tile, in
// any row group; the order inside the unit is the hardware's, so the bits are this code's own
// (tests compare them with float64 within a bound and row against row for equality).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
namespace amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kRows = 16;       // rows of x per tile
constexpr int kRing = 4;        // unpacked weight tiles in flight
constexpr int64_t kFetch = 8;   // records prefetched ahead: one thread reads one stream, and without
                                // it a 1-row pass ran slower than on the vector block kernel
constexpr int kAhead = 2;       // blocks unpacked ahead of the one multiplied: a tile load right
                                // after the stores that wrote its data waits for them to retire

// tiles 0, 1: y's block sums (rows x 16 fp32); 2, 3: x (rows x 32 bf16); 4, 5: q (16 pairs of
// k values x 16 columns, bf16). Even blocks use 0, 2, 4, odd ones 1, 3, 5, so a block's tile
// is read back while the next one multiplies.
inline void configure(int rows) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) { c.rows[t] = rows; c.colsb[t] = 64; }
  for (int t = 4; t < 6; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// A block's q (the record after its scales) as the bf16 tile TDPBF16PS takes: row kk holds, for
// each column n, q[2 kk][n] and q[2 kk + 1][n] (the pair layout 4-bit records already have).
template <int Bits>
inline void unpack(const uint8_t* q, uint16_t* out) {
  if constexpr (Bits == 4) {
    alignas(64) static const uint16_t kTable[32] = {   // bf16 of 0..15, twice
        0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130,
        0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
        0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i table = _mm512_load_si512(kTable), nibbles = _mm512_set1_epi32(0x000F000F);
#pragma GCC unroll 16
    for (int kk = 0; kk < 16; ++kk) {
      // byte n -> 32-bit lane n: low nibble in bits 0-3, high nibble in bits 16-19
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * kk)));
      const __m512i idx = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), nibbles, 0xA8);  // (a | b) & c
      _mm512_store_si512(out + 32 * kk, _mm512_permutexvar_epi16(idx, table));
    }
  } else {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
#pragma GCC unroll 16
    for (int kk = 0; kk < 16; ++kk) {
      // int8 -> fp32 is exact, and so is its top half (at most 8 significant bits): bf16
      const __m512 even = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * kk))));
      const __m512 odd = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * kk + 16))));
      _mm512_store_si512(out + 32 * kk, _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(even), 16),
                                                                  _mm512_castps_si512(odd), high, 0xF8));  // a | (b & c)
    }
  }
}

template <int Bits, bool Half>
inline __m512 load_scale(const uint8_t* p) {
  if constexpr (Half) return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
  else return _mm512_load_ps(reinterpret_cast<const float*>(p));
}

// Panels [p0, p1) for one group of rows <= kRows (xb: their bf16 rows, stride K; sx: their block
// sums of x, stride K / 32). The tile configuration for `rows` is loaded by the caller.
template <int Bits, bool Half>
void panels(const uint16_t* xb, const float* sx, int rows, int64_t K, const uint8_t* blob, int64_t p0, int64_t p1,
            float* y, int64_t ldy) {
  constexpr int64_t kRec = record_bytes<Bits, Half>(), kScale = scale_bytes<Bits, Half>();
  constexpr int64_t kOffset = Half ? 32 : 64;    // m after d (4 bits)
  const int64_t nb = K / kBlock, total = (p1 - p0) * nb;
  const uint8_t* base = blob + p0 * nb * kRec;   // records in (panel, block) order, contiguous
  alignas(64) uint16_t ring[kRing][kBlock * kPanel];
  alignas(64) float tile_out[kRows * kPanel];
  __m512 acc[kRows];
  for (int64_t i = 0; i < std::min<int64_t>(kAhead, total); ++i) unpack<Bits>(base + i * kRec + kScale, ring[i % kRing]);
  auto drain = [&](int64_t i) {   // block i's tile into y
    if (i & 1) _tile_stored(1, tile_out, 64);
    else _tile_stored(0, tile_out, 64);
    const int64_t b = i % nb;
    const uint8_t* rec = base + i * kRec;
    const __m512 d = load_scale<Bits, Half>(rec);
    if (b == 0) for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    if constexpr (Bits == 4) {
      const __m512 m = load_scale<Bits, Half>(rec + kOffset);
      for (int r = 0; r < rows; ++r)
        acc[r] = _mm512_fmadd_ps(d, _mm512_load_ps(tile_out + kPanel * r),
                                 _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), acc[r]));
    } else {
      for (int r = 0; r < rows; ++r) acc[r] = _mm512_fmadd_ps(d, _mm512_load_ps(tile_out + kPanel * r), acc[r]);
    }
    if (b == nb - 1) {
      float* yp = y + kPanel * (p0 + i / nb);
      for (int r = 0; r < rows; ++r) _mm512_storeu_ps(yp + r * ldy, acc[r]);
    }
  };
  for (int64_t i = 0; i < total; ++i) {
    if (i + kFetch < total)   // one record's lines a block: a single stream needs reads in flight
      for (int64_t line = 0; line < kRec; line += 64) _mm_prefetch(reinterpret_cast<const char*>(base + (i + kFetch) * kRec + line), _MM_HINT_T0);
    if (i + kAhead < total) unpack<Bits>(base + (i + kAhead) * kRec + kScale, ring[(i + kAhead) % kRing]);
    const uint16_t* xk = xb + (i % nb) * kBlock;
    if (i & 1) {
      _tile_loadd(5, ring[i % kRing], 64);
      _tile_loadd(3, xk, K * 2);
      _tile_zero(1);
      _tile_dpbf16ps(1, 3, 5);
    } else {
      _tile_loadd(4, ring[i % kRing], 64);
      _tile_loadd(2, xk, K * 2);
      _tile_zero(0);
      _tile_dpbf16ps(0, 2, 4);
    }
    if (i > 0) drain(i - 1);
  }
  if (total > 0) drain(total - 1);
}

// x [M, K] -> its rows rounded to bf16 (round to nearest even) and, for 4 bits, each row's block
// sums of the rounded values (fp32, in k order).
void round_rows(const float* x, int64_t M, int64_t K, uint16_t* xb, float* sx) {
  for (int64_t i = 0; i < M * K; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i), reinterpret_cast<const __m256i&>(h));
  }
  if (sx == nullptr) return;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < K / kBlock; ++b) {
      float s = 0.0f;
      for (int64_t k = 0; k < kBlock; ++k) {
        const uint32_t bits = static_cast<uint32_t>(xb[r * K + b * kBlock + k]) << 16;
        float v;
        std::memcpy(&v, &bits, 4);
        s += v;
      }
      sx[r * (K / kBlock) + b] = s;
    }
}

template <int Bits, bool Half>
void linear(const uint16_t* xb, const float* sx, int64_t M, int64_t K, const uint8_t* blob, int64_t P, float* y,
            int64_t ldy) {
  const int64_t nb = K / kBlock;
  for (int64_t g = 0; g < M; g += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, M - g));
    at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) {
      configure(rows);   // per thread: the tile state is a thread's own
      panels<Bits, Half>(xb + g * K, sx + g * nb, rows, K, blob, p0, p1, y + g * ldy, ldy);
      _tile_release();
    });
  }
}

}  // namespace amx
#pragma GCC pop_options

// exp(x) for x <= 0 as the row kernels of both ISAs compute it (Cephes' expf): x = n ln2 + r
// (ln2 split in two parts), then a degree-7 polynomial in r, times 2^n.
namespace exp_poly {
constexpr float kFloor = -87.3f;   // below it the result is 0 (under fp32's normal range)
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kC[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_poly

// Row attention: softmax(scale q K^T) V for each query row over the keys its mask allows, in
// increasing key order. A row's output depends only on that row's query and the allowed keys and
// values (rows() below: the same operations in the same order for a row alone or among others),
// so a tree node's row is the same bits as the one-token step that decodes the same path: the
// cache then holds the same keys, in the same order. PyTorch's SDPA multiplies a pass's rows as
// one small GEMM, whose order of additions may depend on the row count (row_attention below).
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace row_attn {

// exp(x) for x <= 0, lane by lane (exp_poly; 2^n by scalef); below exp_poly::kFloor it is 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 floor = _mm512_set1_ps(exp_poly::kFloor);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ);
  x = _mm512_max_ps(x, floor);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(exp_poly::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(exp_poly::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(exp_poly::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(exp_poly::kC[0]);
#pragma GCC unroll 5
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(exp_poly::kC[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// Sixteen keys' scores at once: slot i's chain of V FMAs (q.k over 16 V values) sums into lane
// i's dot product through one fixed tree (x[l] + x[l + 8], then + 4, + 2, + 1 lanes apart, the
// same shape for every slot). The tree leaves slot i's sum in lane (i % 4) * 4 + i / 4, so slot i
// takes key (i % 4) * 4 + i / 4 of the block, and lane l holds key l's score. A key's score
// depends only on q and that key: the same bits in any block position and for any key count.
inline int slot_key(int i) { return (i % 4) * 4 + i / 4; }

inline __m512 reduce16(__m512* a) {
  __m512 h[8], g[4], f[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)   // 256-bit halves: [a_2i lo + hi, a_2i+1 lo + hi]
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)   // 128-bit quarters: four slots' 4-lane sums
    g[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xDD));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)   // pairs of lanes
    f[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(g[2 * i]), _mm512_castps_pd(g[2 * i + 1]))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(g[2 * i]), _mm512_castps_pd(g[2 * i + 1]))));
  return _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], 0x88), _mm512_shuffle_ps(f[0], f[1], 0xDD));
}

// Rows of one key/value head: up to kRowGroup query rows (each with its allowed keys, increasing)
// times the G query heads that read that head. Each (row, head) pair gets the same operations in
// the same order as it would alone: scores sixteen keys a block (reduce16), scaled, their maximum,
// the exponentials lane by lane, their sum over blocks in key order, then the weighted values
// summed over even and over odd keys (two chains per register of o), each in key order, and
// added. Only the loop order is shared: key block outer, rows and heads inner, so a block's keys
// and values are read from memory once for every row and head that sees them (a tree pass's rows
// share their prefix), then from L1. k, v: that key/value head's keys and values (key j at
// + j * ks, + j * vs); s: the scores, (row r, head h) at + (r * G + h) * spad; accs: the weighted
// values' chains, 2 V registers a (row, head), kept between key blocks.
constexpr int kRowGroup = 16;

struct Rows {
  int n = 0;                             // rows
  int G = 0;                             // query heads in this call, all of one key/value head (<= 16)
  const float* q[kRowGroup] = {};        // row r's query of head 0 (head h at + h * qh)
  int64_t qh = 0;
  float* o[kRowGroup] = {};              // row r's output of head 0 (head h at + h * oh)
  int64_t oh = 0;
  const int32_t* keys[kRowGroup] = {};   // row r's allowed keys
  int64_t nk[kRowGroup] = {};
};

// The rows of keys [a, a + 16) of a key list (x: keys or values, row j at + j * stride, 16 V floats).
inline void prefetch_block(const float* x, int64_t stride, int V, const int32_t* keys, int64_t nk, int64_t a) {
  for (int64_t j = a; j < std::min(a + 16, nk); ++j)
    for (int c = 0; c < V; ++c) _mm_prefetch(reinterpret_cast<const char*>(x + keys[j] * stride + 16 * c), _MM_HINT_T0);
}

template <int V>
void rows(const Rows& R, const float* k, int64_t ks, const float* v, int64_t vs, float scale, float* s,
          int64_t spad, float* accs) {
  const int G = R.G;
  int64_t most = 0;
  for (int r = 0; r < R.n; ++r) most = std::max(most, R.nk[r]);
  const __m512 scl = _mm512_set1_ps(scale);
  alignas(64) float tops[kRowGroup * 16 * 16];   // G <= 16
  for (int i = 0; i < R.n * G; ++i) _mm512_store_ps(tops + 16 * i, _mm512_set1_ps(-INFINITY));
  for (int64_t a = 0; a < most; a += 16) {
    prefetch_block(k, ks, V, R.keys[0], R.nk[0], a + 16);
    for (int r = 0; r < R.n; ++r) {
      if (a >= R.nk[r]) continue;
      const int n = static_cast<int>(std::min<int64_t>(16, R.nk[r] - a));
      const int32_t* keys = R.keys[r] + a;
      const __mmask16 live = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      for (int h = 0; h < G; ++h) {
        const float* q = R.q[r] + h * R.qh;
        __m512 qv[V], acc[16];
#pragma GCC unroll 16
        for (int c = 0; c < V; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          const int j = slot_key(i);
          if (j < n) {
            const float* kj = k + keys[j] * ks;
            acc[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kj));
#pragma GCC unroll 16
            for (int c = 1; c < V; ++c) acc[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kj + 16 * c), acc[i]);
          } else {
            acc[i] = _mm512_setzero_ps();
          }
        }
        const __m512 sc = _mm512_mul_ps(reduce16(acc), scl);
        const int i = r * G + h;
        _mm512_storeu_ps(s + i * spad + a, sc);
        _mm512_store_ps(tops + 16 * i, _mm512_mask_max_ps(_mm512_load_ps(tops + 16 * i), live, _mm512_load_ps(tops + 16 * i), sc));
      }
    }
  }
  alignas(64) float inv[kRowGroup * 16];
  for (int r = 0; r < R.n; ++r) {
    const int64_t nk = R.nk[r];
    for (int h = 0; h < G; ++h) {
      const int i = r * G + h;
      float* si = s + i * spad;
      const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_load_ps(tops + 16 * i)));
      __m512 total = _mm512_setzero_ps();
      for (int64_t a = 0; a < nk; a += 16) {
        const __mmask16 live = nk - a >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nk - a)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, si + a), shift)));
        _mm512_mask_storeu_ps(si + a, live, e);
        total = _mm512_add_ps(total, e);
      }
      inv[i] = 1.0f / _mm512_reduce_add_ps(total);
      for (int c = 0; c < 2 * V; ++c) _mm512_storeu_ps(accs + (i * 2 * V + c) * 16, _mm512_setzero_ps());
    }
  }
  for (int64_t a0 = 0; a0 < most; a0 += 16) {
    prefetch_block(v, vs, V, R.keys[0], R.nk[0], a0 + 16);
    for (int r = 0; r < R.n; ++r) {
      const int64_t end = std::min<int64_t>(a0 + 16, R.nk[r]);
      if (a0 >= end) continue;
      const int32_t* keys = R.keys[r];
      for (int h = 0; h < G; ++h) {
        const int i = r * G + h;
        const float* si = s + i * spad;
        float* ai = accs + i * 2 * V * 16;
        __m512 even[V], odd[V];
#pragma GCC unroll 16
        for (int c = 0; c < V; ++c) {
          even[c] = _mm512_loadu_ps(ai + 16 * c);
          odd[c] = _mm512_loadu_ps(ai + 16 * (V + c));
        }
        int64_t a = a0;
        for (; a + 2 <= end; a += 2) {
          const __m512 w0 = _mm512_set1_ps(si[a]), w1 = _mm512_set1_ps(si[a + 1]);
          const float* v0 = v + keys[a] * vs;
          const float* v1 = v + keys[a + 1] * vs;
#pragma GCC unroll 16
          for (int c = 0; c < V; ++c) {
            even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * c), even[c]);
            odd[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + 16 * c), odd[c]);
          }
        }
        if (a < end) {   // the row's last key, when its count is odd
          const __m512 w0 = _mm512_set1_ps(si[a]);
          const float* v0 = v + keys[a] * vs;
#pragma GCC unroll 16
          for (int c = 0; c < V; ++c) even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * c), even[c]);
        }
        if (end == R.nk[r]) {
          const __m512 w = _mm512_set1_ps(inv[i]);
          float* o = R.o[r] + h * R.oh;
#pragma GCC unroll 16
          for (int c = 0; c < V; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_add_ps(even[c], odd[c]), w));
        } else {
#pragma GCC unroll 16
          for (int c = 0; c < V; ++c) {
            _mm512_storeu_ps(ai + 16 * c, even[c]);
            _mm512_storeu_ps(ai + 16 * (V + c), odd[c]);
          }
        }
      }
    }
  }
}

// The keys j < S with mr[j * stride] true, in increasing order, into out; returns their count.
inline int64_t allowed_keys(const bool* mr, int64_t stride, int64_t S, int32_t* out) {
  int64_t j = 0, n = 0;
  if (stride == 1) {   // sixteen mask bytes at a time
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; j + 16 <= S; j += 16) {
      const __mmask16 on = _mm512_cmpneq_epi32_mask(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mr + j))), _mm512_setzero_si512());
      _mm512_mask_compressstoreu_epi32(out + n, on, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(j))));
      n += __builtin_popcount(on);
    }
  }
  for (; j < S; ++j)
    if (mr[j * stride]) out[n++] = static_cast<int32_t>(j);
  return n;
}

using RowsFn = void (*)(const Rows&, const float*, int64_t, const float*, int64_t, float, float*, int64_t, float*);

// rows<d / 16> (d a multiple of 16, at most 256)
inline RowsFn rows_for(int64_t d) {
  switch (d / 16) {
    case 1: return rows<1>;
    case 2: return rows<2>;
    case 3: return rows<3>;
    case 4: return rows<4>;
    case 5: return rows<5>;
    case 6: return rows<6>;
    case 7: return rows<7>;
    case 8: return rows<8>;
    case 10: return rows<10>;
    case 12: return rows<12>;
    case 16: return rows<16>;
    default: return nullptr;
  }
}

}  // namespace row_attn
#pragma GCC pop_options

// Row attention on AVX2 (the same contract as row_attn's, its own order of operations: a row's
// bits here differ from the AVX-512 code's, and agree with themselves for a row alone or among
// others). Per (row, head): each allowed key's score is one FMA chain over d (8 lanes) reduced by
// one fixed tree, times the scale; the exponentials of the scores minus their maximum, 8 keys at a
// time, summed per lane in key order and the 8 lanes by the same tree; the weighted values summed
// over even and over odd keys in key order, added, times 1 / the sum. Keys are read per (row,
// head) pair: a key/value head's block stays in cache across its query heads and the pass's rows.
namespace row_attn2 {

// The 8 lanes of x summed by one fixed tree: (lanes l and l + 4), then (l, l + 2), then (0, 1).
inline float reduce8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0, lane by lane (exp_poly, as row_attn::exp_nonpositive does, 2^n
// built in the exponent field, n >= -126); below exp_poly::kFloor it is 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 floor = _mm256_set1_ps(exp_poly::kFloor);
  const __m256 tiny = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(exp_poly::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(exp_poly::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(exp_poly::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(exp_poly::kC[0]);
#pragma GCC unroll 5
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_poly::kC[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// One (row, head): q and o d = 8 V floats; keys[0, nk) allowed (nk >= 1); s: nk + 8 floats of scratch.
template <int V>
void one(const float* q, float* o, const int32_t* keys, int64_t nk, const float* k, int64_t ks, const float* v,
         int64_t vs, float scale, float* s) {
  __m256 qv[V];
#pragma GCC unroll 32
  for (int c = 0; c < V; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  float top = -INFINITY;
  for (int64_t j = 0; j < nk; ++j) {
    const float* kj = k + keys[j] * ks;
    __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kj));
#pragma GCC unroll 32
    for (int c = 1; c < V; ++c) acc = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kj + 8 * c), acc);
    s[j] = reduce8(acc) * scale;
    top = std::max(top, s[j]);
  }
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t a = 0; a < nk; a += 8) {   // 8 keys a register; the tail's lanes past nk are 0
    const int64_t n = std::min<int64_t>(8, nk - a);
    alignas(32) float buf[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::memcpy(buf, s + a, n * sizeof(float));
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(buf), shift));
    _mm256_store_ps(buf, e);
    for (int64_t i = n; i < 8; ++i) buf[i] = 0.f;
    e = _mm256_load_ps(buf);
    std::memcpy(s + a, buf, n * sizeof(float));
    total = _mm256_add_ps(total, e);
  }
  const __m256 w = _mm256_set1_ps(1.0f / reduce8(total));
  __m256 even[V], odd[V];
#pragma GCC unroll 32
  for (int c = 0; c < V; ++c) even[c] = odd[c] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= nk; j += 2) {
    const __m256 w0 = _mm256_set1_ps(s[j]), w1 = _mm256_set1_ps(s[j + 1]);
    const float* v0 = v + keys[j] * vs;
    const float* v1 = v + keys[j + 1] * vs;
#pragma GCC unroll 32
    for (int c = 0; c < V; ++c) {
      even[c] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 8 * c), even[c]);
      odd[c] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v1 + 8 * c), odd[c]);
    }
  }
  if (j < nk) {
    const __m256 w0 = _mm256_set1_ps(s[j]);
    const float* v0 = v + keys[j] * vs;
#pragma GCC unroll 32
    for (int c = 0; c < V; ++c) even[c] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v0 + 8 * c), even[c]);
  }
#pragma GCC unroll 32
  for (int c = 0; c < V; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_add_ps(even[c], odd[c]), w));
}

using OneFn = void (*)(const float*, float*, const int32_t*, int64_t, const float*, int64_t, const float*, int64_t,
                       float, float*);

// one<d / 8> for the head sizes row_attn::rows_for takes (multiples of 16 up to 256)
inline OneFn one_for(int64_t d) {
  switch (d / 16) {
    case 1: return one<2>;
    case 2: return one<4>;
    case 3: return one<6>;
    case 4: return one<8>;
    case 5: return one<10>;
    case 6: return one<12>;
    case 7: return one<14>;
    case 8: return one<16>;
    case 10: return one<20>;
    case 12: return one<24>;
    case 16: return one<32>;
    default: return nullptr;
  }
}

// row_attn::allowed_keys without AVX-512.
inline int64_t allowed_keys(const bool* mr, int64_t stride, int64_t S, int32_t* out) {
  int64_t n = 0;
  for (int64_t j = 0; j < S; ++j)
    if (mr[j * stride]) out[n++] = static_cast<int32_t>(j);
  return n;
}

}  // namespace row_attn2

// Linux hands out the tile registers' state on request only (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA), once per process; false where the kernel or the CPU refuses.
bool amx_permitted() {
  static const bool ok = [] {
#ifdef __linux__
    constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

}  // namespace

// x [M, K] float32 contiguous; wp [P, K, 16] float32 contiguous -> y [M, 16 P].
// 1-3 rows are memory-bound: they read 4, 3 or 2 panels at once (more read streams in flight,
// 15-20 % faster here); more rows are compute-bound and use 6-row blocks over one panel.
// isa: 0 = the AVX2 kernels, 1 = the AVX-512 ones (only on a CPU with AVX-512 F;
// the caller checks). The outputs are the same bits either way.
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& wp, int64_t isa) {
  TORCH_CHECK(isa == 0 || isa == 1, "panel_linear: isa must be 0 (AVX2) or 1 (AVX-512), got ", isa);
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
    if (isa == 1) return avx512::panel_linear(xp, M, K, w, p0, p1, yp, ldy);
    int64_t p = p0;
    if (M == 1) p = panels<Avx2Tiles, 1, 4>(xp, M, K, w, p, p1, yp, ldy);
    else if (M == 2) p = panels<Avx2Tiles, 2, 3>(xp, M, K, w, p, p1, yp, ldy);
    else if (M == 3) p = panels<Avx2Tiles, 3, 2>(xp, M, K, w, p, p1, yp, ldy);
    panels<Avx2Tiles, 6, 1>(xp, M, K, w, p, p1, yp, ldy);  // every panel when M > 3, else the leftovers
  });
  return y;
}

// The arguments panel_linear_blocks and amx_linear_blocks share: x [M, K] float32 and a blob of
// `bits`-bit records (see panel_linear_blocks) that matches it.
void check_blocks(const char* name, const torch::Tensor& x, const torch::Tensor& blob, int64_t bits, bool half_scales) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, name, ": bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(bits == 4 || !half_scales, name, ": fp16 scales are a 4-bit record kind");
  TORCH_CHECK(x.dim() == 2 && blob.dim() == 3, name, ": x [M, K], blob [P, K / 32, record]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && blob.scalar_type() == at::kByte, name, ": x float32, blob uint8");
  TORCH_CHECK(x.is_contiguous() && blob.is_contiguous(), name, ": contiguous inputs only");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0 && blob.size(1) == K / kBlock, name, ": x has K = ", K, ", the blob ", blob.size(1),
              " blocks of ", kBlock);
  const int64_t rec = bits == 8 ? record_bytes<8, false>() : bits == 6 ? record_bytes<6, false>()
                      : half_scales ? record_bytes<4, true>() : record_bytes<4, false>();
  TORCH_CHECK(blob.size(2) == rec, name, ": ", bits, "-bit records are ", rec, " bytes, got ", blob.size(2));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(blob.data_ptr()) % 64 == 0, name, ": blob must be 64-byte aligned");
}

// x [M, K] float32; blob uint8 [P, K / 32, record]: per panel p and block of 32 k values, one
// 64-byte-aligned record of d[16] floats, m[16] floats (4 bits only; 0 for 8 bits) and q for the
// 32 rows (4 bits: 16 bytes a pair of rows k, k + 1 (k even), byte j = column j, row k in its
// low nibble and row k + 1 in its high one; 8 bits: 16 signed bytes a row). half_scales (4 bits
// only): d and m as 16 fp16 numbers each instead of floats (a 320-byte record, not 384).
// W[16 p + j, k] = d[j] q[k][j] + m[j] exactly. 6 bits (GGUF Q6_K): q as for 8 bits, d[16] for
// rows 0-15 and d[16] for rows 16-31 (a 640-byte record); the AVX2 code runs it on every CPU.
// Returns y [M, 16 P], with the arithmetic of block_rows' comment: the same bits on the AVX2 and
// the AVX-512 code, for a row alone or among any others.
torch::Tensor panel_linear_blocks(const torch::Tensor& x, const torch::Tensor& blob, int64_t bits, int64_t isa,
                                  bool half_scales) {
  TORCH_CHECK(isa == 0 || isa == 1, "panel_linear_blocks: isa must be 0 (AVX2) or 1 (AVX-512), got ", isa);
  check_blocks("panel_linear_blocks", x, blob, bits, half_scales);
  const int64_t M = x.size(0), K = x.size(1), P = blob.size(0), ldy = kPanel * P;
  auto y = torch::empty({M, ldy}, x.options());
  if (M == 0) return y;
  // x packed once for every thread: in the row groups of the code that runs
  // (uninitialized: block_rows writes every value the kernels read)
  std::unique_ptr<float[]> packed(new float[M * K + M * (K / kBlock)]);
  float* xt = packed.get();
  float* sums = xt + M * K;
  const bool wide = isa == 1 && bits != 6;
  block_rows(x.data_ptr<float>(), M, K, wide ? avx512::kFusedRows : avx2_group(M), xt, bits == 4 ? sums : nullptr);
  const uint8_t* bp = blob.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  auto run = [&](auto bits_tag, auto half_tag) {
    constexpr int B = decltype(bits_tag)::value;
    constexpr bool H = decltype(half_tag)::value;
    at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) {
      if constexpr (B == 6) block_panels_avx2<B, H>(xt, sums, M, K, bp, p0, p1, yp, ldy);
      else if (wide) avx512::block_panels<B, H>(xt, sums, M, K, bp, p0, p1, yp, ldy);
      else block_panels_avx2<B, H>(xt, sums, M, K, bp, p0, p1, yp, ldy);
    });
  };
  if (bits == 8) run(std::integral_constant<int, 8>{}, std::false_type{});
  else if (bits == 6) run(std::integral_constant<int, 6>{}, std::false_type{});
  else if (half_scales) run(std::integral_constant<int, 4>{}, std::true_type{});
  else run(std::integral_constant<int, 4>{}, std::false_type{});
  return y;
}

// x [M, K] float32; blob as panel_linear_blocks'. y = x @ W^T on the AMX tile unit with x rounded
// to bf16 (the amx namespace's comment): a different product from panel_linear_blocks' (x keeps
// 8 significant bits), the same bits for a row alone or among any others. Only on a CPU with
// amx_bf16 and avx512_bf16 whose OS grants the tile state (amx_permitted(); the caller checks).
torch::Tensor amx_linear_blocks(const torch::Tensor& x, const torch::Tensor& blob, int64_t bits, bool half_scales) {
  check_blocks("amx_linear_blocks", x, blob, bits, half_scales);
  TORCH_CHECK(bits != 6, "amx_linear_blocks: 6-bit records (a scale per 16 k values) run on panel_linear_blocks");
  const int64_t M = x.size(0), K = x.size(1), P = blob.size(0), ldy = kPanel * P;
  TORCH_CHECK(amx_permitted(), "amx_linear_blocks: the OS did not grant the AMX tile state to this process");
  auto y = torch::empty({M, ldy}, x.options());
  if (M == 0) return y;
  const int64_t nb = K / kBlock;
  // rows rounded to bf16 (M K is a multiple of 32, the vector conversion's 16), block sums of x
  std::unique_ptr<uint16_t[]> xb(new uint16_t[M * K]);
  std::unique_ptr<float[]> sx(new float[M * nb]);
  const float* xp = x.data_ptr<float>();
  amx::round_rows(xp, M, K, xb.get(), bits == 4 ? sx.get() : nullptr);
  const uint8_t* bp = blob.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (bits == 8) amx::linear<8, false>(xb.get(), sx.get(), M, K, bp, P, yp, ldy);
  else if (half_scales) amx::linear<4, true>(xb.get(), sx.get(), M, K, bp, P, yp, ldy);
  else amx::linear<4, false>(xb.get(), sx.get(), M, K, bp, P, yp, ldy);
  return y;
}

// x [M, K] float32; blob: panel_linear_blocks' records with q regrouped as the q8 namespace's
// comment says (kernels.x8_records). y = x @ W^T with x rounded to 8-bit integers per block of
// 32 (the q8 namespace's arithmetic): a different product from panel_linear_blocks', the same bits
// for a row alone or among any others. AVX2 (every CPU the other kernels run on).
torch::Tensor x8_linear_blocks(const torch::Tensor& x, const torch::Tensor& blob, int64_t bits, bool half_scales,
                               bool sub_scales) {
  if (sub_scales) {
    TORCH_CHECK(bits == 4 || bits == 6, "x8_linear_blocks: x8k records are 4- or 6-bit, got ", bits);
    TORCH_CHECK(!half_scales, "x8_linear_blocks: x8k records have fp32 super-block scales, not fp16 ones");
    TORCH_CHECK(x.dim() == 2 && blob.dim() == 3, "x8_linear_blocks: x [M, K], blob [P, K / 256, record]");
    TORCH_CHECK(x.scalar_type() == at::kFloat && blob.scalar_type() == at::kByte, "x8_linear_blocks: x float32, blob uint8");
    TORCH_CHECK(x.is_contiguous() && blob.is_contiguous(), "x8_linear_blocks: contiguous inputs only");
    TORCH_CHECK(x.size(1) % (kSuper * kBlock) == 0 && blob.size(1) == x.size(1) / (kSuper * kBlock),
                "x8_linear_blocks: x has K = ", x.size(1), ", the blob ", blob.size(1), " super-blocks of 256");
    const int64_t rec = bits == 4 ? super_bytes<4>() : super_bytes<6>();
    TORCH_CHECK(blob.size(2) == rec, "x8_linear_blocks: ", bits, "-bit x8k records are ", rec, " bytes, got ", blob.size(2));
    TORCH_CHECK(reinterpret_cast<uintptr_t>(blob.data_ptr()) % 64 == 0, "x8_linear_blocks: blob must be 64-byte aligned");
  } else {
    check_blocks("x8_linear_blocks", x, blob, bits, half_scales);
  }
  const int64_t M = x.size(0), K = x.size(1), P = blob.size(0), ldy = kPanel * P;
  auto y = torch::empty({M, ldy}, x.options());
  if (M == 0) return y;
  const int64_t nb = K / kBlock;
  const bool halves = sub_scales && bits == 6;
  std::unique_ptr<int8_t[]> qx(new int8_t[M * K]);
  std::unique_ptr<float[]> scales(new float[2 * M * nb]);
  std::unique_ptr<int32_t[]> s16(halves ? new int32_t[2 * M * nb] : nullptr);
  float* dx = scales.get();
  float* sx = dx + M * nb;
  x8::round_rows(x.data_ptr<float>(), M, K, qx.get(), dx, sx, s16.get());
  const uint8_t* bp = blob.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  auto run = [&](auto bits_tag, auto half_tag, auto sub_tag) {
    constexpr int B = decltype(bits_tag)::value;
    constexpr bool H = decltype(half_tag)::value;
    constexpr bool S = decltype(sub_tag)::value;
    at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) {
      x8::linear<B, H, S>(qx.get(), dx, sx, s16.get(), M, K, bp, p0, p1, yp, ldy);
    });
  };
  using no = std::false_type;
  using yes = std::true_type;
  if (sub_scales && bits == 4) run(std::integral_constant<int, 4>{}, no{}, yes{});
  else if (sub_scales) run(std::integral_constant<int, 6>{}, no{}, yes{});
  else if (bits == 8) run(std::integral_constant<int, 8>{}, no{}, no{});
  else if (bits == 6) run(std::integral_constant<int, 6>{}, no{}, no{});
  else if (half_scales) run(std::integral_constant<int, 4>{}, yes{}, no{});
  else run(std::integral_constant<int, 4>{}, no{}, no{});
  return y;
}

// q [B, Hq, T, d], k and v [B, Hkv, S, d] (any strides, unit stride over d; Hq a multiple of Hkv),
// mask: bool [B, 1 or Hq, T, >= S] (key j of row t allowed where true) or empty, then row t sees
// keys 0 .. S - T + t (a causal pass over the last T positions). -> out [B, T, Hq, d] float32,
// each row by row_attn::rows (isa 1: AVX-512 F, the caller checks) or row_attn2::one (isa 0: AVX2)
// (their comments); d a multiple of 16, <= 256 (the sizes rows_for lists).
torch::Tensor row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& mask, double scale, int64_t isa) {
  TORCH_CHECK(isa == 0 || isa == 1, "row_attention: isa must be 0 (AVX2) or 1 (AVX-512), got ", isa);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "row_attention: q, k, v are [B, H, T|S, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "row_attention: float32 only");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), d = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == d && v.size(3) == d,
              "row_attention: k and v must be [B, Hkv, S, d] with q's B and d");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "row_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(d % 16 == 0 && d <= 256, "row_attention: head size must be a multiple of 16, at most 256; got ", d);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "row_attention: unit stride over d");
  TORCH_CHECK(S >= T, "row_attention: fewer keys than query rows");
  const bool masked = mask.defined() && mask.numel() > 0;
  if (masked) {
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) == B && mask.size(2) == T &&
                mask.size(3) >= S && (mask.size(1) == 1 || mask.size(1) == Hq),
                "row_attention: mask must be bool [B, 1 or Hq, T, >= S]");
  }
  auto out = torch::empty({B, T, Hq, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = masked ? mask.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t groups = Hq / Hkv;
  if (isa == 0) {   // AVX2: one (row, head) at a time (row_attn2)
    const row_attn2::OneFn one = row_attn2::one_for(d);
    TORCH_CHECK(one != nullptr, "row_attention: no kernel for head size ", d);
    const bool per_head = masked && mask.size(1) != 1;
    at::parallel_for(0, B * T, 1, [&](int64_t i0, int64_t i1) {
      std::unique_ptr<int32_t[]> keys(new int32_t[S]);
      std::unique_ptr<float[]> scores(new float[S + 8]);
      for (int64_t bt = i0; bt < i1; ++bt) {
        const int64_t b = bt / T, t = bt % T;
        int64_t nk = 0;
        for (int64_t h = 0; h < Hq; ++h) {
          if (h == 0 || per_head) {   // the row's allowed keys, in increasing order
            if (masked) {
              const bool* mr = mp + b * mask.stride(0) + (per_head ? h * mask.stride(1) : 0) + t * mask.stride(2);
              nk = row_attn2::allowed_keys(mr, mask.stride(3), S, keys.get());
            } else {
              nk = 0;
              for (int64_t j = 0; j <= S - T + t; ++j) keys[nk++] = static_cast<int32_t>(j);
            }
          }
          float* o = op + ((b * T + t) * Hq + h) * d;
          if (nk == 0) {   // a fully masked row: zeros (SDPA would give NaN)
            std::fill(o, o + d, 0.0f);
            continue;
          }
          const int64_t g = h / groups;
          one(qp + b * q.stride(0) + h * q.stride(1) + t * q.stride(2), o, keys.get(), nk,
              kp + b * k.stride(0) + g * k.stride(1), k.stride(2), vp + b * v.stride(0) + g * v.stride(1), v.stride(2),
              static_cast<float>(scale), scores.get());
        }
      }
    });
    return out;
  }
  const row_attn::RowsFn run = row_attn::rows_for(d);
  TORCH_CHECK(run != nullptr, "row_attention: no kernel for head size ", d);
  const bool per_head = masked && mask.size(1) != 1;
  // A task: one batch entry, up to kRowGroup rows, and the query heads that share their key lists
  // (those of one key/value head; one head where the mask is per head), at most 16 at a time.
  const int64_t G = per_head ? 1 : std::min<int64_t>(groups, 16);
  const int64_t per_group = (groups + G - 1) / G, sets = Hkv * per_group;   // head sets
  const int64_t chunks = (T + row_attn::kRowGroup - 1) / row_attn::kRowGroup;
  const int64_t spad = (S + 15) / 16 * 16;
  at::parallel_for(0, B * sets * chunks, 1, [&](int64_t i0, int64_t i1) {
    // scratch for a task's rows (written before it is read: no zero fill)
    const int64_t most = std::min<int64_t>(T, row_attn::kRowGroup);
    std::unique_ptr<int32_t[]> keys(new int32_t[most * S]);
    std::unique_ptr<float[]> scores(new float[most * G * spad]), accs(new float[most * G * (d / 16) * 2 * 16]);
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t b = task / (sets * chunks), set = task / chunks % sets, t0 = task % chunks * row_attn::kRowGroup;
      const int64_t g = set / per_group;   // the key/value head; its query heads [h0, h1)
      const int64_t h0 = g * groups + set % per_group * G, h1 = std::min(h0 + G, (g + 1) * groups);
      row_attn::Rows R;
      R.G = static_cast<int>(h1 - h0);
      R.qh = q.stride(1);
      R.oh = d;
      for (int64_t t = t0; t < std::min(T, t0 + row_attn::kRowGroup); ++t) {
        int32_t* kr = keys.get() + (t - t0) * S;
        int64_t nk = 0;   // the row's allowed keys, in increasing order
        if (masked) {
          const bool* mr = mp + b * mask.stride(0) + (per_head ? h0 * mask.stride(1) : 0) + t * mask.stride(2);
          nk = row_attn::allowed_keys(mr, mask.stride(3), S, kr);
        } else {
          for (int64_t j = 0; j <= S - T + t; ++j) kr[nk++] = static_cast<int32_t>(j);
        }
        float* o = op + ((b * T + t) * Hq + h0) * d;
        if (nk == 0) {   // a fully masked row: zeros (SDPA would give NaN)
          std::fill(o, o + (h1 - h0) * d, 0.0f);
          continue;
        }
        R.q[R.n] = qp + b * q.stride(0) + h0 * q.stride(1) + t * q.stride(2);
        R.o[R.n] = o;
        R.keys[R.n] = kr;
        R.nk[R.n++] = nk;
      }
      if (R.n > 0)
        run(R, kp + b * k.stride(0) + g * k.stride(1), k.stride(2), vp + b * v.stride(0) + g * v.stride(1),
            v.stride(2), static_cast<float>(scale), scores.get(), spad, accs.get());
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// A feature head's decoder block for a few drafting rows (treespec.drafters.feature.DraftBlock's
// fast path), in two calls around the drafter's KV cache update. Every linear layer is a blob of
// panel_linear_blocks' records; the rest (rotary embedding, residual adds, RMS norm, SiLU times
// the up projection) is done here row by row, so a call costs the layers' reads and a few
// microseconds instead of some forty PyTorch operations from Python. The arithmetic is the
// block's: the same formulas in float32, not the same bits as PyTorch's operations.
namespace {

// y [M, out] = x @ W^T for one layer's blob (its last panel's zero padding dropped)
torch::Tensor blocks_linear(const torch::Tensor& x, const torch::Tensor& blob, int64_t bits, bool half, int64_t out,
                            int64_t isa) {
  torch::Tensor y = panel_linear_blocks(x, blob, bits, isa, half);
  return y.size(1) == out ? y : y.narrow(1, 0, out).contiguous();
}

// Rotary embedding in place on the heads of one row (rotate-half layout: element i pairs with i + d / 2).
void rope_row(float* x, int64_t heads, int64_t d, const float* cs, const float* sn) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = xh[i], b = xh[i + half];
      xh[i] = a * cs[i] - b * sn[i];
      xh[i + half] = b * cs[i] + a * sn[i];
    }
  }
}

}  // namespace

// x [T, Din] float32; pos [T] int64; inv_freq [d / 2] float32; blobs / bits / half / outs: the
// q, k and v projections (panel_linear_blocks' records). -> (q [T, nh d], k [T, nkv d], v [T, nkv d]),
// q and k rotated to their positions: cos and sin of pos * inv_freq.
std::vector<torch::Tensor> draft_block_pre(const torch::Tensor& x, const torch::Tensor& pos, const torch::Tensor& inv_freq,
                                           int64_t nh, int64_t nkv, int64_t d, const std::vector<torch::Tensor>& blobs,
                                           const std::vector<int64_t>& bits, const std::vector<bool>& half,
                                           const std::vector<int64_t>& outs, int64_t isa) {
  TORCH_CHECK(blobs.size() == 3 && bits.size() == 3 && half.size() == 3 && outs.size() == 3,
              "draft_block_pre: three layers (q, k, v)");
  TORCH_CHECK(outs[0] == nh * d && outs[1] == nkv * d && outs[2] == nkv * d, "draft_block_pre: layer sizes");
  TORCH_CHECK(d % 2 == 0 && inv_freq.numel() == d / 2 && inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous(),
              "draft_block_pre: inv_freq [d / 2] float32");
  TORCH_CHECK(pos.dim() == 1 && pos.numel() == x.size(0) && pos.scalar_type() == at::kLong && pos.is_contiguous(),
              "draft_block_pre: pos [T] int64");
  torch::Tensor q = blocks_linear(x, blobs[0], bits[0], half[0], outs[0], isa);
  torch::Tensor k = blocks_linear(x, blobs[1], bits[1], half[1], outs[1], isa);
  torch::Tensor v = blocks_linear(x, blobs[2], bits[2], half[2], outs[2], isa);
  const int64_t T = x.size(0), half_d = d / 2;
  const float* inv = inv_freq.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  std::vector<float> cs(half_d), sn(half_d);
  for (int64_t t = 0; t < T; ++t) {
    const float p = static_cast<float>(pp[t]);
    for (int64_t i = 0; i < half_d; ++i) {
      const float angle = p * inv[i];
      cs[i] = std::cos(angle);
      sn[i] = std::sin(angle);
    }
    rope_row(q.data_ptr<float>() + t * nh * d, nh, d, cs.data(), sn.data());
    rope_row(k.data_ptr<float>() + t * nkv * d, nkv, d, cs.data(), sn.data());
  }
  return {q, k, v};
}

// q [T, nh d] (draft_block_pre's); keys / values [1, nkv, S, d] (the cache, the T new rows last);
// mask bool [1, 1, T, >= S]; residual [T, H]; norm_w [H]; blobs ...: o, gate, up and down.
// -> [T, H]: residual + o(attention), then + down(silu(gate(n)) * up(n)) with n its RMS norm.
// AVX-512 F only (row_attention's kernel; the caller checks).
torch::Tensor draft_block_post(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& mask, const torch::Tensor& residual, const torch::Tensor& norm_w,
                               double eps, int64_t nh, int64_t d, const std::vector<torch::Tensor>& blobs,
                               const std::vector<int64_t>& bits, const std::vector<bool>& half,
                               const std::vector<int64_t>& outs, int64_t isa) {
  TORCH_CHECK(blobs.size() == 4 && bits.size() == 4 && half.size() == 4 && outs.size() == 4,
              "draft_block_post: four layers (o, gate, up, down)");
  const int64_t T = q.size(0), H = residual.size(1), I = outs[1];
  TORCH_CHECK(q.dim() == 2 && q.size(1) == nh * d && q.is_contiguous(), "draft_block_post: q [T, nh d]");
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == T && residual.scalar_type() == at::kFloat &&
              residual.is_contiguous(), "draft_block_post: residual [T, H] float32");
  TORCH_CHECK(norm_w.numel() == H && norm_w.scalar_type() == at::kFloat && norm_w.is_contiguous(),
              "draft_block_post: norm_w [H] float32");
  TORCH_CHECK(outs[0] == H && outs[2] == I && outs[3] == H, "draft_block_post: layer sizes");
  // [1, nh, T, d] view of q -> [1, T, nh, d]
  torch::Tensor o =
      row_attention(q.view({1, T, nh, d}).transpose(1, 2), keys, values, mask, 1.0 / std::sqrt(double(d)), 1);
  torch::Tensor h = blocks_linear(o.view({T, nh * d}), blobs[0], bits[0], half[0], outs[0], isa);
  float* hp = h.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* w = norm_w.data_ptr<float>();
  torch::Tensor n = torch::empty({T, H}, h.options());
  float* np_ = n.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* ht = hp + t * H;
    float ss = 0.0f;
    for (int64_t j = 0; j < H; ++j) {
      ht[j] += rp[t * H + j];
      ss += ht[j] * ht[j];
    }
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    for (int64_t j = 0; j < H; ++j) np_[t * H + j] = ht[j] * r * w[j];
  }
  torch::Tensor g = blocks_linear(n, blobs[1], bits[1], half[1], outs[1], isa);
  torch::Tensor u = blocks_linear(n, blobs[2], bits[2], half[2], outs[2], isa);
  float* gp = g.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  for (int64_t i = 0; i < T * I; ++i) gp[i] = gp[i] / (1.0f + std::exp(-gp[i])) * up[i];
  torch::Tensor out = blocks_linear(g, blobs[3], bits[3], half[3], outs[3], isa);
  out.add_(h);
  return out;
}

// The linear kernels and row attention as PyTorch operators (treespec::block_linear, panel_linear,
// amx_linear, x8_linear, row_attention),
// registered when this module loads, for compiled graphs (treespec/fastpath/ops.py gives their
// shapes to the compiler): the dispatcher calls them with no Python in between. Python custom
// operators cost about 40 us a call more here, and a SmolLM2 pass makes 211 of them.
// x [..., K] float32 -> [..., out_features] (a zero-padded last panel's columns dropped); the
// bias is the caller's. Only the module treespec loads defines them (kernels.compile_kernel passes
// TREESPEC_OPS): a namespace takes one TORCH_LIBRARY a process, and benchmarks/kernel_ab.py loads
// two revisions of this file side by side.
#ifdef TREESPEC_OPS
namespace {

torch::Tensor as_rows(const torch::Tensor& x) { return x.reshape({-1, x.size(-1)}).contiguous(); }

torch::Tensor shaped(torch::Tensor y, const torch::Tensor& x, int64_t out_features) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out_features;
  if (y.size(1) != out_features) y = y.narrow(1, 0, out_features).contiguous();
  return y.view(sizes);
}

torch::Tensor op_block_linear(const torch::Tensor& x, const torch::Tensor& blob, int64_t bits, int64_t isa,
                              bool half_scales, int64_t out_features) {
  return shaped(panel_linear_blocks(as_rows(x), blob, bits, isa, half_scales), x, out_features);
}

torch::Tensor op_panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t isa, int64_t out_features) {
  return shaped(panel_linear(as_rows(x), panels, isa), x, out_features);
}

torch::Tensor op_amx_linear(const torch::Tensor& x, const torch::Tensor& blob, int64_t bits, bool half_scales,
                            int64_t out_features) {
  return shaped(amx_linear_blocks(as_rows(x), blob, bits, half_scales), x, out_features);
}

// q, k, v, mask and the result as row_attention's; isa its number (0 AVX2, 1 AVX-512).
torch::Tensor op_row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& mask, double scale, int64_t isa) {
  return row_attention(q, k, v, mask, scale, isa);
}

torch::Tensor op_x8_linear(const torch::Tensor& x, const torch::Tensor& blob, int64_t bits, bool half_scales,
                           bool sub_scales, int64_t out_features) {
  return shaped(x8_linear_blocks(as_rows(x), blob, bits, half_scales, sub_scales), x, out_features);
}

}  // namespace

TORCH_LIBRARY(treespec, m) {
  m.def("block_linear(Tensor x, Tensor blob, int bits, int isa, bool half_scales, int out_features) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int isa, int out_features) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor blob, int bits, bool half_scales, int out_features) -> Tensor");
  m.def("x8_linear(Tensor x, Tensor blob, int bits, bool half_scales, bool sub_scales, int out_features) -> Tensor");
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(treespec, CPU, m) {
  m.impl("block_linear", &op_block_linear);
  m.impl("panel_linear", &op_panel_linear);
  m.impl("amx_linear", &op_amx_linear);
  m.impl("x8_linear", &op_x8_linear);
  m.impl("row_attention", &op_row_attention);
}
#endif  // TREESPEC_OPS

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_linear", &panel_linear, "y = x @ W^T with W stored as 16-column panels",
        pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("isa") = 0);
  m.def("panel_linear_blocks", &panel_linear_blocks,
        "y = x @ W^T with W stored as 16-column panels of 4-, 6- or 8-bit integers and per-32 (6: per-16) scales",
        pybind11::arg("x"), pybind11::arg("blob"), pybind11::arg("bits"), pybind11::arg("isa") = 0,
        pybind11::arg("half_scales") = false);
  m.def("amx_linear_blocks", &amx_linear_blocks,
        "y = x @ W^T on the AMX tile unit, x rounded to bf16, W as panel_linear_blocks' integer blocks",
        pybind11::arg("x"), pybind11::arg("blob"), pybind11::arg("bits"), pybind11::arg("half_scales") = false);
  m.def("x8_linear_blocks", &x8_linear_blocks,
        "y = x @ W^T with x rounded to 8-bit integers per block of 32, W as x8_records' integer blocks",
        pybind11::arg("x"), pybind11::arg("blob"), pybind11::arg("bits"), pybind11::arg("half_scales") = false,
        pybind11::arg("sub_scales") = false);
  m.def("amx_permitted", &amx_permitted, "whether the OS granted this process the AMX tile state");
  m.def("row_attention", &row_attention, "softmax(scale q K^T) V, each query row over its allowed keys as alone",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"), pybind11::arg("scale"),
        pybind11::arg("isa") = 1);
  m.def("draft_block_pre", &draft_block_pre, "a feature head block's q, k, v projections and rotary embedding");
  m.def("draft_block_post", &draft_block_post, "a feature head block's attention, output projection and MLP");
}
