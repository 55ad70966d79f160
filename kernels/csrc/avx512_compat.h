// The AVX-512 intrinsics the CPU kernels use, emulated on AVX2 + FMA (x86 CPUs without
// AVX-512, e.g. Zen 2/3, Haswell..Alder Lake), for the build compiled with -DKEEPWARM_AVX2
// -mavx2 -mfma -mf16c (no -mavx512*). Included by the sources after every other header.
//
// A 512-bit vector is two 256-bit halves (lanes 0..7, 8..15) and a mask an integer; each
// intrinsic computes, lane by lane, what the AVX-512 instruction computes (the same IEEE
// operation per lane, the same lane permutations), with no dependence on anything but the
// operands. So the kernels' structure - one fixed order of operations per output whatever
// the row count, batch or chunk - carries over unchanged: within this build a row's result is
// the same bits in every call. Where the emulation differs from the AVX-512 build (bits need
// not match across builds):
//   - _mm512_dpbf16_ps: per fp32 lane, acc + a_odd * b_odd, then + a_even * b_even (Intel's
//     order), as two fused multiply-adds of the bf16 values widened exactly to fp32, under the
//     caller's MXCSR (vdpbf16ps always flushes denormals in and out; this keeps them unless the
//     caller's MXCSR says DAZ/FTZ). cpu_linear.cpp's "fma" form runs the same two FMAs (same
//     instruction, same operand order) under the same DAZ/FTZ bits in this build, so the two
//     forms are one result by construction and its start-up probe measures exactly that.
//   - reductions (_mm512_reduce_max_ps) in a fixed tree; getexp/getmant/scalef for the
//     operands the kernels give them (finite, normal for getexp/getmant; |n| <= 252 for scalef).
// GCC declares the real _mm512_* names and types even without -mavx512f (uncallable there), so
// these are macros onto keepwarm_avx2::*, defined last.
#pragma once

#ifndef KEEPWARM_AVX2
#error "avx512_compat.h is for the AVX2 build (-DKEEPWARM_AVX2)"
#endif

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace keepwarm_avx2 {

#define KW_INLINE inline __attribute__((always_inline))

struct alignas(64) v16f {
  __m256 lo, hi;
};
struct alignas(64) v16i {
  __m256i lo, hi;
};
struct alignas(64) v8d {
  __m256d lo, hi;
};
struct alignas(64) v32bh {  // 32 bf16 (as vdpbf16ps's operand)
  __m256i lo, hi;
  v32bh() = default;
  KW_INLINE v32bh(v16i v) : lo(v.lo), hi(v.hi) {}
};
using mask16 = uint16_t;
using mask32 = uint32_t;

// --- masks as vectors ---------------------------------------------------------------------
KW_INLINE __m256i mask8_to_vec(unsigned bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), sel), sel);
}
KW_INLINE __m256 mask8_to_ps(unsigned bits) { return _mm256_castsi256_ps(mask8_to_vec(bits)); }
KW_INLINE v16f blend(v16f src, mask16 k, v16f a) {  // k ? a : src
  return {_mm256_blendv_ps(src.lo, a.lo, mask8_to_ps(k & 0xffu)),
          _mm256_blendv_ps(src.hi, a.hi, mask8_to_ps((k >> 8) & 0xffu))};
}

// --- loads, stores, constants -------------------------------------------------------------
KW_INLINE v16f load_ps512(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_load_ps(f), _mm256_load_ps(f + 8)};
}
KW_INLINE v16f loadu_ps(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
KW_INLINE void store_ps512(void* p, v16f v) {
  float* f = static_cast<float*>(p);
  _mm256_store_ps(f, v.lo);
  _mm256_store_ps(f + 8, v.hi);
}
KW_INLINE void storeu_ps(void* p, v16f v) {
  float* f = static_cast<float*>(p);
  _mm256_storeu_ps(f, v.lo);
  _mm256_storeu_ps(f + 8, v.hi);
}
KW_INLINE v16i load_si512(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_load_si256(q), _mm256_load_si256(q + 1)};
}
KW_INLINE v16i loadu_si512(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
// Masked loads/stores never touch memory of masked-off elements (no fault past an array's end).
KW_INLINE v16f maskz_loadu_ps(mask16 k, const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_maskload_ps(f, mask8_to_vec(k & 0xffu)), _mm256_maskload_ps(f + 8, mask8_to_vec((k >> 8) & 0xffu))};
}
KW_INLINE void mask_storeu_ps(void* p, mask16 k, v16f v) {
  float* f = static_cast<float*>(p);
  _mm256_maskstore_ps(f, mask8_to_vec(k & 0xffu), v.lo);
  _mm256_maskstore_ps(f + 8, mask8_to_vec((k >> 8) & 0xffu), v.hi);
}
// 16-bit elements: element by element (tails only).
template <int N>
KW_INLINE void maskz_load16(uint64_t k, const void* p, uint16_t* out) {
  const uint16_t* s = static_cast<const uint16_t*>(p);
  for (int i = 0; i < N; ++i) out[i] = (k >> i) & 1 ? s[i] : 0;
}
KW_INLINE v16i maskz_loadu_epi16_512(mask32 k, const void* p) {
  alignas(64) uint16_t buf[32];
  maskz_load16<32>(k, p, buf);
  return load_si512(buf);
}
KW_INLINE __m256i maskz_loadu_epi16_256(mask16 k, const void* p) {
  alignas(32) uint16_t buf[16];
  maskz_load16<16>(k, p, buf);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}
KW_INLINE void mask_storeu_epi16_256(void* p, mask16 k, __m256i v) {
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), v);
  uint16_t* d = static_cast<uint16_t*>(p);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) d[i] = buf[i];
}
KW_INLINE v16f set1_ps(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
KW_INLINE v16f setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
KW_INLINE v16i set1_epi32(int x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
KW_INLINE v16i setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
KW_INLINE v16i setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9, int a10,
                          int a11, int a12, int a13, int a14, int a15) {
  return {_mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_setr_epi32(a8, a9, a10, a11, a12, a13, a14, a15)};
}

// --- casts --------------------------------------------------------------------------------
KW_INLINE v16i castps_si512(v16f v) { return {_mm256_castps_si256(v.lo), _mm256_castps_si256(v.hi)}; }
KW_INLINE v16f castsi512_ps(v16i v) { return {_mm256_castsi256_ps(v.lo), _mm256_castsi256_ps(v.hi)}; }
KW_INLINE v8d castps_pd(v16f v) { return {_mm256_castps_pd(v.lo), _mm256_castps_pd(v.hi)}; }
KW_INLINE __m256 castps512_ps256(v16f v) { return v.lo; }
template <int I>
KW_INLINE __m256d extractf64x4_pd(v8d v) {
  static_assert(I == 0 || I == 1, "imm");
  return I == 0 ? v.lo : v.hi;
}
KW_INLINE float cvtss_f32(v16f v) { return _mm_cvtss_f32(_mm256_castps256_ps128(v.lo)); }

// --- lane-wise arithmetic ------------------------------------------------------------------
#define KW_BIN_PS(name, op) \
  KW_INLINE v16f name(v16f a, v16f b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
KW_BIN_PS(add_ps, _mm256_add_ps)
KW_BIN_PS(sub_ps, _mm256_sub_ps)
KW_BIN_PS(mul_ps, _mm256_mul_ps)
KW_BIN_PS(div_ps, _mm256_div_ps)
KW_BIN_PS(max_ps, _mm256_max_ps)  // vmaxps/vminps: the second operand where either is NaN (as AVX-512)
KW_BIN_PS(min_ps, _mm256_min_ps)
KW_BIN_PS(unpacklo_ps, _mm256_unpacklo_ps)
KW_BIN_PS(unpackhi_ps, _mm256_unpackhi_ps)
#undef KW_BIN_PS
#define KW_BIN_SI(name, op) \
  KW_INLINE v16i name(v16i a, v16i b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
KW_BIN_SI(add_epi32, _mm256_add_epi32)
KW_BIN_SI(and_si512, _mm256_and_si256)
KW_BIN_SI(or_si512, _mm256_or_si256)
#undef KW_BIN_SI
KW_INLINE v16f fmadd_ps(v16f a, v16f b, v16f c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
KW_INLINE v16f fnmadd_ps(v16f a, v16f b, v16f c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
KW_INLINE v16f abs_ps(v16f a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
template <int S>
KW_INLINE v16i slli_epi32(v16i a) {
  return {_mm256_slli_epi32(a.lo, S), _mm256_slli_epi32(a.hi, S)};
}
template <int S>
KW_INLINE v16i srli_epi32(v16i a) {
  return {_mm256_srli_epi32(a.lo, S), _mm256_srli_epi32(a.hi, S)};
}

// acc + w * x in one rounding, NaN priority w, x, acc (as cpu_linear.cpp's fma_wx): the one
// instruction both bf16 forms use in this build.
KW_INLINE __m256 fma_wx256(__m256 acc, __m256 w, __m256 x) {
  asm("vfmadd231ps %[x], %[w], %[acc]" : [acc] "+x"(acc) : [w] "x"(w), [x] "x"(x));
  return acc;
}
KW_INLINE v16f fma_wx512(v16f acc, v16f w, v16f x) { return {fma_wx256(acc.lo, w.lo, x.lo), fma_wx256(acc.hi, w.hi, x.hi)}; }
KW_INLINE __m256 bf16_odd256(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
KW_INLINE __m256 bf16_even256(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
KW_INLINE v16f dpbf16_ps(v16f acc, v32bh a, v32bh b) {
  return {fma_wx256(fma_wx256(acc.lo, bf16_odd256(a.lo), bf16_odd256(b.lo)), bf16_even256(a.lo), bf16_even256(b.lo)),
          fma_wx256(fma_wx256(acc.hi, bf16_odd256(a.hi), bf16_odd256(b.hi)), bf16_even256(a.hi), bf16_even256(b.hi))};
}

// --- compares, masked moves ---------------------------------------------------------------
template <int P>
KW_INLINE mask16 cmp_ps_mask(v16f a, v16f b) {
  const unsigned lo = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, P)));
  const unsigned hi = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, P)));
  return static_cast<mask16>(lo | hi << 8);
}
KW_INLINE v16f mask_mov_ps(v16f src, mask16 k, v16f a) { return blend(src, k, a); }
KW_INLINE v16f maskz_mov_ps(mask16 k, v16f a) { return blend(setzero_ps(), k, a); }
KW_INLINE v16i mask_mov_epi32(v16i src, mask16 k, v16i a) { return castps_si512(blend(castsi512_ps(src), k, castsi512_ps(a))); }
KW_INLINE v16f mask_add_ps(v16f src, mask16 k, v16f a, v16f b) { return blend(src, k, add_ps(a, b)); }
KW_INLINE v16f mask_sub_ps(v16f src, mask16 k, v16f a, v16f b) { return blend(src, k, sub_ps(a, b)); }

// --- conversions --------------------------------------------------------------------------
KW_INLINE v16i cvtepu16_epi32(__m256i v) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1))};
}
// vpmovdw: each dword truncated to its low word.
KW_INLINE __m256i cvtepi32_epi16(v16i v) {
  const __m256i low = _mm256_set1_epi32(0xffff);
  const __m256i packed = _mm256_packus_epi32(_mm256_and_si256(v.lo, low), _mm256_and_si256(v.hi, low));
  return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));
}

// --- permutations -------------------------------------------------------------------------
template <int I>
KW_INLINE v16f shuffle_ps(v16f a, v16f b) {
  return {_mm256_shuffle_ps(a.lo, b.lo, I), _mm256_shuffle_ps(a.hi, b.hi, I)};
}
// 128-bit lanes: [a(I & 3), a(I >> 2 & 3), b(I >> 4 & 3), b(I >> 6 & 3)]; permute2f128's
// selector 0..3 over (lo, hi) is exactly the lane index 0..3.
template <int I>
KW_INLINE v16f shuffle_f32x4(v16f a, v16f b) {
  return {_mm256_permute2f128_ps(a.lo, a.hi, (I & 3) | ((I >> 2) & 3) << 4),
          _mm256_permute2f128_ps(b.lo, b.hi, ((I >> 4) & 3) | ((I >> 6) & 3) << 4)};
}
KW_INLINE v16f permutexvar_ps(v16i idx, v16f a) {
  alignas(64) float src[16], dst[16];
  alignas(64) int32_t ix[16];
  store_ps512(src, a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ix), idx.lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ix + 8), idx.hi);
  for (int i = 0; i < 16; ++i) dst[i] = src[ix[i] & 15];
  return load_ps512(dst);
}
KW_INLINE v16f permutex2var_ps(v16f a, v16i idx, v16f b) {
  alignas(64) float src[32], dst[16];
  alignas(64) int32_t ix[16];
  store_ps512(src, a);
  store_ps512(src + 16, b);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ix), idx.lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ix + 8), idx.hi);
  for (int i = 0; i < 16; ++i) dst[i] = src[ix[i] & 31];
  return load_ps512(dst);
}

// --- reductions, exponent/mantissa ---------------------------------------------------------
// max over the 16 lanes in one fixed tree (max is exact: the order only picks among NaNs and
// signed zeros, and that pick is the same every call).
KW_INLINE float reduce_max_ps(v16f a) {
  const __m256 t = _mm256_max_ps(a.lo, a.hi);
  const __m128 u = _mm_max_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_max_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_max_ss(v, _mm_shuffle_ps(v, v, 1)));
}
// vroundscaleps with scale 0 (imm bits 7:4 zero) is vroundps with the same low bits.
template <int I>
KW_INLINE v16f roundscale_ps(v16f a) {
  static_assert((I & 0xf0) == 0, "only scale 0 (round to an integer) is emulated");
  return {_mm256_round_ps(a.lo, I), _mm256_round_ps(a.hi, I)};
}
// a * 2^floor(n) rounded once: n clamped to [-252, 254], split as 2^h * 2^(n - h) with both
// factors normal, a * 2^h exact for the kernels' a (|a| in [2^-2, 2^2]), the second product
// the one rounding (underflow to denormal or zero, overflow to inf as vscalefps).
KW_INLINE __m256 scalef256(__m256 a, __m256 n) {
  n = _mm256_floor_ps(_mm256_max_ps(_mm256_min_ps(n, _mm256_set1_ps(254.f)), _mm256_set1_ps(-252.f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i h = _mm256_srai_epi32(ni, 1);
  const __m256i rest = _mm256_sub_epi32(ni, h);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, p1), p2);
}
KW_INLINE v16f scalef_ps(v16f a, v16f n) { return {scalef256(a.lo, n.lo), scalef256(a.hi, n.hi)}; }
// getexp for finite normal x: floor(log2|x|) as float (the exponent field minus 127).
KW_INLINE __m256 getexp256(__m256 x) {
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 23), _mm256_set1_epi32(0xff));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(e, _mm256_set1_epi32(127)));
}
KW_INLINE v16f getexp_ps(v16f x) { return {getexp256(x.lo), getexp256(x.hi)}; }
// getmant for finite normal x, interval [0.5, 1) (_MM_MANT_NORM_p5_1), sign cleared
// (_MM_MANT_SIGN_zero): x's mantissa with exponent -1.
KW_INLINE __m256 getmant_p5_1_zero256(__m256 x) {
  const __m256i m = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x007fffff));
  return _mm256_castsi256_ps(_mm256_or_si256(m, _mm256_set1_epi32(0x3f000000)));
}
template <int Norm, int Sign>
KW_INLINE v16f getmant_ps(v16f x) {
  static_assert(Norm == _MM_MANT_NORM_p5_1 && Sign == _MM_MANT_SIGN_zero, "only [0.5, 1), sign zero is emulated");
  return {getmant_p5_1_zero256(x.lo), getmant_p5_1_zero256(x.hi)};
}

#undef KW_INLINE

}  // namespace keepwarm_avx2

// --- the AVX-512 names onto the emulation -------------------------------------------------
#define KW_MAP(name) keepwarm_avx2::name
#undef __m512
#undef __m512i
#undef __m512d
#undef __m512bh
#undef __mmask16
#undef __mmask32
#define __m512 keepwarm_avx2::v16f
#define __m512i keepwarm_avx2::v16i
#define __m512d keepwarm_avx2::v8d
#define __m512bh keepwarm_avx2::v32bh
#define __mmask16 keepwarm_avx2::mask16
#define __mmask32 keepwarm_avx2::mask32

#undef _mm512_abs_ps
#define _mm512_abs_ps KW_MAP(abs_ps)
#undef _mm512_add_epi32
#define _mm512_add_epi32 KW_MAP(add_epi32)
#undef _mm512_add_ps
#define _mm512_add_ps KW_MAP(add_ps)
#undef _mm512_and_si512
#define _mm512_and_si512 KW_MAP(and_si512)
#undef _mm512_or_si512
#define _mm512_or_si512 KW_MAP(or_si512)
#undef _mm512_castps512_ps256
#define _mm512_castps512_ps256 KW_MAP(castps512_ps256)
#undef _mm512_castps_pd
#define _mm512_castps_pd KW_MAP(castps_pd)
#undef _mm512_castps_si512
#define _mm512_castps_si512 KW_MAP(castps_si512)
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps KW_MAP(castsi512_ps)
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask(a, b, p) keepwarm_avx2::cmp_ps_mask<(p)>((a), (b))
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 KW_MAP(cvtepi32_epi16)
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 KW_MAP(cvtepu16_epi32)
#undef _mm512_cvtss_f32
#define _mm512_cvtss_f32 KW_MAP(cvtss_f32)
#undef _mm512_div_ps
#define _mm512_div_ps KW_MAP(div_ps)
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps KW_MAP(dpbf16_ps)
#undef _mm512_extractf64x4_pd
#define _mm512_extractf64x4_pd(a, i) keepwarm_avx2::extractf64x4_pd<(i)>((a))
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps KW_MAP(fmadd_ps)
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps KW_MAP(fnmadd_ps)
#undef _mm512_getexp_ps
#define _mm512_getexp_ps KW_MAP(getexp_ps)
#undef _mm512_getmant_ps
#define _mm512_getmant_ps(a, n, s) keepwarm_avx2::getmant_ps<(n), (s)>((a))
#undef _mm512_load_ps
#define _mm512_load_ps KW_MAP(load_ps512)
#undef _mm512_load_si512
#define _mm512_load_si512 KW_MAP(load_si512)
#undef _mm512_loadu_ps
#define _mm512_loadu_ps KW_MAP(loadu_ps)
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 KW_MAP(loadu_si512)
#undef _mm512_mask_add_ps
#define _mm512_mask_add_ps KW_MAP(mask_add_ps)
#undef _mm512_mask_mov_epi32
#define _mm512_mask_mov_epi32 KW_MAP(mask_mov_epi32)
#undef _mm512_mask_mov_ps
#define _mm512_mask_mov_ps KW_MAP(mask_mov_ps)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps KW_MAP(mask_storeu_ps)
#undef _mm512_mask_sub_ps
#define _mm512_mask_sub_ps KW_MAP(mask_sub_ps)
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16 KW_MAP(maskz_loadu_epi16_512)
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps KW_MAP(maskz_loadu_ps)
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps KW_MAP(maskz_mov_ps)
#undef _mm512_max_ps
#define _mm512_max_ps KW_MAP(max_ps)
#undef _mm512_min_ps
#define _mm512_min_ps KW_MAP(min_ps)
#undef _mm512_mul_ps
#define _mm512_mul_ps KW_MAP(mul_ps)
#undef _mm512_permutex2var_ps
#define _mm512_permutex2var_ps KW_MAP(permutex2var_ps)
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps KW_MAP(permutexvar_ps)
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps KW_MAP(reduce_max_ps)
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(a, i) keepwarm_avx2::roundscale_ps<(i)>((a))
#undef _mm512_scalef_ps
#define _mm512_scalef_ps KW_MAP(scalef_ps)
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 KW_MAP(set1_epi32)
#undef _mm512_set1_ps
#define _mm512_set1_ps KW_MAP(set1_ps)
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 KW_MAP(setr_epi32)
#undef _mm512_setzero_ps
#define _mm512_setzero_ps KW_MAP(setzero_ps)
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 KW_MAP(setzero_si512)
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, i) keepwarm_avx2::shuffle_f32x4<(i)>((a), (b))
#undef _mm512_shuffle_ps
#define _mm512_shuffle_ps(a, b, i) keepwarm_avx2::shuffle_ps<(i)>((a), (b))
#undef _mm512_slli_epi32
#define _mm512_slli_epi32(a, i) keepwarm_avx2::slli_epi32<(i)>((a))
#undef _mm512_srli_epi32
#define _mm512_srli_epi32(a, i) keepwarm_avx2::srli_epi32<(i)>((a))
#undef _mm512_store_ps
#define _mm512_store_ps KW_MAP(store_ps512)
#undef _mm512_storeu_ps
#define _mm512_storeu_ps KW_MAP(storeu_ps)
#undef _mm512_sub_ps
#define _mm512_sub_ps KW_MAP(sub_ps)
#undef _mm512_unpackhi_ps
#define _mm512_unpackhi_ps KW_MAP(unpackhi_ps)
#undef _mm512_unpacklo_ps
#define _mm512_unpacklo_ps KW_MAP(unpacklo_ps)
// AVX-512VL/BW 256-bit masked 16-bit loads and stores.
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 KW_MAP(maskz_loadu_epi16_256)
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 KW_MAP(mask_storeu_epi16_256)
