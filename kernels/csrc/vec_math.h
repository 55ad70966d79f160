// Vector math with one fixed instruction sequence per element, shared by the row-local CPU
// kernels: an element's result depends only on its value, never on where it sits in a row,
// how long the row is or how many rows a call has (no scalar tails: partial vectors are
// masked), so batch and chunk composition cannot change a bit.
// Needs -mavx512f -mavx512bw -mavx512vl -ffp-contract=off, or (the AVX2 build) -mavx2 -mfma -mf16c
// -ffp-contract=off -DKEEPWARM_AVX2 with avx512_compat.h emulating the AVX-512 intrinsics.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#ifdef KEEPWARM_AVX2
#include "avx512_compat.h"  // the AVX2 build: the AVX-512 names emulated, included last
#endif

namespace keepwarm {

// exp(x) for 16 fp32 lanes, ~1 ulp: x = n ln2 + r (Cody-Waite), exp(r) by a degree-6
// polynomial (Horner, explicit fused multiply-adds), times 2^n by scalef. Inputs are clamped
// to [-104, 88.72]: below, the result underflows to 0 (also for -inf); above, inf.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7228394f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The fixed-tree horizontal sum: t[j] = a[j] + a[j + 8]; u[j] = t[j] + t[j + 4];
// (u[0] + u[2]) + (u[1] + u[3]).
inline float hsum16(__m512 a) {
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

// bf16 <-> fp32 (round to nearest even, as c10::BFloat16 and torch's casts; NaN stays NaN).
inline __m512 bf16x16_to_ps(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

inline __m256i ps_to_bf16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// Loads/stores of up to 16 elements as fp32 lanes (masked past `n`), for fp32 and bf16 rows.
inline __m512 load_ps(const float* p, int n) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
inline __m512 load_ps(const uint16_t* p, int n) {
  const __m256i v = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                            : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
  return bf16x16_to_ps(v);
}
inline void store_ps(float* p, __m512 v, int n) {
  if (n >= 16)
    _mm512_storeu_ps(p, v);
  else
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}
inline void store_ps(uint16_t* p, __m512 v, int n) {
  const __m256i b = ps_to_bf16x16(v);
  if (n >= 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b);
  else
    _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), b);
}

}  // namespace keepwarm
