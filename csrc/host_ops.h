// The host-side draft ops that the decoding loop calls every step, declared for their Python bindings
// (csrc/host_bindings.cpp) beside their torch op registrations (each op's own file): the same C++ functions, the
// same checks and errors.
//
// Why bindings: a torch op's call parses its arguments against the schema, about 0.3 us a tensor in a tensor list
// and 2 us a call warm on this project's CPU: lookahead_draft.propose for 16 rows cost 21 us warm where a pybind11
// call with the same arguments took 11, and record_trials for one row 5.0 us where the same arguments crossed in 1.2
// (session 65). A 16-row step passes about 130 of its rows' tensors to these ops, and on a GPU the host's work is
// what a step waits for. The ops stay registered with torch (tests and other callers use them there); the loop's
// per-step calls go through lookahead_kernels.cpu_ops.host_ops(), the module csrc/host_bindings.cpp makes.
//
// Only host_bindings.cpp includes pybind11 (torch/extension.h): it took 23 s of a compile where ATen took 7, and
// the op files compiled in 36-40 s each while they bound themselves.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace draft_tree {
using Proposal = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// csrc/draft_tree.cpp: every row's best-first walk over its sources, and the trees' encoding.
Proposal propose(at::IntArrayRef roots, at::IntArrayRef suffix_tokens, at::IntArrayRef suffix_lens,
                 at::IntArrayRef suffix_matches, at::IntArrayRef suffix_counts, at::TensorList pool,
                 at::TensorList rates, at::TensorList succ_index, at::TensorList succ_entries, int64_t budget);
// suffix_spans for the rows listed in `matched` (ascending; the other rows have no suffix source), then propose
// from those spans: one call, the spans never turned into Python lists (about 1,000 ints a 16-row step).
Proposal propose_matched(at::IntArrayRef roots, at::TensorList buffers, at::IntArrayRef lengths,
                         at::IntArrayRef new_tokens, at::IntArrayRef new_counts, at::IntArrayRef matched,
                         int64_t max_match, int64_t max_len, int64_t limit, at::TensorList pool, at::TensorList rates,
                         at::TensorList succ_index, at::TensorList succ_entries, int64_t budget);
Proposal encode(const at::Tensor& parents, const at::Tensor& tokens, at::IntArrayRef starts, at::IntArrayRef keep,
                int64_t size);
void record_successors(at::TensorList succ_index, at::TensorList succ_entries, const at::Tensor& tokens,
                       const at::Tensor& tops, at::IntArrayRef rows, at::IntArrayRef computed,
                       at::IntArrayRef last_count, at::IntArrayRef last);
}  // namespace draft_tree

namespace pack_step {
// csrc/pack_step.cpp: a tree step's trees encoded into its packed inputs.
std::tuple<at::Tensor, at::Tensor> encode_step(const at::Tensor& parents, const at::Tensor& tokens,
                                               at::IntArrayRef starts, at::IntArrayRef keep, int64_t size,
                                               at::IntArrayRef positions, at::IntArrayRef xs,
                                               const std::optional<at::Tensor>& window_tokens,
                                               const at::Tensor& offsets, const at::Tensor& rows);
}  // namespace pack_step

namespace suffix_match {
// The suffix_spans op (csrc/suffix_match.cpp): (tokens, lens, matches, counts). Also called by draft_tree.cpp's
// propose_matched, which proposes from the spans without handing them to Python and back.
using Spans = std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>;
Spans suffix_spans(at::TensorList buffers, at::IntArrayRef lengths, at::IntArrayRef new_tokens,
                   at::IntArrayRef new_counts, int64_t max_match, int64_t max_len, int64_t limit);
}  // namespace suffix_match

namespace accept_trials {
// csrc/accept_trials.cpp: a verified step's acceptance trials recorded into its rows' rates.
void record_trials(at::TensorList trials, at::TensorList rates, const at::Tensor& priors, double prior_weight,
                   const at::Tensor& codes, const at::Tensor& code_offsets, const at::Tensor& parents,
                   const at::Tensor& order, at::IntArrayRef firsts, at::IntArrayRef starts, at::IntArrayRef keep,
                   at::IntArrayRef path_counts, at::IntArrayRef paths);
}  // namespace accept_trials
