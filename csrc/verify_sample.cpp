// Speculative sampling on a token tree with point-mass drafts, on the CPU: the walk of
// lookahead_kernels/verify_ref.py's verify_tree_sample_reference, row by row in C++.
//
// Why: the reference is a loop of torch ops over the batch (each accepted node copies its row of the vocabulary to
// float64 and sums it); on this project's 2-core CPU it took 1.3 ms of a sampled tree step for SmolLM2, which a
// walk that reads the rows in place does in a tenth of that. The rule is the reference's: the residual weights r
// start as x's row, S = sum(r) (float64); the real children c of the current node are tried in order, t =
// tokens[b, c] (r(t) = 0 outside the vocabulary), accepted iff uniforms[b, c] * S < r(t); a rejection subtracts r(t)
// from S and zeroes r(t); an acceptance makes r node c's row and S its sum. When no child is left to try (or
// max_accept nodes are accepted), the bonus is the inverse CDF of r at uniforms[b, V] * S. Sums here run in index
// order (torch's reductions in another order): a decision can differ only where u * S meets r(t) to the last bits.
//
// Op (namespace lookahead_draft, CPU; lookahead_kernels/verify_cpu.py checks the inputs and calls it):
//   verify_tree_sample(Tensor x_probs, Tensor node_probs, Tensor tokens, Tensor end, Tensor num_nodes,
//                      int max_accept, Tensor uniforms) -> (Tensor accept_len, Tensor path, Tensor emitted)
//     x_probs float32 [B, vocab], node_probs float32 [B, V, vocab] (the last dimension contiguous, any strides
//     before it), tokens and end int64 [B, V], num_nodes int64 [B] in 0 .. V, uniforms float64 [B, V + 1].
//     accept_len int64 [B]; path int64 [B, max_accept] and emitted int64 [B, max_accept + 1], -1 past the end.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_ops.h"

namespace verify_sample {
namespace {

// The row's weight at i: zero where a rejection zeroed it.
inline double weight(const float* row, const std::vector<int64_t>& zeroed, int64_t i) {
  for (int64_t z : zeroed)
    if (z == i) return 0.0;
  return static_cast<double>(row[i]);
}

double row_sum(const float* row, int64_t vocab) {
  double s = 0.0;
  for (int64_t i = 0; i < vocab; ++i) s += static_cast<double>(row[i]);
  return s;
}

}  // namespace

int64_t inverse_cdf(const float* row, int64_t vocab, double target, const std::vector<int64_t>& zeroed) {
  double cdf = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < vocab; ++i) {
    const double w = zeroed.empty() ? static_cast<double>(row[i]) : weight(row, zeroed, i);
    cdf += w;
    if (w > 0) last = i;
    if (target < cdf) return i;
  }
  return last;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_sample(const at::Tensor& x_probs,
                                                                  const at::Tensor& node_probs,
                                                                  const at::Tensor& tokens, const at::Tensor& end,
                                                                  const at::Tensor& num_nodes, int64_t max_accept,
                                                                  const at::Tensor& uniforms) {
  const char* name = "lookahead_draft.verify_tree_sample";
  TORCH_CHECK_VALUE(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous(), name,
                    ": tokens must be a contiguous int64 [B, V] tensor");
  const int64_t B = tokens.size(0), V = tokens.size(1);
  TORCH_CHECK_VALUE(x_probs.dim() == 2 && x_probs.scalar_type() == at::kFloat && x_probs.size(0) == B &&
                        x_probs.stride(1) == 1,
                    name, ": x_probs must be float32 [B, vocab] with a contiguous last dimension");
  const int64_t vocab = x_probs.size(1);
  TORCH_CHECK_VALUE(node_probs.dim() == 3 && node_probs.scalar_type() == at::kFloat && node_probs.size(0) == B &&
                        node_probs.size(1) == V && node_probs.size(2) == vocab && node_probs.stride(2) == 1,
                    name, ": node_probs must be float32 [B, V, vocab] with a contiguous last dimension");
  TORCH_CHECK_VALUE(end.sizes() == tokens.sizes() && end.scalar_type() == at::kLong && end.is_contiguous(), name,
                    ": end must be a contiguous int64 [B, V] tensor");
  TORCH_CHECK_VALUE(num_nodes.dim() == 1 && num_nodes.size(0) == B && num_nodes.scalar_type() == at::kLong, name,
                    ": num_nodes must be int64 [B]");
  TORCH_CHECK_VALUE(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == V + 1 &&
                        uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous(),
                    name, ": uniforms must be a contiguous float64 [B, V + 1] tensor");
  TORCH_CHECK_VALUE(max_accept >= 0, name, ": max_accept must be >= 0, got ", max_accept);
  TORCH_CHECK_VALUE(x_probs.device().is_cpu() && node_probs.device().is_cpu() && tokens.device().is_cpu() &&
                        end.device().is_cpu() && num_nodes.device().is_cpu() && uniforms.device().is_cpu(),
                    name, ": every tensor must be on the CPU");
  const auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor accept_len = at::zeros({B}, opts);
  at::Tensor path = at::full({B, max_accept}, -1, opts);
  at::Tensor emitted = at::full({B, max_accept + 1}, -1, opts);
  const float* xp = x_probs.data_ptr<float>();
  const float* np = node_probs.data_ptr<float>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* en = end.data_ptr<int64_t>();
  const int64_t* nn = num_nodes.data_ptr<int64_t>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* acc_out = accept_len.data_ptr<int64_t>();
  int64_t* path_out = path.data_ptr<int64_t>();
  int64_t* emit_out = emitted.data_ptr<int64_t>();
  const int64_t sx = x_probs.stride(0), sb = node_probs.stride(0), sv = node_probs.stride(1);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> zeroed;  // tokens rejected at the current node
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n = std::clamp<int64_t>(nn[b], 0, V);
      const int64_t* tb = tok + b * V;
      const int64_t* eb = en + b * V;
      const double* ub = u + b * (V + 1);
      const float* row = xp + b * sx;
      zeroed.clear();
      double S = row_sum(row, vocab);
      int64_t c = 0, lim = n, acc = 0;
      while (acc < max_accept && c < lim) {
        const int64_t t = tb[c];
        const bool in_vocab = t >= 0 && t < vocab;
        const double p = in_vocab ? weight(row, zeroed, t) : 0.0;
        if (ub[c] * S < p) {
          path_out[b * max_accept + acc] = c;
          emit_out[b * (max_accept + 1) + acc] = t;
          ++acc;
          row = np + b * sb + c * sv;
          zeroed.clear();
          S = row_sum(row, vocab);
          lim = std::min(eb[c], n);
          c = c + 1;
        } else {
          S -= p;
          if (in_vocab) zeroed.push_back(t);
          c = std::max(eb[c], c + 1);  // the next sibling; max() keeps a malformed end from looping
        }
      }
      emit_out[b * (max_accept + 1) + acc] = inverse_cdf(row, vocab, ub[V] * S, zeroed);
      acc_out[b] = acc;
    }
  });
  return {accept_len, path, emitted};
}

}  // namespace
}  // namespace verify_sample

TORCH_LIBRARY_FRAGMENT(lookahead_draft, m) {
  m.def("verify_tree_sample(Tensor x_probs, Tensor node_probs, Tensor tokens, Tensor end, Tensor num_nodes, "
        "int max_accept, Tensor uniforms) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lookahead_draft, CPU, m) { m.impl("verify_tree_sample", &verify_sample::verify_tree_sample); }
