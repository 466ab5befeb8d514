// One row's draft tree in depth-first pre-order: shared by draft_tree.cpp's encode op and pack_step.cpp's
// encode_step op, which writes the encoding straight into a step's packed inputs.
#pragma once

#include <cstdint>
#include <vector>

namespace draft_tree {

// What encoding reuses from row to row: children lists linked through arrays (slot keep: the roots under x).
struct EncodeSpace {
  std::vector<int64_t> first, last, next, pre, stack;
};

// The first `keep` nodes of a best-first list (par[i]: the index of node i's parent in the list, -1 under x; tok[i]:
// its token) in pre-order, children best first, padded with leaves under x (token 0) to `size` nodes: ot / dp / en
// [size] the tokens, depths and subtree ends (shared/design/draft-tree.md), op / od [keep] each pre-order node's
// parent (pre-order numbering, -1 under x) and best-first index. Returns the deepest real node's depth (0: none).
int64_t encode_row(const int64_t* par, const int64_t* tok, int64_t keep, int64_t size, int64_t* ot, int64_t* dp,
                   int64_t* en, int64_t* op, int64_t* od, EncodeSpace& ws);

}  // namespace draft_tree
