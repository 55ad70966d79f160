// One decode step of a dense attention model (llama, qwen2, qwen3: models/dense.py) through all
// its layers in one call: for B sequences with one new token each, per layer
//   h = rms_norm(x, input_norm); q, k, v = split(h W_qkv^T + b_qkv); (qwen3) q, k = rms_norm(q|k, q|k_norm)
//   q, k = rotary(q|k, cos, sin); cache rows k, v written at the sequence's position
//   a = decode_attention(q, the cache's rows 0 .. position); x = round(x + a W_o^T + b_o)
//   h = rms_norm(x, post_norm); g, u = split(h W_gu^T + b_gu); x = round(x + silu_mul(g, u) W_d^T + b_d)
// The arithmetic is the other extensions' own compiled kernels, called through their raw entry
// points (raw_kernels.h; their addresses come from their `raw_api()`), so every value has the
// bits the per-op path gives it (models/dense.py `_forward`); what goes is the per-operation
// framework overhead: a dozen Python-to-torch calls and tensor allocations a layer.
// bf16 only; the caller (kernels/cpu_decode_step.py) checks every weight and shape first.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "raw_kernels.h"

namespace {

namespace raw = keepwarm::raw;

const uint16_t* bits(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const uint16_t*>(t.data_ptr()) : nullptr;
}

// A projection: y [M, N] = x [M, K] W^T (+ bias), its rows in one or more parts, each by its
// own product `fn` (cpu_linear's or cpu_quant_linear's): a fused projection of block kinds that
// cannot share one matrix (kernels/quant_weight.py QuantRows), each part's outputs side by side.
struct Part {
  raw::Linear fn = nullptr;
  at::Tensor w, bias;  // held: the plan keeps them alive
  int64_t N = 0, K = 0, variant = 0;
};
struct Proj {
  std::vector<Part> parts;
  int64_t N = 0;  // the parts' N summed
  void operator()(const uint16_t* x, int64_t M, uint16_t* y) const {
    if (parts.size() == 1) {
      const Part& p = parts[0];
      p.fn(x, M, p.K, p.w.data_ptr(), p.N, bits(p.bias), y, p.variant);
      return;
    }
    std::vector<uint16_t> part_out;
    int64_t col = 0;
    for (const Part& p : parts) {
      part_out.resize(M * p.N);
      p.fn(x, M, p.K, p.w.data_ptr(), p.N, bits(p.bias), part_out.data(), p.variant);
      for (int64_t r = 0; r < M; ++r)
        std::memcpy(y + r * N + col, part_out.data() + r * p.N, p.N * sizeof(uint16_t));
      col += p.N;
    }
  }
};

struct Layer {
  at::Tensor input_norm, q_norm, k_norm, post_norm;  // q_norm / k_norm undefined: none
  Proj qkv, o, gate_up, down;
};

// round(a + b) in bf16, as torch adds two bf16 tensors (fp32 sum, rounded to nearest even).
void add_rows(uint16_t* x, const uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = static_cast<float>(c10::BFloat16(x[i], c10::BFloat16::from_bits())) +
                    static_cast<float>(c10::BFloat16(y[i], c10::BFloat16::from_bits()));
    x[i] = c10::BFloat16(s).x;
  }
}

class DecodeStep {
 public:
  DecodeStep(const std::map<std::string, uint64_t>& api, int64_t hidden, int64_t heads, int64_t kv_heads,
             int64_t head_dim, int64_t intermediate, double eps, double scale)
      : H_(hidden), Hq_(heads), Hkv_(kv_heads), D_(head_dim), I_(intermediate), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)) {
    rms_norm_ = reinterpret_cast<raw::RmsNorm>(api.at("rms_norm"));
    silu_mul_ = reinterpret_cast<raw::SiluMul>(api.at("silu_mul"));
    rotary_ = reinterpret_cast<raw::Rotary>(api.at("rotary"));
    attention_ = reinterpret_cast<raw::DecodeAttention>(api.at("decode_attention"));
  }

  void add_layer(const at::Tensor& input_norm, const c10::optional<at::Tensor>& q_norm,
                 const c10::optional<at::Tensor>& k_norm, const at::Tensor& post_norm) {
    Layer l;
    l.input_norm = input_norm;
    if (q_norm.has_value()) l.q_norm = *q_norm;
    if (k_norm.has_value()) l.k_norm = *k_norm;
    l.post_norm = post_norm;
    layers_.push_back(std::move(l));
  }

  // A part (the next rows) of the last added layer's projection `slot` (0 qkv, 1 o, 2 gate_up, 3 down).
  void add_part(int64_t slot, uint64_t fn, const at::Tensor& w, int64_t N, int64_t K, int64_t variant,
                const c10::optional<at::Tensor>& bias) {
    TORCH_CHECK(!layers_.empty() && slot >= 0 && slot < 4, "add_part: add a layer first; slot 0..3");
    Layer& l = layers_.back();
    Proj* p[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    Part part;
    part.fn = reinterpret_cast<raw::Linear>(fn);
    part.w = w;
    part.N = N;
    part.K = K;
    part.variant = variant;
    if (bias.has_value()) part.bias = *bias;
    p[slot]->parts.push_back(std::move(part));
    p[slot]->N += N;
  }

  // x [B, hidden] bf16 (the new tokens' embeddings), cos / sin [B, head_dim] bf16 (their
  // positions' rows), caches: per sequence b its 2 L cache addresses (layer i's K buffer at
  // b * 2 L + 2 i, its V buffer next: [capacity, Hkv, D] bf16 each), positions [B] (the new
  // token's). Writes each layer's K/V row at the position; returns the last layer's output [B, hidden].
  at::Tensor run(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<int64_t>& caches, const std::vector<int64_t>& positions) const {
    const int64_t B = static_cast<int64_t>(positions.size()), L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) == B && x_in.size(1) == H_ && x_in.is_contiguous() &&
                    x_in.scalar_type() == at::kBFloat16,
                "x must be [B, hidden] bf16, contiguous");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * D_ && sin.numel() == B * D_ &&
                    cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
                "cos, sin must be [B, head_dim] bf16, contiguous");
    TORCH_CHECK(static_cast<int64_t>(caches.size()) == B * 2 * L, "caches must hold 2 L addresses per sequence");
    const int64_t qd = Hq_ * D_, kvd = Hkv_ * D_, nqkv = qd + 2 * kvd;
    at::Tensor out = x_in.clone();
    uint16_t* x = reinterpret_cast<uint16_t*>(out.data_ptr());
    const uint16_t* cs = bits(cos);
    const uint16_t* sn = bits(sin);
    std::vector<uint16_t> h(B * H_), qkv(B * nqkv), qn(B * qd), kn(kvd), q(B * qd), attn(B * qd), y(B * H_),
        gu(B * 2 * I_), act(B * I_);
    std::vector<const uint16_t*> ks(B), vs(B);
    std::vector<int64_t> S(B);
    for (int64_t b = 0; b < B; ++b) S[b] = positions[b] + 1;
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers_[i];
      rms_norm_(x, H_, bits(l.input_norm), h.data(), B, H_, eps_);
      l.qkv(h.data(), B, qkv.data());
      for (int64_t b = 0; b < B; ++b) {
        auto* kc = reinterpret_cast<uint16_t*>(caches[b * 2 * L + 2 * i]);
        auto* vc = reinterpret_cast<uint16_t*>(caches[b * 2 * L + 2 * i + 1]);
        const uint16_t* qs = qkv.data() + b * nqkv;
        const uint16_t* kv = qs + qd;
        if (l.q_norm.defined()) {  // qwen3: each head normed before the rotation
          rms_norm_(qs, D_, bits(l.q_norm), qn.data() + b * qd, Hq_, D_, eps_);
          rms_norm_(kv, D_, bits(l.k_norm), kn.data(), Hkv_, D_, eps_);
          qs = qn.data() + b * qd;
          kv = kn.data();
        }
        rotary_(qs, qd, D_, cs + b * D_, sn + b * D_, q.data() + b * qd, 1, Hq_, D_);
        rotary_(kv, kvd, D_, cs + b * D_, sn + b * D_, kc + positions[b] * kvd, 1, Hkv_, D_);
        std::memcpy(vc + positions[b] * kvd, qkv.data() + b * nqkv + qd + kvd, kvd * sizeof(uint16_t));
        ks[b] = kc;
        vs[b] = vc;
      }
      attention_(B, q.data(), ks.data(), vs.data(), S.data(), attn.data(), Hq_, Hkv_, D_, scale_);
      l.o(attn.data(), B, y.data());
      add_rows(x, y.data(), B * H_);
      rms_norm_(x, H_, bits(l.post_norm), h.data(), B, H_, eps_);
      l.gate_up(h.data(), B, gu.data());
      silu_mul_(gu.data(), 2 * I_, gu.data() + I_, 2 * I_, act.data(), B, I_);
      l.down(act.data(), B, y.data());
      add_rows(x, y.data(), B * H_);
    }
    return out;
  }

 private:
  int64_t H_, Hq_, Hkv_, D_, I_;
  float eps_, scale_;
  raw::RmsNorm rms_norm_;
  raw::SiluMul silu_mul_;
  raw::Rotary rotary_;
  raw::DecodeAttention attention_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<const std::map<std::string, uint64_t>&, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                    double>(),
           py::arg("api"), py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"), py::arg("eps"), py::arg("scale"))
      .def("add_layer", &DecodeStep::add_layer, py::arg("input_norm"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("post_norm"))
      .def("add_part", &DecodeStep::add_part, py::arg("slot"), py::arg("fn"), py::arg("w"), py::arg("N"),
           py::arg("K"), py::arg("variant"), py::arg("bias"))
      .def("run", &DecodeStep::run, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("caches"),
           py::arg("positions"), py::call_guard<py::gil_scoped_release>());
}
