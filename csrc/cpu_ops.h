// The CPU ops one C++ op calls from another within the library (each also registered with torch on its own).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace small_gemm {
// y [M, n] = x [M, K] @ W^T (+ bias), W packed by lookahead_gemm::pack; csrc/small_gemm.cpp.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias);
// "avx512", "avx2" or "scalar": the instruction set the CPU ops run (the CPU's best, or what a test forced).
std::string current_isa();
}  // namespace small_gemm

namespace cpu_attention {
// q [B, T, Hq, D] over k_cache / v_cache [B, S, Hkv, D]; csrc/cpu_attention.cpp.
at::Tensor step_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& cache_len, const at::Tensor& visible, double scale);
}  // namespace cpu_attention

namespace row_topk {
// Row x[0 .. V)'s k largest entries (k <= V) into vals / idx, largest first, NaN the largest, ties by index;
// csrc/row_topk.cpp.
void top_row(const float* x, int64_t V, int64_t k, float* vals, int64_t* idx);
}  // namespace row_topk

namespace verify_sample {
// The smallest i with target < cdf[i] over row[0 .. vocab) (float64 sums in index order), the entries listed in
// `zeroed` counted as 0; past the end, the last index of positive weight; -1 if none. csrc/verify_sample.cpp.
int64_t inverse_cdf(const float* row, int64_t vocab, double target, const std::vector<int64_t>& zeroed);
}  // namespace verify_sample
