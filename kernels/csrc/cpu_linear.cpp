// CPU matrix product y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for bf16 and fp32, any M,
// with ONE per-output reduction order for every M (batch- and chunk-invariant).
//
// The reduction order of one output y[m, n] (the contract both paths below implement):
//   - K is cut into blocks of E elements (E = 32 for bf16, 16 for fp32): nb = K / E full
//     blocks, then a tail of K % E elements loaded masked (zeros past the end);
//   - four chains (vector accumulators of 16 fp32 lanes) per output: with q = nb / 4, block j
//     < 4q goes to chain j % 4, blocks 4q..nb-1 and then the tail go to chain 0, each chain
//     in increasing j. A block is one `_mm512_dpbf16_ps` (bf16: 32 products summed pairwise
//     into 16 lanes, exact products, fp32 accumulation) or one `_mm512_fmadd_ps` (fp32);
//   - total = ((c0 + c1) + c2) + c3, then a horizontal sum in a fixed tree (hsum16), + bias, then
//     one rounding to the output dtype (bf16 round-to-nearest-even) unless fp32 is asked.
// Threads split N (output columns), never K, so neither the thread count nor M changes a bit.
//
// Two paths, chosen by speed only (identical bits):
//   - decode (M <= kStreamRows): the weight in a single sequential stream, the rows
//     kPrefetchBytes ahead prefetched meanwhile, spread over the arithmetic, so DRAM and the
//     arithmetic overlap. Bound by DRAM bandwidth at small M, by the arithmetic from M ~ 8.
//     fp32, and bf16 in the "dpbf16" form (or below kStreamFmaRows rows): one weight row at a
//     time, up to 4 token rows sharing each weight load (more rows: further passes over the
//     row in L1; stream_range). bf16 in the "fma" form: tiles of 4 weight rows x up to 4
//     token rows, one chain at a time, the weight split in registers, x unpacked once to an
//     fp32 panel (stream_fma_range; see "decode path, bf16 fma form" below).
//   - prefill (M > kStreamRows): register tiles of 4 token rows x 6 weight rows, one chain at
//     a time. Bound by arithmetic. fp32, and bf16 in the "dpbf16" form: the tiles straight
//     from x and the weight (tiled_range). bf16 in the "fma" form: x and weight strips unpacked
//     to fp32 panels in chain order (packed_run; see "bf16 prefill path" below).
// The bf16 "fma" form computes each block as two fp32 FMAs under DAZ/FTZ, which is vdpbf16ps
// bit for bit where the probe says so (see "bf16 prefill path" below). The form is the
// caller's argument (`fma_form`, for both paths); the Python side picks it once per process
// from two probes exported here: `fma_form_mismatches` (the FMA form against vdpbf16ps on
// random and special lanes: any mismatch rules the FMA form out) and `time_prefill_forms` (the
// two prefill inner loops raced; the FMA form must win by MIN_FMA_SPEEDUP, 1.2x). On
// Sapphire/Emerald Rapids without AMX vdpbf16ps issues at a quarter of the FMA rate: the FMA
// form's prefill inner loop is ~2x faster (prefill ~1.3-1.6x, decode at 4-16 rows 1.1-1.2x where
// the arithmetic binds); on Zen 4 (vdpbf16ps at about the FMA rate) it would be ~2x slower, and
// whether it rounds like vdpbf16ps there is for the probe to say.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -ffp-contract=off: the Python
// side loads this build only on CPUs that report avx512_bf16. On x86 CPUs without it but with
// AVX2 + FMA, the AVX2 build (-mavx2 -mfma -mf16c -ffp-contract=off -DKEEPWARM_AVX2) runs the
// same code with avx512_compat.h emulating each AVX-512 intrinsic on two 256-bit halves: the
// same contract, so the same invariance (its bits need not equal the AVX-512 build's: there
// vdpbf16ps is two FMAs under the caller's MXCSR, denormals kept, and so is the "fma" form).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
// pybind11 and the at::Tensor caster: a quarter of torch/extension.h's compile time.
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "raw_kernels.h"

#ifdef KEEPWARM_AVX2
#include "avx512_compat.h"  // the AVX2 build: the AVX-512 names emulated, included last
#endif

namespace {

constexpr int kChains = 4;

// One element kind: storage type, block width E, the block product and the masked tail load.
struct Bf16 {
  using T = uint16_t;
  using V = __m512i;
  static constexpr int E = 32;
  static inline V load(const T* p) { return _mm512_loadu_si512(p); }
  static inline V load_tail(const T* p, int r) {
    return _mm512_maskz_loadu_epi16((__mmask32)((1ull << r) - 1), p);
  }
  static inline __m512 madd(__m512 acc, V w, V x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  static inline float to_float(T v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

struct Fp32 {
  using T = float;
  using V = __m512;
  static constexpr int E = 16;
  static inline V load(const T* p) { return _mm512_loadu_ps(p); }
  static inline V load_tail(const T* p, int r) { return _mm512_maskz_loadu_ps((__mmask16)((1u << r) - 1), p); }
  static inline __m512 madd(__m512 acc, V w, V x) { return _mm512_fmadd_ps(x, w, acc); }
  static inline float to_float(T v) { return v; }
};

template <typename Kind>
struct Bias {
  const typename Kind::T* ptr = nullptr;  // [N] or null
  inline float at(int64_t n) const { return ptr == nullptr ? 0.f : Kind::to_float(ptr[n]); }
};

// The horizontal sum of the contract, written out so that no compiler's reduce intrinsic
// decides it: t[j] = a[j] + a[j + 8]; u[j] = t[j] + t[j + 4]; (u[0] + u[2]) + (u[1] + u[3]).
inline float hsum16(__m512 a) {
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));  // [u0 + u2, u1 + u3, ...]
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

// out[i] = hsum16(v[i]) for 16 vectors at once, bitwise: the same additions of the same
// operands, with the vectors' lanes transposed as the tree goes (15 adds for 16 sums).
inline void hsum16x16(const __m512* v, float* out) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // [a(0..7) + a(8..15), b(0..7) + b(8..15)]
    s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: u(0..3) of vector 4 i + L
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // lane L: [u0 + u2, u1 + u3] of vectors 8 i + L, 8 i + 4 + L
    s3[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane L, element j: the sum of vector 4 j + L
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, r);
  for (int lane = 0; lane < 4; ++lane)
    for (int j = 0; j < 4; ++j) out[4 * j + lane] = tmp[4 * lane + j];
}

// The contract's last step: ((c0 + c1) + c2) + c3, then hsum16.
inline __m512 combine_chains(__m512 c0, __m512 c1, __m512 c2, __m512 c3) {
  __m512 total = _mm512_add_ps(c0, c1);
  total = _mm512_add_ps(total, c2);
  return _mm512_add_ps(total, c3);
}
inline float combine(__m512 c0, __m512 c1, __m512 c2, __m512 c3) { return hsum16(combine_chains(c0, c1, c2, c3)); }

// The same for `outs` (<= 16) outputs at once: sums[o] from chain(o, u), u < kChains.
template <typename Chain>
inline void combine_outputs(int outs, Chain chain, float* sums) {
  __m512 total[16];
  for (int o = 0; o < 16; ++o)
    total[o] = o < outs ? combine_chains(chain(o, 0), chain(o, 1), chain(o, 2), chain(o, 3)) : _mm512_setzero_ps();
  hsum16x16(total, sums);
}

template <typename Out>
inline Out store_value(float v);
template <>
inline float store_value<float>(float v) { return v; }
template <>
inline c10::BFloat16 store_value<c10::BFloat16>(float v) { return c10::BFloat16(v); }  // nearest even

// c10::BFloat16(float) for 16 lanes: round to nearest even on the bits, every NaN as 0x7fc0.
inline __m256i round_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

// --- decode path (fp32; bf16 "dpbf16" form): one weight row against up to 4 token rows -----

constexpr int64_t kPrefetchBytes = 8192;  // how far ahead (at least one row) the weight is prefetched

// The cache lines [pf, end) of a later weight row, `per` of them per block group, into L2:
// the memory stream keeps going while this row's arithmetic runs (on its own, the hardware
// prefetcher lets DRAM idle while a row is reused from L1 for more token rows).
struct Prefetch {
  const char* pf;
  const char* end;
  int per;
  inline void step() {
    for (int i = 0; i < per && pf < end; ++i, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
  }
};

template <typename Kind, int M>
inline void dot_row(const typename Kind::T* __restrict x, const typename Kind::T* __restrict w, int64_t K,
                    float* sums, Prefetch& pf) {
  constexpr int E = Kind::E;
  __m512 acc[kChains][M];
  for (int u = 0; u < kChains; ++u)
    for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + E * kChains <= K; k += E * kChains) {
    pf.step();
    for (int u = 0; u < kChains; ++u) {
      const auto wv = Kind::load(w + k + E * u);
      for (int m = 0; m < M; ++m) acc[u][m] = Kind::madd(acc[u][m], wv, Kind::load(x + m * K + k + E * u));
    }
  }
  for (; k + E <= K; k += E) {
    const auto wv = Kind::load(w + k);
    for (int m = 0; m < M; ++m) acc[0][m] = Kind::madd(acc[0][m], wv, Kind::load(x + m * K + k));
  }
  if (k < K) {
    const int r = static_cast<int>(K - k);
    const auto wv = Kind::load_tail(w + k, r);
    for (int m = 0; m < M; ++m) acc[0][m] = Kind::madd(acc[0][m], wv, Kind::load_tail(x + m * K + k, r));
  }
  for (int m = 0; m < M; ++m) sums[m] = combine(acc[0][m], acc[1][m], acc[2][m], acc[3][m]);
}

constexpr int kGroup = 4;  // token rows sharing one weight load (kChains * kGroup zmm accumulators)

// All M rows against weight row w; `next` (or null) is the row to prefetch meanwhile, spread
// evenly over the passes' block groups.
template <typename Kind>
inline void dot_rows(const typename Kind::T* __restrict x, const typename Kind::T* __restrict w, int64_t M,
                     int64_t K, float* sums, const typename Kind::T* next) {
  const int64_t bytes = K * static_cast<int64_t>(sizeof(typename Kind::T));
  const int64_t passes = (M + kGroup - 1) / kGroup, groups = K / (Kind::E * kChains);
  const int64_t lines = (bytes + 63) / 64;
  Prefetch pf{nullptr, nullptr, 0};
  if (next != nullptr && groups > 0) {
    pf.pf = reinterpret_cast<const char*>(next);
    pf.end = pf.pf + lines * 64;
    pf.per = static_cast<int>((lines + passes * groups - 1) / (passes * groups));
  }
  int64_t m = 0;
  for (; m + kGroup <= M; m += kGroup) dot_row<Kind, kGroup>(x + m * K, w, K, sums + m, pf);
  switch (M - m) {
    case 0: return;
    case 1: return dot_row<Kind, 1>(x + m * K, w, K, sums + m, pf);
    case 2: return dot_row<Kind, 2>(x + m * K, w, K, sums + m, pf);
    case 3: return dot_row<Kind, 3>(x + m * K, w, K, sums + m, pf);
  }
}

constexpr int64_t kStreamRows = 16;  // M up to this takes the decode path
constexpr int64_t kStreamFmaRows = 4;  // ... in the bf16 fma form from this M (below: no faster)

template <typename Kind, typename Out>
void stream_range(const typename Kind::T* x, const typename Kind::T* w, Bias<Kind> bias, Out* y, int64_t M,
                  int64_t N, int64_t K, int64_t n_begin, int64_t n_end) {
  float sums[kStreamRows];
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(typename Kind::T));
  const int64_t rows_ahead = std::max<int64_t>(1, kPrefetchBytes / row_bytes);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int64_t ahead = n + rows_ahead;
    dot_rows<Kind>(x, w + n * K, M, K, sums, ahead < n_end ? w + ahead * K : nullptr);
    const float b = bias.at(n);
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = store_value<Out>(sums[m] + b);
  }
}

// --- prefill path (fp32; bf16 "dpbf16" form): register tiles, one chain at a time -----------

#ifdef KEEPWARM_AVX2
// 16 ymm registers, two per emulated zmm: smaller tiles (the shape never changes a bit; of 4x6,
// 3x2, 2x3, 2x2, 2x4 and 1x6, 2x4 was fastest on Zen 3, ~1.4x the prefill rate of 4x6).
constexpr int kMr = 2;
constexpr int kNr = 4;
#else
constexpr int kMr = 4;  // token rows per register tile
constexpr int kNr = 6;  // weight rows per register tile (kMr * kNr accumulators + kNr + 1 loads)
#endif

// Chain u of the tile x[0..MR) x w[0..NR), its blocks in the contract's order, added into
// total[MR][NR][16] (chain 0 stores): after the four chains, total = ((c0 + c1) + c2) + c3.
template <typename Kind, int MR, int NR>
inline void tile_chain(const typename Kind::T* __restrict x, const typename Kind::T* __restrict w, int64_t K,
                       int u, float* __restrict total) {
  constexpr int E = Kind::E;
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  const int64_t nb = K / E, grouped = (nb / kChains) * kChains;
  auto block = [&](int64_t k) {
    typename Kind::V wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = Kind::load(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const auto xv = Kind::load(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = Kind::madd(acc[m][n], wv[n], xv);
    }
  };
  for (int64_t j = u; j < grouped; j += kChains) block(j * E);
  if (u == 0) {
    for (int64_t j = grouped; j < nb; ++j) block(j * E);
    if (nb * E < K) {
      const int64_t k = nb * E;
      const int r = static_cast<int>(K - k);
      typename Kind::V wv[NR];
      for (int n = 0; n < NR; ++n) wv[n] = Kind::load_tail(w + n * K + k, r);
      for (int m = 0; m < MR; ++m) {
        const auto xv = Kind::load_tail(x + m * K + k, r);
        for (int n = 0; n < NR; ++n) acc[m][n] = Kind::madd(acc[m][n], wv[n], xv);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) _mm512_store_ps(total + (m * NR + n) * 16, acc[m][n]);
    return;
  }
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) {
      float* t = total + (m * NR + n) * 16;
      _mm512_store_ps(t, _mm512_add_ps(_mm512_load_ps(t), acc[m][n]));
    }
  }
}

template <typename Kind, typename Out, int MR, int NR>
void tile(const typename Kind::T* x, const typename Kind::T* w, Bias<Kind> bias, Out* y, int64_t N, int64_t K,
          int64_t n0) {
  constexpr int kOut = MR * NR, kPadded = (kOut + 15) / 16 * 16;
  alignas(64) float total[kPadded * 16];
  for (int u = 0; u < kChains; ++u) tile_chain<Kind, MR, NR>(x, w, K, u, total);
  for (int i = kOut * 16; i < kPadded * 16; ++i) total[i] = 0.f;
  float sums[kPadded];
  for (int i = 0; i < kPadded; i += 16) hsum16x16(reinterpret_cast<const __m512*>(total + i * 16), sums + i);
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) y[m * N + n0 + n] = store_value<Out>(sums[m * NR + n] + bias.at(n0 + n));
}

template <typename Kind, typename Out, int MR>
void tile_nr(int nr, const typename Kind::T* x, const typename Kind::T* w, Bias<Kind> bias, Out* y, int64_t N,
             int64_t K, int64_t n0) {
  switch (nr) {
    case 1: return tile<Kind, Out, MR, 1>(x, w, bias, y, N, K, n0);
    case 2: return tile<Kind, Out, MR, 2>(x, w, bias, y, N, K, n0);
    case 3: return tile<Kind, Out, MR, 3>(x, w, bias, y, N, K, n0);
    case 4: return tile<Kind, Out, MR, 4>(x, w, bias, y, N, K, n0);
    case 5: return tile<Kind, Out, MR, 5>(x, w, bias, y, N, K, n0);
    case 6: return tile<Kind, Out, MR, 6>(x, w, bias, y, N, K, n0);
  }
}

template <typename Kind, typename Out>
void tile_any(int mr, int nr, const typename Kind::T* x, const typename Kind::T* w, Bias<Kind> bias, Out* y,
              int64_t N, int64_t K, int64_t n0) {
  switch (mr) {
    case 1: return tile_nr<Kind, Out, 1>(nr, x, w, bias, y, N, K, n0);
    case 2: return tile_nr<Kind, Out, 2>(nr, x, w, bias, y, N, K, n0);
    case 3: return tile_nr<Kind, Out, 3>(nr, x, w, bias, y, N, K, n0);
    case 4: return tile_nr<Kind, Out, 4>(nr, x, w, bias, y, N, K, n0);
  }
}

// Columns [n_begin, n_end) of y for all M rows: x panels of mc rows (kept in L2) times each
// kNr-row weight strip (kept in L1), strip by strip.
template <typename Kind, typename Out>
void tiled_range(const typename Kind::T* x, const typename Kind::T* w, Bias<Kind> bias, Out* y, int64_t M,
                 int64_t N, int64_t K, int64_t n_begin, int64_t n_end) {
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(typename Kind::T));
  const int64_t mc = std::max<int64_t>(kMr, ((768 * 1024) / row_bytes) / kMr * kMr);
  for (int64_t m0 = 0; m0 < M; m0 += mc) {
    const int64_t m1 = std::min(M, m0 + mc);
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kNr) {
      const int nr = static_cast<int>(std::min<int64_t>(kNr, n_end - n0));
      for (int64_t m = m0; m < m1; m += kMr) {
        const int mr = static_cast<int>(std::min<int64_t>(kMr, m1 - m));
        tile_any<Kind, Out>(mr, nr, x + m * K, w + n0 * K, bias, y + m * N, N, K, n0);
      }
    }
  }
}

// --- bf16 prefill path, "fma" form: each block's products as two fp32 FMAs on packed panels --
//
// (The "dpbf16" form is tiled_range<Bf16> above, one vdpbf16ps per block.) On Sapphire/Emerald
// Rapids (AMX not exposed) `vdpbf16ps` issues at a quarter of the rate of `vfmadd231ps`, so 32
// products as two FMAs cost half as much; on a CPU with a full-rate vdpbf16ps (Zen 4) they
// cost twice as much, and time_prefill_forms below tells which. On Emerald Rapids, for every
// input (normal, denormal, zero, inf, NaN; checked on 2.9e8 random lanes, NaN payloads
// included; fma_form_mismatches re-checks the CPU it runs on) a block
//   acc = dpbf16(acc, w, x)    equals, bit for bit,
//   acc = fma(w_odd, x_odd, acc); acc = fma(w_even, x_even, acc)    (vfmadd231ps acc, w, x)
// under MXCSR DAZ + FTZ + round-to-nearest-even: the instruction's own definition (two fused
// steps, the odd bf16 of each pair first, denormals in and out as zero, RNE). w_odd / w_even
// are the pair's high / low bf16 as fp32 (bits & 0xffff0000, bits << 16), exact. With w as
// vfmadd231ps's first multiplicand the NaN kept where several meet is the one dpbf16 keeps.
// DAZ/FTZ hold only while chains accumulate; the combine, hsum, bias and rounding run under the
// caller's MXCSR. The decode path's fma form (below) uses the same blocks.
//
// Layout: x panels (per thread, kept in L2) and weight strips of kPNr rows (kept in L1) are
// unpacked to fp32 [odd 16 | even 16] per block, the blocks reordered chain by chain (chain 0's
// j = 0, 4, .., then 4q..nb-1 and the tail block zero-padded, then chain 1's j = 1, 5, .., ...),
// so each chain is one contiguous run. x panel: [tile of kPMr rows][block][row][32]; strip:
// [block][kPNr weight rows][32]; rows past M or N are zeros whose outputs are dropped.

constexpr int kPMr = kMr;           // token rows per register tile (4; the AVX2 build: 2)
constexpr int kPNr = kNr;           // weight rows per register tile (6: 24 accumulators + 6 w + 1 x zmm; AVX2: 4)
constexpr int kMaxGroupTiles = 4;   // tiles per DAZ/FTZ window (see packed_run)
constexpr int kLanes = 16;
constexpr int kPacked = 2 * kLanes;     // floats per packed block per row
#ifdef KEEPWARM_AVX2
// The AVX2 build has no vdpbf16ps: avx512_compat.h's _mm512_dpbf16_ps is these same two FMAs
// under the caller's MXCSR, so the FMA form keeps the caller's DAZ/FTZ bits (the two forms are
// one result by construction; the probe checks it).
constexpr unsigned kCsrDpbf = 0x1f80u;  // MXCSR: all exceptions masked
#else
constexpr unsigned kCsrDpbf = 0x9fc0u;  // MXCSR: FTZ | all exceptions masked | DAZ
#endif
constexpr unsigned kCsrRound = 0x6000u;  // MXCSR rounding control (00: nearest even)

// The MXCSR under which the FMA form is vdpbf16ps: the caller's with DAZ, FTZ, all exceptions
// masked and round to nearest even (restoring the caller's also drops the FMAs' flags).
inline unsigned fma_form_csr(unsigned csr) { return (csr & ~kCsrRound) | kCsrDpbf; }

// A bf16 pair's high (odd) and low (even) element in each fp32 lane, exactly.
inline __m512 bf16_odd(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline __m512 bf16_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }

// acc + w * x in one rounding; NaN priority w, x, acc (vdpbf16ps's src1, src2, srcdest).
#ifdef KEEPWARM_AVX2
inline __m512 fma_wx(__m512 acc, __m512 w, __m512 x) { return keepwarm_avx2::fma_wx512(acc, w, x); }
#else
inline __m512 fma_wx(__m512 acc, __m512 w, __m512 x) {
  asm("vfmadd231ps %[x], %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "v"(x));
  return acc;
}
#endif

// One block in the FMA form: the odd products, then the even ones.
inline __m512 fma_block(__m512 acc, __m512 w_odd, __m512 w_even, __m512 x_odd, __m512 x_even) {
  return fma_wx(fma_wx(acc, w_odd, x_odd), w_even, x_even);
}

// MXCSR = csr, with no memory access moved across (the chains are stored before it is restored).
inline void set_csr(unsigned csr) {
  asm volatile("" ::: "memory");
  _mm_setcsr(csr);
  asm volatile("" ::: "memory");
}

// Where each chain's blocks sit in the packed order, and which contract block each one is.
struct ChainOrder {
  int64_t nb = 0, nbt = 0;          // full blocks; blocks with the tail
  int64_t begin[kChains + 1] = {};  // chain u is packed blocks [begin[u], begin[u + 1])
  std::vector<int64_t> pos;         // contract block j (nb: the tail) sits at packed block pos[j]
  explicit ChainOrder(int64_t K) : nb(K / Bf16::E), nbt((K + Bf16::E - 1) / Bf16::E), pos(nbt) {
    const int64_t q = nb / kChains;
    int64_t b = 0;
    for (int u = 0; u < kChains; ++u) {
      begin[u] = b;
      for (int64_t i = 0; i < q; ++i) pos[u + kChains * i] = b++;
      if (u == 0)
        for (int64_t j = kChains * q; j < nbt; ++j) pos[j] = b++;
    }
    begin[kChains] = b;
  }
};

// Rows [r0, r0 + R) of a [rows, K] bf16 matrix into packed [block][R][32] at dst: block j of
// row r as [odd 16 | even 16] fp32 (zeros past K and for rows >= `rows`). Rows are read in
// order (one sequential stream each).
template <int R>
void pack_rows(const uint16_t* a, int64_t rows, int64_t K, int64_t r0, const ChainOrder& order, float* dst) {
  for (int r = 0; r < R; ++r) {
    if (r0 + r >= rows) {
      for (int64_t b = 0; b < order.nbt; ++b) {
        _mm512_store_ps(dst + (b * R + r) * kPacked, _mm512_setzero_ps());
        _mm512_store_ps(dst + (b * R + r) * kPacked + kLanes, _mm512_setzero_ps());
      }
      continue;
    }
    const uint16_t* row = a + (r0 + r) * K;
    for (int64_t j = 0; j < order.nbt; ++j) {
      const int64_t k = j * Bf16::E;
      const __m512i v =
          j < order.nb ? Bf16::load(row + k) : Bf16::load_tail(row + k, static_cast<int>(K - k));
      float* d = dst + (order.pos[j] * R + r) * kPacked;
      _mm512_store_ps(d, bf16_odd(v));
      _mm512_store_ps(d + kLanes, bf16_even(v));
    }
  }
}

// Packed blocks [b0, b1) of one chain for a kPMr x kPNr tile, from zero, into out[m][n][16].
// Not inlined: on its own the compiler keeps the 31 live zmm registers without spills or
// reloads (inlined into the callers' loops it did not).
__attribute__((noinline)) void chain_tile(const float* __restrict xp, const float* __restrict wp, int64_t b0,
                                          int64_t b1, float* __restrict out) {
  __m512 acc[kPMr][kPNr];
#pragma GCC unroll 4
  for (int m = 0; m < kPMr; ++m)
#pragma GCC unroll 6
    for (int n = 0; n < kPNr; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = xp + b * kPMr * kPacked;
    const float* wb = wp + b * kPNr * kPacked;
#pragma GCC unroll 2
    for (int h = 0; h < kPacked; h += kLanes) {  // the odd products, then the even ones
      __m512 wv[kPNr];
#pragma GCC unroll 6
      for (int n = 0; n < kPNr; ++n) wv[n] = _mm512_load_ps(wb + n * kPacked + h);
#pragma GCC unroll 4
      for (int m = 0; m < kPMr; ++m) {
        const __m512 xv = _mm512_load_ps(xb + m * kPacked + h);
#pragma GCC unroll 6
        for (int n = 0; n < kPNr; ++n) acc[m][n] = fma_wx(acc[m][n], wv[n], xv);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < kPMr; ++m)
#pragma GCC unroll 6
    for (int n = 0; n < kPNr; ++n) _mm512_store_ps(out + (m * kPNr + n) * kLanes, acc[m][n]);
}

// A thread's 64-byte aligned float buffers, grown on demand and kept for the thread's life
// (the pool's threads run every call: no allocation, no page faults per call).
struct Scratch {
  float* p = nullptr;
  int64_t n = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(p); }
  float* get(int64_t want) {
    if (want > n) {
      std::free(p);
      p = static_cast<float*>(std::aligned_alloc(64, (want * sizeof(float) + 63) / 64 * 64));
      n = p == nullptr ? 0 : want;
      if (p == nullptr) throw std::bad_alloc();
    }
    return p;
  }
};

// One group of `gt` tiles (rows from tile t0 of the packed x panel `xp`) against the packed
// strip `wp` (weight rows n0..n0 + kPNr), stepping `pf` before each chain of a tile: the
// chains under DAZ/FTZ into `chains`, then the
// contract's combine, hsum, bias and rounding under the caller's MXCSR `csr`, into y.
// bias_pattern[o] is the bias of output o's column (o % kPNr), for every o of a group.
// chain_major: chain by chain over the tiles (else tile by tile).
template <typename Out>
void run_group(const float* xp, int64_t t0, int gt, bool chain_major, const float* wp, const ChainOrder& order,
               float* chains, const float* bias_pattern, Out* y, int64_t M, int64_t N, int64_t n0, unsigned csr,
               Prefetch& pf) {
  constexpr int kTileOut = kPMr * kPNr;
  const int64_t tile_floats = order.nbt * kPMr * kPacked;
  const unsigned csr_dpbf = fma_form_csr(csr);
  auto chain = [&](int u, int g) {
    pf.step();
    chain_tile(xp + g * tile_floats, wp, order.begin[u], order.begin[u + 1],
               chains + (g * kChains + u) * kTileOut * kLanes);
  };
  set_csr(csr_dpbf);
  if (chain_major) {
    for (int u = 0; u < kChains; ++u)
      for (int g = 0; g < gt; ++g) chain(u, g);
  } else {
    for (int g = 0; g < gt; ++g)
      for (int u = 0; u < kChains; ++u) chain(u, g);
  }
  set_csr(csr);
  // Output o = g * kTileOut + m * kPNr + n; its chain u at chains[g][u][m * kPNr + n].
  alignas(64) float sums[kMaxGroupTiles * kTileOut + 16];
  const int outs = gt * kTileOut;
  for (int o0 = 0; o0 < outs; o0 += 16) {
    auto chain = [&](int i, int u) {
      const int o = o0 + i;
      return _mm512_load_ps(chains + ((o / kTileOut * kChains + u) * kTileOut + o % kTileOut) * kLanes);
    };
    combine_outputs(std::min(16, outs - o0), chain, sums + o0);
  }
  // + bias (0 without: -0 becomes +0 as in the decode path), one rounding, then each tile row's
  // kPNr outputs into y.
  alignas(64) Out vals[kMaxGroupTiles * kTileOut + 16];
  for (int o0 = 0; o0 < outs; o0 += 16) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(sums + o0), _mm512_load_ps(bias_pattern + o0));
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_store_ps(vals + o0, v);
    } else {
      _mm256_store_si256(reinterpret_cast<__m256i*>(vals + o0), round_bf16x16(v));
    }
  }
  const int64_t cols = std::min<int64_t>(kPNr, N - n0);
  for (int g = 0; g < gt; ++g)
    for (int m = 0; m < kPMr; ++m) {
      const int64_t row = (t0 + g) * kPMr + m;
      if (row >= M) break;
      std::memcpy(y + row * N + n0, vals + g * kTileOut + m * kPNr, cols * sizeof(Out));
    }
}

// Threads split the strips of kPNr weight rows; each packs x panel by panel (kept in L2) and,
// per panel, each of its strips (kept in L1, the next one prefetched meanwhile).
template <typename Out>
void packed_run(int64_t M, const uint16_t* x, const uint16_t* w, Bias<Bf16> bias, Out* y, int64_t N, int64_t K) {
  constexpr int kTileOut = kPMr * kPNr;
  const ChainOrder order(K);
  const int64_t tiles = (M + kPMr - 1) / kPMr, tile_floats = order.nbt * kPMr * kPacked;
  const int64_t strip_floats = order.nbt * kPNr * kPacked;
  // A strip that fits L1 beside one x tile runs tile by tile (its four chains back to back);
  // a larger one chain by chain over a group of tiles, so that only the strip's current chain
  // (a quarter) needs to stay in L1.
  const bool chain_major = strip_floats * 4 > (24 << 10);
  const int group = chain_major ? 4 : 1;
  const int64_t panel = std::max<int64_t>(group, (1 << 20) / (tile_floats * 4) / group * group);
  const int64_t strips = (N + kPNr - 1) / kPNr;
  const int64_t strip_bytes = kPNr * K * static_cast<int64_t>(sizeof(uint16_t));
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    thread_local Scratch x_buf, w_buf, chain_buf;
    float* xp = x_buf.get(std::min(panel, tiles) * tile_floats);
    float* wp = w_buf.get(strip_floats);
    float* chains = chain_buf.get(kMaxGroupTiles * kChains * kTileOut * kLanes);
    const unsigned csr = _mm_getcsr();
    alignas(64) float bias_pattern[kMaxGroupTiles * kTileOut + 16];
    for (int64_t p0 = 0; p0 < tiles; p0 += panel) {
      const int64_t p1 = std::min(tiles, p0 + panel);
      for (int64_t t = p0; t < p1; ++t) pack_rows<kPMr>(x, M, K, t * kPMr, order, xp + (t - p0) * tile_floats);
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t n0 = s * kPNr;
        pack_rows<kPNr>(w, N, K, n0, order, wp);
        for (int o = 0; o < kMaxGroupTiles * kTileOut + 16; ++o)
          bias_pattern[o] = n0 + o % kPNr < N ? bias.at(n0 + o % kPNr) : 0.f;
        // The next strip's weight rows (contiguous) into L2 while this one computes.
        const int64_t next = s + 1 < s1 ? s + 1 : (p1 < tiles ? s0 : s1);
        Prefetch pf{nullptr, nullptr, 0};
        if (next < s1) {
          pf.pf = reinterpret_cast<const char*>(w + next * kPNr * K);
          pf.end = reinterpret_cast<const char*>(w + std::min(N, (next + 1) * kPNr) * K);
          const int64_t calls = (p1 - p0) * kChains;  // chain_tile calls on this strip
          pf.per = static_cast<int>(((strip_bytes + 63) / 64 + calls - 1) / calls);
        }
        for (int64_t g0 = p0; g0 < p1; g0 += group) {
          const int gt = static_cast<int>(std::min<int64_t>(group, p1 - g0));
          run_group<Out>(xp + (g0 - p0) * tile_floats, g0, gt, chain_major, wp, order, chains, bias_pattern, y, M, N,
                         n0, csr, pf);
        }
      }
    }
  });
}

// --- decode path, bf16 "fma" form: tiles of token rows x weight rows, one chain at a time -----
//
// Each block as two FMAs (see above) needs one x load per FMA where vdpbf16ps needs one per 32
// products: streamed one weight row at a time, the fp32 x panel (twice bf16's bytes) would be
// read from L2 for every weight row and bind the loop. So the weight is streamed kStreamTileRows
// rows at a time (the same single sequential stream, the next tile's rows prefetched meanwhile):
// register tiles of up to kStreamTileTokens token rows x those weight rows, chain by chain, the
// weight blocks split in registers (and/shift) from the bf16 rows, x unpacked once per call to a
// chain-ordered fp32 panel ([row][packed block][32], ChainOrder). Each x block load feeds
// kStreamTileRows FMAs, and a chain's share of x and of the tile's weight rows stays in L1.

constexpr int kStreamTileTokens = 4;  // token rows per register tile
constexpr int kStreamTileRows = 4;    // weight rows per tile: 16 accumulators + 8 weight halves + 2 x zmm

// Chain u (its packed blocks start at x[g]) of token rows x[g] = x + g * ldx, g < G, against bf16
// weight rows w + r * K, r < R, from zero, into chains[(g * kStreamTileRows + r) * kChains + u];
// `pf` stepped once per block group. Not inlined, as chain_tile.
template <int G, int R>
__attribute__((noinline)) void stream_tile(const float* __restrict x, int64_t ldx, const uint16_t* __restrict w,
                                           int64_t K, int u, __m512* __restrict chains, Prefetch& pf) {
  constexpr int E = Bf16::E;
  __m512 acc[G][R];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
  // Contract block at element k (tail: its length, else 0), x's next packed block.
  auto block = [&](int64_t k, int tail) {
    __m512 w_odd[R], w_even[R];
    for (int r = 0; r < R; ++r) {
      const __m512i v = tail ? Bf16::load_tail(w + r * K + k, tail) : Bf16::load(w + r * K + k);
      w_odd[r] = bf16_odd(v);
      w_even[r] = bf16_even(v);
    }
    for (int g = 0; g < G; ++g) {
      const __m512 x_odd = _mm512_load_ps(x + g * ldx), x_even = _mm512_load_ps(x + g * ldx + kLanes);
      for (int r = 0; r < R; ++r) acc[g][r] = fma_block(acc[g][r], w_odd[r], w_even[r], x_odd, x_even);
    }
    x += kPacked;
  };
  const int64_t nb = K / E, grouped = nb / kChains * kChains;
  for (int64_t j = u; j < grouped; j += kChains) {
    pf.step();
    block(j * E, 0);
  }
  if (u == 0) {
    for (int64_t j = grouped; j < nb; ++j) block(j * E, 0);
    if (nb * E < K) block(nb * E, static_cast<int>(K - nb * E));
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) chains[(g * kStreamTileRows + r) * kChains + u] = acc[g][r];
}

template <int R>
void stream_tile_g(int g, const float* x, int64_t ldx, const uint16_t* w, int64_t K, int u, __m512* chains,
                   Prefetch& pf) {
  switch (g) {
    case 1: return stream_tile<1, R>(x, ldx, w, K, u, chains, pf);
    case 2: return stream_tile<2, R>(x, ldx, w, K, u, chains, pf);
    case 3: return stream_tile<3, R>(x, ldx, w, K, u, chains, pf);
    case 4: return stream_tile<4, R>(x, ldx, w, K, u, chains, pf);
  }
}

// Columns [n_begin, n_end) of y from the packed x panel `xp` (M rows of ldx floats): tiles of
// kStreamTileRows weight rows (a last partial one row by row), their chains under DAZ/FTZ, then
// the combine, hsum, bias and rounding under the caller's MXCSR.
template <typename Out>
void stream_fma_range(const float* xp, int64_t ldx, const ChainOrder& order, const uint16_t* w, Bias<Bf16> bias,
                      Out* y, int64_t M, int64_t N, int64_t K, int64_t n_begin, int64_t n_end) {
  constexpr int kR = kStreamTileRows;
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t ahead = std::max<int64_t>(kR, kPrefetchBytes / row_bytes);  // rows
  const int64_t groups = (M + kStreamTileTokens - 1) / kStreamTileTokens;
  const unsigned csr = _mm_getcsr();
  __m512 chains[kStreamRows * kR * kChains];  // output (m, r) chain u at [(m * kR + r) * kChains + u]
  for (auto& c : chains) c = _mm512_setzero_ps();
  alignas(64) float sums[kStreamRows * kR];
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kR) {
    const int rows = static_cast<int>(std::min<int64_t>(kR, n_end - n0));
    // The rows `ahead` later, as far as this thread's run goes, over the tile's block groups.
    Prefetch pf{nullptr, nullptr, 0};
    const int64_t p0 = std::min(n_end, n0 + ahead), p1 = std::min(n_end, p0 + kR);
    const int64_t steps = kChains * groups * (K / (Bf16::E * kChains));  // pf.step() calls
    if (p0 < p1 && steps > 0) {
      pf.pf = reinterpret_cast<const char*>(w + p0 * K);
      pf.end = reinterpret_cast<const char*>(w + p1 * K);
      pf.per = static_cast<int>(((pf.end - pf.pf + 63) / 64 + steps - 1) / steps);
    }
    set_csr(fma_form_csr(csr));
    for (int u = 0; u < kChains; ++u) {
      const float* xu = xp + order.begin[u] * kPacked;
      for (int64_t m0 = 0; m0 < M; m0 += kStreamTileTokens) {
        const int g = static_cast<int>(std::min<int64_t>(kStreamTileTokens, M - m0));
        __m512* c = chains + m0 * kR * kChains;
        if (rows == kR) {
          stream_tile_g<kR>(g, xu + m0 * ldx, ldx, w + n0 * K, K, u, c, pf);
        } else {
          for (int r = 0; r < rows; ++r)
            stream_tile_g<1>(g, xu + m0 * ldx, ldx, w + (n0 + r) * K, K, u, c + r * kChains, pf);
        }
      }
    }
    set_csr(csr);
    const int outs = static_cast<int>(M) * kR;
    for (int o0 = 0; o0 < outs; o0 += 16)
      combine_outputs(
          std::min(16, outs - o0), [&](int i, int v) { return chains[(o0 + i) * kChains + v]; }, sums + o0);
    for (int64_t m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) y[m * N + n0 + r] = store_value<Out>(sums[m * kR + r] + bias.at(n0 + r));
  }
}

// `fma_form`: bf16 in the FMA form (else vdpbf16ps), in both paths (decode from
// kStreamFmaRows rows); the same bits wherever the caller chose it from the probes below.
template <typename Kind, typename Out>
void run(int64_t M, const typename Kind::T* x, const typename Kind::T* w, Bias<Kind> bias, Out* y, int64_t N,
         int64_t K, bool force_tiled, bool fma_form) {
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(typename Kind::T));
  if (M <= kStreamRows && !force_tiled) {
    // Each thread gets one contiguous run of rows, so it streams one contiguous slab of the
    // weight; at least ~256 KiB of weight per thread (smaller is not worth the fork/join).
    const int64_t grain = std::max<int64_t>(1, (256 * 1024) / row_bytes);
    if constexpr (std::is_same_v<Kind, Bf16>) {
      if (fma_form && M >= kStreamFmaRows) {
        const ChainOrder order(K);
        const int64_t ldx = order.nbt * kPacked;
        thread_local Scratch x_buf;
        float* xp = x_buf.get(M * ldx);
        for (int64_t m = 0; m < M; ++m) pack_rows<1>(x, M, K, m, order, xp + m * ldx);
        at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
          stream_fma_range<Out>(xp, ldx, order, w, bias, y, M, N, K, n0, n1);
        });
        return;
      }
    }
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      stream_range<Kind, Out>(x, w, bias, y, M, N, K, n0, n1);
    });
    return;
  }
  // Threads own whole strips of weight rows (never a share of K).
  if constexpr (std::is_same_v<Kind, Bf16>) {
    if (fma_form) return packed_run<Out>(M, x, w, bias, y, N, K);
  }
  const int64_t strips = (N + kNr - 1) / kNr;
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    tiled_range<Kind, Out>(x, w, bias, y, M, N, K, s0 * kNr, std::min(N, s1 * kNr));
  });
}

// --- the bf16 prefill form's probes ---------------------------------------------------------

// xorshift64: the probes' reproducible random bits.
struct Rng {
  uint64_t s;
  inline uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
};

// bf16 bit patterns the FMA form must get right: signed zeros, denormals, the smallest normals,
// values whose products are near 2^-126 (exponent 63: 2^-64 squared), ones, values near
// overflow, the largest finite, infinities, quiet and signalling NaNs with payloads.
constexpr uint16_t kSpecialBf16[] = {
    0x0000, 0x8000, 0x0001, 0x8001, 0x0040, 0x007f, 0x807f, 0x0080, 0x8080, 0x0081, 0x00ff,
    0x0100, 0x1f80, 0x9f80, 0x1fff, 0x2000, 0x2080, 0x3f80, 0xbf80, 0x3fff, 0x7f00, 0xff00,
    0x7f7f, 0xff7f, 0x7f80, 0xff80, 0x7fc0, 0xffc0, 0x7f81, 0xffc1, 0x7fff, 0x7fa5};
// fp32 accumulators likewise: zeros, denormals, +-2^-126 and its neighbours, ordinary, near
// overflow, infinities, NaNs with payloads.
constexpr uint32_t kSpecialAcc[] = {
    0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x00400000u, 0x00800000u,
    0x80800000u, 0x00800001u, 0x3f800000u, 0xbf800000u, 0x7f7fffffu, 0xff7fffffu,
    0x7f000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u};

// One random bf16: a special pattern (1/4), any 16 bits (1/4), or a random sign and mantissa
// with an exponent from a class (zero/denormal, near 2^-126, products near 2^-126, ordinary,
// near overflow).
inline uint16_t probe_bf16(Rng& rng) {
  const uint64_t r = rng.next();
  constexpr int kSpecials = sizeof(kSpecialBf16) / sizeof(kSpecialBf16[0]);
  switch (r & 7) {
    case 0:
    case 1: return kSpecialBf16[(r >> 3) % kSpecials];
    case 2:
    case 3: return static_cast<uint16_t>(r >> 16);
  }
  static constexpr int kLo[] = {0, 1, 59, 120}, kSpan[] = {1, 3, 10, 16};
  const int cls = static_cast<int>((r >> 3) % 5);
  const int spread = static_cast<int>((r >> 8) % 16);
  const int e = cls == 4 ? 250 + spread % 5 : kLo[cls] + spread % kSpan[cls];
  return static_cast<uint16_t>(((r >> 20) & 1) << 15 | e << 7 | ((r >> 24) & 0x7f));
}

// One random fp32 accumulator: special (1/4), any 32 bits (1/4), or a random bf16 as above
// with random low mantissa bits.
inline uint32_t probe_acc(Rng& rng) {
  const uint64_t r = rng.next();
  constexpr int kSpecials = sizeof(kSpecialAcc) / sizeof(kSpecialAcc[0]);
  switch (r & 3) {
    case 0: return kSpecialAcc[(r >> 2) % kSpecials];
    case 1: return static_cast<uint32_t>(r >> 32);
  }
  return static_cast<uint32_t>(probe_bf16(rng)) << 16 | static_cast<uint32_t>((r >> 8) & 0xffff);
}

// How many of `vectors` x 16 lanes differ between acc = vdpbf16ps(acc, w, x) and the FMA form
// (odd products, then even, under fma_form_csr), NaN matching any NaN; lanes from `seed`. The
// first vectors pair every special bf16 with every other (as w and x) over the special accs.
int64_t fma_form_mismatches(int64_t vectors, uint64_t seed) {
  Rng rng{seed | 1};
  constexpr int kSpecials = sizeof(kSpecialBf16) / sizeof(kSpecialBf16[0]);
  constexpr int kAccs = sizeof(kSpecialAcc) / sizeof(kSpecialAcc[0]);
  const unsigned csr = _mm_getcsr(), csr_fma = fma_form_csr(csr);
  int64_t bad = 0, pair = 0;
  for (int64_t v = 0; v < vectors; ++v) {
    alignas(64) uint16_t wb[32], xb[32];
    alignas(64) uint32_t ab[16], got[16], want[16];
    for (int i = 0; i < 32; ++i, ++pair) {
      const bool all_pairs = pair < kSpecials * kSpecials;
      wb[i] = all_pairs ? kSpecialBf16[pair / kSpecials] : probe_bf16(rng);
      xb[i] = all_pairs ? kSpecialBf16[pair % kSpecials] : probe_bf16(rng);
    }
    for (int i = 0; i < 16; ++i) ab[i] = v % 2 == 0 ? kSpecialAcc[(v / 2 + i) % kAccs] : probe_acc(rng);
    const __m512i w = _mm512_load_si512(wb), x = _mm512_load_si512(xb);
    const __m512 acc = _mm512_load_ps(reinterpret_cast<const float*>(ab));
    _mm512_store_ps(reinterpret_cast<float*>(want), Bf16::madd(acc, w, x));
    set_csr(csr_fma);
    const __m512 fma = fma_block(acc, bf16_odd(w), bf16_even(w), bf16_odd(x), bf16_even(x));
    _mm512_store_ps(reinterpret_cast<float*>(got), fma);
    set_csr(csr);
    for (int i = 0; i < 16; ++i) {
      const bool nan_g = (got[i] & 0x7fffffffu) > 0x7f800000u, nan_w = (want[i] & 0x7fffffffu) > 0x7f800000u;
      bad += nan_g || nan_w ? nan_g != nan_w : got[i] != want[i];
    }
  }
  return bad;
}

// The best of `rounds` times (seconds) of each form's inner loop on one L1-resident tile of
// kMr x kNr outputs at K = 512 (all four chains, `reps` times over), the two interleaved:
// (vdpbf16ps form, FMA form). Neither includes packing, which the FMA form amortises over M.
std::pair<double, double> time_prefill_forms(int64_t reps, int64_t rounds) {
  static_assert(kMr == kPMr && kNr == kPNr, "the race compares tiles of one shape");
  constexpr int64_t K = 512;
  std::vector<uint16_t> x(kMr * K), w(kNr * K);
  Rng rng{0x9e3779b97f4a7c15ull};
  for (auto& v : x) v = static_cast<uint16_t>(0x3f00 | (rng.next() & 0xff));  // [0.5, 2), no overflow
  for (auto& v : w) v = static_cast<uint16_t>(0x3f00 | (rng.next() & 0xff));
  const ChainOrder order(K);
  std::vector<float> xp(order.nbt * kPMr * kPacked + 16), wp(order.nbt * kPNr * kPacked + 16);
  float* xa = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(xp.data()) + 63) & ~uintptr_t{63});
  float* wa = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(wp.data()) + 63) & ~uintptr_t{63});
  pack_rows<kPMr>(x.data(), kMr, K, 0, order, xa);
  pack_rows<kPNr>(w.data(), kNr, K, 0, order, wa);
  alignas(64) float total[kMr * kNr * kLanes], chains[kChains * kMr * kNr * kLanes];
  const unsigned csr = _mm_getcsr();
  auto seconds = [](auto&& body) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double best_dpbf = 1e30, best_fma = 1e30;
  for (int64_t round = 0; round <= rounds; ++round) {  // round 0 warms up (caches, clocks)
    const double t_dpbf = seconds([&] {
      for (int64_t r = 0; r < reps; ++r) {
        for (int u = 0; u < kChains; ++u) tile_chain<Bf16, kMr, kNr>(x.data(), w.data(), K, u, total);
        asm volatile("" : : "r"(total) : "memory");
      }
    });
    set_csr(fma_form_csr(csr));
    const double t_fma = seconds([&] {
      for (int64_t r = 0; r < reps; ++r) {
        for (int u = 0; u < kChains; ++u)
          chain_tile(xa, wa, order.begin[u], order.begin[u + 1], chains + u * kMr * kNr * kLanes);
        asm volatile("" : : "r"(chains) : "memory");
      }
    });
    set_csr(csr);
    if (round > 0) {
      best_dpbf = std::min(best_dpbf, t_dpbf);
      best_fma = std::min(best_fma, t_fma);
    }
  }
  return {best_dpbf, best_fma};
}

// Whether linear(x, weight, bias) can run here; false means "use torch". The rules (the
// Python side documents them): x [..., K] and weight [N, K] of one dtype, bf16 or fp32, on
// CPU, weight contiguous, at least one row; bias None or [N] of that dtype; no autograd graph
// being recorded through them (this op has no backward).
bool eligible(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const auto dt = weight.scalar_type();
  if (dt != at::kBFloat16 && dt != at::kFloat) return false;
  if (x.scalar_type() != dt) return false;
  if (!x.device().is_cpu() || !weight.device().is_cpu()) return false;
  if (x.layout() != at::kStrided || weight.layout() != at::kStrided) return false;
  if (weight.dim() != 2 || !weight.is_contiguous() || x.dim() == 0) return false;
  const int64_t K = weight.size(1), N = weight.size(0);
  if (K == 0 || N == 0 || x.size(-1) != K) return false;
  if (x.numel() / K < 1) return false;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    const at::Tensor& b = *bias;
    if (b.scalar_type() != dt || !b.device().is_cpu() || b.layout() != at::kStrided || b.dim() != 1 ||
        b.size(0) != N)
      return false;
  }
  if (at::GradMode::is_enabled() &&
      (x.requires_grad() || weight.requires_grad() || (has_bias && bias->requires_grad())))
    return false;
  return true;
}

// y = x @ weight^T (+ bias): [..., N] in x's dtype (fp32 when out_fp32), or None when the
// inputs are not eligible (the caller then uses torch). `force_tiled` takes the prefill path
// for any M (tests: both paths give the same bits); `fma_form` runs bf16 in the FMA
// form (the caller's choice from the probes; false: vdpbf16ps, right on every CPU).
c10::optional<at::Tensor> try_linear(const at::Tensor& x, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias, bool out_fp32, bool force_tiled,
                                     bool fma_form) {
  if (!eligible(x, weight, bias)) return c10::nullopt;
  const int64_t K = weight.size(1), N = weight.size(0);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();  // [M, K]
  const int64_t M = x2.size(0);
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) bias_c = bias->contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  if (weight.scalar_type() == at::kFloat) {
    Bias<Fp32> b;
    if (bias_c.defined()) b.ptr = bias_c.data_ptr<float>();
    at::Tensor y = at::empty(out_shape, x.options());
    run<Fp32, float>(M, x2.data_ptr<float>(), weight.data_ptr<float>(), b, y.data_ptr<float>(), N, K,
                     force_tiled, false);
    return y;
  }
  Bias<Bf16> b;
  if (bias_c.defined()) b.ptr = reinterpret_cast<const uint16_t*>(bias_c.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  if (out_fp32) {
    at::Tensor y = at::empty(out_shape, x.options().dtype(at::kFloat));
    run<Bf16, float>(M, xp, wp, b, y.data_ptr<float>(), N, K, force_tiled, fma_form);
    return y;
  }
  at::Tensor y = at::empty(out_shape, x.options());
  run<Bf16, c10::BFloat16>(M, xp, wp, b, reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>()), N, K,
                           force_tiled, fma_form);
  return y;
}

// keepwarm::raw::Linear: try_linear's bf16 product (variant: fma_form), the decode and prefill
// paths chosen by M as there.
void raw_linear(const uint16_t* x, int64_t M, int64_t K, const void* w, int64_t N, const uint16_t* bias, uint16_t* y,
                int64_t fma_form) {
  Bias<Bf16> b;
  b.ptr = bias;
  run<Bf16, c10::BFloat16>(M, x, static_cast<const uint16_t*>(w), b, reinterpret_cast<c10::BFloat16*>(y), N, K, false,
                           fma_form != 0);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("raw_api", [] {
    keepwarm::raw::Linear linear = &raw_linear;
    return std::map<std::string, uint64_t>{{"linear", reinterpret_cast<uint64_t>(linear)}};
  }, "the raw entry points by address (kernels/csrc/raw_kernels.h)");
  m.attr("STREAM_ROWS") = kStreamRows;
  m.attr("STREAM_FMA_ROWS") = kStreamFmaRows;
  m.def("eligible", &eligible, "whether try_linear runs the kernel for these inputs", py::arg("x"),
        py::arg("weight"), py::arg("bias"));
  m.def("try_linear", &try_linear, "x [..., K] @ weight[N, K]^T (+ bias) for bf16/fp32, or None", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("out_fp32"), py::arg("force_tiled") = false,
        py::arg("fma_form") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("fma_form_mismatches", &fma_form_mismatches,
        "lanes (of vectors x 16) where the FMA form of a bf16 block differs from vdpbf16ps (NaN as NaN)",
        py::arg("vectors"), py::arg("seed"));
  m.def("time_prefill_forms", &time_prefill_forms,
        "best seconds of the (vdpbf16ps, FMA) prefill inner loops over `rounds`, each `reps` tiles",
        py::arg("reps"), py::arg("rounds"));
}
