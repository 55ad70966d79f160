// Causal attention on CPU whose result for a query row depends only on that row's query and
// the keys/values it sees: a prefill chunk of any length, a decode step and a restore tail
// compute each row with the same instructions in the same order.
//
//   attention(q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, D], scale, window, offset,
//             extra_k [C, Hkv, D], extra_v [C, Hkv, D], extra_mask [T, C] bool, sinks [Hq] fp32)
//   -> [T, Hq, D]. Key row i sits at absolute position offset + i; query t at position
//   p = offset + S - T + t and sees keys max(offset, p - window + 1) .. p (window 0: all);
//   query head h reads kv head h / (Hq / Hkv). Optional extra keys (e.g. compressed rows):
//   query t also sees extra row c where extra_mask[t, c]. Optional sinks: one extra logit per
//   query head in the softmax denominator only. bf16 or fp32 in, same dtype out, fp32 arithmetic.
//
// The order for one query row (the contract): keys in tiles of 16 at fixed absolute positions
// (tile j holds keys 16 j .. 16 j + 15, from the first tile the row sees to the tile of p);
// per tile, each score is one chain of fused multiply-adds over d = 0 .. D-1 from 0, times
// `scale`; keys outside the row's range are masked (score -inf, weight exactly 0); online
// softmax per tile: m' = max(m, tile max), alpha = exp(m - m') (0 on the first tile),
// l = l * alpha + hsum16(exp(s - m')), o = o * alpha, then o += w_i * v_i for the tile's
// keys in increasing position (one fused multiply-add per 16 lanes of D); then the extra
// keys in tiles of 16 from extra row 0 (same update, masked by extra_mask; a tile with no
// visible row is skipped, as is a window tile outside the range); then the sink:
// m' = max(m, sink), alpha = exp(m - m'), l = l * alpha + exp(sink - m'), o = o * alpha;
// out = o / l.
// Rows share loads (8 rows per group) but never accumulators, and threads split heads and
// row groups, never a row's keys.
//
//   decode_batch(q [B, Hq, D], [k_b [S_b, Hkv, D]], [v_b], scale) -> [B, Hq, D]: the decode
//   steps of B sequences in one call (one parallel region over (sequence, kv head) pairs);
//   row b is attention(q[b][None], k_b, v_b, scale)[0], the same bits. Decode rows (this and
//   attention with T = 1 and no offset, window, extra keys or sinks) skip the staging: see
//   `decode_heads`.
// Compiled with -mavx512f -mavx512bw -mavx512vl -ffp-contract=off, or for x86 CPUs without
// AVX-512 with -mavx2 -mfma -mf16c -ffp-contract=off -DKEEPWARM_AVX2 (vec_math.h then includes
// avx512_compat.h, which emulates the AVX-512 intrinsics lane by lane on AVX2).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "raw_kernels.h"
#include "vec_math.h"

namespace {

using keepwarm::exp512;
using keepwarm::hsum16;

constexpr int kTile = 16;  // keys per tile (one zmm of scores)
constexpr int kRows = 8;   // query rows sharing each key-tile load
constexpr int kPrefetchTiles = 2;  // staging prefetches the key/value rows of the tile this far ahead

struct Shape {
  int64_t T, S, Hq, Hkv, G, D, DV, Spad, window;
  int64_t shift;  // offset % kTile: staged key i is key row i - shift (tiles at absolute positions)
  int64_t C, Cpad;  // extra keys (0: none)
  float scale;
  const uint8_t* mask;  // [T, C] or null
  const float* sinks;   // [Hq] or null
};

// r[i] (row i, 16 columns) -> r[j] (column j, 16 rows): unpack pairs, then 4x4 blocks of
// 128-bit lanes.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // r[4 i + j], 128-bit lane L: rows 4 i .. 4 i + 3 of column 4 L + j
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], _MM_SHUFFLE(2, 0, 2, 0));       // L0,L2 of rows 0-3 | 4-7
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], _MM_SHUFFLE(3, 1, 3, 1));   // L1,L3
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
  }
  // t[j]: [c_j r0-3, c_(8+j) r0-3, c_j r4-7, c_(8+j) r4-7]; t[4+j]: the same for columns 4+j, 12+j
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

inline __m512 load_row(const float* p, int n) { return keepwarm::load_ps(p, n); }
inline __m512 load_row(const c10::BFloat16* p, int n) {
  return keepwarm::load_ps(reinterpret_cast<const uint16_t*>(p), n);
}

// Per kv head: KT [D][Spad] (keys transposed, fp32, zero past S) and VF [Spad][DV * 16]
// (values, fp32, zero-padded), so a tile's scores are D vector FMAs and a key's value row
// is DV aligned vectors. Staging copies values exactly (bf16 -> fp32 is exact).
// Staged row i holds key/value row i - shift of `rows` (zero outside); npad staged rows.
template <typename T>
void stage_head(const T* k, const T* v, int64_t rows, int64_t shift, int64_t npad, const Shape& s, int64_t h,
                float* kt, float* vf) {
  const int64_t dp = s.DV * 16, row = s.Hkv * s.D;
  auto present = [&](int64_t i) { return i - shift >= 0 && i - shift < rows; };
  const int64_t head_bytes = s.D * static_cast<int64_t>(sizeof(T));
  for (int64_t kb = 0; kb < npad; kb += kTile) {
    // The head's slice of each key row is a short piece of a long row (a stride the hardware
    // prefetcher does not follow): fetch the rows of a later tile while this one is staged.
    const int64_t ahead = kb + kPrefetchTiles * kTile - shift;
    for (int64_t i = std::max<int64_t>(0, ahead); i < std::min(rows, ahead + kTile); ++i) {
      const char* kp = reinterpret_cast<const char*>(k + i * row + h * s.D);
      const char* vp = reinterpret_cast<const char*>(v + i * row + h * s.D);
      for (int64_t b = 0; b < head_bytes; b += 64) {
        _mm_prefetch(kp + b, _MM_HINT_T0);
        _mm_prefetch(vp + b, _MM_HINT_T0);
      }
    }
    for (int64_t d0 = 0; d0 < s.D; d0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, s.D - d0));
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = present(kb + i) ? load_row(k + (kb + i - shift) * row + h * s.D + d0, n) : _mm512_setzero_ps();
      transpose16(r);
      for (int j = 0; j < n; ++j) _mm512_storeu_ps(kt + (d0 + j) * npad + kb, r[j]);
    }
    for (int64_t i = kb; i < kb + kTile; ++i) {
      for (int64_t d0 = 0; d0 < dp; d0 += 16) {
        const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, s.D - d0)));
        const __m512 x =
            present(i) && n > 0 ? load_row(v + (i - shift) * row + h * s.D + d0, n) : _mm512_setzero_ps();
        _mm512_storeu_ps(vf + i * dp + d0, x);
      }
    }
  }
}

// One online-softmax update of row state (m, l, o) by a tile: scores sc (masked lanes -inf),
// `valid` lanes, values vr (staged rows of the tile's first key). `advance` is its softmax part:
// it moves m and l, writes the weights w (masked lanes 0) and returns alpha for o.
inline float advance(float& m, float& l, __m512 sc, __mmask16 valid, float* w) {
  const float m_new = std::max(m, _mm512_reduce_max_ps(sc));  // max: exact in any order
  const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
  // alpha = exp(m - m_new), 0 on the first tile; an unchanged max gives exp512(0) = 1 exactly,
  // so that exp is skipped
  const float alpha =
      std::isinf(m) ? 0.f : m_new == m ? 1.f : _mm512_cvtss_f32(exp512(_mm512_set1_ps(m - m_new)));
  l = l * alpha + hsum16(p);
  m = m_new;
  _mm512_store_ps(w, p);
  return alpha;
}

template <int DV>
inline void update(float& m, float& l, __m512* o, __m512 sc, __mmask16 valid, const float* vr) {
  const int64_t dp = DV * 16;
  alignas(64) float w[kTile];
  const float alpha = advance(m, l, sc, valid, w);
  const __m512 a = _mm512_set1_ps(alpha);
  // The row's output in locals through the tile (o may alias vr for the compiler: updated in
  // place, every fused multiply-add would go through memory). o * 1 is o: skipped.
  __m512 acc[DV];
  for (int dv = 0; dv < DV; ++dv) acc[dv] = alpha == 1.f ? o[dv] : _mm512_mul_ps(o[dv], a);
  for (int i = 0; i < kTile; ++i) {
    if (!((valid >> i) & 1)) continue;
    const __m512 wi = _mm512_set1_ps(w[i]);
    for (int dv = 0; dv < DV; ++dv)
      acc[dv] = _mm512_fmadd_ps(wi, _mm512_load_ps(vr + i * dp + dv * 16), acc[dv]);
  }
  for (int dv = 0; dv < DV; ++dv) o[dv] = acc[dv];
}

inline float first_lane(__m512 x) { return _mm512_cvtss_f32(x); }

inline void store(float* p, __m512 v, int n) { keepwarm::store_ps(p, v, n); }
inline void store(c10::BFloat16* p, __m512 v, int n) { keepwarm::store_ps(reinterpret_cast<uint16_t*>(p), v, n); }

// One group of up to kRows query rows of kv head h: rows r0 .. r1-1 of the flattened
// (t, g) order, query head h * G + g at position S - T + t.
template <int DV, typename T>
void group(const T* q, const float* kt, const float* vf, const float* xkt, const float* xvf, const Shape& s,
           int64_t h, int64_t r0, int64_t r1, T* out) {
  const int64_t nr = r1 - r0, start = s.shift + s.S - s.T;
  alignas(64) float qf[kRows][DV * 16];
  int64_t pos[kRows], first[kRows];
  float m[kRows], l[kRows];
  __m512 o[kRows][DV];
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t t = (r0 + r) / s.G, g = (r0 + r) % s.G;
    const T* qr = q + (t * s.Hq + h * s.G + g) * s.D;
    for (int64_t d = 0; d < s.D; ++d) qf[r][d] = static_cast<float>(qr[d]);
    pos[r] = start + t;
    first[r] = s.window > 0 ? std::max<int64_t>(s.shift, pos[r] - s.window + 1) : s.shift;
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
    for (int dv = 0; dv < DV; ++dv) o[r][dv] = _mm512_setzero_ps();
  }
  const int64_t dp = DV * 16;
  const int64_t j_begin = first[0] / kTile, j_end = pos[nr - 1] / kTile;  // rows are in position order
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Scores for two tiles at a time (independent chains hide the FMA latency), then the
  // softmax updates tile by tile, in order.
  __m512 acc[2][kRows];
  for (int64_t j = j_begin; j <= j_end; ++j) {
    const int64_t kb = j * kTile;
    const int slot = static_cast<int>((j - j_begin) & 1);
    if (slot == 0) {
      const bool pair = j + 1 <= j_end;
      for (int r = 0; r < kRows; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
      for (int64_t d = 0; d < s.D; ++d) {
        const __m512 k0 = _mm512_load_ps(kt + d * s.Spad + kb);
        const __m512 k1 = pair ? _mm512_load_ps(kt + d * s.Spad + kb + kTile) : k0;
        for (int r = 0; r < kRows; ++r) {
          if (r < nr) {
            const __m512 qd = _mm512_set1_ps(qf[r][d]);
            acc[0][r] = _mm512_fmadd_ps(qd, k0, acc[0][r]);
            acc[1][r] = _mm512_fmadd_ps(qd, k1, acc[1][r]);
          }
        }
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t lo = std::max<int64_t>(first[r], kb), hi = std::min<int64_t>(pos[r], kb + kTile - 1);
      if (lo > hi) continue;  // this tile is outside the row's range
      const __mmask16 valid = (__mmask16)(((1u << (hi - lo + 1)) - 1) << (lo - kb));
      const __m512 sc = _mm512_mask_mov_ps(neg_inf, valid, _mm512_mul_ps(acc[slot][r], _mm512_set1_ps(s.scale)));
      update<DV>(m[r], l[r], o[r], sc, valid, vf + kb * dp);
    }
  }
  // Extra keys: tiles of 16 from extra row 0, each row masked by its extra_mask bits.
  for (int64_t cb = 0; cb < s.Cpad; cb += kTile) {
    __mmask16 valid[kRows];
    bool any = false;
    for (int64_t r = 0; r < nr; ++r) {
      const uint8_t* mr = s.mask + ((r0 + r) / s.G) * s.C;
      unsigned bits = 0;
      for (int i = 0; i < kTile && cb + i < s.C; ++i) bits |= (mr[cb + i] ? 1u : 0u) << i;
      valid[r] = (__mmask16)bits;
      any = any || bits != 0;
    }
    if (!any) continue;
    for (int r = 0; r < kRows; ++r) acc[0][r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < s.D; ++d) {
      const __m512 k0 = _mm512_load_ps(xkt + d * s.Cpad + cb);
      for (int r = 0; r < kRows; ++r)
        if (r < nr) acc[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r][d]), k0, acc[0][r]);
    }
    for (int64_t r = 0; r < nr; ++r) {
      if (valid[r] == 0) continue;
      const __m512 sc = _mm512_mask_mov_ps(neg_inf, valid[r], _mm512_mul_ps(acc[0][r], _mm512_set1_ps(s.scale)));
      update<DV>(m[r], l[r], o[r], sc, valid[r], xvf + cb * dp);
    }
  }
  if (s.sinks != nullptr) {
    for (int64_t r = 0; r < nr; ++r) {
      const float sink = s.sinks[h * s.G + (r0 + r) % s.G];
      const float m_new = std::max(m[r], sink);
      const float alpha = std::isinf(m[r]) ? 0.f : first_lane(exp512(_mm512_set1_ps(m[r] - m_new)));
      l[r] = l[r] * alpha + first_lane(exp512(_mm512_set1_ps(sink - m_new)));
      m[r] = m_new;
      const __m512 a = _mm512_set1_ps(alpha);
      for (int dv = 0; dv < DV; ++dv) o[r][dv] = _mm512_mul_ps(o[r][dv], a);
    }
  }
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t t = (r0 + r) / s.G, g = (r0 + r) % s.G;
    T* orow = out + (t * s.Hq + h * s.G + g) * s.D;
    const __m512 lv = _mm512_set1_ps(l[r]);
    for (int dv = 0; dv < DV; ++dv) {
      const int n = static_cast<int>(std::min<int64_t>(16, s.D - dv * 16));
      if (n <= 0) break;
      store(orow + dv * 16, _mm512_div_ps(o[r][dv], lv), n);
    }
  }
}

template <typename T>
using GroupFn = void (*)(const T*, const float*, const float*, const float*, const float*, const Shape&, int64_t,
                         int64_t, int64_t, T*);

// The instance of a kernel template for vector count `nv` (the counts the kernels are built
// for), or null: make(std::integral_constant<int, NV>) returns the instance for NV.
template <typename Make>
auto for_width(int64_t nv, Make make) -> decltype(make(std::integral_constant<int, 1>{})) {
  switch (nv) {
    case 1: return make(std::integral_constant<int, 1>{});
    case 2: return make(std::integral_constant<int, 2>{});
    case 3: return make(std::integral_constant<int, 3>{});
    case 4: return make(std::integral_constant<int, 4>{});
    case 5: return make(std::integral_constant<int, 5>{});
    case 6: return make(std::integral_constant<int, 6>{});
    case 8: return make(std::integral_constant<int, 8>{});
    case 12: return make(std::integral_constant<int, 12>{});
    case 16: return make(std::integral_constant<int, 16>{});
    case 32: return make(std::integral_constant<int, 32>{});
  }
  return nullptr;
}

template <typename T>
GroupFn<T> group_for(int64_t dv) {
  return for_width(dv, [](auto nv) -> GroupFn<T> { return &group<decltype(nv)::value, T>; });
}

// The staging buffer of one kv head and the calls on it, for one attention call's shape.
template <typename T>
struct Call {
  const T *q, *k, *v, *xk, *xv;
  T* out;
  Shape s;
  GroupFn<T> fn;
  int64_t rows, groups, kt_stride, vf_stride, head;  // head: floats of one head's staging

  Call(const T* q_, const T* k_, const T* v_, const T* xk_, const T* xv_, T* out_, const Shape& s_)
      : q(q_), k(k_), v(v_), xk(xk_), xv(xv_), out(out_), s(s_), fn(group_for<T>(s_.DV)) {
    TORCH_CHECK(fn != nullptr, "cpu_attention: head_dim ", s.D, " is not supported");
    rows = s.T * s.G;
    groups = (rows + kRows - 1) / kRows;
    // per head: window keys KT [D][Spad], VF [Spad][dp], then extra keys KT [D][Cpad], VF [Cpad][dp]
    kt_stride = s.D * s.Spad;
    vf_stride = s.Spad * s.DV * 16;
    head = kt_stride + vf_stride + s.Cpad * (s.D + s.DV * 16);
  }
  void stage(int64_t h, float* base) const {
    stage_head<T>(k, v, s.S, s.shift, s.Spad, s, h, base, base + kt_stride);
    if (s.Cpad > 0)
      stage_head<T>(xk, xv, s.C, 0, s.Cpad, s, h, base + kt_stride + vf_stride,
                    base + kt_stride + vf_stride + s.Cpad * s.D);
  }
  void group_at(const float* base, int64_t h, int64_t r0) const {
    const float* x = base + kt_stride + vf_stride;
    fn(q, base, base + kt_stride, x, x + s.Cpad * s.D, s, h, r0, std::min(rows, r0 + kRows), out);
  }
  // Head h whole: stage it and use it at once, while it is in L2.
  void head_at(int64_t h, float* base) const {
    stage(h, base);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) group_at(base, h, r0);
  }
};

// Staging buffers are reused across calls (a fresh multi-MiB allocation per decode step
// costs more in page faults than the attention itself); every element read is written.
inline float* buffer(std::vector<float>& buf, int64_t floats) {
  if (buf.size() < static_cast<size_t>(floats) + 16) buf.resize(static_cast<size_t>(floats) + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}

template <typename T>
void run(const Call<T>& c) {
  const Shape& s = c.s;
  if (s.Hkv >= at::get_num_threads()) {
    at::parallel_for(0, s.Hkv, 1, [&](int64_t h0, int64_t h1) {
      static thread_local std::vector<float> local;
      float* base = buffer(local, c.head);
      for (int64_t h = h0; h < h1; ++h) c.head_at(h, base);
    });
    return;
  }
  // Fewer heads than threads: stage every head, then split heads x row groups.
  static thread_local std::vector<float> shared;
  float* all = buffer(shared, s.Hkv * c.head);
  at::parallel_for(0, s.Hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) c.stage(h, all + h * c.head);
  });
  at::parallel_for(0, s.Hkv * c.groups, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / c.groups, r0 = (i % c.groups) * kRows;
      c.group_at(all + h * c.head, h, r0);
    }
  });
}

int64_t padded_dv(int64_t d) {
  const int64_t dv = (d + 15) / 16;
  for (int64_t c : {1, 2, 3, 4, 5, 6, 8, 12, 16, 32})
    if (dv <= c) return c;
  return -1;
}

// k, v [S, Hkv, D] for T query rows of Hq heads of size D, dtype dt (bf16 or fp32)
bool eligible_kv(at::ScalarType dt, int64_t T, int64_t Hq, int64_t D, const at::Tensor& k, const at::Tensor& v) {
  if (k.scalar_type() != dt || v.scalar_type() != dt) return false;
  if (!k.device().is_cpu() || !v.device().is_cpu()) return false;
  if (k.dim() != 3 || v.dim() != 3) return false;
  if (k.sizes() != v.sizes() || D != k.size(2) || T > k.size(0) || T < 1) return false;
  if (k.size(1) < 1 || Hq % k.size(1) != 0) return false;
  return padded_dv(D) > 0;
}

bool eligible(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto dt = q.scalar_type();
  if ((dt != at::kBFloat16 && dt != at::kFloat) || !q.device().is_cpu() || q.dim() != 3) return false;
  return eligible_kv(dt, q.size(0), q.size(1), q.size(2), k, v);
}

// The shape of T query rows of Hq heads against k [S, Hkv, D] (no extra keys, no sinks).
Shape shape_of(int64_t T, const at::Tensor& k, int64_t Hq, double scale, int64_t window, int64_t offset) {
  Shape s;
  s.T = T;
  s.S = k.size(0);
  s.Hq = Hq;
  s.Hkv = k.size(1);
  s.G = s.Hq / s.Hkv;
  s.D = k.size(2);
  s.DV = padded_dv(s.D);
  s.shift = offset % kTile;
  s.Spad = (s.shift + s.S + kTile - 1) / kTile * kTile;
  s.window = window;
  s.C = s.Cpad = 0;
  s.scale = static_cast<float>(scale);
  s.mask = nullptr;
  s.sinks = nullptr;
  return s;
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// ---- Decode straight from the cache rows ------------------------------------------------
// A decode row (T = 1, offset 0, no window, extra keys or sinks) over k, v [S, Hkv, D]: the
// same tiles, score chains and online-softmax steps as `group`, without staging whole heads.
// Per tile of 16 keys, the key slices of a few heads are transposed into kt (small enough for
// L1) for the score chains, and the value sums read the value rows in place. bf16 -> fp32 is
// exact, so the fp32 operands, and the bits, are those of the staged path.
//
// bf16 rows are read as dwords: dword e of a key's slice holds dims 2e (low half) and 2e + 1
// (high half), and x << 16, x & 0xffff0000 are those two dims as fp32. One 16x16 dword
// transpose thus yields 32 dims of 16 keys (kt keeps the transposed dwords). The row state o
// keeps the split: per chunk c of 32 dims, o[2c] lane j is dim 32c + 2j and o[2c + 1] lane j
// dim 32c + 2j + 1; the value sums are elementwise over dims, and `finish` puts them in order.
//
// A decode row has few score chains per kv head (G), each D fused multiply-adds long: the
// chains of several heads run together (kChains at a time) to hide the FMA latency, and the
// value sums of the heads follow one another (independent chains, overlapped).

constexpr int kChains = 8;  // score chains computed together

// fp32 vectors of a row state: DV for fp32; two per 32 dims for bf16, padded to an
// instantiated count (always even).
template <typename T>
int64_t state_nv(int64_t d) {
  return std::is_same<T, float>::value ? padded_dv(d) : padded_dv(2 * ((d + 31) / 32) * 16);
}

inline __mmask32 first_bits32(int n) { return n >= 32 ? ~__mmask32(0) : (__mmask32)((1u << n) - 1); }
// dims d0 .. d0 + n - 1 (n <= 32) of a bf16 row as 16 dwords (zero past n)
inline __m512i load_pairs(const c10::BFloat16* p, int n) {
  return n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(first_bits32(n), p);
}
inline __m512 low_dims(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 high_dims(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Key rows 0 .. nk-1 at kh (one head, `row` elements apart; rows >= nk as zero), transposed:
// fp32: kt [D][16], kt[d] lane i = key i's dim d. bf16: kt [ceil(D / 2)][16] dwords, kt[e]
// lane i = key i's dims 2e, 2e + 1. Whole transposes are stored (zero past D; kt has room):
// a store loop of variable length becomes a memcpy from the stack.
inline void tile_keys(const float* kh, int64_t row, int nk, int64_t D, float* kt) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, D - d0));
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < nk ? load_row(kh + i * row + d0, n) : _mm512_setzero_ps();
    transpose16(r);  // r[j] lane i: key i, dim d0 + j
    for (int j = 0; j < 16; ++j) _mm512_store_ps(kt + (d0 + j) * 16, r[j]);
  }
}
inline void tile_keys(const c10::BFloat16* kh, int64_t row, int nk, int64_t D, float* kt) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const int n = static_cast<int>(std::min<int64_t>(32, D - d0));  // dims in this chunk
    __m512 r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < nk ? _mm512_castsi512_ps(load_pairs(kh + i * row + d0, n)) : _mm512_setzero_ps();
    transpose16(r);  // r[j] lane i: key i, dims d0 + 2j, d0 + 2j + 1
    for (int j = 0; j < 16; ++j) _mm512_store_ps(kt + (d0 / 2 + j) * 16, r[j]);
  }
}

// Raw scores of kChains chains: acc[x] lane i = fma chain over d = 0 .. D-1 of q[x][d] * key i's
// dim d, from 0, where q rows are QS floats apart and chains u R .. u R + R - 1 share the keys
// kt[u] (as tile_keys writes them).
template <int R, int64_t QS>
inline void tile_scores(const float* q, const float* const* kt, int64_t D, float, __m512* acc) {
  constexpr int U = kChains / R;
  const float* ku[U];
  for (int u = 0; u < U; ++u) ku[u] = kt[u];
  __m512 a[kChains];  // in registers through the loop (acc may alias q or kt for the compiler)
  for (int x = 0; x < kChains; ++x) a[x] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d)
    for (int u = 0; u < U; ++u) {
      const __m512 k = _mm512_load_ps(ku[u] + d * 16);
      for (int r = 0; r < R; ++r)
        a[u * R + r] = _mm512_fmadd_ps(_mm512_set1_ps(q[(u * R + r) * QS + d]), k, a[u * R + r]);
    }
  for (int x = 0; x < kChains; ++x) acc[x] = a[x];
}
template <int R, int64_t QS>
inline void tile_scores(const float* q, const float* const* kt, int64_t D, c10::BFloat16, __m512* acc) {
  constexpr int U = kChains / R;
  const float* ku[U];
  for (int u = 0; u < U; ++u) ku[u] = kt[u];
  __m512 a[kChains];
  for (int x = 0; x < kChains; ++x) a[x] = _mm512_setzero_ps();
  auto step = [&](int64_t d, int u, __m512 k) {
    for (int r = 0; r < R; ++r)
      a[u * R + r] = _mm512_fmadd_ps(_mm512_set1_ps(q[(u * R + r) * QS + d]), k, a[u * R + r]);
  };
  for (int64_t e = 0; e < D / 2; ++e)
    for (int u = 0; u < U; ++u) {
      const __m512i pairs = _mm512_load_si512(ku[u] + e * 16);
      step(2 * e, u, low_dims(pairs));
      step(2 * e + 1, u, high_dims(pairs));
    }
  if (D % 2 == 1)
    for (int u = 0; u < U; ++u) step(D - 1, u, low_dims(_mm512_load_si512(ku[u] + D / 2 * 16)));
  for (int x = 0; x < kChains; ++x) acc[x] = a[x];
}

// The value sums of RB rows of one kv head (states o[r], alpha[r], weights w[r]) over the tile's
// value rows at vh (`row` elements apart): o = o * alpha (skipped for alpha = 1: the same bits),
// then per valid key in increasing order one fused multiply-add per row and 16 dims.
template <int NV, int RB>
inline void tile_sums(__m512* const* o, const float* alpha, const float (*w)[kTile], __mmask16 valid,
                      const float* vh, int64_t row, int64_t D) {
  __m512 acc[RB][NV];  // in registers through the tile
  for (int r = 0; r < RB; ++r)
    for (int dv = 0; dv < NV; ++dv)
      acc[r][dv] = alpha[r] == 1.f ? o[r][dv] : _mm512_mul_ps(o[r][dv], _mm512_set1_ps(alpha[r]));
  for (int i = 0; i < kTile; ++i) {
    if (!((valid >> i) & 1)) continue;
    for (int dv = 0; dv < NV; ++dv) {
      const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, D - dv * 16)));
      const __m512 x = n > 0 ? load_row(vh + i * row + dv * 16, n) : _mm512_setzero_ps();
      for (int r = 0; r < RB; ++r) acc[r][dv] = _mm512_fmadd_ps(_mm512_set1_ps(w[r][i]), x, acc[r][dv]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int dv = 0; dv < NV; ++dv) o[r][dv] = acc[r][dv];
}
template <int NV, int RB>
inline void tile_sums(__m512* const* o, const float* alpha, const float (*w)[kTile], __mmask16 valid,
                      const c10::BFloat16* vh, int64_t row, int64_t D) {
  __m512 acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int dv = 0; dv < NV; ++dv)
      acc[r][dv] = alpha[r] == 1.f ? o[r][dv] : _mm512_mul_ps(o[r][dv], _mm512_set1_ps(alpha[r]));
  for (int i = 0; i < kTile; ++i) {
    if (!((valid >> i) & 1)) continue;
    for (int c = 0; c < NV / 2; ++c) {
      const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(32, D - c * 32)));
      const __m512i pairs = n > 0 ? load_pairs(vh + i * row + c * 32, n) : _mm512_setzero_si512();
      const __m512 lo = low_dims(pairs), hi = high_dims(pairs);
      for (int r = 0; r < RB; ++r) {
        const __m512 wi = _mm512_set1_ps(w[r][i]);
        acc[r][2 * c] = _mm512_fmadd_ps(wi, lo, acc[r][2 * c]);
        acc[r][2 * c + 1] = _mm512_fmadd_ps(wi, hi, acc[r][2 * c + 1]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int dv = 0; dv < NV; ++dv) o[r][dv] = acc[r][dv];
}

// out row = o / l (elementwise, as `group`), dims back in order.
template <int NV>
inline void finish(const __m512* o, float l, int64_t D, float* orow) {
  const __m512 lv = _mm512_set1_ps(l);
  for (int dv = 0; dv < NV && dv * 16 < D; ++dv)
    store(orow + dv * 16, _mm512_div_ps(o[dv], lv), static_cast<int>(std::min<int64_t>(16, D - dv * 16)));
}
template <int NV>
inline void finish(const __m512* o, float l, int64_t D, c10::BFloat16* orow) {
  const __m512 lv = _mm512_set1_ps(l);
  // lanes 2j, 2j + 1 of the result: even[j], odd[j] (first half: j = 0..7, second: j = 8..15)
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int c = 0; c < NV / 2 && c * 32 < D; ++c) {
    const __m512 even = _mm512_div_ps(o[2 * c], lv), odd = _mm512_div_ps(o[2 * c + 1], lv);
    store(orow + c * 32, _mm512_permutex2var_ps(even, first, odd), static_cast<int>(std::min<int64_t>(16, D - c * 32)));
    if (c * 32 + 16 < D)
      store(orow + c * 32 + 16, _mm512_permutex2var_ps(even, second, odd),
            static_cast<int>(std::min<int64_t>(16, D - c * 32 - 16)));
  }
}

// One sequence's decode step: q [Hq, D] against k, v [S, Hkv, D] -> out [Hq, D].
template <typename T>
struct Decode {
  const T *q, *k, *v;
  T* out;
  Shape s;
};

// Kv heads h0 .. h1-1 of one decode step, in one sweep over the key tiles (each tile's rows are
// read once for all these heads); per tile, passes of `heads_per_pass` heads. work: 64-byte
// aligned, decode_work floats.
int64_t heads_per_pass(const Shape& s) { return std::max<int64_t>(1, kChains / s.G); }
int64_t decode_work(const Shape& s, int64_t nv, int64_t heads) {
  return kChains * nv * 16 * 16 + (heads * s.G + kChains) * (2 * nv * 16 + 32);
}
template <int NV, typename T>
void decode_heads(const Decode<T>& c, int64_t h0, int64_t h1, float* work) {
  const Shape& s = c.s;
  constexpr int64_t kd = NV * 16 * 16, qs = NV * 16;  // floats per head in kt (D <= NV * 16), per row in qf
  const int64_t rows = (h1 - h0) * s.G, row = s.Hkv * s.D, hp = heads_per_pass(s);
  // row x of this call: query head h0 * G + x
  float* kt = work;                                               // [kChains][kd]
  auto* o = reinterpret_cast<__m512*>(kt + kChains * kd);         // [rows][NV]
  auto* sc = reinterpret_cast<float(*)[kTile]>(o + rows * NV);    // [rows][16]: scores, then weights
  auto* qf = reinterpret_cast<float(*)[qs]>(sc + rows + kChains);  // [rows + kChains][NV * 16], zero past rows
  float* m = qf[rows + kChains];                                  // [rows]
  float* l = m + rows;                                            // [rows]
  float* alpha = l + rows;                                        // [rows]
  for (int64_t x = 0; x < rows; ++x) {
    const T* qr = c.q + (h0 * s.G + x) * s.D;
    for (int64_t d = 0; d < s.D; ++d) qf[x][d] = static_cast<float>(qr[d]);
    m[x] = -std::numeric_limits<float>::infinity();
    l[x] = 0.f;
    for (int dv = 0; dv < NV; ++dv) o[x * NV + dv] = _mm512_setzero_ps();
  }
  std::fill(qf[rows], qf[rows + kChains], 0.f);  // the rows of unused chains
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(s.scale);
  // R rows per key load in the score chains: the largest power of two <= 8 dividing G
  const int64_t rg = std::min<int64_t>(8, s.G & -s.G);
  void (*scores)(const float*, const float* const*, int64_t, T, __m512*) = &tile_scores<8, qs>;
  if (rg == 1) scores = &tile_scores<1, qs>;
  if (rg == 2) scores = &tile_scores<2, qs>;
  if (rg == 4) scores = &tile_scores<4, qs>;
  // RB rows per value load in the sums: 2 where G is even and 2 NV sums fit in registers
  const int64_t rb = s.G % 2 == 0 && NV <= 8 ? 2 : 1;
  for (int64_t kb = 0; kb < s.S; kb += kTile) {
    const int nk = static_cast<int>(std::min<int64_t>(kTile, s.S - kb));
    const __mmask16 valid = (__mmask16)((1u << nk) - 1);  // the row (position S - 1) sees keys 0 .. S-1
    for (int64_t hs = h0; hs < h1; hs += hp) {
      const int64_t he = std::min(h1, hs + hp), x0 = (hs - h0) * s.G, x1 = (he - h0) * s.G;
      for (int64_t h = hs; h < he; ++h) tile_keys(c.k + kb * row + h * s.D, row, nk, s.D, kt + (h - hs) * kd);
      for (int64_t xb = x0; xb < x1; xb += kChains) {
        // rows xb + u R .. xb + u R + R - 1 are query heads of one kv head (R divides G and
        // kChains); chains past x1 are computed and dropped (keys: the pass's first head)
        const float* ku[kChains];
        for (int64_t u = 0; u < kChains / rg; ++u) {
          const int64_t slot = (xb + u * rg - x0) / s.G;
          ku[u] = kt + (slot < he - hs ? slot : 0) * kd;
        }
        __m512 acc[kChains];
        scores(qf[xb], ku, s.D, T{}, acc);
        for (int64_t x = xb; x < std::min(x1, xb + kChains); ++x)
          _mm512_store_ps(sc[x], _mm512_mask_mov_ps(neg_inf, valid, _mm512_mul_ps(acc[x - xb], scale)));
      }
      for (int64_t x = x0; x < x1; ++x) alpha[x] = advance(m[x], l[x], _mm512_load_ps(sc[x]), valid, sc[x]);
      for (int64_t x = x0; x < x1; x += rb) {
        const T* vh = c.v + kb * row + (h0 + x / s.G) * s.D;
        __m512* os[2] = {o + x * NV, o + (x + rb - 1) * NV};
        if (rb == 2)
          tile_sums<NV, 2>(os, alpha + x, sc + x, valid, vh, row, s.D);
        else
          tile_sums<NV, 1>(os, alpha + x, sc + x, valid, vh, row, s.D);
      }
    }
  }
  for (int64_t x = 0; x < rows; ++x) finish<NV>(o + x * NV, l[x], s.D, c.out + (h0 * s.G + x) * s.D);
}

template <typename T>
using DecodeFn = void (*)(const Decode<T>&, int64_t, int64_t, float*);

template <typename T>
DecodeFn<T> decode_for(int64_t nv) {
  return for_width(nv, [](auto w) -> DecodeFn<T> { return &decode_heads<decltype(w)::value, T>; });
}

// The decode steps of several sequences (one dtype, Hq, Hkv, D) in one parallel region. The
// (sequence, kv head) pairs, in order, are cut into one contiguous run per thread of about
// equal cost (key tiles); a thread sweeps each sequence of its run once for the run's heads.
// Which thread computes a pair does not change its bits.
template <typename T>
void run_decode(const std::vector<Decode<T>>& seqs) {
  const Shape& s0 = seqs[0].s;
  const int64_t B = static_cast<int64_t>(seqs.size()), Hkv = s0.Hkv, pairs = B * Hkv;
  const int64_t nv = state_nv<T>(s0.D);
  const DecodeFn<T> fn = decode_for<T>(nv);
  TORCH_CHECK(fn != nullptr, "cpu_attention: head_dim ", s0.D, " is not supported");
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), pairs);
  // begin[t]: the first pair of thread t's run (pair i goes to the thread its cost midpoint falls in)
  std::vector<int64_t> begin(nt + 1, pairs);
  int64_t total = 0;
  for (const Decode<T>& c : seqs) total += Hkv * ((c.s.S + kTile - 1) / kTile);
  for (int64_t i = 0, before = 0, t = 0; i < pairs; ++i) {
    const int64_t cost = (seqs[i / Hkv].s.S + kTile - 1) / kTile;
    const int64_t owner = std::min(nt - 1, (2 * before + cost) * nt / (2 * total));
    while (t <= owner) begin[t++] = i;
    before += cost;
  }
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    static thread_local std::vector<float> local;
    float* work = buffer(local, decode_work(s0, nv, Hkv));
    for (int64_t i = begin[t0]; i < begin[t1];) {
      const int64_t b = i / Hkv, h0 = i % Hkv, h1 = std::min(Hkv, h0 + begin[t1] - i);
      fn(seqs[b], h0, h1, work);
      i += h1 - h0;
    }
  });
}

// attention for q [T, Hq, D] against k, v [S, Hkv, D]; None when not eligible.
c10::optional<at::Tensor> try_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        double scale, int64_t window, int64_t offset,
                                        const c10::optional<at::Tensor>& extra_k,
                                        const c10::optional<at::Tensor>& extra_v,
                                        const c10::optional<at::Tensor>& extra_mask,
                                        const c10::optional<at::Tensor>& sinks) {
  if (!eligible(q, k, v) || offset < 0 || window < 0) return c10::nullopt;
  const bool has_extra = extra_k.has_value() && extra_k->defined();
  if (has_extra != (extra_v.has_value() && extra_v->defined()) ||
      has_extra != (extra_mask.has_value() && extra_mask->defined()))
    return c10::nullopt;
  at::Tensor xkc, xvc, maskc, sinkc;
  if (has_extra) {
    const at::Tensor &xk = *extra_k, &xv = *extra_v, &mk = *extra_mask;
    if (xk.scalar_type() != q.scalar_type() || xv.scalar_type() != q.scalar_type() || !xk.device().is_cpu() ||
        !xv.device().is_cpu() || !mk.device().is_cpu() || xk.dim() != 3 || xk.sizes() != xv.sizes() ||
        xk.size(1) != k.size(1) || xk.size(2) != k.size(2) || mk.scalar_type() != at::kBool || mk.dim() != 2 ||
        mk.size(0) != q.size(0) || mk.size(1) != xk.size(0))
      return c10::nullopt;
    xkc = xk.contiguous();
    xvc = xv.contiguous();
    maskc = mk.contiguous();
  }
  if (sinks.has_value() && sinks->defined()) {
    if (sinks->scalar_type() != at::kFloat || !sinks->device().is_cpu() || sinks->dim() != 1 ||
        sinks->size(0) != q.size(1))
      return c10::nullopt;
    sinkc = sinks->contiguous();
  }
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  Shape s = shape_of(q.size(0), k, q.size(1), scale, window, offset);
  s.C = has_extra ? xkc.size(0) : 0;
  s.Cpad = (s.C + kTile - 1) / kTile * kTile;
  s.mask = has_extra ? reinterpret_cast<const uint8_t*>(maskc.data_ptr<bool>()) : nullptr;
  s.sinks = sinkc.defined() ? sinkc.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty(q.sizes(), q.options());
  // a decode row: straight from the cache rows (the same bits)
  const bool decode_row = s.T == 1 && offset == 0 && window == 0 && !has_extra && s.sinks == nullptr;
  if (q.scalar_type() == at::kFloat) {
    if (decode_row)
      run_decode(std::vector<Decode<float>>{{qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                                             out.data_ptr<float>(), s}});
    else
      run(Call<float>(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                      has_extra ? xkc.data_ptr<float>() : nullptr, has_extra ? xvc.data_ptr<float>() : nullptr,
                      out.data_ptr<float>(), s));
  } else {
    using B = c10::BFloat16;
    if (decode_row)
      run_decode(std::vector<Decode<B>>{{ptr<B>(qc), ptr<B>(kc), ptr<B>(vc), ptr<B>(out), s}});
    else
      run(Call<B>(ptr<B>(qc), ptr<B>(kc), ptr<B>(vc), has_extra ? ptr<B>(xkc) : nullptr,
                  has_extra ? ptr<B>(xvc) : nullptr, ptr<B>(out), s));
  }
  return out;
}

// The decode steps of B sequences: q [B, Hq, D] (row b: sequence b's query) against k_b, v_b
// [S_b, Hkv, D] (S_b >= 1; one dtype, Hkv and D for all) -> [B, Hq, D]; None when not eligible.
c10::optional<at::Tensor> try_decode_batch(const at::Tensor& q, const std::vector<at::Tensor>& ks,
                                           const std::vector<at::Tensor>& vs, double scale) {
  const int64_t B = static_cast<int64_t>(ks.size());
  const auto dt = q.scalar_type();
  if (B == 0 || vs.size() != ks.size() || q.dim() != 3 || q.size(0) != B || !q.device().is_cpu() ||
      (dt != at::kBFloat16 && dt != at::kFloat))
    return c10::nullopt;
  const at::Tensor qc = q.contiguous();
  std::vector<at::Tensor> held;  // contiguous keys and values, alive until the kernel is done
  held.reserve(2 * B);
  for (int64_t b = 0; b < B; ++b) {
    const at::Tensor &k = ks[b], &v = vs[b];
    if (k.dim() != 3 || k.size(1) != ks[0].size(1) || !eligible_kv(dt, 1, q.size(1), q.size(2), k, v))
      return c10::nullopt;
    held.push_back(k.contiguous());
    held.push_back(v.contiguous());
  }
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  const int64_t step = qc.size(1) * qc.size(2);
  auto run_as = [&](auto tag) {
    using T = decltype(tag);
    std::vector<Decode<T>> seqs;
    seqs.reserve(B);
    for (int64_t b = 0; b < B; ++b) {
      const at::Tensor &k = held[2 * b], &v = held[2 * b + 1];
      seqs.push_back({ptr<T>(qc) + b * step, ptr<T>(k), ptr<T>(v), ptr<T>(out) + b * step,
                      shape_of(1, k, qc.size(1), scale, 0, 0)});
    }
    run_decode(seqs);
  };
  if (qc.scalar_type() == at::kFloat)
    run_as(float{});
  else
    run_as(c10::BFloat16{});
  return out;
}

// keepwarm::raw::DecodeAttention: try_decode_batch's kernel over raw bf16 rows.
void raw_decode_attention(int64_t B, const uint16_t* q, const uint16_t* const* k, const uint16_t* const* v,
                          const int64_t* S, uint16_t* out, int64_t Hq, int64_t Hkv, int64_t D, float scale) {
  using T = c10::BFloat16;
  std::vector<Decode<T>> seqs;
  seqs.reserve(B);
  for (int64_t b = 0; b < B; ++b) {
    Shape s;
    s.T = 1;
    s.S = S[b];
    s.Hq = Hq;
    s.Hkv = Hkv;
    s.G = Hq / Hkv;
    s.D = D;
    s.DV = padded_dv(D);
    s.shift = 0;
    s.Spad = (s.S + kTile - 1) / kTile * kTile;
    s.window = 0;
    s.C = s.Cpad = 0;
    s.scale = scale;
    s.mask = nullptr;
    s.sinks = nullptr;
    seqs.push_back({reinterpret_cast<const T*>(q) + b * Hq * D, reinterpret_cast<const T*>(k[b]),
                    reinterpret_cast<const T*>(v[b]), reinterpret_cast<T*>(out) + b * Hq * D, s});
  }
  run_decode(seqs);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("raw_api", [] {
    keepwarm::raw::DecodeAttention decode = &raw_decode_attention;
    return std::map<std::string, uint64_t>{{"decode_attention", reinterpret_cast<uint64_t>(decode)}};
  }, "the raw entry points by address (kernels/csrc/raw_kernels.h)");
  m.def("eligible", &eligible, py::arg("q"), py::arg("k"), py::arg("v"));
  m.def("try_attention", &try_attention, "causal attention, invariant per query row, or None", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("window") = 0, py::arg("offset") = 0,
        py::arg("extra_k") = py::none(), py::arg("extra_v") = py::none(), py::arg("extra_mask") = py::none(),
        py::arg("sinks") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("try_decode_batch", &try_decode_batch, "the decode attention of several sequences, or None",
        py::arg("q"), py::arg("ks"), py::arg("vs"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
}
