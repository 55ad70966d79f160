// The gated delta rule (kernels/delta_rule.py's contract) as a token-serial recurrence on CPU
// whose result for a value head depends only on that head's inputs and state: a span gives
// the same bits in one call, in chunks of any length or token by token, and a head gives the
// same bits whatever other heads (or sequences folded into the head dim) share the call.
//
//   gated_delta_rule(q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] fp32, beta [T, Hv],
//                    state [Hv, Dk, Dv] fp32) -> (out [T, Hv, Dv] in q's dtype, new state fp32)
//   value head j reads key head j / (Hv / Hk); q, k, v, beta bf16 or fp32 (q, k, v one dtype).
//
// The order (the contract), all fp32:
//   per (t, key head): ss = one chain of 16-lane fused multiply-adds of x^2 over Dk (masked
//     tail), hsum16; kn = k / sqrt(ss + 1e-6); qn = (q / sqrt(ss_q + 1e-6)) * Dk^-0.5
//     (a multiply by the reciprocal, as torch's rsqrt).
//   per (value head, 16 columns of Dv), tokens in order: a = exp(g_t) (exp512);
//     S[i] = S[i] * a for i = 0..Dk-1, kv = sum_i S[i] kn[i] (one fused multiply-add chain
//     from 0 in i order); d = (v - kv) * beta; S[i] = S[i] + kn[i] d (fused), out = sum_i
//     S[i] qn[i] (one chain from 0 in i order).
// Threads split (value head, column block) pairs, never a head's tokens or Dk sums.
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
#include <tuple>
#include <vector>

#include "vec_math.h"

namespace {

using keepwarm::load_ps;
using keepwarm::store_ps;

// One row of Dk, L2-normalized (eps 1e-6) and scaled, into fp32.
template <typename T>
void l2norm_row(const T* x, float* out, int64_t D, float scale) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 v = load_ps(x + d, static_cast<int>(std::min<int64_t>(16, D - d)));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(keepwarm::hsum16(acc) + 1e-6f));
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < D; d += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, D - d));
    __m512 y = _mm512_mul_ps(load_ps(x + d, n), inv);
    if (scale != 1.0f) y = _mm512_mul_ps(y, sc);
    store_ps(out + d, y, n);
  }
}

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T, typename B>
void run(const T* q, const T* k, const T* v, const float* g, const B* beta, float* S, T* out, int64_t Tn,
         int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  // normalized q, k: [T, Hk, Dk] fp32
  std::vector<float> qn(static_cast<size_t>(Tn * Hk * Dk)), kn(static_cast<size_t>(Tn * Hk * Dk));
  const float qscale = 1.0f / std::sqrt(static_cast<float>(Dk));
  at::parallel_for(0, Tn * Hk, std::max<int64_t>(1, 4096 / Dk), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      l2norm_row(q + r * Dk, qn.data() + r * Dk, Dk, qscale);
      l2norm_row(k + r * Dk, kn.data() + r * Dk, Dk, 1.0f);
    }
  });
  const int64_t blocks = (Dv + 15) / 16, group = Hv / Hk;
  at::parallel_for(0, Hv * blocks, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t h = u / blocks, c0 = (u % blocks) * 16, hk = h / group;
      const int n = static_cast<int>(std::min<int64_t>(16, Dv - c0));
      float* Sh = S + h * Dk * Dv + c0;
      for (int64_t t = 0; t < Tn; ++t) {
        const float* kt = kn.data() + (t * Hk + hk) * Dk;
        const float* qt = qn.data() + (t * Hk + hk) * Dk;
        const __m512 decay = keepwarm::exp512(_mm512_set1_ps(g[t * Hv + h]));
        __m512 kv = _mm512_setzero_ps();
        for (int64_t i = 0; i < Dk; ++i) {
          const __m512 s = _mm512_mul_ps(load_ps(Sh + i * Dv, n), decay);
          store_ps(Sh + i * Dv, s, n);
          kv = _mm512_fmadd_ps(s, _mm512_set1_ps(kt[i]), kv);
        }
        const __m512 d = _mm512_mul_ps(_mm512_sub_ps(load_ps(v + (t * Hv + h) * Dv + c0, n), kv),
                                       _mm512_set1_ps(load1(beta + t * Hv + h)));
        __m512 o = _mm512_setzero_ps();
        for (int64_t i = 0; i < Dk; ++i) {
          const __m512 s = _mm512_fmadd_ps(_mm512_set1_ps(kt[i]), d, load_ps(Sh + i * Dv, n));
          store_ps(Sh + i * Dv, s, n);
          o = _mm512_fmadd_ps(s, _mm512_set1_ps(qt[i]), o);
        }
        store_ps(out + (t * Hv + h) * Dv + c0, o, n);
      }
    }
  });
}

bool ok(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided &&
         (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat);
}

template <typename T>
const T* p(const at::Tensor& t);
template <>
const float* p<float>(const at::Tensor& t) { return t.data_ptr<float>(); }
template <>
const uint16_t* p<uint16_t>(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

template <typename T>
void dispatch_beta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, at::Tensor& S, at::Tensor& out, int64_t Tn, int64_t Hk, int64_t Hv,
                   int64_t Dk, int64_t Dv) {
  T* o = const_cast<T*>(p<T>(out));
  if (beta.scalar_type() == at::kFloat) {
    run<T, float>(p<T>(q), p<T>(k), p<T>(v), g.data_ptr<float>(), p<float>(beta), S.data_ptr<float>(), o, Tn, Hk,
                  Hv, Dk, Dv);
  } else {
    run<T, uint16_t>(p<T>(q), p<T>(k), p<T>(v), g.data_ptr<float>(), p<uint16_t>(beta), S.data_ptr<float>(), o, Tn,
                     Hk, Hv, Dk, Dv);
  }
}

c10::optional<std::tuple<at::Tensor, at::Tensor>> try_gated_delta_rule(const at::Tensor& q, const at::Tensor& k,
                                                                       const at::Tensor& v, const at::Tensor& g,
                                                                       const at::Tensor& beta,
                                                                       const at::Tensor& state) {
  if (!ok(q) || !ok(k) || !ok(v) || !ok(beta) || !g.device().is_cpu() || !state.device().is_cpu()) return c10::nullopt;
  if (q.scalar_type() != k.scalar_type() || q.scalar_type() != v.scalar_type()) return c10::nullopt;
  if (g.scalar_type() != at::kFloat || state.scalar_type() != at::kFloat) return c10::nullopt;
  if (q.dim() != 3 || k.sizes() != q.sizes() || v.dim() != 3 || state.dim() != 3) return c10::nullopt;
  const int64_t Tn = q.size(0), Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  if (Tn < 1 || Hk < 1 || Dk < 1 || Dv < 1 || Hv % Hk != 0 || v.size(0) != Tn) return c10::nullopt;
  if (g.dim() != 2 || g.size(0) != Tn || g.size(1) != Hv || beta.sizes() != g.sizes()) return c10::nullopt;
  if (state.size(0) != Hv || state.size(1) != Dk || state.size(2) != Dv) return c10::nullopt;
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous(),
                   bc = beta.contiguous();
  at::Tensor S = state.clone(at::MemoryFormat::Contiguous);  // the caller's state is never written
  at::Tensor out = at::empty({Tn, Hv, Dv}, q.options());
  if (q.scalar_type() == at::kFloat) {
    dispatch_beta<float>(qc, kc, vc, gc, bc, S, out, Tn, Hk, Hv, Dk, Dv);
  } else {
    dispatch_beta<uint16_t>(qc, kc, vc, gc, bc, S, out, Tn, Hk, Hv, Dk, Dv);
  }
  return std::make_tuple(out, S);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("try_gated_delta_rule", &try_gated_delta_rule,
        "token-serial gated delta rule, invariant per value head, or None", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("beta"), py::arg("state"),
        py::call_guard<py::gil_scoped_release>());
}
