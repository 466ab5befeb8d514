// A lookahead step's integer inputs packed into one int64 block in a step runner's layout
// (lookahead/runner.py's input_spans): the host work lookahead/step.py's _packed_step does with NumPy views.
//
// Why: those views and writes are about twenty small NumPy and torch calls, 24 us a one-row tree step warm on this
// project's CPU and about 80 us in the decoding loop, where the rest of a step's host work leaves the interpreter's
// caches cold (session 54, the H200's steps replayed); here they are one call.
//
// Op (namespace lookahead_draft, CPU):
//   pack_step(int[] positions, Tensor window_tokens, Tensor offsets, Tensor? tree_tokens, Tensor? depth,
//             Tensor? end, int[] num_nodes, Tensor rows) -> Tensor
//     B = len(positions) rows; window_tokens int64 [B, L] (x at column 0), offsets int64 [L] (the window branch's
//     position offsets); tree_tokens, depth, end int64 [B, V] (all three or none: V = 0); num_nodes: B ints; rows
//     int64 [R]. All contiguous. Returns int64 [2 B T + 2 B + 2 B V + R], T = L + V: tokens [B, T] (the window's,
//     then the tree's), positions [B, T] (positions[b] + offsets, then positions[b] + depth), cache_len [B]
//     (positions), num_nodes [B], depth [B, V], end [B, V], rows [R].

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>

namespace pack_step {
namespace {

void check_rows(const char* name, const char* what, const at::Tensor& t, int64_t B) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 2 && t.size(0) == B &&
                        t.is_contiguous(),
                    name, ": ", what, " must be a contiguous CPU int64 [", B, ", n] tensor, got ", t.sizes(), " ",
                    t.scalar_type());
}

at::Tensor pack(at::IntArrayRef positions, const at::Tensor& window_tokens, const at::Tensor& offsets,
                const std::optional<at::Tensor>& tree_tokens, const std::optional<at::Tensor>& depth,
                const std::optional<at::Tensor>& end, at::IntArrayRef num_nodes, const at::Tensor& rows) {
  const char* name = "lookahead_draft.pack_step";
  const int64_t B = static_cast<int64_t>(positions.size());
  check_rows(name, "window_tokens", window_tokens, B);
  const int64_t L = window_tokens.size(1);
  TORCH_CHECK_VALUE(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                        offsets.size(0) == L && offsets.is_contiguous(),
                    name, ": offsets must be a contiguous CPU int64 [", L, "] tensor, got ", offsets.sizes());
  const bool tree = tree_tokens.has_value();
  TORCH_CHECK_VALUE(tree == depth.has_value() && tree == end.has_value(), name,
                    ": tree_tokens, depth and end are given together or not at all");
  int64_t V = 0;
  if (tree) {
    check_rows(name, "tree_tokens", *tree_tokens, B);
    V = tree_tokens->size(1);
    check_rows(name, "depth", *depth, B);
    check_rows(name, "end", *end, B);
    TORCH_CHECK_VALUE(depth->size(1) == V && end->size(1) == V, name,
                      ": tree_tokens, depth and end must have one width, got ", tree_tokens->sizes(), ", ",
                      depth->sizes(), ", ", end->sizes());
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(num_nodes.size()) == B, name, ": num_nodes must have ", B,
                    " entries, got ", num_nodes.size());
  TORCH_CHECK_VALUE(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 &&
                        rows.is_contiguous(),
                    name, ": rows must be a contiguous CPU int64 [R] tensor, got ", rows.sizes());
  const int64_t T = L + V, R = rows.size(0);
  at::Tensor block = at::empty({2 * B * T + 2 * B + 2 * B * V + R}, window_tokens.options());
  int64_t* out = block.data_ptr<int64_t>();
  int64_t* tokens = out;
  int64_t* places = tokens + B * T;
  int64_t* lens = places + B * T;
  int64_t* nodes = lens + B;
  int64_t* depth_out = nodes + B;
  int64_t* end_out = depth_out + B * V;
  int64_t* rows_out = end_out + B * V;
  const int64_t* win = window_tokens.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = positions[b];
    std::memcpy(tokens + b * T, win + b * L, sizeof(int64_t) * L);
    for (int64_t j = 0; j < L; ++j) places[b * T + j] = off[j] + p;
    lens[b] = p;
    nodes[b] = num_nodes[b];
  }
  if (V) {
    const int64_t* tok = tree_tokens->data_ptr<int64_t>();
    const int64_t* dep = depth->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(tokens + b * T + L, tok + b * V, sizeof(int64_t) * V);
      for (int64_t j = 0; j < V; ++j) places[b * T + L + j] = dep[b * V + j] + positions[b];
    }
    std::memcpy(depth_out, dep, sizeof(int64_t) * B * V);
    std::memcpy(end_out, end->data_ptr<int64_t>(), sizeof(int64_t) * B * V);
  }
  std::memcpy(rows_out, rows.data_ptr<int64_t>(), sizeof(int64_t) * R);
  return block;
}

}  // namespace
}  // namespace pack_step

TORCH_LIBRARY_FRAGMENT(lookahead_draft, m) {
  m.def("pack_step(int[] positions, Tensor window_tokens, Tensor offsets, Tensor? tree_tokens, Tensor? depth, "
        "Tensor? end, int[] num_nodes, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(lookahead_draft, CPU, m) { m.impl("pack_step", &pack_step::pack); }
