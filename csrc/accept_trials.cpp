// A verified step's acceptance trials for every row of a batch in one call: what lookahead/draft.py's
// AcceptanceStats.record_code does node by node (its Python reference, lookahead.draft.record_trials_reference).
//
// Why: each row's tested nodes went through a Python loop of a few attribute reads and a rate update per code, 20
// us a one-row tree step and 40-60 us a 16-row one in the decoding loop (the H200's steps replayed on this project's
// CPU, session 64), where the step's forward replays in about 1.3 ms on the H200 and its host work is what decides.
//
// Op (namespace lookahead_draft, CPU):
//   record_trials(Tensor(a!)[] trials, Tensor(b!)[] rates, Tensor priors, float prior_weight, Tensor codes,
//                 Tensor code_offsets, Tensor parents, Tensor order, int[] firsts, int[] starts, int[] keep,
//                 int[] path_counts, int[] paths) -> ()
//     n = len(trials) rows. Row i's tree holds keep[i] real nodes; their pre-order parents (-1 under x) are
//     parents[firsts[i] : firsts[i] + keep[i]] and their best-first indexes the same entries of order (int64 [K]
//     each: lookahead_draft.encode's and encode_step's parents and order, a batch's rows one after another), node
//     j of the best-first list that starts at starts[i] having acceptance codes codes[code_offsets[starts[i] + j]
//     : code_offsets[starts[i] + j + 1]] (int64 [M] and [N + 1], as lookahead_draft.propose returns them). Its
//     accepted nodes are the next path_counts[i] entries of paths (pre-order indexes, root first). A node was
//     tested iff it hangs from x or its parent was accepted; each tested node's every code c counts a trial in
//     trials[i] (int64 [2, C]: tested, accepted) and sets rates[i][c] (float64 [C]) to (accepted + prior_weight *
//     priors[c]) / (tested + prior_weight), the Python reference's arithmetic in the same order.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "host_ops.h"

namespace accept_trials {
namespace {

void check_vector(const char* what, const at::Tensor& t, at::ScalarType type) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.is_contiguous(),
                    "lookahead_draft.record_trials: ", what, " must be a contiguous 1-D CPU ", type,
                    " tensor, got ", t.sizes(), " ", t.scalar_type(), " on ", t.device());
}

}  // namespace

void record_trials(at::TensorList trials, at::TensorList rates, const at::Tensor& priors, double prior_weight,
                   const at::Tensor& codes, const at::Tensor& code_offsets, const at::Tensor& parents,
                   const at::Tensor& order, at::IntArrayRef firsts, at::IntArrayRef starts, at::IntArrayRef keep,
                   at::IntArrayRef path_counts, at::IntArrayRef paths) {
  const char* name = "lookahead_draft.record_trials";
  const int64_t n = static_cast<int64_t>(trials.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(rates.size()) == n && static_cast<int64_t>(firsts.size()) == n &&
                        static_cast<int64_t>(starts.size()) == n && static_cast<int64_t>(keep.size()) == n &&
                        static_cast<int64_t>(path_counts.size()) == n,
                    name, ": one trials, rates, first, start, keep and path count per row, got ", trials.size(),
                    ", ", rates.size(), ", ", firsts.size(), ", ", starts.size(), ", ", keep.size(), " and ",
                    path_counts.size());
  check_vector("priors", priors, at::kDouble);
  check_vector("codes", codes, at::kLong);
  check_vector("code_offsets", code_offsets, at::kLong);
  check_vector("parents", parents, at::kLong);
  check_vector("order", order, at::kLong);
  const int64_t C = priors.size(0), N = code_offsets.size(0) - 1, M = codes.size(0), K = parents.size(0);
  TORCH_CHECK_VALUE(N >= 0 && parents.size(0) == order.size(0), name, ": code_offsets must hold N + 1 entries and "
                    "parents and order one entry per real node each, got ", code_offsets.size(0), ", ",
                    parents.size(0), " and ", order.size(0));
  int64_t listed = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor &t = trials[i], &r = rates[i];
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 2 && t.size(0) == 2 &&
                          t.size(1) == C && t.is_contiguous(),
                      name, ": trials[", i, "] must be a contiguous CPU int64 [2, ", C, "] tensor, got ", t.sizes(),
                      " ", t.scalar_type());
    check_vector("each rates tensor", r, at::kDouble);
    TORCH_CHECK_VALUE(r.size(0) == C, name, ": rates[", i, "] must hold ", C, " entries, got ", r.size(0));
    TORCH_CHECK_VALUE(keep[i] >= 0 && starts[i] >= 0 && starts[i] + keep[i] <= N && firsts[i] >= 0 &&
                          firsts[i] + keep[i] <= K && path_counts[i] >= 0,
                      name, ": row ", i, " needs keep >= 0, 0 <= start <= N - keep (N = ", N,
                      "), 0 <= first <= K - keep (K = ", K, ") and a path count >= 0, got keep ", keep[i],
                      ", start ", starts[i], ", first ", firsts[i], ", path count ", path_counts[i]);
    listed += path_counts[i];
  }
  TORCH_CHECK_VALUE(listed == static_cast<int64_t>(paths.size()), name, ": path_counts sum to ", listed,
                    " but paths holds ", paths.size());
  const double* prior = priors.data_ptr<double>();
  const int64_t* code = codes.data_ptr<int64_t>();
  const int64_t* offset = code_offsets.data_ptr<int64_t>();
  const int64_t* path = paths.data();
  // Everything checked before anything is written: a refused call leaves every row's statistics as they were.
  for (int64_t i = 0, listed_at = 0; i < n; listed_at += path_counts[i], ++i) {
    const int64_t* par = parents.data_ptr<int64_t>() + firsts[i];
    const int64_t* ord = order.data_ptr<int64_t>() + firsts[i];
    for (int64_t m = listed_at; m < listed_at + path_counts[i]; ++m)
      TORCH_CHECK_VALUE(0 <= path[m] && path[m] < keep[i], name, ": row ", i, "'s path holds node ", path[m],
                        " outside its ", keep[i], " real nodes");
    for (int64_t j = 0; j < keep[i]; ++j) {
      TORCH_CHECK_VALUE(-1 <= par[j] && par[j] < j, name, ": row ", i, "'s node ", j, " has parent ",
                        par[j], " (pre-order: -1 or an earlier node)");
      TORCH_CHECK_VALUE(0 <= ord[j] && ord[j] < keep[i], name, ": row ", i, "'s node ", j,
                        " has best-first index ", ord[j], " outside [0, ", keep[i], ")");
      const int64_t node = starts[i] + ord[j];
      TORCH_CHECK_VALUE(0 <= offset[node] && offset[node] <= offset[node + 1] && offset[node + 1] <= M, name,
                        ": code_offsets must rise within [0, ", M, "], not at node ", node);
      for (int64_t c = offset[node]; c < offset[node + 1]; ++c)
        TORCH_CHECK_VALUE(0 <= code[c] && code[c] < C, name, ": code ", code[c], " outside [0, ", C, ")");
    }
  }
  std::vector<char> accepted;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = keep[i];
    accepted.assign(k, 0);
    for (int64_t m = 0; m < path_counts[i]; ++m) accepted[path[m]] = 1;
    int64_t* tested = trials[i].data_ptr<int64_t>();
    int64_t* hits = tested + C;
    double* rate = rates[i].data_ptr<double>();
    const int64_t* par = parents.data_ptr<int64_t>() + firsts[i];
    const int64_t* ord = order.data_ptr<int64_t>() + firsts[i];
    for (int64_t j = 0; j < k; ++j) {
      if (par[j] >= 0 && !accepted[par[j]]) continue;  // its parent was rejected: never tested
      const int64_t node = starts[i] + ord[j];
      const int64_t hit = accepted[j];
      for (int64_t at = offset[node]; at < offset[node + 1]; ++at) {
        const int64_t c = code[at];
        tested[c] += 1;
        hits[c] += hit;
        rate[c] = (static_cast<double>(hits[c]) + prior_weight * prior[c]) /
                  (static_cast<double>(tested[c]) + prior_weight);
      }
    }
    path += path_counts[i];
  }
}

}  // namespace accept_trials

TORCH_LIBRARY_FRAGMENT(lookahead_draft, m) {
  m.def("record_trials(Tensor(a!)[] trials, Tensor(b!)[] rates, Tensor priors, float prior_weight, Tensor codes, "
        "Tensor code_offsets, Tensor parents, Tensor order, int[] firsts, int[] starts, int[] keep, "
        "int[] path_counts, int[] paths) -> ()");
}

TORCH_LIBRARY_IMPL(lookahead_draft, CPU, m) { m.impl("record_trials", &accept_trials::record_trials); }
