// The CPU ops library as a Python module: the host-side draft ops bound for the decoding loop's per-step calls
// (host_ops.h says why, and why the bindings live here and not beside each op).

#include <torch/extension.h>

#include "host_ops.h"

// Vectors, not IntArrayRef or TensorList, at the boundary: pybind11 converts Python lists to them fastest.
using Ints = std::vector<int64_t>;
using Tensors = std::vector<at::Tensor>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lookahead's host-side draft ops (the torch.ops.lookahead_draft functions, called with less overhead)";
  m.def("propose", [](const Ints& roots, const Ints& suffix_tokens, const Ints& suffix_lens, const Ints& suffix_matches,
                      const Ints& suffix_counts, const Tensors& pool, const Tensors& rates,
                      const Tensors& succ_index, const Tensors& succ_entries, int64_t budget) {
    return draft_tree::propose(roots, suffix_tokens, suffix_lens, suffix_matches, suffix_counts, pool, rates,
                               succ_index, succ_entries, budget);
  });
  m.def("propose_matched", [](const Ints& roots, const Tensors& buffers, const Ints& lengths, const Ints& new_tokens,
                              const Ints& new_counts, const Ints& matched, int64_t max_match, int64_t max_len,
                              int64_t limit, const Tensors& pool, const Tensors& rates,
                              const Tensors& succ_index, const Tensors& succ_entries, int64_t budget) {
    return draft_tree::propose_matched(roots, buffers, lengths, new_tokens, new_counts, matched, max_match, max_len,
                                       limit, pool, rates, succ_index, succ_entries, budget);
  });
  m.def("encode", [](const at::Tensor& parents, const at::Tensor& tokens, const Ints& starts, const Ints& keep,
                     int64_t size) { return draft_tree::encode(parents, tokens, starts, keep, size); });
  m.def("record_successors", [](const Tensors& succ_index, const Tensors& succ_entries, const at::Tensor& tokens,
                                const at::Tensor& tops, const Ints& rows, const Ints& computed,
                                const Ints& last_count, const Ints& last) {
    draft_tree::record_successors(succ_index, succ_entries, tokens, tops, rows, computed, last_count, last);
  });
  m.def("encode_step", [](const at::Tensor& parents, const at::Tensor& tokens, const Ints& starts, const Ints& keep,
                          int64_t size, const Ints& positions, const Ints& xs,
                          const std::optional<at::Tensor>& window_tokens, const at::Tensor& offsets,
                          const at::Tensor& rows) {
    return pack_step::encode_step(parents, tokens, starts, keep, size, positions, xs, window_tokens, offsets, rows);
  });
  m.def("suffix_spans", [](const Tensors& buffers, const Ints& lengths, const Ints& new_tokens,
                           const Ints& new_counts, int64_t max_match, int64_t max_len, int64_t limit) {
    return suffix_match::suffix_spans(buffers, lengths, new_tokens, new_counts, max_match, max_len, limit);
  });
  m.def("record_trials", [](const Tensors& trials, const Tensors& rates, const at::Tensor& priors, double prior_weight,
                            const at::Tensor& codes, const at::Tensor& code_offsets, const at::Tensor& parents,
                            const at::Tensor& order, const Ints& firsts, const Ints& starts, const Ints& keep,
                            const Ints& path_counts, const Ints& paths) {
    accept_trials::record_trials(trials, rates, priors, prior_weight, codes, code_offsets, parents, order, firsts,
                                 starts, keep, path_counts, paths);
  });
}
