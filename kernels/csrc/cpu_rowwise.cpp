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
// bf16 or fp32; the last dim contiguous, rows may be strided (a chunk of a fused projection).
// Compiled with -mavx512f -mavx512bw -mavx512vl -ffp-contract=off.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace {

using keepwarm::load_ps;
using keepwarm::store_ps;

// x rounded to T's precision (identity for fp32; bf16 round-to-nearest-even).
inline __m512 round_to(__m512 x, const float*) { return x; }
inline __m512 round_to(__m512 x, const uint16_t*) { return keepwarm::bf16x16_to_ps(keepwarm::ps_to_bf16x16(x)); }

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * x_stride;
      T* yr = y + r * D;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 v = load_ps(xr + d, static_cast<int>(std::min<int64_t>(16, D - d)));
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float inv = 1.0f / std::sqrt(keepwarm::hsum16(acc) / static_cast<float>(D) + eps);
      const __m512 iv = _mm512_set1_ps(inv);
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("try_rms_norm", &try_rms_norm, "row-invariant RMSNorm, or None", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("try_silu_mul", &try_silu_mul, "row-invariant silu(gate) * up, or None", py::arg("gate"), py::arg("up"));
}
