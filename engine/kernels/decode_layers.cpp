// The layers of a decode step run from C++: engine/decode_step.py's loop over the layers, the same ATen ops in the
// same order and dtypes and the same gguf-q8 kernels (gemv_q8_many), so the hidden state that comes out is the
// Python loop's bit for bit. What goes is Python's own cost per op: a layer is ~60 small ops (norms, rotary, the
// cache write, attention over the cache, bf16 round trips), ~10 of a ~47 ms step of the 1.5B on 2 threads (AMD
// EPYC), and an op called from C++ skips the Python argument parsing and object wrapping around each.
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

// transformers' RMSNorm (llama's and qwen2's): fp32 statistics, the weight in the model's dtype.
at::Tensor rms_norm(const at::Tensor& weight, double eps, const at::Tensor& hidden) {
  const auto dtype = hidden.scalar_type();
  at::Tensor h = hidden.to(at::kFloat);
  const at::Tensor variance = h.pow(2).mean({-1}, true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(dtype);
}

// Rotary embedding (GPT-NeoX layout, transformers' rotate_half).
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return (x * cos) + (at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1) * sin);
}

// A decode copy's forward for one row (engine/packed.py _DecodeCopy): fp32 in, the kernel, back to the model's dtype.
at::Tensor one_matrix(const Matrices& m, const at::Tensor& x, at::ScalarType dtype) {
  const at::Tensor rows = x.reshape({1, x.size(-1)}).to(at::kFloat).contiguous();
  return m(rows)[0].to(dtype).reshape({1, 1, -1});
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
    // The step holds no Python object: let other Python threads (the app's server) run meanwhile.
    std::optional<pybind11::gil_scoped_release> no_gil;
    if (PyGILState_Check()) no_gil.emplace();
    c10::InferenceMode inference;
    const auto dtype = hidden.scalar_type();
    for (size_t index = 0; index < layers.size(); ++index) {
      const Layer& layer = layers[index];
      at::Tensor residual = hidden;
      at::Tensor x = rms_norm(layer.input_norm, layer.input_eps, hidden).reshape({1, -1}).to(at::kFloat);
      const std::vector<at::Tensor> ys = layer.qkv(x);
      at::Tensor qkv[3];
      for (int i = 0; i < 3; ++i) {
        qkv[i] = ys[i].to(dtype);
        if (layer.qkv_bias[i].numel()) qkv[i] = qkv[i] + layer.qkv_bias[i];
        qkv[i] = qkv[i].view({1, 1, -1, head_dim}).transpose(1, 2);
      }
      const at::Tensor q = rotate(qkv[0], cos, sin), k = rotate(qkv[1], cos, sin);
      keys[index].slice(2, length, length + 1).copy_(k);
      values[index].slice(2, length, length + 1).copy_(qkv[2]);
      const at::Tensor cached_keys = keys[index].slice(2, 0, length + 1);
      const at::Tensor cached_values = values[index].slice(2, 0, length + 1);
      // engine/attention.py grouped_decode: the query heads that share a key/value head as rows against it
      const int64_t heads = q.size(1), kv_heads = cached_keys.size(1);
      const at::Tensor rows = q.reshape({1, kv_heads, heads / kv_heads, q.size(-1)});
      at::Tensor out = at::scaled_dot_product_attention(rows, cached_keys, cached_values, std::nullopt, 0.0, false,
                                                        scaling);
      out = out.reshape({1, 1, heads, cached_values.size(-1)}).reshape({1, 1, -1}).contiguous();
      hidden = residual + one_matrix(layer.o, out, dtype);
      residual = hidden;
      x = rms_norm(layer.post_norm, layer.post_eps, hidden).reshape({1, -1}).to(at::kFloat);
      const std::vector<at::Tensor> gate_up = layer.gate_up(x);
      const at::Tensor gate = gate_up[0].to(dtype), up = gate_up[1].to(dtype);
      hidden = residual + one_matrix(layer.down, (at::silu(gate) * up).view({1, 1, -1}), dtype);
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
