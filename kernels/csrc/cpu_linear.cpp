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
//   - decode (M <= kStreamRows): one weight row at a time, a single sequential stream,
//     up to 4 token rows sharing each weight load (more rows: further passes over the row in
//     L1); meanwhile the row kPrefetchBytes ahead is prefetched, spread over the passes, so
//     DRAM and the arithmetic overlap. Bound by DRAM bandwidth at small M, by the arithmetic
//     from M ~ 8.
//   - prefill (M > kStreamRows): register tiles of kMr token rows x kNr weight rows, one chain
//     at a time (its blocks are strided by 4 E elements), x panels blocked to stay in L2.
//     Bound by arithmetic.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -ffp-contract=off: the Python
// side loads this only on CPUs that report avx512_bf16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
// pybind11 and the at::Tensor caster: a quarter of torch/extension.h's compile time.
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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

// The contract's last step in the decode path: ((c0 + c1) + c2) + c3, then hsum16.
inline float combine(__m512 c0, __m512 c1, __m512 c2, __m512 c3) {
  __m512 total = _mm512_add_ps(c0, c1);
  total = _mm512_add_ps(total, c2);
  total = _mm512_add_ps(total, c3);
  return hsum16(total);
}

template <typename Out>
inline Out store_value(float v);
template <>
inline float store_value<float>(float v) { return v; }
template <>
inline c10::BFloat16 store_value<c10::BFloat16>(float v) { return c10::BFloat16(v); }  // nearest even

// --- decode path: one weight row against up to 4 token rows --------------------------------

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

// --- prefill path: register tiles, one chain at a time ---------------------------------------

constexpr int kMr = 4;  // token rows per register tile
constexpr int kNr = 6;  // weight rows per register tile (kMr * kNr accumulators + kNr + 1 loads)

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

template <typename Kind, typename Out>
void run(int64_t M, const typename Kind::T* x, const typename Kind::T* w, Bias<Kind> bias, Out* y, int64_t N,
         int64_t K, bool force_tiled) {
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(typename Kind::T));
  if (M <= kStreamRows && !force_tiled) {
    // Each thread gets one contiguous run of rows, so it streams one contiguous slab of the
    // weight; at least ~256 KiB of weight per thread (smaller is not worth the fork/join).
    const int64_t grain = std::max<int64_t>(1, (256 * 1024) / row_bytes);
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      stream_range<Kind, Out>(x, w, bias, y, M, N, K, n0, n1);
    });
    return;
  }
  // Threads own whole kNr-row strips of the weight (never a share of K).
  const int64_t strips = (N + kNr - 1) / kNr;
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    tiled_range<Kind, Out>(x, w, bias, y, M, N, K, s0 * kNr, std::min(N, s1 * kNr));
  });
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
// for any M (tests: both paths give the same bits).
c10::optional<at::Tensor> try_linear(const at::Tensor& x, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias, bool out_fp32, bool force_tiled) {
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
    run<Fp32, float>(M, x2.data_ptr<float>(), weight.data_ptr<float>(), b, y.data_ptr<float>(), N, K, force_tiled);
    return y;
  }
  Bias<Bf16> b;
  if (bias_c.defined()) b.ptr = reinterpret_cast<const uint16_t*>(bias_c.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  if (out_fp32) {
    at::Tensor y = at::empty(out_shape, x.options().dtype(at::kFloat));
    run<Bf16, float>(M, xp, wp, b, y.data_ptr<float>(), N, K, force_tiled);
    return y;
  }
  at::Tensor y = at::empty(out_shape, x.options());
  run<Bf16, c10::BFloat16>(M, xp, wp, b, reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>()), N, K,
                           force_tiled);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("STREAM_ROWS") = kStreamRows;
  m.def("eligible", &eligible, "whether try_linear runs the kernel for these inputs", py::arg("x"),
        py::arg("weight"), py::arg("bias"));
  m.def("try_linear", &try_linear, "x [..., K] @ weight[N, K]^T (+ bias) for bf16/fp32, or None", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("out_fp32"), py::arg("force_tiled") = false);
}
