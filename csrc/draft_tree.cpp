// The draft builder's host work in C++: one step's candidate trie grown best-first, and its pre-order encoding.
//
// Why: in Python the best-first walk (a node object per candidate, a heap, a dict per node) cost 3-6 ms a step
// at 255 nodes on an H100 host, where the model's whole step replays in 2-4 ms (bench/results/gpu-h100.md); the
// same walk here costs a few microseconds per node. The Python builder in lookahead/draft.py is the reference:
// both take the same inputs, make the same choices in the same order (ties: first proposed first) and compute the
// same double-precision scores, and tests/test_draft_native.py checks that they agree exactly.
//
// Acceptance keys are small integer codes (lookahead/draft.py documents them): pool depth d -> min(d, 63);
// a suffix match of match class c (lengths 1, 2-3, 4-7, 8+) at depth d -> 64 + 8 c + min(d, 8) - 1; a successor of
// probability bucket b at depth d -> 96 + 4 b + min(d, 4) - 1; each plus kAgreed (144) where another source
// proposed the same node too (its acceptance is learned apart: on MT-Bench a successor that a suffix match did not
// propose was accepted at under half the rate of one that it did, and one rate for both overstated the lone ones
// 2.4x).
//
// Ops (namespace lookahead_draft, CPU). Each takes every row of a batch in one call: a call from Python costs
// microseconds, which a 16-row batch paid per row and per op in every step.
//   propose(int[] roots, int[] suffix_tokens, int[] suffix_lens, int[] suffix_matches, int[] suffix_counts,
//           Tensor[] pool, Tensor[] rates, Tensor[] succ_index, Tensor[] succ_entries, int budget)
//       -> (Tensor tokens, Tensor parents, Tensor scores, Tensor codes, Tensor code_offsets, Tensor counts)
//     Row i grows a trie from roots[i] with its candidate continuations: suffix_counts[i] suffix matches
//     (flattened: each continuation's length in suffix_lens, the length of the match it follows (>= 1) in
//     suffix_matches, its tokens in suffix_tokens, rows in order), then
//     pool[i] int64 [Cp, Lp] (each row read until its first negative entry); rates[i] float64 [kCodes]: its
//     conditional acceptance per code; succ_index[i] int32 [V + 1, 2] and succ_entries[i] int32 [S, 2, k]: its
//     successor table (lookahead/successors.py; succ_index[i] empty: no successor source). It
//     chooses up to `budget` nodes best first (each after its parent); every row's nodes follow the previous
//     row's (counts int64 [n]: nodes per row): token int64 [N], parent int64 [N] (an index into its row's list,
//     -1 under root), score float64 [N] (the chance the verifier reaches the node), and each node's acceptance
//     codes in the order they were proposed: node j's are codes[code_offsets[j] : code_offsets[j + 1]] (codes
//     int64 [M], code_offsets int64 [N + 1]).
//   encode(Tensor parents, Tensor tokens, int[] starts, int[] keep, int size)
//       -> (Tensor tokens, Tensor depth, Tensor end, Tensor parents, Tensor order, Tensor max_depth)
//     Per row i, the first keep[i] nodes of the best-first list that starts at starts[i] in parents / tokens
//     (int64 [N], as propose returns them) in depth-first pre-order, children best first, padded with leaves
//     (token 0) to `size` nodes: token / depth / end int64 [n, size] (the tree encoding of
//     shared/design/draft-tree.md), parent int64 [sum keep] in each row's pre-order numbering (-1 under x), order
//     int64 [sum keep]: the best-first index of each pre-order node (rows one after another), max_depth int64
//     [n]: each row's deepest real node (0 without one).
//   record_successors(Tensor(a!)[] succ_index, Tensor(b!)[] succ_entries, Tensor tokens, Tensor tops, int[] rows,
//                     int[] computed, int[] last_count, int[] last) -> ()
//     One step's successor tops into n tables at once (one call a step, not one a row: each call from Python
//     costs microseconds). Table i (index int32 [V + 1, 2], entries int32 [S, 2, k]: a token's first record takes
//     the next free entry, and entries grows by doubling where none is free) reads batch row
//     b = rows[i] of tokens int64 [B, R] (the token fed at each logits row) and tops int32 [B, 2, R', j] (R' <= R,
//     j <= k; tops[b, 0] the top ids of each logits row, tops[b, 1] their probabilities' float32 bits: a view of a
//     step's read-back as it arrives, each row contiguous) and takes its logits rows 0 .. computed[i] - 1 in
//     order; then every table takes again its last_count[i] rows listed next in last, in order. Logits row r makes
//     tops[b, 0, r] the successors of tokens[b, r] and a later row for the same token wins, so the rows that saw
//     the true context (x and the accepted path) are listed (and a table may serve several rows).

// A successor table (lookahead/successors.py, SuccessorTable) is compact: index[t] = (entry, count) for token t
// (count 0: none recorded), index[V, 0] = entries in use; entries[e] = the entry's k ids, then its k probabilities'
// float32 bits. Why not dense [V, k] rows: at SmolLM2's vocabulary those were 3.3 MB a row, 53 MB for 16 rows, and
// the best-first walk's reads missed the cache (the same 16-row calls took 62-72 us where two tables served every
// row, against 100-105, session 66); a row's index is 0.4 MB and its entries a few kilobytes.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "draft_encode.h"
#include "host_ops.h"

namespace draft_tree {
namespace {

constexpr int64_t kAgreed = 144;  // a node several sources proposed learns under its code + kAgreed
constexpr int64_t kCodes = 2 * kAgreed;
constexpr int64_t kMaxPoolDepthCode = 63;
constexpr int64_t kSuffixBase = 64;
constexpr int64_t kMaxSuffixDepth = 8;
constexpr int64_t kSuccessorBase = 96;
constexpr int64_t kMaxSuccessorDepth = 4;
// Upper bounds of the successor probability buckets (lookahead/draft.py's _PROB_BUCKETS).
constexpr double kBuckets[] = {0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01};
constexpr int64_t kNumBuckets = sizeof(kBuckets) / sizeof(kBuckets[0]);

// A node `depth` tokens into the continuation of a suffix match of `match` tokens, learned per class of match
// length (lookahead/draft.py's _MATCH_CLASSES: 1, 2-3, 4-7, 8 or more).
int64_t suffix_code(int64_t match, int64_t depth) {
  const int64_t match_class = match >= 8 ? 3 : match >= 4 ? 2 : match >= 2 ? 1 : 0;
  return kSuffixBase + kMaxSuffixDepth * match_class + std::min(depth, kMaxSuffixDepth) - 1;
}

int64_t bucket_of(double p) {  // Python's bisect_right(_PROB_BUCKETS, p), clamped to the last bucket
  int64_t b = 0;
  while (b < kNumBuckets && !(p < kBuckets[b])) ++b;
  return b < kNumBuckets ? b : kNumBuckets - 1;
}

// Flat storage, kept across the rows of a call: a node's children and codes are linked lists through arrays,
// not vectors per node (the allocations of a hundred-odd small vectors a row were most of the walk's time).
struct Node {
  int64_t token;
  int32_t parent;
  int32_t depth;
  double cond = 0.0;
  double score = 0.0;
  int32_t first_child = -1, last_child = -1, next_sibling = -1;  // children in the order first proposed
  int32_t first_code = -1, last_code = -1;  // every proposal's code, in order (repeats kept: each is a trial)
  uint8_t sources = 0;                      // a bit per source that proposed it (pool, suffix, successors)
};

int source_bit(int64_t code) { return code < kSuffixBase ? 1 : code < kSuccessorBase ? 2 : 4; }

struct Code {
  int16_t code;
  int32_t next;
};

class Trie {
 public:
  void reset(int64_t root_token, const double* rates) {
    rates_ = rates;
    nodes_.clear();
    codes_.clear();
    nodes_.push_back(Node{root_token, -1, 0});
  }

  int32_t child(int32_t parent, int64_t token) {
    for (int32_t c = nodes_[parent].first_child; c >= 0; c = nodes_[c].next_sibling)
      if (nodes_[c].token == token) return c;
    const int32_t c = static_cast<int32_t>(nodes_.size());
    nodes_.push_back(Node{token, parent, nodes_[parent].depth + 1});
    Node& p = nodes_[parent];
    (p.last_child < 0 ? p.first_child : nodes_[p.last_child].next_sibling) = c;
    p.last_child = c;
    return c;
  }

  void propose(int32_t node, int64_t code) {
    const int32_t e = static_cast<int32_t>(codes_.size());
    codes_.push_back(Code{static_cast<int16_t>(code), -1});
    Node& n = nodes_[node];
    (n.last_code < 0 ? n.first_code : codes_[n.last_code].next) = e;
    n.last_code = e;
    n.sources |= source_bit(code);
  }

  // A node's codes as learned: offset by kAgreed where more than one source proposed it. Final once its parent is
  // expanded (continuations come first, its parent's successors then): its estimate is read after that.
  int64_t learned_code(const Node& n, int64_t code) const {
    return (n.sources & (n.sources - 1)) ? code + kAgreed : code;
  }

  // The best estimate among the node's codes (0 without one).
  void estimate(int32_t node) {
    Node& n = nodes_[node];
    n.cond = 0.0;
    for (int32_t e = n.first_code; e >= 0; e = codes_[e].next) {
      const double r = rates_[learned_code(n, codes_[e].code)];
      if (r > n.cond) n.cond = r;
    }
  }

  // One continuation of the root, read until its first negative token or `len`: a suffix match's of `match`
  // tokens, or (match 0) a pool row.
  void add_continuation(const int64_t* tokens, int64_t len, int64_t match) {
    int32_t node = 0;
    for (int64_t d = 1; d <= len; ++d) {
      const int64_t t = tokens[d - 1];
      if (t < 0) break;
      node = child(node, t);
      propose(node, match > 0 ? suffix_code(match, d) : std::min(d, kMaxPoolDepthCode));
    }
  }

  std::vector<Node> nodes_;
  std::vector<Code> codes_;

 private:
  const double* rates_ = nullptr;
};

// Max-heap on score; equal scores pop in the order they were pushed (a counter), as Python's heapq on
// (-score, counter) does.
using Entry = std::tuple<double, int64_t, int32_t>;
struct Worse {
  bool operator()(const Entry& a, const Entry& b) const {
    if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) < std::get<0>(b);
    return std::get<1>(a) > std::get<1>(b);
  }
};

// What one call reuses from row to row.
struct Workspace {
  Trie trie;
  std::vector<Entry> heap;
  std::vector<int32_t> chosen, list_index;  // list_index: trie node -> index in `chosen` (-1: not chosen)
  std::vector<int32_t> siblings;  // one node's children, best estimate first
};

// Every row's chosen nodes, one after another (one allocation per output for the batch, not per row).
struct Proposals {
  std::vector<int64_t> tokens, parents, codes, code_offsets{0}, counts;
  std::vector<double> scores;
};

void check_table(const at::Tensor& index, const at::Tensor& entries, const char* op) {
  TORCH_CHECK(index.scalar_type() == at::kInt && entries.scalar_type() == at::kInt && index.dim() == 2 &&
                  index.size(0) >= 2 && index.size(1) == 2 && entries.dim() == 3 && entries.size(1) == 2 &&
                  index.is_contiguous() && entries.is_contiguous() && index.device().is_cpu() &&
                  entries.device().is_cpu(),
              "lookahead_draft.", op, ": a successor table must be an int32 index [V + 1, 2] and int32 entries "
              "[S, 2, k], contiguous, on the CPU, got ", index.sizes(), " ", index.scalar_type(), " and ",
              entries.sizes(), " ", entries.scalar_type());
}

// One row's best-first walk, appended to `out`: `suffix_count` continuations of `suffix_lens[c]` tokens each,
// following matches of `suffix_matches[c]` tokens, flattened in `suffix_tokens` (all three left pointing past this
// row's); the pool's rows; the row's rates and successor table (index null: none; `entries` of them).
void propose_row(int64_t root, const int64_t*& suffix_tokens, const int64_t*& suffix_lens,
                 const int64_t*& suffix_matches, int64_t suffix_count, const at::Tensor& pool, const double* rate,
                 const int32_t* index, const int32_t* entry, int64_t entries, int64_t vocab, int64_t k,
                 int64_t budget, Workspace& ws, Proposals& out) {
  Trie& trie = ws.trie;
  trie.reset(root, rate);
  for (int64_t c = 0; c < suffix_count; ++c) {
    trie.add_continuation(suffix_tokens, *suffix_lens, *suffix_matches++);
    suffix_tokens += *suffix_lens++;
  }
  for (int64_t c = 0; c < pool.size(0); ++c) trie.add_continuation(pool.data_ptr<int64_t>() + c * pool.size(1),
                                                                    pool.size(1), 0);

  const bool successors = index != nullptr;
  auto expand = [&](int32_t node) {
    if (!successors) return;
    const int64_t token = trie.nodes_[node].token;
    if (token < 0 || token >= vocab) return;
    const int64_t e = index[2 * token], n = std::min<int64_t>(index[2 * token + 1], k);
    if (n <= 0) return;
    TORCH_CHECK(0 <= e && e < entries, "lookahead_draft.propose: token ", token, "'s successor entry ", e,
                " outside [0, ", entries, ")");
    const int32_t* ids = entry + e * 2 * k;
    const float* probs = reinterpret_cast<const float*>(ids + k);
    const int64_t depth = std::min<int64_t>(trie.nodes_[node].depth + 1, kMaxSuccessorDepth);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t code = kSuccessorBase + 4 * bucket_of(static_cast<double>(probs[j])) + depth - 1;
      trie.propose(trie.child(node, ids[j]), code);
    }
  };

  std::vector<Entry>& heap = ws.heap;
  std::vector<int32_t>& chosen = ws.chosen;
  heap.clear();
  chosen.clear();
  int64_t counter = 0;
  int32_t node = 0;
  trie.nodes_[0].score = 1.0;
  while (true) {
    if (node != 0) {
      chosen.push_back(node);
      if (static_cast<int64_t>(chosen.size()) >= budget) break;
    }
    expand(node);
    // At most one child is accepted: their estimates are capped to sum to 1, the best first (ties in the order
    // proposed), each at what those above it leave (lookahead/draft.py's _exclusive_conds).
    const double s = trie.nodes_[node].score;
    std::vector<int32_t>& siblings = ws.siblings;
    siblings.clear();
    for (int32_t c = trie.nodes_[node].first_child; c >= 0; c = trie.nodes_[c].next_sibling) {
      trie.estimate(c);
      siblings.push_back(c);
    }
    for (size_t i = 1; i < siblings.size(); ++i) {  // a stable insertion sort: a few children, no allocation
      const int32_t c = siblings[i];
      size_t j = i;
      for (; j > 0 && trie.nodes_[siblings[j - 1]].cond < trie.nodes_[c].cond; --j) siblings[j] = siblings[j - 1];
      siblings[j] = c;
    }
    double left = 1.0;
    for (const int32_t c : siblings) {
      const double cond = std::min(trie.nodes_[c].cond, left);  // an estimate is at most 1: one child keeps it
      left -= cond;
      trie.nodes_[c].score = s * cond;
    }
    for (int32_t c = trie.nodes_[node].first_child; c >= 0; c = trie.nodes_[c].next_sibling) {
      heap.emplace_back(trie.nodes_[c].score, counter++, c);
      std::push_heap(heap.begin(), heap.end(), Worse{});
    }
    if (heap.empty() || budget == 0) break;
    std::pop_heap(heap.begin(), heap.end(), Worse{});
    node = std::get<2>(heap.back());
    heap.pop_back();
  }

  ws.list_index.assign(trie.nodes_.size(), -1);
  for (size_t i = 0; i < chosen.size(); ++i) {
    const Node& nd = trie.nodes_[chosen[i]];
    ws.list_index[chosen[i]] = static_cast<int32_t>(i);
    out.tokens.push_back(nd.token);
    out.parents.push_back(nd.parent == 0 ? -1 : ws.list_index[nd.parent]);  // a parent is chosen before its children
    out.scores.push_back(nd.score);
    for (int32_t e = nd.first_code; e >= 0; e = trie.codes_[e].next)
      out.codes.push_back(trie.learned_code(nd, trie.codes_[e].code));
    out.code_offsets.push_back(static_cast<int64_t>(out.codes.size()));
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> propose(
    at::IntArrayRef roots, at::IntArrayRef suffix_tokens, at::IntArrayRef suffix_lens,
    at::IntArrayRef suffix_matches, at::IntArrayRef suffix_counts, at::TensorList pool, at::TensorList rates,
    at::TensorList succ_index, at::TensorList succ_entries, int64_t budget) {
  const int64_t n = static_cast<int64_t>(roots.size());
  TORCH_CHECK(static_cast<int64_t>(suffix_counts.size()) == n && static_cast<int64_t>(pool.size()) == n &&
                  static_cast<int64_t>(rates.size()) == n && static_cast<int64_t>(succ_index.size()) == n &&
                  static_cast<int64_t>(succ_entries.size()) == n,
              "lookahead_draft.propose: one root, suffix count, pool, rates and successor table per row");
  TORCH_CHECK(budget >= 0, "lookahead_draft.propose: budget must be >= 0, got ", budget);
  int64_t spans = 0, listed = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(suffix_counts[i] >= 0, "lookahead_draft.propose: suffix_counts must be >= 0");
    spans += suffix_counts[i];
  }
  TORCH_CHECK(spans == static_cast<int64_t>(suffix_lens.size()),
              "lookahead_draft.propose: suffix_counts sums to ", spans, " but suffix_lens has ", suffix_lens.size());
  TORCH_CHECK(spans == static_cast<int64_t>(suffix_matches.size()), "lookahead_draft.propose: suffix_counts sums to ",
              spans, " but suffix_matches has ", suffix_matches.size());
  for (int64_t c = 0; c < spans; ++c) {
    TORCH_CHECK(suffix_lens[c] >= 0, "lookahead_draft.propose: suffix_lens must be >= 0");
    TORCH_CHECK(suffix_matches[c] >= 1, "lookahead_draft.propose: suffix_matches must be >= 1");
    listed += suffix_lens[c];
  }
  TORCH_CHECK(listed == static_cast<int64_t>(suffix_tokens.size()), "lookahead_draft.propose: suffix_lens sums to ",
              listed, " but suffix_tokens has ", suffix_tokens.size());
  Proposals out;
  Workspace ws;
  const int64_t* span_tokens = suffix_tokens.data();
  const int64_t* span_lens = suffix_lens.data();
  const int64_t* span_matches = suffix_matches.data();
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& p = pool[i];
    TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kLong && p.dim() == 2 && p.is_contiguous(),
                "lookahead_draft.propose: pool must be a contiguous int64 CPU tensor [C, L], got ", p.sizes(), " ",
                p.scalar_type(), " on ", p.device());
    const at::Tensor& r = rates[i];
    TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == at::kDouble && r.numel() == kCodes && r.is_contiguous(),
                "lookahead_draft.propose: rates must be a contiguous float64 CPU tensor [", kCodes, "]");
    const at::Tensor &index = succ_index[i], &entries = succ_entries[i];
    const bool successors = index.numel() > 0;
    if (successors) check_table(index, entries, "propose");
    const size_t before = out.tokens.size();
    propose_row(roots[i], span_tokens, span_lens, span_matches, suffix_counts[i], p, r.data_ptr<double>(),
                successors ? index.data_ptr<int32_t>() : nullptr,
                successors ? entries.data_ptr<int32_t>() : nullptr, successors ? entries.size(0) : 0,
                successors ? index.size(0) - 1 : 0, successors ? entries.size(2) : 0, budget, ws, out);
    out.counts.push_back(static_cast<int64_t>(out.tokens.size() - before));
  }
  auto longs = [](const std::vector<int64_t>& v) {
    return at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong));
  };
  return {longs(out.tokens), longs(out.parents),
          at::tensor(at::ArrayRef<double>(out.scores), at::TensorOptions().dtype(at::kDouble)), longs(out.codes),
          longs(out.code_offsets), longs(out.counts)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> encode(
    const at::Tensor& parents, const at::Tensor& tokens, at::IntArrayRef starts, at::IntArrayRef keep, int64_t size) {
  const int64_t n = static_cast<int64_t>(starts.size());
  TORCH_CHECK(parents.device().is_cpu() && tokens.device().is_cpu() && parents.scalar_type() == at::kLong &&
                  tokens.scalar_type() == at::kLong && parents.dim() == 1 && tokens.dim() == 1 &&
                  parents.size(0) == tokens.size(0) && parents.is_contiguous() && tokens.is_contiguous(),
              "lookahead_draft.encode: parents and tokens must be contiguous int64 CPU tensors [N] of one length");
  TORCH_CHECK(static_cast<int64_t>(keep.size()) == n, "lookahead_draft.encode: one start and one keep per row");
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= keep[i] && keep[i] <= size && 0 <= starts[i] && starts[i] + keep[i] <= parents.size(0),
                "lookahead_draft.encode: need 0 <= keep <= size and start + keep <= N, got start ", starts[i],
                ", keep ", keep[i], ", size ", size, ", N ", parents.size(0));
    kept += keep[i];
  }
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor out_tok = at::empty({n, size}, opts), depth = at::empty({n, size}, opts);
  at::Tensor end = at::empty({n, size}, opts), out_par = at::empty({kept}, opts), order = at::empty({kept}, opts);
  at::Tensor deepest = at::empty({n}, opts);
  int64_t* op = out_par.data_ptr<int64_t>();
  int64_t* od = order.data_ptr<int64_t>();
  EncodeSpace ws;
  for (int64_t i = 0; i < n; ++i) {
    deepest.data_ptr<int64_t>()[i] = encode_row(
        parents.data_ptr<int64_t>() + starts[i], tokens.data_ptr<int64_t>() + starts[i], keep[i], size,
        out_tok.data_ptr<int64_t>() + i * size, depth.data_ptr<int64_t>() + i * size,
        end.data_ptr<int64_t>() + i * size, op, od, ws);
    op += keep[i];
    od += keep[i];
  }
  return {out_tok, depth, end, out_par, order, deepest};
}

void record_successors(at::TensorList succ_index, at::TensorList succ_entries, const at::Tensor& tokens,
                       const at::Tensor& tops, at::IntArrayRef rows, at::IntArrayRef computed,
                       at::IntArrayRef last_count, at::IntArrayRef last) {
  const int64_t n = static_cast<int64_t>(succ_index.size());
  TORCH_CHECK(static_cast<int64_t>(succ_entries.size()) == n,
              "lookahead_draft.record_successors: one index and one entries tensor per table");
  TORCH_CHECK(tokens.device().is_cpu() && tops.device().is_cpu() && tokens.scalar_type() == at::kLong &&
                  tokens.dim() == 2 && tops.scalar_type() == at::kInt && tops.dim() == 4 &&
                  tops.size(0) == tokens.size(0) && tops.size(1) == 2 && tops.size(2) <= tokens.size(1),
              "lookahead_draft.record_successors: tokens int64 [B, R] and tops int32 [B, 2, R', j] with R' <= R "
              "on the CPU, got ", tokens.sizes(), " ", tokens.scalar_type(), " and ", tops.sizes(), " ",
              tops.scalar_type());
  const int64_t B = tokens.size(0), Rt = tops.size(2), j = tops.size(3);
  TORCH_CHECK(j >= 1, "lookahead_draft.record_successors: tops must hold at least one successor a row");
  TORCH_CHECK(tops.stride(3) == 1 && tops.stride(2) == j && tops.stride(1) == Rt * j,
              "lookahead_draft.record_successors: each row of tops must be contiguous (a view of the read-back)");
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == n && static_cast<int64_t>(computed.size()) == n &&
                  static_cast<int64_t>(last_count.size()) == n,
              "lookahead_draft.record_successors: one batch row, computed and last_count per table");
  const at::Tensor tk = tokens.contiguous();
  const int64_t R = tk.size(1);
  for (int64_t i = 0; i < n; ++i) {
    check_table(succ_index[i], succ_entries[i], "record_successors");
    TORCH_CHECK(j <= succ_entries[i].size(2), "lookahead_draft.record_successors: table ", i, " keeps ",
                succ_entries[i].size(2), " successors a token, fewer than the ", j, " of tops");
    const int64_t used = succ_index[i].data_ptr<int32_t>()[2 * (succ_index[i].size(0) - 1)];
    TORCH_CHECK(0 <= used && used <= succ_entries[i].size(0), "lookahead_draft.record_successors: table ", i,
                " says it uses ", used, " entries of ", succ_entries[i].size(0));
    TORCH_CHECK(0 <= rows[i] && rows[i] < B, "lookahead_draft.record_successors: rows[", i, "] = ", rows[i],
                " outside [0, ", B, ")");
    TORCH_CHECK(0 <= computed[i] && computed[i] <= Rt && last_count[i] >= 0,
                "lookahead_draft.record_successors: computed[", i, "] = ", computed[i], " outside [0, ", Rt, "]");
  }
  int64_t listed = 0;
  for (int64_t i = 0; i < n; ++i) listed += last_count[i];
  TORCH_CHECK(listed == static_cast<int64_t>(last.size()),
              "lookahead_draft.record_successors: last_count sums to ", listed, " but last has ", last.size());
  const int32_t* top = tops.data_ptr<int32_t>();
  auto record = [&](int64_t i, int64_t r) {  // logits row r of table i's batch row
    TORCH_CHECK(0 <= r && r < Rt, "lookahead_draft.record_successors: row ", r, " outside the ", Rt,
                " rows of tops");
    const int64_t b = rows[i];
    const int64_t token = tk.data_ptr<int64_t>()[b * R + r];
    const at::Tensor &index_t = succ_index[i], &entries_t = succ_entries[i];
    const int64_t V = index_t.size(0) - 1, k = entries_t.size(2);
    TORCH_CHECK(0 <= token && token < V, "lookahead_draft.record_successors: token ", token, " outside [0, ", V,
                ")");
    int32_t* index = index_t.data_ptr<int32_t>();
    if (index[2 * token + 1] == 0) {  // the token's first record: the next free entry
      int32_t& used = index[2 * V];
      if (used == entries_t.size(0))  // grown in place (the Python table holds the same tensor), kept entries kept
        entries_t.resize_({std::min<int64_t>(std::max<int64_t>(2 * used, 64), V), 2, k});  // successors.py too
      index[2 * token] = used++;
    }
    TORCH_CHECK(0 <= index[2 * token] && index[2 * token] < entries_t.size(0), "lookahead_draft.record_successors: "
                "token ", token, "'s entry ", index[2 * token], " outside [0, ", entries_t.size(0), ")");
    const int32_t* ids = top + b * tops.stride(0) + r * j;
    int32_t* out = entries_t.data_ptr<int32_t>() + index[2 * token] * 2 * k;
    std::memcpy(out, ids, sizeof(int32_t) * j);
    std::memcpy(out + k, ids + Rt * j, sizeof(int32_t) * j);  // the probabilities' float32 bits, as read back
    index[2 * token + 1] = static_cast<int32_t>(j);
  };
  // Every table's computed rows, then every table's listed rows: where rows share one table, the rows that saw
  // their true context win over any row's speculative ones.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < computed[i]; ++r) record(i, r);
  listed = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t m = 0; m < last_count[i]; ++m) record(i, last[listed++]);
}

// See draft_encode.h.
int64_t encode_row(const int64_t* par, const int64_t* tok, int64_t keep, int64_t size, int64_t* ot, int64_t* dp,
                   int64_t* en, int64_t* op, int64_t* od, EncodeSpace& ws) {
  // Children lists in best-first order (the list's order), then an iterative depth-first walk.
  ws.first.assign(keep + 1, -1);
  ws.last.assign(keep + 1, -1);
  ws.next.assign(keep, -1);
  for (int64_t i = 0; i < keep; ++i) {
    const int64_t p = par[i];
    TORCH_CHECK(-1 <= p && p < i, "lookahead_draft: a draft tree's parent of node ", i, " must be -1 or an "
                "earlier node, got ", p);
    const int64_t slot = p < 0 ? keep : p;
    (ws.last[slot] < 0 ? ws.first[slot] : ws.next[ws.last[slot]]) = i;
    ws.last[slot] = i;
  }
  ws.pre.assign(keep, -1);  // best-first index -> pre-order index
  ws.stack.clear();
  // The stack pops the best child first: push a parent's children worst first, i.e. reversed.
  auto push_children = [&](int64_t slot) {
    const size_t from = ws.stack.size();
    for (int64_t c = ws.first[slot]; c >= 0; c = ws.next[c]) ws.stack.push_back(c);
    std::reverse(ws.stack.begin() + static_cast<std::ptrdiff_t>(from), ws.stack.end());
  };
  push_children(keep);
  int64_t next = 0, deepest = 0;
  while (!ws.stack.empty()) {
    const int64_t i = ws.stack.back();
    ws.stack.pop_back();
    const int64_t j = next++;
    ws.pre[i] = j;
    od[j] = i;
    ot[j] = tok[i];
    op[j] = par[i] < 0 ? -1 : ws.pre[par[i]];
    dp[j] = par[i] < 0 ? 1 : dp[ws.pre[par[i]]] + 1;
    en[j] = j + 1;
    deepest = std::max(deepest, dp[j]);
    push_children(i);
  }
  for (int64_t j = keep - 1; j >= 0; --j)  // children follow parents: fold subtree ends upwards
    if (op[j] >= 0 && en[j] > en[op[j]]) en[op[j]] = en[j];
  for (int64_t j = keep; j < size; ++j) {  // padding: leaves under x
    ot[j] = 0;
    dp[j] = 1;
    en[j] = j + 1;
  }
  return deepest;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> propose_matched(
    at::IntArrayRef roots, at::TensorList buffers, at::IntArrayRef lengths, at::IntArrayRef new_tokens,
    at::IntArrayRef new_counts, at::IntArrayRef matched, int64_t max_match, int64_t max_len, int64_t limit,
    at::TensorList pool, at::TensorList rates, at::TensorList succ_index, at::TensorList succ_entries,
    int64_t budget) {
  const int64_t n = static_cast<int64_t>(roots.size());
  TORCH_CHECK_VALUE(matched.size() == buffers.size(), "lookahead_draft.propose_matched: one buffer per matched "
                    "row, got ", buffers.size(), " buffers and ", matched.size(), " rows");
  for (size_t i = 0; i < matched.size(); ++i)
    TORCH_CHECK_VALUE(0 <= matched[i] && matched[i] < n && (i == 0 || matched[i - 1] < matched[i]),
                      "lookahead_draft.propose_matched: matched rows must rise within [0, ", n, "), got ",
                      matched[i], " at ", i);
  const suffix_match::Spans spans =
      suffix_match::suffix_spans(buffers, lengths, new_tokens, new_counts, max_match, max_len, limit);
  std::vector<int64_t> counts(n, 0);
  for (size_t i = 0; i < matched.size(); ++i) counts[matched[i]] = std::get<3>(spans)[i];
  return propose(roots, std::get<0>(spans), std::get<1>(spans), std::get<2>(spans), counts, pool, rates,
                 succ_index, succ_entries, budget);
}

}  // namespace draft_tree

TORCH_LIBRARY(lookahead_draft, m) {
  m.def("propose(int[] roots, int[] suffix_tokens, int[] suffix_lens, int[] suffix_matches, int[] suffix_counts, "
        "Tensor[] pool, Tensor[] rates, Tensor[] succ_index, Tensor[] succ_entries, int budget) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("encode(Tensor parents, Tensor tokens, int[] starts, int[] keep, int size) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("record_successors(Tensor(a!)[] succ_index, Tensor(b!)[] succ_entries, "
        "Tensor tokens, Tensor tops, int[] rows, int[] computed, int[] last_count, int[] last) -> ()");
}

TORCH_LIBRARY_IMPL(lookahead_draft, CPU, m) {
  m.impl("propose", &draft_tree::propose);
  m.impl("encode", &draft_tree::encode);
  m.impl("record_successors", &draft_tree::record_successors);
}
