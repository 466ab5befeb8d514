// A lookahead tree step's integer inputs, its rows' trees encoded and packed into one int64 block in a step
// runner's layout (lookahead/runner.py's input_spans): what lookahead/draft.py's encode_rows, window.py's
// stack_step_tokens and step.py's pack_step_reference do for a step replayed from the runner's buffers.
//
// Why: packing alone took twenty small NumPy and torch calls, 24 us a one-row tree step warm on this project's CPU
// and about 80 us in the decoding loop, where the rest of a step's host work leaves the interpreter's caches cold
// (session 54, the H200's steps replayed); encoding the trees, stacking the step's tokens and packing were then three
// calls and their Python, 58-75 us a tree step in that loop, 38-41 as one call (session 61), which writes each
// row's encoding straight into the block.
//
// Op (namespace lookahead_draft, CPU):
//   encode_step(Tensor parents, Tensor tokens, int[] starts, int[] keep, int size, int[] positions, int[] xs,
//               Tensor? window_tokens, Tensor offsets, Tensor rows) -> (Tensor block, Tensor meta)
//     B = len(positions) rows. Row b's tree is the first keep[b] nodes of the best-first list that starts at
//     starts[b] in parents / tokens (int64 [N], as lookahead_draft.propose returns them), encoded as
//     lookahead_draft.encode encodes it (pre-order, children best first, padded with leaves to V = size nodes).
//     Its lookahead branch is xs[b] then window_tokens[b, 1:] (int64 [B, L]; None: L = 1, x alone); offsets int64
//     [L]: that branch's position offsets; rows int64 [R]. Returns block int64 [2 B T + 2 B + 2 B V + R], T = L + V:
//     tokens [B, T] (the branch's, then the tree's), positions [B, T] (positions[b] + offsets, then positions[b] +
//     depth), cache_len [B] (positions), num_nodes [B] (keep), depth [B, V], end [B, V], rows [R]; and meta int64
//     [2 K + B], K = sum(keep): each real node's parent in its row's pre-order numbering (-1 under x), then each
//     pre-order node's best-first index, rows one after another, then each row's deepest real node (0: none).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>

#include "draft_encode.h"
#include "host_ops.h"

namespace pack_step {
namespace {

void check_vector(const char* name, const char* what, const at::Tensor& t, int64_t n) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() &&
                        (n < 0 || t.size(0) == n),
                    name, ": ", what, " must be a contiguous CPU int64 [", n < 0 ? "n" : std::to_string(n),
                    "] tensor, got ", t.sizes(), " ", t.scalar_type());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> encode_step(const at::Tensor& parents, const at::Tensor& tokens,
                                               at::IntArrayRef starts, at::IntArrayRef keep, int64_t size,
                                               at::IntArrayRef positions, at::IntArrayRef xs,
                                               const std::optional<at::Tensor>& window_tokens,
                                               const at::Tensor& offsets, const at::Tensor& rows) {
  const char* name = "lookahead_draft.encode_step";
  const int64_t B = static_cast<int64_t>(positions.size());
  check_vector(name, "parents", parents, -1);
  check_vector(name, "tokens", tokens, parents.size(0));
  TORCH_CHECK_VALUE(static_cast<int64_t>(starts.size()) == B && static_cast<int64_t>(keep.size()) == B &&
                        static_cast<int64_t>(xs.size()) == B,
                    name, ": one start, keep, x and position per row, got ", starts.size(), ", ", keep.size(), ", ",
                    xs.size(), " and ", B);
  TORCH_CHECK_VALUE(size >= 0, name, ": size must be >= 0, got ", size);
  int64_t kept = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(0 <= keep[b] && keep[b] <= size && 0 <= starts[b] && starts[b] + keep[b] <= parents.size(0),
                      name, ": need 0 <= keep <= size and start + keep <= N, got start ", starts[b], ", keep ",
                      keep[b], ", size ", size, ", N ", parents.size(0));
    kept += keep[b];
  }
  int64_t L = 1;
  if (window_tokens.has_value()) {
    const at::Tensor& w = *window_tokens;
    TORCH_CHECK_VALUE(w.device().is_cpu() && w.scalar_type() == at::kLong && w.dim() == 2 && w.size(0) == B &&
                          w.size(1) >= 1 && w.is_contiguous(),
                      name, ": window_tokens must be None or a contiguous CPU int64 [", B, ", L] tensor, got ",
                      w.sizes(), " ", w.scalar_type());
    L = w.size(1);
  }
  check_vector(name, "offsets", offsets, L);
  check_vector(name, "rows", rows, -1);
  const int64_t V = size, T = L + V, R = rows.size(0);
  at::Tensor block = at::empty({2 * B * T + 2 * B + 2 * B * V + R}, parents.options());
  at::Tensor meta = at::empty({2 * kept + B}, parents.options());
  int64_t* out = block.data_ptr<int64_t>();
  int64_t* step_tokens = out;
  int64_t* places = step_tokens + B * T;
  int64_t* lens = places + B * T;
  int64_t* nodes = lens + B;
  int64_t* depth = nodes + B;
  int64_t* end = depth + B * V;
  int64_t* rows_out = end + B * V;
  int64_t* tree_parents = meta.data_ptr<int64_t>();
  int64_t* order = tree_parents + kept;
  int64_t* deepest = order + kept;
  const int64_t* par = parents.data_ptr<int64_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* win = window_tokens.has_value() ? window_tokens->data_ptr<int64_t>() : nullptr;
  const int64_t* off = offsets.data_ptr<int64_t>();
  draft_tree::EncodeSpace ws;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = positions[b];
    int64_t* row_tokens = step_tokens + b * T;
    int64_t* row_places = places + b * T;
    row_tokens[0] = xs[b];
    if (win != nullptr) std::memcpy(row_tokens + 1, win + b * L + 1, sizeof(int64_t) * (L - 1));
    for (int64_t j = 0; j < L; ++j) row_places[j] = off[j] + p;
    lens[b] = p;
    nodes[b] = keep[b];
    deepest[b] = draft_tree::encode_row(par + starts[b], tok + starts[b], keep[b], V, row_tokens + L, depth + b * V,
                                        end + b * V, tree_parents, order, ws);
    tree_parents += keep[b];
    order += keep[b];
    for (int64_t j = 0; j < V; ++j) row_places[L + j] = depth[b * V + j] + p;
  }
  std::memcpy(rows_out, rows.data_ptr<int64_t>(), sizeof(int64_t) * R);
  return {block, meta};
}

}  // namespace pack_step

TORCH_LIBRARY_FRAGMENT(lookahead_draft, m) {
  m.def("encode_step(Tensor parents, Tensor tokens, int[] starts, int[] keep, int size, int[] positions, int[] xs, "
        "Tensor? window_tokens, Tensor offsets, Tensor rows) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lookahead_draft, CPU, m) { m.impl("encode_step", &pack_step::encode_step); }
