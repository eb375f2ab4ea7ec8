// What gemv_gguf.cpp offers the other sources built with it (decode_layers.cpp).
#pragma once
#include <torch/extension.h>

#include <vector>

namespace marginalia {

// x [rows <= 4, K] fp32 times several gguf-q8 matrices that take it (4-bit packs with fp16 scales and lows, or int8
// values with fp16 scales and an empty low): x rounded to int8 blocks once -> [rows, N_i] fp32 each.
std::vector<torch::Tensor> gemv_q8_many(torch::Tensor x, std::vector<torch::Tensor> weights,
                                        std::vector<torch::Tensor> scales, std::vector<torch::Tensor> lows);

}  // namespace marginalia
