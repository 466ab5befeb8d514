// Tree verification on the CPU from the step's logits, greedy and by speculative sampling: the walks of
// lookahead_kernels/verify_ref.py's verify_tree_greedy_reference and verify_tree_sample_reference, each reading the
// rows of x and of the nodes it accepts only.
//
// Greedy: the argmax of x's row (row_topk's scan, NaN the largest, the lower index first among equals: torch.argmax)
// is matched against the real children of the current node in order; the first match is accepted and its row's
// argmax is matched next; the bonus is the last argmax. Why: the torch reference (argmax of every row it visits,
// a few small ops a level, its checks of the tree) took 0.3 ms alone and 0.58 ms in a decoding step, about half of a
// CPU tree step's host work (session 40, SmolLM2, 2 cores).
//
// Sampling: point-mass drafts; the walk over the rows lookahead/sampling.py's warp_logits would give, each row
// warped only when the walk reaches it. Why: warping every row of a step with torch (x and each node: temperature,
// top-k, top-p over the vocabulary) took 0.7-1.1 ms of a sampled tree step for SmolLM2 on this project's 2-core
// CPU, and the walk reads x's row and the accepted nodes' rows only. Here a row is warped when the walk reaches it
// (csrc/sample_warped.cpp's WarpedRow, 0.1 ms for 49k tokens), with top-p as its few kept tokens. The rule is the
// reference's: the residual weights r start as x's warped row, S = sum(r) (float64); the real children c of the
// current node are tried in order, t = tokens[b, c] (r(t) = 0 outside the vocabulary), accepted iff uniforms[b,
// c] * S < r(t); a rejection subtracts r(t) from S and zeroes r(t); an acceptance makes r node c's warped row and
// S its sum. When no child is left to try (or max_accept nodes are accepted), the bonus is the inverse CDF of r
// at uniforms[b, V] * S. The weights are unnormalised (exp(x / temperature - max)) and sums run in token order:
// a decision can differ from the reference's only where u * S meets r(t) to the last bits.
//
// Ops (namespace lookahead_draft, CPU; lookahead_kernels/verify_cpu.py checks the inputs and calls them):
//   verify_tree_argmax(Tensor x_logits, Tensor node_logits, Tensor tokens, Tensor end, Tensor num_nodes,
//                      int max_accept) -> (Tensor accept_len, Tensor path, Tensor emitted)
//   verify_tree_warped(Tensor x_logits, Tensor node_logits, Tensor tokens, Tensor end, Tensor num_nodes,
//                      int max_accept, float temperature, int top_k, float top_p, float min_p,
//                      Tensor uniforms)
//       -> (Tensor accept_len, Tensor path, Tensor emitted)
//     x_logits float32 [B, vocab], node_logits float32 [B, V, vocab] (the last dimension contiguous, any strides
//     before it; a padding node's row is never read), tokens and end int64 [B, V], num_nodes int64 [B] in 0 .. V,
//     temperature > 0, top_k >= 0 (0: off), top_p in (0, 1], min_p in [0, 1] (0: off), uniforms float64
//     [B, V + 1]. Each row's end must encode a pre-ordered tree (i < end[i] <= V, subtrees nested): ValueError
//     otherwise, as num_nodes outside 0 .. V.
//     accept_len int64 [B]; path int64 [B, max_accept] and emitted int64 [B, max_accept + 1], -1 past the end.
//     Sampling: a row whose largest logit is not finite keeps no token: the walk rejects every child there and its
//     bonus is -1.

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

// ValueError naming `name` unless the inputs both walks take are as the ops' comment says, each row's end included.
void check_walk_inputs(const char* name, const at::Tensor& x_logits, const at::Tensor& node_logits,
                       const at::Tensor& tokens, const at::Tensor& end, const at::Tensor& num_nodes,
                       int64_t max_accept) {
  TORCH_CHECK_VALUE(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous(), name,
                    ": tokens must be a contiguous int64 [B, V] tensor");
  const int64_t B = tokens.size(0), V = tokens.size(1);
  TORCH_CHECK_VALUE(x_logits.dim() == 2 && x_logits.scalar_type() == at::kFloat && x_logits.size(0) == B &&
                        x_logits.size(1) >= 1 && x_logits.stride(1) == 1,
                    name, ": x_logits must be float32 [B, vocab] with vocab >= 1 and a contiguous last dimension");
  const int64_t vocab = x_logits.size(1);
  TORCH_CHECK_VALUE(node_logits.dim() == 3 && node_logits.scalar_type() == at::kFloat &&
                        node_logits.size(0) == B && node_logits.size(1) == V && node_logits.size(2) == vocab &&
                        node_logits.stride(2) == 1,
                    name, ": node_logits must be float32 [B, V, vocab] with a contiguous last dimension");
  TORCH_CHECK_VALUE(end.sizes() == tokens.sizes() && end.scalar_type() == at::kLong && end.is_contiguous(), name,
                    ": end must be a contiguous int64 [B, V] tensor");
  TORCH_CHECK_VALUE(num_nodes.dim() == 1 && num_nodes.size(0) == B && num_nodes.scalar_type() == at::kLong &&
                        num_nodes.is_contiguous(),
                    name, ": num_nodes must be a contiguous int64 [B] tensor");
  TORCH_CHECK_VALUE(max_accept >= 0, name, ": max_accept must be >= 0, got ", max_accept);
  TORCH_CHECK_VALUE(x_logits.device().is_cpu() && node_logits.device().is_cpu() && tokens.device().is_cpu() &&
                        end.device().is_cpu() && num_nodes.device().is_cpu(),
                    name, ": every tensor must be on the CPU");
  // Each row's tree: i < end[i] <= V, and every subtree inside its parent's (a stack of the open subtrees).
  const int64_t* en = end.data_ptr<int64_t>();
  const int64_t* nn = num_nodes.data_ptr<int64_t>();
  std::vector<int64_t> open;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(nn[b] >= 0 && nn[b] <= V, name, ": num_nodes[", b, "] must be in 0 .. V = ", V, ", got ",
                      nn[b]);
    const int64_t* eb = en + b * V;
    open.clear();
    for (int64_t i = 0; i < V; ++i) {
      TORCH_CHECK_VALUE(eb[i] > i && eb[i] <= V, name, ": tree end[", i, "] must satisfy ", i, " < end <= V = ", V,
                        ", got ", eb[i], " (row ", b, ")");
      while (!open.empty() && eb[open.back()] <= i) open.pop_back();
      TORCH_CHECK_VALUE(open.empty() || eb[i] <= eb[open.back()], name, ": tree end is not a pre-order nesting of "
                        "subtrees: node ", i, "'s ends at ", eb[i], " past its parent ", open.back(), "'s ",
                        eb[open.back()], " (row ", b, ")");
      open.push_back(i);
    }
  }
}

// A walk's outputs (accept_len [B], path [B, max_accept], emitted [B, max_accept + 1], -1 where unwritten) and its
// inputs' pointers and strides.
struct Walk {
  int64_t B, V, vocab;
  at::Tensor accept_len, path, emitted;
  const float *xl, *nl;
  const int64_t *tok, *en, *nn;
  int64_t *acc_out, *path_out, *emit_out;
  int64_t sx, sb, sv;  // x_logits' row stride, node_logits' batch and node strides

  Walk(const at::Tensor& x_logits, const at::Tensor& node_logits, const at::Tensor& tokens, const at::Tensor& end,
       const at::Tensor& num_nodes, int64_t max_accept)
      : B(tokens.size(0)), V(tokens.size(1)), vocab(x_logits.size(1)),
        accept_len(at::zeros({B}, at::kLong)),
        path(at::full({B, max_accept}, -1, at::TensorOptions().dtype(at::kLong))),
        emitted(at::full({B, max_accept + 1}, -1, at::TensorOptions().dtype(at::kLong))),
        xl(x_logits.data_ptr<float>()), nl(node_logits.data_ptr<float>()), tok(tokens.data_ptr<int64_t>()),
        en(end.data_ptr<int64_t>()), nn(num_nodes.data_ptr<int64_t>()), acc_out(accept_len.data_ptr<int64_t>()),
        path_out(path.data_ptr<int64_t>()), emit_out(emitted.data_ptr<int64_t>()), sx(x_logits.stride(0)),
        sb(node_logits.stride(0)), sv(node_logits.stride(1)) {}
};

// Row x's argmax as torch.argmax takes it: NaN the largest, the first index among equals.
inline int64_t argmax(const float* x, int64_t vocab) {
  float value;
  int64_t index;
  row_topk::top_row(x, vocab, 1, &value, &index);
  return index;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_argmax(const at::Tensor& x_logits,
                                                                  const at::Tensor& node_logits,
                                                                  const at::Tensor& tokens, const at::Tensor& end,
                                                                  const at::Tensor& num_nodes, int64_t max_accept) {
  check_walk_inputs("lookahead_draft.verify_tree_argmax", x_logits, node_logits, tokens, end, num_nodes,
                    max_accept);
  const Walk w(x_logits, node_logits, tokens, end, num_nodes, max_accept);
  at::parallel_for(0, w.B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n = w.nn[b], V = w.V;
      const int64_t* tb = w.tok + b * V;
      const int64_t* eb = w.en + b * V;
      int64_t y = argmax(w.xl + b * w.sx, w.vocab);
      int64_t c = 0, lim = n, acc = 0;  // the current node's next child to try and the end of its real children
      while (acc < max_accept && c < lim) {
        if (tb[c] == y) {
          w.path_out[b * max_accept + acc] = c;
          w.emit_out[b * (max_accept + 1) + acc] = y;
          ++acc;
          y = argmax(w.nl + b * w.sb + c * w.sv, w.vocab);
          lim = std::min(eb[c], n);
          c = c + 1;
        } else {
          c = eb[c];  // the next sibling
        }
      }
      w.emit_out[b * (max_accept + 1) + acc] = y;
      w.acc_out[b] = acc;
    }
  });
  return {w.accept_len, w.path, w.emitted};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_warped(const at::Tensor& x_logits,
                                                                  const at::Tensor& node_logits,
                                                                  const at::Tensor& tokens, const at::Tensor& end,
                                                                  const at::Tensor& num_nodes, int64_t max_accept,
                                                                  double temperature, int64_t top_k, double top_p,
                                                                  double min_p, const at::Tensor& uniforms) {
  const char* name = "lookahead_draft.verify_tree_warped";
  check_walk_inputs(name, x_logits, node_logits, tokens, end, num_nodes, max_accept);
  const int64_t B = tokens.size(0), V = tokens.size(1), vocab = x_logits.size(1);
  TORCH_CHECK_VALUE(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == V + 1 &&
                        uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.device().is_cpu(),
                    name, ": uniforms must be a contiguous float64 [B, V + 1] CPU tensor");
  sample_warped::WarpedRow::check(name, temperature, top_k, top_p, min_p);
  const Walk walk(x_logits, node_logits, tokens, end, num_nodes, max_accept);
  const float* xl = walk.xl;
  const float* nl = walk.nl;
  const int64_t *tok = walk.tok, *en = walk.en, *nn = walk.nn;
  const double* u = uniforms.data_ptr<double>();
  int64_t *acc_out = walk.acc_out, *path_out = walk.path_out, *emit_out = walk.emit_out;
  const int64_t sx = walk.sx, sb = walk.sb, sv = walk.sv;
  const float T = static_cast<float>(temperature);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    sample_warped::WarpedRow row(vocab);  // the current node's residual weights
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n = nn[b];
      const int64_t* tb = tok + b * V;
      const int64_t* eb = en + b * V;
      const double* ub = u + b * (V + 1);
      row.warp(xl + b * sx, T, top_k, top_p, min_p);
      double S = row.mass();
      int64_t c = 0, lim = n, acc = 0;
      while (acc < max_accept && c < lim) {
        const int64_t t = tb[c];
        float* w = row.weight(t);
        const double p = w ? static_cast<double>(*w) : 0.0;
        if (ub[c] * S < p) {
          path_out[b * max_accept + acc] = c;
          emit_out[b * (max_accept + 1) + acc] = t;
          ++acc;
          row.warp(nl + b * sb + c * sv, T, top_k, top_p, min_p);
          S = row.mass();
          lim = std::min(eb[c], n);
          c = c + 1;
        } else {
          S -= p;
          if (w) *w = 0.f;
          c = eb[c];  // the next sibling
        }
      }
      emit_out[b * (max_accept + 1) + acc] = row.draw(ub[V] * S);
      acc_out[b] = acc;
    }
  });
  return {walk.accept_len, walk.path, walk.emitted};
}

}  // namespace
}  // namespace verify_sample

TORCH_LIBRARY_FRAGMENT(lookahead_draft, m) {
  m.def("verify_tree_argmax(Tensor x_logits, Tensor node_logits, Tensor tokens, Tensor end, Tensor num_nodes, "
        "int max_accept) -> (Tensor, Tensor, Tensor)");
  m.def("verify_tree_warped(Tensor x_logits, Tensor node_logits, Tensor tokens, Tensor end, Tensor num_nodes, "
        "int max_accept, float temperature, int top_k, float top_p, float min_p, Tensor uniforms) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lookahead_draft, CPU, m) {
  m.impl("verify_tree_argmax", &verify_sample::verify_tree_argmax);
  m.impl("verify_tree_warped", &verify_sample::verify_tree_warped);
}
