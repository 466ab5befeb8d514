// The draft builder's host work in C++: one step's candidate trie grown best-first, and its pre-order encoding.
//
// Why: in Python the best-first walk (a node object per candidate, a heap, a dict per node) cost 3-6 ms a step
// at 255 nodes on an H100 host, where the model's whole step replays in 2-4 ms (bench/results/gpu-h100.md); the
// same walk here costs a few microseconds per node. The Python builder in lookahead/draft.py is the reference:
// both take the same inputs, make the same choices in the same order (ties: first proposed first) and compute the
// same double-precision scores, and tests/test_draft_native.py checks that they agree exactly.
//
// Acceptance keys are small integer codes (lookahead/draft.py documents them): pool depth d -> min(d, 63);
// suffix depth d -> 64 + min(d, 8); a successor of probability bucket b at depth d -> 73 + 4 b + min(d, 4) - 1.
//
// Ops (namespace lookahead_draft, CPU):
//   propose(int root, Tensor suffix, Tensor pool, Tensor rates, Tensor succ_ids, Tensor succ_probs,
//           Tensor succ_count, int budget) -> (Tensor tokens, Tensor parents, Tensor scores, Tensor codes,
//           Tensor code_offsets)
//     suffix int64 [Cs, Ls] and pool int64 [Cp, Lp]: candidate continuations of root, each row read until its
//     first negative entry (suffix rows first, in order); rates float64 [kCodes]: conditional acceptance per code;
//     succ_ids int32 [V, k], succ_probs float32 [V, k], succ_count int32 [V]: each token's recorded successors,
//     most likely first (succ_count empty: no successor source). Returns up to `budget` nodes best first (each
//     after its parent): token int64 [n], parent int64 [n] (an index into this list, -1 under root), score
//     float64 [n] (the chance the verifier reaches the node), and each node's acceptance codes in the order they
//     were proposed, flattened: codes int64 [m], code_offsets int64 [n + 1].
//   encode(Tensor parents, Tensor tokens, int keep, int size) -> (Tensor tokens, Tensor depth, Tensor end,
//          Tensor parents, Tensor order)
//     The first `keep` nodes of a best-first list (parents as propose returns them) in depth-first pre-order,
//     children best first, padded with leaves (token 0) to `size` nodes: token / depth / end int64 [size] (the
//     tree encoding of shared/design/draft-tree.md), parent int64 [keep] in pre-order numbering (-1 under x),
//     order int64 [keep]: the best-first index of each pre-order node.
//   record_successors(Tensor(a!)[] succ_ids, Tensor(b!)[] succ_probs, Tensor(c!)[] succ_count, Tensor tokens,
//                     Tensor top_ids, Tensor top_probs, int[] computed, int[] last_count, int[] last) -> ()
//     One step's successor tops into n tables at once (one call a step, not one a row: each call from Python
//     costs microseconds). Table i (int32 ids [V, k], float32 probs [V, k], int32 counts [V]) takes rows
//     0 .. computed[i] - 1 of tokens int64 [n, R], top_ids int64 [n, R', j] and top_probs float32 [n, R', j]
//     (j <= k), in order; then every table takes again its last_count[i] rows listed next in last, in order.
//     Row r makes top_ids[i, r] the successors of tokens[i, r] and a later row for the same token wins, so the
//     rows that saw the true context (x and the accepted path) are listed (and a table may serve several rows).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <queue>
#include <tuple>
#include <vector>

namespace draft_tree {
namespace {

constexpr int64_t kCodes = 121;
constexpr int64_t kMaxPoolDepthCode = 63;
constexpr int64_t kSuffixBase = 64;
constexpr int64_t kMaxSuffixDepth = 8;
constexpr int64_t kSuccessorBase = 73;
constexpr int64_t kMaxSuccessorDepth = 4;
// Upper bounds of the successor probability buckets (lookahead/draft.py's _PROB_BUCKETS).
constexpr double kBuckets[] = {0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01};
constexpr int64_t kNumBuckets = sizeof(kBuckets) / sizeof(kBuckets[0]);

int64_t bucket_of(double p) {  // Python's bisect_right(_PROB_BUCKETS, p), clamped to the last bucket
  int64_t b = 0;
  while (b < kNumBuckets && !(p < kBuckets[b])) ++b;
  return b < kNumBuckets ? b : kNumBuckets - 1;
}

struct Node {
  int64_t token;
  int32_t parent;
  int32_t depth;
  double cond = 0.0;
  double score = 0.0;
  std::vector<int32_t> children;  // in the order they were first proposed
  std::vector<int16_t> codes;     // every proposal's code, in order (repeats kept: each counts as a trial)
};

class Trie {
 public:
  Trie(int64_t root_token, const double* rates) : rates_(rates) { nodes_.push_back(Node{root_token, -1, 0}); }

  int32_t child(int32_t parent, int64_t token) {
    for (int32_t c : nodes_[parent].children)
      if (nodes_[c].token == token) return c;
    const int32_t c = static_cast<int32_t>(nodes_.size());
    nodes_.push_back(Node{token, parent, nodes_[parent].depth + 1});
    nodes_[parent].children.push_back(c);
    return c;
  }

  void propose(int32_t node, int64_t code) {
    Node& n = nodes_[node];
    n.codes.push_back(static_cast<int16_t>(code));
    const double r = rates_[code];
    if (r > n.cond) n.cond = r;
  }

  void add_rows(const at::Tensor& rows, bool suffix) {
    if (rows.numel() == 0) return;
    const auto acc = rows.accessor<int64_t, 2>();
    for (int64_t c = 0; c < rows.size(0); ++c) {
      int32_t node = 0;
      for (int64_t d = 1; d <= rows.size(1); ++d) {
        const int64_t t = acc[c][d - 1];
        if (t < 0) break;
        node = child(node, t);
        propose(node, suffix ? kSuffixBase + std::min(d, kMaxSuffixDepth) : std::min(d, kMaxPoolDepthCode));
      }
    }
  }

  std::vector<Node> nodes_;

 private:
  const double* rates_;
};

void check_2d_long(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 2 && t.is_contiguous(),
              "lookahead_draft.propose: ", name, " must be a contiguous int64 CPU tensor [C, L], got ", t.sizes(),
              " ", t.scalar_type(), " on ", t.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> propose(
    int64_t root, const at::Tensor& suffix, const at::Tensor& pool, const at::Tensor& rates,
    const at::Tensor& succ_ids, const at::Tensor& succ_probs, const at::Tensor& succ_count, int64_t budget) {
  check_2d_long(suffix, "suffix");
  check_2d_long(pool, "pool");
  TORCH_CHECK(rates.device().is_cpu() && rates.scalar_type() == at::kDouble && rates.numel() == kCodes &&
                  rates.is_contiguous(),
              "lookahead_draft.propose: rates must be a contiguous float64 CPU tensor [", kCodes, "]");
  TORCH_CHECK(budget >= 0, "lookahead_draft.propose: budget must be >= 0, got ", budget);
  const bool successors = succ_count.numel() > 0;
  int64_t vocab = 0, k = 0;
  if (successors) {
    TORCH_CHECK(succ_ids.scalar_type() == at::kInt && succ_probs.scalar_type() == at::kFloat &&
                    succ_count.scalar_type() == at::kInt && succ_ids.dim() == 2 &&
                    succ_ids.sizes() == succ_probs.sizes() && succ_count.dim() == 1 &&
                    succ_count.size(0) == succ_ids.size(0) && succ_ids.is_contiguous() &&
                    succ_probs.is_contiguous() && succ_count.is_contiguous() && succ_ids.device().is_cpu() &&
                    succ_probs.device().is_cpu() && succ_count.device().is_cpu(),
                "lookahead_draft.propose: the successor table must be int32 ids [V, k], float32 probs [V, k] and "
                "int32 counts [V], contiguous, on the CPU");
    vocab = succ_ids.size(0);
    k = succ_ids.size(1);
  }
  const double* rate = rates.data_ptr<double>();
  Trie trie(root, rate);
  trie.add_rows(suffix, true);
  trie.add_rows(pool, false);

  const int32_t* sids = successors ? succ_ids.data_ptr<int32_t>() : nullptr;
  const float* sprobs = successors ? succ_probs.data_ptr<float>() : nullptr;
  const int32_t* scount = successors ? succ_count.data_ptr<int32_t>() : nullptr;
  auto expand = [&](int32_t node) {
    if (!successors) return;
    const int64_t token = trie.nodes_[node].token;
    if (token < 0 || token >= vocab) return;
    const int64_t depth = std::min<int64_t>(trie.nodes_[node].depth + 1, kMaxSuccessorDepth);
    const int64_t n = std::min<int64_t>(scount[token], k);
    for (int64_t j = 0; j < n; ++j) {
      const double p = static_cast<double>(sprobs[token * k + j]);
      const int64_t code = kSuccessorBase + 4 * bucket_of(p) + depth - 1;
      trie.propose(trie.child(node, sids[token * k + j]), code);
    }
  };

  // Max-heap on score; equal scores pop in the order they were pushed (a counter), as Python's heapq on
  // (-score, counter) does.
  using Entry = std::tuple<double, int64_t, int32_t>;
  auto worse = [](const Entry& a, const Entry& b) {
    if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) < std::get<0>(b);
    return std::get<1>(a) > std::get<1>(b);
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(worse)> heap(worse);
  std::vector<int32_t> chosen;
  std::vector<int32_t> list_index;  // trie node -> index in `chosen` (-1: not chosen)
  int64_t counter = 0;
  int32_t node = 0;
  trie.nodes_[0].score = 1.0;
  while (true) {
    if (node != 0) {
      chosen.push_back(node);
      if (static_cast<int64_t>(chosen.size()) >= budget) break;
    }
    expand(node);
    const double s = trie.nodes_[node].score;
    for (int32_t c : trie.nodes_[node].children) {
      trie.nodes_[c].score = s * trie.nodes_[c].cond;
      heap.emplace(trie.nodes_[c].score, counter++, c);
    }
    if (heap.empty() || budget == 0) break;
    node = std::get<2>(heap.top());
    heap.pop();
  }

  const int64_t n = static_cast<int64_t>(chosen.size());
  list_index.assign(trie.nodes_.size(), -1);
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    list_index[chosen[i]] = static_cast<int32_t>(i);
    m += static_cast<int64_t>(trie.nodes_[chosen[i]].codes.size());
  }
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor tokens = at::empty({n}, opts), parents = at::empty({n}, opts), offsets = at::empty({n + 1}, opts);
  at::Tensor scores = at::empty({n}, at::TensorOptions().dtype(at::kDouble)), codes = at::empty({m}, opts);
  int64_t *tok = tokens.data_ptr<int64_t>(), *par = parents.data_ptr<int64_t>(), *off = offsets.data_ptr<int64_t>();
  int64_t* cod = codes.data_ptr<int64_t>();
  double* sc = scores.data_ptr<double>();
  off[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Node& nd = trie.nodes_[chosen[i]];
    tok[i] = nd.token;
    par[i] = nd.parent == 0 ? -1 : list_index[nd.parent];  // a parent is always chosen before its children
    sc[i] = nd.score;
    int64_t o = off[i];
    for (int16_t c : nd.codes) cod[o++] = c;
    off[i + 1] = o;
  }
  return {tokens, parents, scores, codes, offsets};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> encode(const at::Tensor& parents,
                                                                               const at::Tensor& tokens,
                                                                               int64_t keep, int64_t size) {
  TORCH_CHECK(parents.device().is_cpu() && tokens.device().is_cpu() && parents.scalar_type() == at::kLong &&
                  tokens.scalar_type() == at::kLong && parents.dim() == 1 && tokens.dim() == 1 &&
                  parents.size(0) == tokens.size(0) && parents.is_contiguous() && tokens.is_contiguous(),
              "lookahead_draft.encode: parents and tokens must be contiguous int64 CPU tensors [n] of one length");
  TORCH_CHECK(0 <= keep && keep <= parents.size(0) && keep <= size,
              "lookahead_draft.encode: need 0 <= keep <= n and keep <= size, got keep ", keep, ", n ",
              parents.size(0), ", size ", size);
  const int64_t* par = parents.data_ptr<int64_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  // Children lists in best-first order (the list's order), then an iterative depth-first walk.
  std::vector<std::vector<int64_t>> kids(keep);
  std::vector<int64_t> roots;
  for (int64_t i = 0; i < keep; ++i) {
    const int64_t p = par[i];
    TORCH_CHECK(-1 <= p && p < i, "lookahead_draft.encode: the parent of node ", i, " must be -1 or an earlier "
                "node, got ", p);
    (p < 0 ? roots : kids[p]).push_back(i);
  }
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor out_tok = at::zeros({size}, opts), depth = at::empty({size}, opts), end = at::empty({size}, opts);
  at::Tensor out_par = at::empty({keep}, opts), order = at::empty({keep}, opts);
  int64_t *ot = out_tok.data_ptr<int64_t>(), *dp = depth.data_ptr<int64_t>(), *en = end.data_ptr<int64_t>();
  int64_t *op = out_par.data_ptr<int64_t>(), *od = order.data_ptr<int64_t>();
  std::vector<int64_t> pre(keep, -1);  // best-first index -> pre-order index
  std::vector<int64_t> stack(roots.rbegin(), roots.rend());
  int64_t next = 0;
  while (!stack.empty()) {
    const int64_t i = stack.back();
    stack.pop_back();
    const int64_t j = next++;
    pre[i] = j;
    od[j] = i;
    ot[j] = tok[i];
    op[j] = par[i] < 0 ? -1 : pre[par[i]];
    dp[j] = par[i] < 0 ? 1 : dp[pre[par[i]]] + 1;
    en[j] = j + 1;
    for (auto it = kids[i].rbegin(); it != kids[i].rend(); ++it) stack.push_back(*it);
  }
  for (int64_t j = keep - 1; j >= 0; --j)  // children follow parents: fold subtree ends upwards
    if (op[j] >= 0 && en[j] > en[op[j]]) en[op[j]] = en[j];
  for (int64_t j = keep; j < size; ++j) {  // padding: leaves under x
    dp[j] = 1;
    en[j] = j + 1;
  }
  return {out_tok, depth, end, out_par, order};
}

void record_successors(at::TensorList succ_ids, at::TensorList succ_probs, at::TensorList succ_count,
                       const at::Tensor& tokens, const at::Tensor& top_ids, const at::Tensor& top_probs,
                       at::IntArrayRef computed, at::IntArrayRef last_count, at::IntArrayRef last) {
  const int64_t n = static_cast<int64_t>(succ_ids.size());
  TORCH_CHECK(static_cast<int64_t>(succ_probs.size()) == n && static_cast<int64_t>(succ_count.size()) == n,
              "lookahead_draft.record_successors: one ids, probs and counts tensor per table");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 2 && tokens.size(0) == n &&
                  top_ids.scalar_type() == at::kLong && top_probs.scalar_type() == at::kFloat &&
                  top_ids.dim() == 3 && top_ids.sizes() == top_probs.sizes() && top_ids.size(0) == n &&
                  top_ids.size(1) <= tokens.size(1),
              "lookahead_draft.record_successors: tokens int64 [n, R], top_ids int64 [n, R', j] and top_probs "
              "float32 [n, R', j] with R' <= R, one row per table");
  TORCH_CHECK(static_cast<int64_t>(computed.size()) == n && static_cast<int64_t>(last_count.size()) == n,
              "lookahead_draft.record_successors: one computed and one last_count per table");
  const at::Tensor tk = tokens.contiguous(), ti = top_ids.contiguous(), tp = top_probs.contiguous();
  const int64_t R = tk.size(1), Rt = ti.size(1), j = ti.size(2);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor &ids_t = succ_ids[i], &probs_t = succ_probs[i], &count_t = succ_count[i];
    TORCH_CHECK(ids_t.scalar_type() == at::kInt && probs_t.scalar_type() == at::kFloat &&
                    count_t.scalar_type() == at::kInt && ids_t.dim() == 2 && ids_t.sizes() == probs_t.sizes() &&
                    count_t.dim() == 1 && count_t.size(0) == ids_t.size(0) && ids_t.is_contiguous() &&
                    probs_t.is_contiguous() && count_t.is_contiguous() && j <= ids_t.size(1),
                "lookahead_draft.record_successors: table ", i, " must be int32 ids [V, k], float32 probs [V, k] "
                "and int32 counts [V], contiguous, with k >= ", j);
    TORCH_CHECK(0 <= computed[i] && computed[i] <= Rt && last_count[i] >= 0,
                "lookahead_draft.record_successors: computed[", i, "] = ", computed[i], " outside [0, ", Rt, "]");
  }
  int64_t listed = 0;
  for (int64_t i = 0; i < n; ++i) listed += last_count[i];
  TORCH_CHECK(listed == static_cast<int64_t>(last.size()),
              "lookahead_draft.record_successors: last_count sums to ", listed, " but last has ", last.size());
  auto record = [&](int64_t i, int64_t r) {  // row r of table i
    TORCH_CHECK(0 <= r && r < Rt, "lookahead_draft.record_successors: row ", r, " outside the ", Rt,
                " rows of top_ids");
    const int64_t token = tk.data_ptr<int64_t>()[i * R + r];
    const int64_t V = succ_ids[i].size(0), k = succ_ids[i].size(1);
    TORCH_CHECK(0 <= token && token < V, "lookahead_draft.record_successors: token ", token, " outside [0, ", V,
                ")");
    const int64_t* ids = ti.data_ptr<int64_t>() + (i * Rt + r) * j;
    const float* probs = tp.data_ptr<float>() + (i * Rt + r) * j;
    int32_t* out_ids = succ_ids[i].data_ptr<int32_t>() + token * k;
    float* out_probs = succ_probs[i].data_ptr<float>() + token * k;
    for (int64_t c = 0; c < j; ++c) {
      out_ids[c] = static_cast<int32_t>(ids[c]);
      out_probs[c] = probs[c];
    }
    succ_count[i].data_ptr<int32_t>()[token] = static_cast<int32_t>(j);
  };
  // Every table's computed rows, then every table's listed rows: where rows share one table, the rows that saw
  // their true context win over any row's speculative ones.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < computed[i]; ++r) record(i, r);
  listed = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t m = 0; m < last_count[i]; ++m) record(i, last[listed++]);
}

}  // namespace
}  // namespace draft_tree

TORCH_LIBRARY(lookahead_draft, m) {
  m.def("propose(int root, Tensor suffix, Tensor pool, Tensor rates, Tensor succ_ids, Tensor succ_probs, "
        "Tensor succ_count, int budget) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("encode(Tensor parents, Tensor tokens, int keep, int size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("record_successors(Tensor(a!)[] succ_ids, Tensor(b!)[] succ_probs, Tensor(c!)[] succ_count, "
        "Tensor tokens, Tensor top_ids, Tensor top_probs, int[] computed, int[] last_count, int[] last) -> ()");
}

TORCH_LIBRARY_IMPL(lookahead_draft, CPU, m) {
  m.impl("propose", &draft_tree::propose);
  m.impl("encode", &draft_tree::encode);
  m.impl("record_successors", &draft_tree::record_successors);
}
