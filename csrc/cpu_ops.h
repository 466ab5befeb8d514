// The CPU ops one C++ op calls from another within the library (each also registered with torch on its own).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
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

namespace sample_warped {
// One row of the distribution lookahead/sampling.py's warp_logits makes of logits (temperature > 0, top-k with its
// ties, top-p, min-p), unnormalised: each kept token weighted exp(x / temperature - max) in float32. With top-p or
// min-p the row is its kept tokens; without, the weights over the whole vocabulary. csrc/sample_warped.cpp.
class WarpedRow {
 public:
  // ValueError naming `op` unless temperature > 0 (finite), top_k >= 0 (0: off), top_p in (0, 1] and min_p in
  // [0, 1] (0: off).
  static void check(const char* op, double temperature, int64_t top_k, double top_p, double min_p);
  explicit WarpedRow(int64_t V);
  // The row of the logits x[0 .. V); nothing kept if its largest tempered logit is not finite.
  void warp(const float* x, float temperature, int64_t top_k, double top_p, double min_p);
  // Token t's weight, writable (a rejection zeroes it); nullptr where t has none or is outside the vocabulary.
  float* weight(int64_t t);
  // The weights' float64 sum as warped (not updated by writes through weight()).
  double mass() const { return mass_; }
  // The first token with target < its cdf (float64 sums in token order); past the end, the last of positive
  // weight; -1 if none.
  int64_t draw(double target) const;

 private:
  int64_t V_;
  std::unique_ptr<float[]> s_, e_;  // scratch: tempered logits, weights
  std::vector<std::pair<int64_t, float>> kept_;  // with top-p: (token, weight) in token order
  bool dense_ = false;  // without top-p: the weights are e_
  double mass_ = 0.0;
};
}  // namespace sample_warped
