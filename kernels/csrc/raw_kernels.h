// The kernels' raw entry points: plain functions over bf16 bit patterns (uint16_t) and sizes,
// which an extension hands out by address (its `raw_api()`: name -> address) so that another
// extension can call the same compiled code without Python or the dispatcher in between
// (kernels/cpu_decode_step.py: a whole decode step in one call). Each is the code its extension's
// tensor entry runs for bf16, so a row's bits are the same through either.
#pragma once

#include <cstdint>

namespace keepwarm::raw {

// y [M, N] = x [M, K] W^T (+ bias [N] or null), rounded once to bf16. `w`: the weight as the
// extension keeps it; `variant`: cpu_linear's fma_form (0 or 1), cpu_quant_linear's kind (0 Q8_0,
// 1 Q4_0, 2 Q4_1).
using Linear = void (*)(const uint16_t* x, int64_t M, int64_t K, const void* w, int64_t N, const uint16_t* bias,
                        uint16_t* y, int64_t variant);
// rows of D at x + r * x_stride -> y [rows, D]: weight * round(x * rsqrt(mean(x^2) + eps)).
using RmsNorm = void (*)(const uint16_t* x, int64_t x_stride, const uint16_t* w, uint16_t* y, int64_t rows,
                         int64_t D, float eps);
// y [rows, I] = round(silu(g)) * u, rows at g + r * gs, u + r * us.
using SiluMul = void (*)(const uint16_t* g, int64_t gs, const uint16_t* u, int64_t us, uint16_t* y, int64_t rows,
                         int64_t I);
// x [n_t, n_h, dr] (strides st, sh; last dim contiguous), cos / sin [n_t, dr] -> y [n_t, n_h, dr]
// contiguous: the rotate-half rotary embedding.
using Rotary = void (*)(const uint16_t* x, int64_t st, int64_t sh, const uint16_t* cos, const uint16_t* sin,
                        uint16_t* y, int64_t n_t, int64_t n_h, int64_t dr);
// B decode rows: q [B, Hq, D] against sequence b's k[b], v[b] [S[b], Hkv, D] -> out [B, Hq, D].
using DecodeAttention = void (*)(int64_t B, const uint16_t* q, const uint16_t* const* k, const uint16_t* const* v,
                                 const int64_t* S, uint16_t* out, int64_t Hq, int64_t Hkv, int64_t D, float scale);

}  // namespace keepwarm::raw
