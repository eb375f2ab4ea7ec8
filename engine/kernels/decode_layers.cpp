// The layers of a decode step run from C++: engine/decode_step.py's loop over the layers with the same gguf-q8
// kernels (gemv_q8_many), the same attention call and the same values bit for bit, without Python's cost per op.
// A layer there is ~60 small ops (norms, rotary, bias adds, the cache write, bf16 round trips), ~10 of a ~47 ms
// step of the 1.5B on 2 threads (AMD EPYC); here the elementwise ones are loops over one row (below) and the rest
// (RMSNorm's statistics, attention, silu) are torch's own ops called from C++.
//
// `DecodeLayers` holds a model's layers (built once, `add_layer` per layer, the tensors shared with the model's
// modules); `run` takes the embedded token, the rotary cos/sin of its position and the cache's key/value buffers,
// writes the token's keys and values at slot `length` of each layer and returns the last layer's output.
#include "gemv_gguf.h"

#include <torch/custom_class.h>

#include <optional>
#include <vector>

namespace {

// Matrices that take one input (a layer's q, k and v; its gate and up; o or down alone), as gemv_q8_many takes them.
struct Matrices {
  std::vector<at::Tensor> weights, scales, lows;

  std::vector<at::Tensor> operator()(const at::Tensor& x) const {
    return marginalia::gemv_q8_many(x, weights, scales, lows);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  Matrices qkv, o, gate_up, down;
  std::vector<at::Tensor> qkv_bias;  // an empty tensor where the matrix has no bias
};

// The elementwise work between the kernels is written out here, each step rounded to the model's dtype T where
// torch rounds it (a bf16 op computes in fp32 and rounds its result to bf16, nearest even, as c10::BFloat16 does),
// so the values are those of engine/decode_step.py's ops; the build's -ffp-contract=off keeps a product and a sum
// two roundings. The one reduction (RMSNorm's mean of squares) stays torch's, whose order of sums it is.

// transformers' RMSNorm (llama's and qwen2's), fp32 statistics and the weight in T, into `out`, the fp32 row the
// kernels take: out = float(weight * T(h * rsqrt(mean(h^2) + eps))).
template <typename T>
void norm_into(const at::Tensor& weight, double eps, const at::Tensor& hidden, float* out) {
  const at::Tensor h = hidden.to(at::kFloat).contiguous();
  const float r = at::rsqrt(h.pow(2).mean({-1}, true) + eps).item<float>();
  const float* hp = h.data_ptr<float>();
  const T* wp = weight.data_ptr<T>();
  for (int64_t j = 0; j < h.numel(); ++j) out[j] = static_cast<float>(T(float(wp[j]) * float(T(hp[j] * r))));
}

// One head of q or k: T(y) (+ bias), then the rotary embedding (GPT-NeoX layout: x * cos + rotate_half(x) * sin)
// into `out`.
template <typename T>
void rotate_into(const float* y, const T* bias, const T* cos, const T* sin, int64_t dim, T* out) {
  T x[512];
  for (int64_t j = 0; j < dim; ++j) x[j] = bias ? T(float(T(y[j])) + float(bias[j])) : T(y[j]);
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < dim; ++j) {
    const float rotated = j < half ? -float(x[j + half]) : float(x[j - half]);
    out[j] = T(float(T(float(x[j]) * float(cos[j]))) + float(T(rotated * float(sin[j]))));
  }
}

// hidden = residual + T(y): a matrix's fp32 output added back to the residual stream.
template <typename T>
at::Tensor plus(const at::Tensor& residual, const at::Tensor& y) {
  at::Tensor out = at::empty_like(residual);
  const T* rp = residual.data_ptr<T>();
  const float* yp = y.data_ptr<float>();
  T* op = out.data_ptr<T>();
  for (int64_t j = 0; j < out.numel(); ++j) op[j] = T(float(rp[j]) + float(T(yp[j])));
  return out;
}

struct DecodeLayers : torch::CustomClassHolder {
  int64_t head_dim;
  double scaling;
  std::vector<Layer> layers;

  DecodeLayers(int64_t head_dim, double scaling) : head_dim(head_dim), scaling(scaling) {}

  void add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps,
                 std::vector<at::Tensor> qkv_weights, std::vector<at::Tensor> qkv_scales,
                 std::vector<at::Tensor> qkv_lows, std::vector<at::Tensor> qkv_bias,
                 std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up_weights,
                 std::vector<at::Tensor> gate_up_scales, std::vector<at::Tensor> gate_up_lows,
                 std::vector<at::Tensor> down) {
    TORCH_CHECK(qkv_weights.size() == 3 && qkv_bias.size() == 3 && gate_up_weights.size() == 2 && o.size() == 3
                && down.size() == 3, "DecodeLayers.add_layer: q, k, v; gate, up; o and down as (weight, scale, low)");
    layers.push_back(Layer{input_norm, post_norm, input_eps, post_eps,
                           Matrices{qkv_weights, qkv_scales, qkv_lows}, Matrices{{o[0]}, {o[1]}, {o[2]}},
                           Matrices{gate_up_weights, gate_up_scales, gate_up_lows},
                           Matrices{{down[0]}, {down[1]}, {down[2]}}, qkv_bias});
  }

  at::Tensor run(at::Tensor hidden, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                 std::vector<at::Tensor> values, int64_t length) {
    TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(),
                "DecodeLayers.run: one key and one value buffer a layer");
    TORCH_CHECK(head_dim <= 512 && hidden.is_contiguous() && hidden.numel() == layers[0].input_norm.numel(),
                "DecodeLayers.run: one token's hidden state, heads of at most 512 values");
    // The step holds no Python object: let other Python threads (the app's server) run meanwhile.
    std::optional<pybind11::gil_scoped_release> no_gil;
    if (PyGILState_Check()) no_gil.emplace();
    c10::InferenceMode inference;
    if (hidden.scalar_type() == at::kBFloat16) return layers_in<at::BFloat16>(hidden, cos, sin, keys, values, length);
    TORCH_CHECK(hidden.scalar_type() == at::kFloat, "DecodeLayers.run: bf16 or fp32");
    return layers_in<float>(hidden, cos, sin, keys, values, length);
  }

  template <typename T>
  at::Tensor layers_in(at::Tensor hidden, const at::Tensor& cos_in, const at::Tensor& sin_in,
                       const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values, int64_t length) {
    const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    const auto as_float = hidden.options().dtype(at::kFloat);
    const int64_t width = hidden.numel();
    for (size_t index = 0; index < layers.size(); ++index) {
      const Layer& layer = layers[index];
      at::Tensor x = at::empty({1, width}, as_float);
      norm_into<T>(layer.input_norm, layer.input_eps, hidden, x.data_ptr<float>());
      const std::vector<at::Tensor> ys = layer.qkv(x);
      const int64_t heads = ys[0].numel() / head_dim, kv_heads = ys[1].numel() / head_dim;
      const T* bias[3];
      for (int i = 0; i < 3; ++i) bias[i] = layer.qkv_bias[i].numel() ? layer.qkv_bias[i].data_ptr<T>() : nullptr;
      // q rotated, as engine/attention.py grouped_decode lays it out: the heads that share a key/value head as
      // rows against it
      at::Tensor rows = at::empty({1, kv_heads, heads / kv_heads, head_dim}, hidden.options());
      for (int64_t h = 0; h < heads; ++h)
        rotate_into<T>(ys[0].data_ptr<float>() + h * head_dim, bias[0] ? bias[0] + h * head_dim : nullptr, cp, sp,
                       head_dim, rows.data_ptr<T>() + h * head_dim);
      // k rotated and v written at slot `length` of the cache (PreallocatedLayer.update's copy)
      const at::Tensor& key_buffer = keys[index];
      const at::Tensor& value_buffer = values[index];
      for (int64_t h = 0; h < kv_heads; ++h) {
        T* key_slot = key_buffer.data_ptr<T>() + h * key_buffer.stride(1) + length * key_buffer.stride(2);
        rotate_into<T>(ys[1].data_ptr<float>() + h * head_dim, bias[1] ? bias[1] + h * head_dim : nullptr, cp, sp,
                       head_dim, key_slot);
        T* value_slot = value_buffer.data_ptr<T>() + h * value_buffer.stride(1) + length * value_buffer.stride(2);
        const float* v = ys[2].data_ptr<float>() + h * head_dim;
        for (int64_t j = 0; j < head_dim; ++j)
          value_slot[j] = bias[2] ? T(float(T(v[j])) + float(bias[2][h * head_dim + j])) : T(v[j]);
      }
      const at::Tensor cached_keys = key_buffer.slice(2, 0, length + 1);
      const at::Tensor cached_values = value_buffer.slice(2, 0, length + 1);
      const at::Tensor out = at::scaled_dot_product_attention(rows, cached_keys, cached_values, std::nullopt, 0.0,
                                                              false, scaling);
      hidden = plus<T>(hidden, layer.o(out.reshape({1, -1}).to(at::kFloat).contiguous())[0]);
      norm_into<T>(layer.post_norm, layer.post_eps, hidden, x.data_ptr<float>());
      const std::vector<at::Tensor> gate_up = layer.gate_up(x);
      const at::Tensor act = at::silu(gate_up[0].to(hidden.scalar_type()));
      const T* ap = act.data_ptr<T>();
      const float* up = gate_up[1].data_ptr<float>();
      at::Tensor product = at::empty({1, act.numel()}, as_float);
      float* pp = product.data_ptr<float>();
      for (int64_t j = 0; j < act.numel(); ++j) pp[j] = static_cast<float>(T(float(ap[j]) * float(T(up[j]))));
      hidden = plus<T>(hidden, layer.down(product)[0]);
    }
    return hidden;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(marginalia_gemv, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<int64_t, double>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("run", &DecodeLayers::run);
}
