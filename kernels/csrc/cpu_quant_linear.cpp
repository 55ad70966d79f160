// y = x W^T + b with W kept in its quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), one
// row's bits whatever the number of rows M, the row's place in the call or the thread split.
//
// Layout (kernels/quant_weight.py, the GGUF blocks regrouped at load): a weight row of K = 32 nb
// weights is its scales, then its nb blocks of quants. Q8_0 / Q4_0 / Q4_1: nb f16 scales d, then
// (Q4_1) nb f16 minima m; quants per block: Q8_0 32 int8, Q4_0 / Q4_1 16 bytes of nibbles (byte
// i's low half weight i, its high half weight i + 16): w = d q (Q8_0), d (q - 8) (Q4_0), d q + m
// (Q4_1); Q5_0 / Q5_1 as Q4_0 / Q4_1 with a fifth bit from 4 more bytes per block, w = d (q - 16)
// (Q5_0), d q + m (Q5_1). The k-quants, per super-block of 8 blocks: Q4_K / Q5_K an f16 d and dmin and per block
// 6-bit sc and m (a byte each), w = (d sc) q - dmin m (q: 4 bits; Q5_K: a fifth from 4 more bytes
// per block); Q6_K an f16 d and per block two int8 scales (its halves of 16), w = (d sc) (q - 32)
// with q of 6 bits (the nibbles and 8 bytes of 2-bit highs per block).
//
// The weights are never rounded; the activations are quantized per block of 32 to int16 (15
// bits against bf16's 8: below the input's own rounding). Per row and block b, x32 = x[r, 32b ..
// 32b + 31] widened to fp32: amax = max |x32|, dx = amax / 32767, xq = x32 * (32767 / amax)
// rounded to the nearest int16 (ties to even; 0 for an all-zero block), xs = hsum8(x32[0:8] +
// x32[8:16] + x32[16:24] + x32[24:32]) (lane-wise in that order). Per output y[r, n], over
// groups of 8 blocks g = 0, 1, ... (the last group's missing lanes zero) and, within a group,
// blocks b = 8g + j in order, with q the block's integer values as int16:
//   s[j]  = d[b] * dx[b]                        (8 lanes at once; k-quants: d[b] = d sc, exact)
//   p     = the exact int32 dot of q and xq: lane l holds pairs (2l, 2l + 1) and (16 + 2l, 17 + 2l)
//   acc   = fma(s[j], float(p), acc)            (8 lanes)
//   sm    = fma(m'[8g..], xs[8g..], sm)         (8 lanes, once per group; Q4_1, Q5_1: m' = m;
//                                                Q4_0: m' = -8 d; Q5_0: -16 d; Q4_K / Q5_K: m' = -(dmin m), exact;
//                                                Q8_0, Q6_K: none)
// Q6_K has a scale per 16 weights: p0 = the dot of weights 0-15 (lane l: pair 2l, 2l + 1), p1 of
// 16-31, and acc = fma(s1[j], float(p1), fma(s0[j], float(p0), acc)).
// then y = hsum8(acc) + hsum8(sm) (hsum8: (l, l + 4) pairs, then (0, 2), (1, 3), then the last
// two), plus the bias in fp32, rounded once to x's dtype (bf16: to nearest even). d, m are the
// stored f16 values widened exactly.
// Rows are computed 4 at a time where 4 remain (prefill: each column's blocks unpacked once for
// the 4, two columns at a time on AVX-512 builds), else one at a time, 4 columns side by side
// (decode); either way each output has one instruction sequence. Columns are split among threads, never a row's reduction.
// Compiled with -mavx2 -mfma -mf16c -ffp-contract=off on every x86 build (AVX-512 CPUs have
// them), so the bits are the same on every such CPU; the AVX-512 build (VNNI) adds each block's
// two pair sums with vpdpwssd, the same integers (dot32).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "raw_kernels.h"

namespace {

enum Kind { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5, kQ5_0 = 6, kQ5_1 = 7 };
constexpr int kKinds = 8;
constexpr bool is_k(int kind) { return kind == kQ4_K || kind == kQ5_K || kind == kQ6_K; }
// whether a block's quants carry fifth bits (4 bytes after its nibbles)
constexpr bool has_fifth(int kind) { return kind == kQ5_K || kind == kQ5_0 || kind == kQ5_1; }
// bytes of a row of K weights in the kernel's layout (kernels/quant_weight.py row_bytes)
constexpr int64_t kLayoutBytes[kKinds] = {34, 18, 20, 148, 180, 210, 22, 24};  // per 32, or 256 (k-quants)
inline int64_t row_bytes_of(int kind, int64_t K) { return K / (is_k(kind) ? 256 : 32) * kLayoutBytes[kind]; }
// whether the kind has a minimum (m) term, which needs each block's activation sum
constexpr bool has_sums(int kind) { return kind != kQ8_0 && kind != kQ6_K; }
constexpr int kTile = 4;       // rows computed together (each with its own sequence)
// prefill columns per tile: 2 where AVX-512VL's 32 vector registers hold the 4 x 2 outputs' sums
// (1.15-1.2x on Q8_0 / Q4_1 on Zen 4); the AVX2 build's 16 would spill
#if defined(__AVX512VL__)
constexpr int kTileCols = 2;
#else
constexpr int kTileCols = 1;
#endif
constexpr int64_t kCols = 16;  // columns per inner chunk (their blocks stay in L1)

// hsum of 8 lanes in a fixed tree.
inline float hsum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l, l+4
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));                                   // (0,2),(1,3)
  const __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
  return _mm_cvtss_f32(c);
}

// A block's exact int32 dot of q and xq (lane l: pairs 2l, 2l + 1 and 16 + 2l, 17 + 2l). With
// AVX-512 VNNI (the AVX-512 build) the second madd and the add are one vpdpwssd: the same
// integers (no product pair reaches the int32 range: |xq| <= 32767, so the sum wraps nowhere).
inline __m256i dot32(const __m256i w[2], const __m256i x[2]) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(w[0], x[0]), w[1], x[1]);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w[0], x[0]), _mm256_madd_epi16(w[1], x[1]));
#endif
}

// Each row's activations per block of 32 (the header's xq, dx, xs); dx and xs padded with zeros
// to whole groups of 8 blocks.
struct Prepared {
  std::vector<int16_t> xq;  // [M, K]
  std::vector<float> dx;    // [M, nb8]
  std::vector<float> xs;    // [M, nb8] (Q4 kinds)
  int64_t nb8 = 0;
};

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename T>
Prepared prepare(const T* x, int64_t M, int64_t K, bool sums) {
  const int64_t nb = K / 32;
  Prepared p;
  p.nb8 = (nb + 7) / 8 * 8;
  p.xq.resize(M * K);
  p.dx.assign(M * p.nb8, 0.0f);
  if (sums) p.xs.assign(M * p.nb8, 0.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const T* xb = x + r * K + b * 32;
        __m256 v[4];
        for (int i = 0; i < 4; ++i) v[i] = load8(xb + 8 * i);
        const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        const __m256i q01 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[0], inv)),
                                               _mm256_cvtps_epi32(_mm256_mul_ps(v[1], inv)));
        const __m256i q23 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[2], inv)),
                                               _mm256_cvtps_epi32(_mm256_mul_ps(v[3], inv)));
        int16_t* q = p.xq.data() + r * K + b * 32;  // packs interleaves 128-bit halves: undo it
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(q01, 0xD8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm256_permute4x64_epi64(q23, 0xD8));
        p.dx[r * p.nb8 + b] = amax / 32767.0f;
        if (sums) p.xs[r * p.nb8 + b] = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), v[2]), v[3]));
      }
  };
  if (M >= 16) {
    at::parallel_for(0, M, 8, rows);
  } else {
    rows(0, M);  // a decode step: not worth waking the threads
  }
  return p;
}

constexpr int64_t kQuants[kKinds] = {32, 16, 16, 16, 20, 24, 20, 20};  // bytes of quants per block of 32
// bytes before the quants in a row of nb blocks: the scales (and minima)
inline int64_t header_bytes(int kind, int64_t nb) {
  switch (kind) {
    case kQ4_1:
    case kQ5_1: return 4 * nb;
    case kQ4_K:
    case kQ5_K: return 4 * (nb / 8) + 2 * nb;  // d, dmin per super-block; sc, m per block
    case kQ6_K: return 2 * (nb / 8) + 2 * nb;  // d per super-block; two int8 scales per block
    default: return 2 * nb;
  }
}

// The block's integer values as two vectors of 16 int16 (weights 0-15, 16-31).
template <int K>
inline void unpack16(const uint8_t* qs, __m256i w[2]) {
  if constexpr (K == kQ8_0) {
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    if constexpr (has_fifth(K)) {  // fifth bits: byte i bit k is weight i + 4 k
      uint32_t h;
      std::memcpy(&h, qs + 16, 4);
      const __m128i one = _mm_set1_epi8(1);
      lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_setr_epi32(h, h >> 1, h >> 2, h >> 3), one), 4));
      hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_setr_epi32(h >> 4, h >> 5, h >> 6, h >> 7), one), 4));
    }
    if constexpr (K == kQ6_K) {  // 2-bit highs: byte i bits 2k, 2k + 1 are weight i + 8 k
      uint64_t h;
      std::memcpy(&h, qs + 16, 8);
      const __m128i three = _mm_set1_epi8(3);
      const auto h64 = [](uint64_t v) { return static_cast<long long>(v); };
      lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_set_epi64x(h64(h >> 2), h64(h)), three), 4));
      hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_set_epi64x(h64(h >> 6), h64(h >> 4)), three), 4));
    }
    w[0] = _mm256_cvtepu8_epi16(lo);
    w[1] = _mm256_cvtepu8_epi16(hi);
    if constexpr (K == kQ6_K) {
      const __m256i off = _mm256_set1_epi16(32);
      w[0] = _mm256_sub_epi16(w[0], off);
      w[1] = _mm256_sub_epi16(w[1], off);
    }
  }
}

// 8 unsigned (or, signed_, int8) bytes as fp32 lanes.
inline __m256 bytes8(const uint8_t* p, bool signed_) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(signed_ ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 8 f16 values from p (lanes >= n zeroed; reading 16 bytes stays inside the row: the quants follow).
inline __m256 f16x8(const uint8_t* p, int n, __m256 lanes) {
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return n >= 8 ? v : _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_castps_si256(lanes))));
}

// R rows x C columns, each output with the header's sequence whatever R and C.
template <int K, int R, int C>
inline void tile(const uint8_t* w0, int64_t row_bytes, int64_t nb, const Prepared& p, int64_t row, int64_t Kdim,
                 float out[R][C]) {
  const __m256 lanes = _mm256_castsi256_ps(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const uint8_t* quants = w0 + header_bytes(K, nb);
  const int64_t nsb = nb / 8;  // k-quants: super-blocks (one per group of 8 blocks)
  __m256 acc[R][C], sm[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = sm[r][c] = _mm256_setzero_ps();
  alignas(32) float scale[R][C][8];
  alignas(32) float scale2[K == kQ6_K ? R : 1][C][8];  // Q6_K: the blocks' second halves
  for (int64_t g = 0; g < nb; g += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, nb - g));
    for (int c = 0; c < C; ++c) {
      const uint8_t* wr = w0 + c * row_bytes;
      __m256 d, d2 = _mm256_setzero_ps(), m = _mm256_setzero_ps();
      if constexpr (K == kQ4_K || K == kQ5_K) {  // d sc and -dmin m, exact in fp32
        d = _mm256_mul_ps(_mm256_set1_ps(f16(wr + 2 * (g / 8))), bytes8(wr + 4 * nsb + g, false));
        m = _mm256_mul_ps(_mm256_set1_ps(-f16(wr + 2 * nsb + 2 * (g / 8))), bytes8(wr + 4 * nsb + nb + g, false));
      } else if constexpr (K == kQ6_K) {  // d sc of each block's halves, exact in fp32
        const __m256 dsb = _mm256_set1_ps(f16(wr + 2 * (g / 8)));
        d = _mm256_mul_ps(dsb, bytes8(wr + 2 * nsb + 2 * g, true));
        d2 = _mm256_mul_ps(dsb, bytes8(wr + 2 * nsb + 2 * g + 8, true));
      } else {
        d = f16x8(wr + 2 * g, n, lanes);
        if constexpr (K == kQ4_1 || K == kQ5_1) m = f16x8(wr + 2 * nb + 2 * g, n, lanes);
        if constexpr (K == kQ4_0) m = _mm256_mul_ps(_mm256_set1_ps(-8.0f), d);
        if constexpr (K == kQ5_0) m = _mm256_mul_ps(_mm256_set1_ps(-16.0f), d);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (row + r) * p.nb8 + g;
        const __m256 dx = _mm256_loadu_ps(p.dx.data() + i);
        _mm256_store_ps(scale[r][c], _mm256_mul_ps(d, dx));
        if constexpr (K == kQ6_K) _mm256_store_ps(scale2[r][c], _mm256_mul_ps(d2, dx));
        if constexpr (has_sums(K)) sm[r][c] = _mm256_fmadd_ps(m, _mm256_loadu_ps(p.xs.data() + i), sm[r][c]);
      }
    }
    for (int j = 0; j < n; ++j) {
      const int64_t b = g + j;
      __m256i xq[R][2];
      for (int r = 0; r < R; ++r) {
        const int16_t* x = p.xq.data() + (row + r) * Kdim + b * 32;
        xq[r][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        xq[r][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
      }
      for (int c = 0; c < C; ++c) {
        __m256i w[2];
        unpack16<K>(quants + c * row_bytes + b * kQuants[K], w);
        for (int r = 0; r < R; ++r) {
          if constexpr (K == kQ6_K) {  // a scale per 16 weights: the halves' dots one after the other
            const __m256i s0 = _mm256_madd_epi16(w[0], xq[r][0]), s1 = _mm256_madd_epi16(w[1], xq[r][1]);
            acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scale[r][c][j]), _mm256_cvtepi32_ps(s0), acc[r][c]);
            acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scale2[r][c][j]), _mm256_cvtepi32_ps(s1), acc[r][c]);
          } else {
            const __m256i s = dot32(w, xq[r]);
            acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scale[r][c][j]), _mm256_cvtepi32_ps(s), acc[r][c]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = hsum8(acc[r][c]) + hsum8(sm[r][c]);
}

// Decode reads each weight once, from DRAM: ask for the rows kAhead columns on while these
// compute (the hardware prefetcher ramps up too slowly on rows of a few hundred bytes).
constexpr int64_t kAhead = 16;
inline void prefetch(const uint8_t* from, const uint8_t* to, const uint8_t* end) {
  for (const uint8_t* a = from; a < std::min(to, end); a += 64) _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
}

template <int K, typename T>
void run(const Prepared& p, const uint8_t* w, const T* bias, T* y, int64_t M, int64_t N, int64_t Kdim) {
  const int64_t nb = Kdim / 32, row_bytes = row_bytes_of(K, Kdim);
  auto emit = [&](int64_t row, int64_t n, float v) {
    if (bias != nullptr) v += static_cast<float>(bias[n]);
    y[row * N + n] = static_cast<T>(v);
  };
  at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * kCols, n1 = std::min(N, n0 + kCols);
      int64_t r = 0;
      for (; r + kTile <= M; r += kTile) {  // prefill: 4 rows share each column's unpacked blocks
        int64_t n = n0;
        for (; n + kTileCols <= n1; n += kTileCols) {  // and each row's loaded activations serve kTileCols columns
          float out[kTile][kTileCols];
          tile<K, kTile, kTileCols>(w + n * row_bytes, row_bytes, nb, p, r, Kdim, out);
          for (int i = 0; i < kTile; ++i)
            for (int j = 0; j < kTileCols; ++j) emit(r + i, n + j, out[i][j]);
        }
        for (; n < n1; ++n) {
          float out[kTile][1];
          tile<K, kTile, 1>(w + n * row_bytes, row_bytes, nb, p, r, Kdim, out);
          for (int i = 0; i < kTile; ++i) emit(r + i, n, out[i][0]);
        }
      }
      for (; r + 2 <= M; r += 2) {  // a short chunk (a verified draft): 2 rows share each column's unpacked blocks
        int64_t n = n0;
        for (; n + 2 * kTileCols <= n1; n += 2 * kTileCols) {
          float out[2][2 * kTileCols];
          if (M < kTile) prefetch(w + (n + kAhead) * row_bytes, w + (n + kAhead + 2 * kTileCols) * row_bytes, w + N * row_bytes);
          tile<K, 2, 2 * kTileCols>(w + n * row_bytes, row_bytes, nb, p, r, Kdim, out);
          for (int i = 0; i < 2; ++i)
            for (int j = 0; j < 2 * kTileCols; ++j) emit(r + i, n + j, out[i][j]);
        }
        for (; n < n1; ++n) {
          float out[2][1];
          tile<K, 2, 1>(w + n * row_bytes, row_bytes, nb, p, r, Kdim, out);
          for (int i = 0; i < 2; ++i) emit(r + i, n, out[i][0]);
        }
      }
      for (; r < M; ++r) {  // decode (and the last row): 4 columns' chains side by side
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) {
          float out[1][4];
          if (M == 1) prefetch(w + (n + kAhead) * row_bytes, w + (n + kAhead + 4) * row_bytes, w + N * row_bytes);
          tile<K, 1, 4>(w + n * row_bytes, row_bytes, nb, p, r, Kdim, out);
          for (int j = 0; j < 4; ++j) emit(r, n + j, out[0][j]);
        }
        for (; n < n1; ++n) {
          float out[1][1];
          tile<K, 1, 1>(w + n * row_bytes, row_bytes, nb, p, r, Kdim, out);
          emit(r, n, out[0][0]);
        }
      }
    }
  });
}

template <typename T>
void dispatch(int kind, const Prepared& p, const uint8_t* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
  switch (kind) {
    case kQ8_0: run<kQ8_0>(p, w, bias, y, M, N, K); break;
    case kQ4_0: run<kQ4_0>(p, w, bias, y, M, N, K); break;
    case kQ4_1: run<kQ4_1>(p, w, bias, y, M, N, K); break;
    case kQ4_K: run<kQ4_K>(p, w, bias, y, M, N, K); break;
    case kQ5_K: run<kQ5_K>(p, w, bias, y, M, N, K); break;
    case kQ5_0: run<kQ5_0>(p, w, bias, y, M, N, K); break;
    case kQ5_1: run<kQ5_1>(p, w, bias, y, M, N, K); break;
    default: run<kQ6_K>(p, w, bias, y, M, N, K); break;
  }
}

// x [..., K] (bf16 or fp32, contiguous), w [N, K / 32 * block bytes] uint8 contiguous, bias [N]
// of x's dtype or None -> [..., N] of x's dtype. The caller (kernels/cpu_quant_linear.py) checks
// the types; broken shapes raise.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t K,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind >= 0 && kind < kKinds, "kind must be 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q5_K, 5 Q6_K, 6 Q5_0 or 7 Q5_1");
  TORCH_CHECK(K % (is_k(static_cast<int>(kind)) ? 256 : 32) == 0 && x.size(-1) == K,
              "x's last dim must be K, a multiple of 32 (k-quants: of 256)");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be [N, bytes] uint8");
  TORCH_CHECK(w.size(1) == row_bytes_of(static_cast<int>(kind), K), "w's rows must hold K weights of the kind");
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(), "x must be contiguous, on the CPU");
  const int64_t N = w.size(0), M = x.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const bool sums = has_sums(static_cast<int>(kind));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xp = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
    const auto* bp = bias.has_value() ? reinterpret_cast<const c10::BFloat16*>(bias->data_ptr()) : nullptr;
    dispatch<c10::BFloat16>(kind, prepare(xp, M, K, sums), wp, bp, reinterpret_cast<c10::BFloat16*>(y.data_ptr()),
                            M, N, K);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    dispatch<float>(kind, prepare(x.data_ptr<float>(), M, K, sums), wp, bp, y.data_ptr<float>(), M, N, K);
  }
  return y;
}

// The kernel where it applies (x bf16 or fp32 on the CPU, contiguous or made so; the blocks on
// the CPU; bias None or a [N] CPU tensor of x's dtype), else None: the caller runs the reference.
c10::optional<at::Tensor> try_quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t K,
                                           const c10::optional<at::Tensor>& bias) {
  if (!x.device().is_cpu() || !w.device().is_cpu() || x.dim() < 1) return c10::nullopt;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat) return c10::nullopt;
  if (bias.has_value() && (bias->scalar_type() != x.scalar_type() || !bias->device().is_cpu() || bias->dim() != 1 ||
                           bias->size(0) != w.size(0)))
    return c10::nullopt;
  const c10::optional<at::Tensor> b = bias.has_value() ? c10::optional<at::Tensor>(bias->contiguous()) : c10::nullopt;
  return quant_linear(x.is_contiguous() ? x : x.contiguous(), w, kind, K, b);
}

// keepwarm::raw::Linear: the bf16 product of quant_linear (variant: the kind).
void raw_quant_linear(const uint16_t* x, int64_t M, int64_t K, const void* w, int64_t N, const uint16_t* bias,
                      uint16_t* y, int64_t kind) {
  using B = c10::BFloat16;
  const auto* xp = reinterpret_cast<const B*>(x);
  dispatch<B>(static_cast<int>(kind), prepare(xp, M, K, has_sums(static_cast<int>(kind))), static_cast<const uint8_t*>(w),
              reinterpret_cast<const B*>(bias), reinterpret_cast<B*>(y), M, N, K);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("raw_api", [] {
    keepwarm::raw::Linear linear = &raw_quant_linear;
    return std::map<std::string, uint64_t>{{"linear", reinterpret_cast<uint64_t>(linear)}};
  }, "the raw entry points by address (kernels/csrc/raw_kernels.h)");
  m.def("quant_linear", &quant_linear, "y = x W^T + b, W in GGUF blocks (row-invariant)", pybind11::arg("x"),
        pybind11::arg("w"), pybind11::arg("kind"), pybind11::arg("K"), pybind11::arg("bias") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("try_quant_linear", &try_quant_linear, "quant_linear where it applies, else None", pybind11::arg("x"),
        pybind11::arg("w"), pybind11::arg("kind"), pybind11::arg("K"), pybind11::arg("bias") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
