// Python bindings of the host-side draft ops that the decoding loop calls every step, beside their torch op
// registrations (the same C++ functions, the same checks and errors).
//
// Why: a torch op's call parses its arguments against the schema, about 0.3 us a tensor in a tensor list and 2 us a
// call warm on this project's CPU: lookahead_draft.propose for 16 rows cost 21 us warm where a pybind11 call with
// the same arguments took 11, and record_trials for one row 5.0 us where the same arguments crossed in 1.2
// (session 65). A 16-row step passes about 130 of its rows' tensors to these ops, and on a GPU the host's work is
// what a step waits for. The ops stay registered with torch (tests and other callers use them there); the loop's
// per-step calls go through lookahead_kernels.cpu_ops.host_ops(), the module csrc/host_bindings.cpp makes.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace draft_tree {
void bind_host(pybind11::module_& m);  // propose, propose_matched, encode, record_successors
}
namespace pack_step {
void bind_host(pybind11::module_& m);  // encode_step
}
namespace suffix_match {
void bind_host(pybind11::module_& m);  // suffix_spans
// The suffix_spans op (csrc/suffix_match.cpp): (tokens, lens, matches, counts). Also called by draft_tree.cpp's
// propose_matched, which proposes from the spans without handing them to Python and back.
using Spans = std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>;
Spans suffix_spans(at::TensorList buffers, at::IntArrayRef lengths, at::IntArrayRef new_tokens,
                   at::IntArrayRef new_counts, int64_t max_match, int64_t max_len, int64_t limit);
}
namespace accept_trials {
void bind_host(pybind11::module_& m);  // record_trials
}
