// bf16 matrix-vector product for CPU decode: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// Decode multiplies one (or a few) token rows by every weight matrix, so the product is
// bound by how fast the weights stream from DRAM, not by arithmetic. This kernel reads each
// weight row exactly once, sequentially, and keeps the few x rows in L1:
//   - `_mm512_dpbf16_ps` multiplies 32 bf16 pairs of x and w and accumulates into 16 fp32
//     lanes (products of bf16 are exact in fp32; accumulation is fp32 throughout);
//   - one weight row at a time (a single sequential stream the hardware prefetcher follows),
//     up to 4 token rows share each weight load (more rows: further passes over the row in L1), several accumulators hide dpbf16 latency;
//   - K that is not a multiple of 32 ends with one masked load (zeros past the end);
//   - output rows are split into contiguous ranges, one per thread (at::parallel_for, torch's
//     OpenMP pool and thread count), so each thread streams one contiguous slab of memory;
//   - the result is rounded to bf16 round-to-nearest-even once (after the bias add), or kept
//     fp32 when asked.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16: the Python side loads this only
// on CPUs that report avx512_bf16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
// pybind11 and the at::Tensor caster: a quarter of torch/extension.h's compile time.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>

namespace {

// Independent accumulators per (row, token): dpbf16 has a ~5-cycle latency, so one chain
// per row would cap a core below DRAM speed; kUnroll chains hide it.
constexpr int kUnroll = 4;

struct Bias {
  const c10::BFloat16* ptr = nullptr;  // [N] or null
  inline float at(int64_t n) const { return ptr == nullptr ? 0.f : static_cast<float>(ptr[n]); }
};

// Dot products of one weight row w [K] with M x rows (x: [M, K], row stride K): sums[m].
//
// One row at a time on purpose: measured on Zen 4, walking 4 rows together (4 interleaved
// streams, each only K*2 bytes long) reached ~13 GB/s per core, while a single sequential
// stream through the whole matrix lets the hardware prefetcher run ahead and reaches the
// core's plain-read bandwidth (~26 GB/s). x stays in L1, so re-reading it per row is free.
// Software prefetch 1-4 KiB ahead measured slower single-threaded, so it is not used.
template <int M>
inline void dot_row(const uint16_t* __restrict x, const uint16_t* __restrict w, int64_t K, float* sums) {
  __m512 acc[kUnroll][M];
  for (int u = 0; u < kUnroll; ++u)
    for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * kUnroll <= K; k += 32 * kUnroll) {
    for (int u = 0; u < kUnroll; ++u) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * u);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u);
        acc[u][m] = _mm512_dpbf16_ps(acc[u][m], wv, xv);
      }
    }
  }
  for (; k + 32 <= K; k += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int m = 0; m < M; ++m) {
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k));
    }
  }
  if (k < K) {
    // Tail: lanes past K load as zero in both operands, so they add 0 * 0.
    const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < M; ++m) {
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
    }
  }
  for (int m = 0; m < M; ++m) {
    __m512 total = acc[0][m];
    for (int u = 1; u < kUnroll; ++u) total = _mm512_add_ps(total, acc[u][m]);
    sums[m] = _mm512_reduce_add_ps(total);
  }
}

// Dot products of one weight row with all M token rows, in groups of up to kGroup rows per
// pass (kUnroll * kGroup accumulators fit the 32 zmm registers); the row is re-read from L1
// for each further group. Every token row's sum is computed by the same instruction
// sequence whatever M and whichever group it falls in, so a row's result does not depend
// on how many rows are in the batch.
constexpr int kGroup = 4;

inline void dot_rows(const uint16_t* __restrict x, const uint16_t* __restrict w, int64_t M, int64_t K,
                     float* sums) {
  int64_t m = 0;
  for (; m + kGroup <= M; m += kGroup) dot_row<kGroup>(x + m * K, w, K, sums + m);
  switch (M - m) {
    case 0: return;
    case 1: return dot_row<1>(x + m * K, w, K, sums + m);
    case 2: return dot_row<2>(x + m * K, w, K, sums + m);
    case 3: return dot_row<3>(x + m * K, w, K, sums + m);
  }
}

template <typename Out>
void gemv_range(const uint16_t* x, const uint16_t* w, Bias bias, Out* y, int64_t M, int64_t N, int64_t K,
                int64_t n_begin, int64_t n_end) {
  float sums[16];
  for (int64_t n = n_begin; n < n_end; ++n) {
    dot_rows(x, w + n * K, M, K, sums);
    const float b = bias.at(n);
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = static_cast<Out>(sums[m] + b);
  }
}

constexpr int64_t kMaxTokens = 16;  // token rows per call (decode steps of up to 16 sequences)

template <typename Out>
void dispatch_m(int64_t M, const uint16_t* x, const uint16_t* w, Bias bias, Out* y, int64_t N, int64_t K) {
  TORCH_CHECK(M >= 1 && M <= kMaxTokens, "cpu_linear: tokens (M) must be 1..", kMaxTokens, ", got ", M);
  // Each thread gets one contiguous run of rows, so it streams one contiguous slab of the
  // weight. The grain keeps at least ~256 KiB of weight per thread: smaller matrices are not
  // worth the fork/join.
  const int64_t grain = std::max<int64_t>(1, (256 * 1024) / (K * 2));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { gemv_range<Out>(x, w, bias, y, M, N, K, n0, n1); });
}

// Whether linear(x, weight, bias) can run here; false means "use torch". The rules (the
// Python side documents them): bf16 CPU x [..., K] with 1..kMaxTokens rows once leading
// dims are flattened; bf16 CPU weight [N, K] contiguous; bias None or bf16 CPU [N]; no
// autograd graph being recorded through them (this op has no backward).
bool eligible(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (x.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16) return false;
  if (!x.device().is_cpu() || !weight.device().is_cpu()) return false;
  if (x.layout() != at::kStrided || weight.layout() != at::kStrided) return false;
  if (weight.dim() != 2 || !weight.is_contiguous() || x.dim() == 0) return false;
  const int64_t K = weight.size(1), N = weight.size(0);
  if (K == 0 || N == 0 || x.size(-1) != K) return false;
  const int64_t M = x.numel() / K;
  if (M < 1 || M > kMaxTokens) return false;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    const at::Tensor& b = *bias;
    if (b.scalar_type() != at::kBFloat16 || !b.device().is_cpu() || b.layout() != at::kStrided || b.dim() != 1 ||
        b.size(0) != N)
      return false;
  }
  if (at::GradMode::is_enabled() &&
      (x.requires_grad() || weight.requires_grad() || (has_bias && bias->requires_grad())))
    return false;
  return true;
}

// y = x @ weight^T (+ bias): [..., N] in bf16 (or fp32 when out_fp32), or None when the
// inputs are not eligible (the caller then uses torch).
c10::optional<at::Tensor> try_linear(const at::Tensor& x, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias, bool out_fp32) {
  if (!eligible(x, weight, bias)) return c10::nullopt;
  const int64_t K = weight.size(1), N = weight.size(0);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();  // [M, K]
  const int64_t M = x2.size(0);
  Bias b;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    b.ptr = reinterpret_cast<const c10::BFloat16*>(bias_c.data_ptr<at::BFloat16>());
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  if (out_fp32) {
    at::Tensor y = at::empty(out_shape, x.options().dtype(at::kFloat));
    dispatch_m<float>(M, xp, wp, b, y.data_ptr<float>(), N, K);
    return y;
  }
  at::Tensor y = at::empty(out_shape, x.options());
  // c10::BFloat16(float) rounds to nearest even, like torch's own casts.
  dispatch_m<c10::BFloat16>(M, xp, wp, b, reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>()), N, K);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("MAX_TOKENS") = kMaxTokens;
  m.def("eligible", &eligible, "whether try_linear runs the kernel for these inputs", py::arg("x"),
        py::arg("weight"), py::arg("bias"));
  m.def("try_linear", &try_linear, "bf16 GEMV x [..., K] (<= MAX_TOKENS rows) @ weight[N, K]^T (+ bias), or None",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out_fp32"));
}
