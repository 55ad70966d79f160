// Row-local CPU ops with one instruction sequence per element or row, whatever the number of
// rows, the row's place in the call or the thread split (rows are never split across threads;
// partial vectors are masked, never finished by scalar code):
//
//   rms_norm(x [..., D], weight [D], eps) -> [..., D]: per row, ss = the fp32 sum of x^2 in
//     one chain of 16-lane fused multiply-adds over d (masked tail), then hsum16; r = 1 / sqrt(ss
//     / D + eps); y = weight * round(x * r) with the product rounded to x's dtype (as
//     transformers' Llama/Qwen RMSNorm: normalize in fp32, cast, then scale).
//   silu_mul(gate [..., I], up [..., I]) -> [..., I]: round(round(g / (1 + exp(-g))) * up), the
//     rounding to the inputs' dtype (as torch's F.silu(gate) * up).
//   rms_norm_1p(x [..., D], scale [D] fp32, eps) -> [..., D]: round(x * r * scale) with r as
//     rms_norm's, the products in fp32 (Qwen3.5's zero-centred norm, scale = 1 + weight).
//   pointwise(x, op) -> x's shape and dtype: exp, sigmoid 1 / (1 + exp(-x)), silu x / (1 + exp(-x)),
//     softplus max(x, 0) + log1p(exp(-|x|)) (x itself above 20, as torch), in fp32, rounded once.
//   conv_silu(x [..., C, L], weight [C, 1, K]) -> [..., C, L - K + 1]: the depthwise causal
//     convolution y[c, t] = round(w[c, 0] x[c, t] + ... + w[c, K-1] x[c, t + K - 1]) summed in
//     fp32 in tap order, then silu (rounded), as F.silu(F.conv1d(x, weight, groups=C)).
// bf16 or fp32; the last dim contiguous, rows may be strided (a chunk of a fused projection).
// Compiled with -mavx512f -mavx512bw -mavx512vl -ffp-contract=off, or for x86 CPUs without
// AVX-512 with -mavx2 -mfma -mf16c -ffp-contract=off -DKEEPWARM_AVX2 (vec_math.h then includes
// avx512_compat.h, which emulates the AVX-512 intrinsics lane by lane on AVX2).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "raw_kernels.h"
#include "vec_math.h"

namespace {

using keepwarm::load_ps;
using keepwarm::store_ps;

// x rounded to T's precision (identity for fp32; bf16 round-to-nearest-even).
inline __m512 round_to(__m512 x, const float*) { return x; }
inline __m512 round_to(__m512 x, const uint16_t*) { return keepwarm::bf16x16_to_ps(keepwarm::ps_to_bf16x16(x)); }

// 1 / sqrt(mean(x^2) + eps) of one row: 16 lanes of fused squares in d order, then hsum16.
template <typename T>
inline float inv_rms(const T* xr, int64_t D, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = load_ps(xr + d, static_cast<int>(std::min<int64_t>(16, D - d)));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return 1.0f / std::sqrt(keepwarm::hsum16(acc) / static_cast<float>(D) + eps);
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * x_stride;
      T* yr = y + r * D;
      const __m512 iv = _mm512_set1_ps(inv_rms(xr, D, eps));
      for (int64_t d = 0; d < D; d += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, D - d));
        const __m512 normed = round_to(_mm512_mul_ps(load_ps(xr + d, n), iv), xr);
        store_ps(yr + d, _mm512_mul_ps(load_ps(w + d, n), normed), n);
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* g, int64_t g_stride, const T* u, int64_t u_stride, T* y, int64_t rows, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = g + r * g_stride;
      const T* ur = u + r * u_stride;
      T* yr = y + r * I;
      for (int64_t i = 0; i < I; i += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, I - i));
        const __m512 gv = load_ps(gr + i, n);
        const __m512 e = keepwarm::exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 silu = round_to(_mm512_div_ps(gv, _mm512_add_ps(one, e)), gr);
        store_ps(yr + i, _mm512_mul_ps(silu, load_ps(ur + i, n)), n);
      }
    }
  });
}


// log(x) for 16 fp32 lanes, x > 0 finite (cephes logf): x = m 2^e with m in [sqrt(1/2), sqrt(2)),
// log(m) by a degree-9 polynomial in m - 1 (Horner, fused multiply-adds), plus e ln 2 in two parts.
inline __m512 log512(__m512 x) {
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_p5_1, _MM_MANT_SIGN_zero);  // [0.5, 1)
  __m512 e = _mm512_add_ps(_mm512_getexp_ps(x), _mm512_set1_ps(1.0f));
  const __mmask16 small = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm512_mask_sub_ps(e, small, e, _mm512_set1_ps(1.0f));
  m = _mm512_mask_add_ps(m, small, m, m);
  m = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
  const __m512 z = _mm512_mul_ps(m, m);
  __m512 p = _mm512_set1_ps(7.0376836292e-2f);
  p = _mm512_fmadd_ps(p, m, _mm512_set1_ps(-1.1514610310e-1f));
  p = _mm512_fmadd_ps(p, m, _mm512_set1_ps(1.1676998740e-1f));
  p = _mm512_fmadd_ps(p, m, _mm512_set1_ps(-1.2420140846e-1f));
  p = _mm512_fmadd_ps(p, m, _mm512_set1_ps(1.4249322787e-1f));
  p = _mm512_fmadd_ps(p, m, _mm512_set1_ps(-1.6668057665e-1f));
  p = _mm512_fmadd_ps(p, m, _mm512_set1_ps(2.0000714765e-1f));
  p = _mm512_fmadd_ps(p, m, _mm512_set1_ps(-2.4999993993e-1f));
  p = _mm512_fmadd_ps(p, m, _mm512_set1_ps(3.3333331174e-1f));
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, m), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(m, y));
}

enum Pointwise : int { kSigmoid = 0, kSilu = 1, kSoftplus = 2, kExp = 3 };

inline __m512 pointwise16(__m512 x, int op) {
  const __m512 one = _mm512_set1_ps(1.0f);
  if (op == kSoftplus) {
    // log1p(u), u = exp(-|x|) in (0, 1]: log(w) u / (w - 1) with w = 1 + u (exact where w = 1)
    const __m512 ax = _mm512_abs_ps(x);
    const __m512 u = keepwarm::exp512(_mm512_sub_ps(_mm512_setzero_ps(), ax));
    const __m512 w = _mm512_add_ps(one, u);
    const __m512 wm1 = _mm512_sub_ps(w, one);
    const __mmask16 exact = _mm512_cmp_ps_mask(wm1, _mm512_setzero_ps(), _CMP_EQ_OQ);
    const __m512 l = _mm512_mask_mov_ps(_mm512_div_ps(_mm512_mul_ps(log512(w), u), wm1), exact, u);
    const __m512 sp = _mm512_add_ps(_mm512_max_ps(x, _mm512_setzero_ps()), l);
    return _mm512_mask_mov_ps(sp, _mm512_cmp_ps_mask(x, _mm512_set1_ps(20.0f), _CMP_GT_OQ), x);
  }
  if (op == kExp) return keepwarm::exp512(x);
  const __m512 den = _mm512_add_ps(one, keepwarm::exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)));
  return _mm512_div_ps(op == kSilu ? x : one, den);
}

template <typename T>
void pointwise_rows(const T* x, int64_t x_stride, T* y, int64_t rows, int64_t D, int op) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t d = 0; d < D; d += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, D - d));
        store_ps(y + r * D + d, pointwise16(load_ps(x + r * x_stride + d, n), op), n);
      }
    }
  });
}

template <typename T>
void rms_norm_1p_rows(const T* x, int64_t x_stride, const float* s, T* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * x_stride;
      T* yr = y + r * D;
      const __m512 iv = _mm512_set1_ps(inv_rms(xr, D, eps));
      for (int64_t d = 0; d < D; d += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, D - d));
        store_ps(yr + d, _mm512_mul_ps(_mm512_mul_ps(load_ps(xr + d, n), iv), load_ps(s + d, n)), n);
      }
    }
  });
}

// rows: B * C channel rows of length L (row r is channel r % C), outputs L - K + 1 per row.
template <typename T>
void conv_silu_rows(const T* x, const T* w, T* y, int64_t rows, int64_t C, int64_t L, int64_t K) {
  const int64_t n_out = L - K + 1;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / L), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * L;
      const T* wr = w + (r % C) * K;
      T* yr = y + r * n_out;
      for (int64_t t = 0; t < n_out; t += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, n_out - t));
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < K; ++j) {
          const __m512 wj = load_ps(wr + j, 1);  // lane 0 only, broadcast below
          acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_setzero_si512(), wj),
                                                 load_ps(xr + t + j, n)));
        }
        const __m512 c = round_to(acc, xr);
        store_ps(yr + t, pointwise16(c, kSilu), n);
      }
    }
  });
}

// Rows of a tensor whose last dim is contiguous: (pointer, rows, row stride), or false.
bool as_rows(const at::Tensor& t, int64_t& rows, int64_t& stride) {
  if (t.dim() < 1 || t.stride(-1) != 1 || t.size(-1) < 1) return false;
  if (t.dim() == 1) {
    rows = 1;
    stride = t.size(0);
    return true;
  }
  // leading dims must flatten to one stride (true for contiguous tensors and column chunks)
  const int64_t expect = t.stride(-2);
  for (int64_t d = t.dim() - 2; d > 0; --d) {
    if (t.stride(d - 1) != t.stride(d) * t.size(d)) return false;
  }
  rows = t.numel() / t.size(-1);
  stride = expect;
  return true;
}

bool dtype_ok(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided &&
         (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat);
}

c10::optional<at::Tensor> try_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!dtype_ok(x) || !dtype_ok(weight) || x.scalar_type() != weight.scalar_type()) return c10::nullopt;
  if (weight.dim() != 1 || !weight.is_contiguous() || x.dim() < 1 || x.size(-1) != weight.size(0)) return c10::nullopt;
  int64_t rows = 0, stride = 0;
  at::Tensor xc = x;
  if (!as_rows(xc, rows, stride)) {  // e.g. heads of a fused projection: copy (exact) to rows
    xc = x.contiguous();
    if (!as_rows(xc, rows, stride)) return c10::nullopt;
  }
  if (rows < 1) return c10::nullopt;
  const int64_t D = x.size(-1);
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(xc.data_ptr<float>(), stride, weight.data_ptr<float>(), y.data_ptr<float>(), rows, D,
                         static_cast<float>(eps));
  } else {
    rms_norm_rows<uint16_t>(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), stride,
                            reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
                            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), rows, D, static_cast<float>(eps));
  }
  return y;
}

c10::optional<at::Tensor> try_silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  if (!dtype_ok(gate) || !dtype_ok(up) || gate.scalar_type() != up.scalar_type()) return c10::nullopt;
  if (gate.sizes() != up.sizes()) return c10::nullopt;
  int64_t rows = 0, gs = 0, rows_u = 0, us = 0;
  at::Tensor gc = gate, uc = up;
  if (!as_rows(gc, rows, gs)) {
    gc = gate.contiguous();
    if (!as_rows(gc, rows, gs)) return c10::nullopt;
  }
  if (!as_rows(uc, rows_u, us)) {
    uc = up.contiguous();
    if (!as_rows(uc, rows_u, us)) return c10::nullopt;
  }
  if (rows < 1) return c10::nullopt;
  const int64_t I = gate.size(-1);
  at::Tensor y = at::empty(gate.sizes(), gate.options());
  if (gate.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(gc.data_ptr<float>(), gs, uc.data_ptr<float>(), us, y.data_ptr<float>(), rows, I);
  } else {
    silu_mul_rows<uint16_t>(reinterpret_cast<const uint16_t*>(gc.data_ptr<at::BFloat16>()), gs,
                            reinterpret_cast<const uint16_t*>(uc.data_ptr<at::BFloat16>()), us,
                            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), rows, I);
  }
  return y;
}

// fp32 or bf16 pointer of a tensor as the kernels' element type
template <typename T>
const T* ptr(const at::Tensor& t);
template <>
const float* ptr<float>(const at::Tensor& t) { return t.data_ptr<float>(); }
template <>
const uint16_t* ptr<uint16_t>(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
template <typename T>
T* mut(at::Tensor& t) { return const_cast<T*>(ptr<T>(t)); }

c10::optional<at::Tensor> try_rms_norm_1p(const at::Tensor& x, const at::Tensor& scale, double eps) {
  if (!dtype_ok(x) || !scale.device().is_cpu() || scale.scalar_type() != at::kFloat) return c10::nullopt;
  if (scale.dim() != 1 || !scale.is_contiguous() || x.dim() < 1 || x.size(-1) != scale.size(0)) return c10::nullopt;
  int64_t rows = 0, stride = 0;
  at::Tensor xc = x;
  if (!as_rows(xc, rows, stride)) {
    xc = x.contiguous();
    if (!as_rows(xc, rows, stride)) return c10::nullopt;
  }
  if (rows < 1) return c10::nullopt;
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_1p_rows<float>(ptr<float>(xc), stride, scale.data_ptr<float>(), mut<float>(y), rows, x.size(-1),
                            static_cast<float>(eps));
  } else {
    rms_norm_1p_rows<uint16_t>(ptr<uint16_t>(xc), stride, scale.data_ptr<float>(), mut<uint16_t>(y), rows,
                               x.size(-1), static_cast<float>(eps));
  }
  return y;
}

c10::optional<at::Tensor> try_pointwise(const at::Tensor& x, int64_t op) {
  if (!dtype_ok(x) || op < 0 || op > 3 || x.numel() < 1) return c10::nullopt;
  int64_t rows = 0, stride = 0;
  at::Tensor xc = x;
  if (!as_rows(xc, rows, stride)) {
    xc = x.contiguous();
    if (!as_rows(xc, rows, stride)) return c10::nullopt;
  }
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    pointwise_rows<float>(ptr<float>(xc), stride, mut<float>(y), rows, x.size(-1), static_cast<int>(op));
  } else {
    pointwise_rows<uint16_t>(ptr<uint16_t>(xc), stride, mut<uint16_t>(y), rows, x.size(-1), static_cast<int>(op));
  }
  return y;
}

c10::optional<at::Tensor> try_conv_silu(const at::Tensor& x, const at::Tensor& weight) {
  if (!dtype_ok(x) || !dtype_ok(weight) || x.scalar_type() != weight.scalar_type() || x.dim() < 2) return c10::nullopt;
  const int64_t C = x.size(-2), L = x.size(-1);
  if (weight.dim() != 3 || weight.size(0) != C || weight.size(1) != 1) return c10::nullopt;
  const int64_t K = weight.size(2);
  if (K < 1 || L < K || x.numel() < 1) return c10::nullopt;
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = L - K + 1;
  at::Tensor y = at::empty(out_shape, x.options());
  const int64_t rows = x.numel() / L;
  if (x.scalar_type() == at::kFloat) {
    conv_silu_rows<float>(ptr<float>(xc), ptr<float>(wc), mut<float>(y), rows, C, L, K);
  } else {
    conv_silu_rows<uint16_t>(ptr<uint16_t>(xc), ptr<uint16_t>(wc), mut<uint16_t>(y), rows, C, L, K);
  }
  return y;
}

}  // namespace

// Rotary embedding, rotate-half convention: y = x * cos + rotate_half(x) * sin with
// rotate_half(x) = cat(-x[Dr/2:], x[:Dr/2]), each product and the sum rounded to x's dtype as
// torch's elementwise ops round them (so the bits are the reference's). x [T, H, Dr] with the last
// dim contiguous (a head of a fused projection: any T / H strides), cos, sin [T, Dr] contiguous
// of x's dtype -> y [T, H, Dr] contiguous.
template <typename T>
void rotary_rows(const T* x, int64_t st, int64_t sh, const T* cos, const T* sin, T* y, int64_t n_t, int64_t n_h,
                 int64_t dr) {
  const int64_t half = dr / 2;
  at::parallel_for(0, n_t, std::max<int64_t>(1, 4096 / (n_h * dr)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < n_h; ++h) {
        const T* xr = x + t * st + h * sh;
        const T* c = cos + t * dr;
        const T* s = sin + t * dr;
        T* yr = y + (t * n_h + h) * dr;
        for (int64_t i = 0; i < dr; ++i) {
          const T rot = i < half ? static_cast<T>(-static_cast<float>(xr[i + half])) : xr[i - half];
          const T a = static_cast<T>(static_cast<float>(xr[i]) * static_cast<float>(c[i]));
          const T b = static_cast<T>(static_cast<float>(rot) * static_cast<float>(s[i]));
          yr[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
        }
      }
  });
}

c10::optional<at::Tensor> try_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (!dtype_ok(x) || cos.scalar_type() != x.scalar_type() || sin.scalar_type() != x.scalar_type()) return c10::nullopt;
  if (x.dim() != 3 || x.stride(2) != 1 || !cos.device().is_cpu() || !sin.device().is_cpu()) return c10::nullopt;
  const int64_t n_t = x.size(0), n_h = x.size(1), dr = x.size(2);
  if (dr % 2 != 0 || cos.dim() != 2 || sin.sizes() != cos.sizes() || cos.size(0) != n_t || cos.size(1) != dr)
    return c10::nullopt;
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor y = at::empty({n_t, n_h, dr}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rotary_rows<float>(x.data_ptr<float>(), x.stride(0), x.stride(1), cc.data_ptr<float>(), sc.data_ptr<float>(),
                       y.data_ptr<float>(), n_t, n_h, dr);
  } else {
    rotary_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), x.stride(0), x.stride(1), cc.data_ptr<c10::BFloat16>(),
                               sc.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), n_t, n_h, dr);
  }
  return y;
}

// keepwarm::raw's row-wise entries: the bf16 instances of the kernels above.
static void raw_rms_norm(const uint16_t* x, int64_t x_stride, const uint16_t* w, uint16_t* y, int64_t rows, int64_t D,
                  float eps) {
  rms_norm_rows<uint16_t>(x, x_stride, w, y, rows, D, eps);
}
static void raw_silu_mul(const uint16_t* g, int64_t gs, const uint16_t* u, int64_t us, uint16_t* y, int64_t rows,
                  int64_t I) {
  silu_mul_rows<uint16_t>(g, gs, u, us, y, rows, I);
}
static void raw_rotary(const uint16_t* x, int64_t st, int64_t sh, const uint16_t* cos, const uint16_t* sin, uint16_t* y,
                int64_t n_t, int64_t n_h, int64_t dr) {
  using B = c10::BFloat16;
  rotary_rows<B>(reinterpret_cast<const B*>(x), st, sh, reinterpret_cast<const B*>(cos),
                 reinterpret_cast<const B*>(sin), reinterpret_cast<B*>(y), n_t, n_h, dr);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("raw_api", [] {
    keepwarm::raw::RmsNorm rms_norm = &raw_rms_norm;
    keepwarm::raw::SiluMul silu_mul = &raw_silu_mul;
    keepwarm::raw::Rotary rotary = &raw_rotary;
    return std::map<std::string, uint64_t>{{"rms_norm", reinterpret_cast<uint64_t>(rms_norm)},
                                           {"silu_mul", reinterpret_cast<uint64_t>(silu_mul)},
                                           {"rotary", reinterpret_cast<uint64_t>(rotary)}};
  }, "the raw entry points by address (kernels/csrc/raw_kernels.h)");
  m.def("try_rms_norm", &try_rms_norm, "row-invariant RMSNorm, or None", py::arg("x"), py::arg("weight"),
        py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("try_rotary", &try_rotary, "rotary embedding (rotate-half), the reference's bits, or None", py::arg("x"),
        py::arg("cos"), py::arg("sin"),
        py::call_guard<py::gil_scoped_release>());
  m.def("try_silu_mul", &try_silu_mul, "row-invariant silu(gate) * up, or None", py::arg("gate"), py::arg("up"),
        py::call_guard<py::gil_scoped_release>());
  m.def("try_rms_norm_1p", &try_rms_norm_1p, "row-invariant x * rsqrt(mean(x^2) + eps) * scale, or None",
        py::arg("x"), py::arg("scale"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("try_pointwise", &try_pointwise, "element-invariant sigmoid (0), silu (1), softplus (2), exp (3), or None",
        py::arg("x"), py::arg("op"),
        py::call_guard<py::gil_scoped_release>());
  m.def("try_conv_silu", &try_conv_silu, "row-invariant silu(depthwise causal conv1d), or None", py::arg("x"),
        py::arg("weight"),
        py::call_guard<py::gil_scoped_release>());
}
