// Suffix matches for every row of a batch in one call: what followed earlier occurrences of each sequence's last
// tokens. lookahead/suffix.py (SuffixIndex.matches) is the reference: the same matches in the same order, checked
// by tests/test_draft_native.py.
//
// Why: in Python a row's query cost 3-4 us a step on this project's CPU (a dict of positions walked, a tuple built
// per continuation) and handing its continuations to the draft builder as flat lists about as much again: a
// quarter of a 16-row batch step's host work, which beside a GPU's replayed step is time the device waits.
//
// Each row keeps a copy of its sequence in an int64 buffer that the op extends with the tokens committed since
// the last call, so a step passes a few new tokens per row instead of the whole sequence. Occurrences of the last
// token are found by a scan of that copy (about a nanosecond a token; a dict of positions would be one more
// structure to keep in step).
//
// Op (namespace lookahead_draft, CPU):
//   suffix_spans(Tensor(a!)[] buffers, int[] lengths, int[] new_tokens, int[] new_counts, int max_match,
//                int max_len, int limit) -> (int[] tokens, int[] lens, int[] matches, int[] counts)
//     Row i's sequence is buffers[i] (int64 [capacity], contiguous, on the CPU) up to lengths[i] tokens, to which
//     the op first appends its new_counts[i] tokens listed next in new_tokens (the capacity must hold them).
//     Then, with x the sequence's last token, n its length: every earlier position j <= n - 2 holding x is
//     matched backwards against the tokens before x, up to min(max_match, n - 1) tokens in all (m >= 1); the
//     pairs (m, j) are taken in decreasing order of m, then of j, and each gives the continuation
//     sequence[j + 1 : j + 1 + min(max_len, 4 m)] (shorter where the sequence ends) unless it is a prefix of a
//     continuation already taken, until `limit` are taken. Out, rows in order, as lookahead_draft.propose takes
//     them: counts[i] continuations for row i, each one's length in lens and its match length in matches, their
//     tokens one after another in tokens.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include "host_ops.h"

namespace suffix_match {
namespace {

// Row `seq[0 .. n)`'s continuations appended to the outputs; returns how many.
int64_t match_row(const int64_t* seq, int64_t n, int64_t max_match, int64_t max_len, int64_t limit,
                  std::vector<std::pair<int64_t, int64_t>>& found, std::vector<std::pair<int64_t, int64_t>>& taken,
                  Spans& out) {
  if (n < 2 || limit <= 0) return 0;
  const int64_t x = seq[n - 1];
  const int64_t cap = std::min(max_match, n - 1);
  found.clear();
  for (int64_t j = 0; j + 1 < n; ++j) {
    if (seq[j] != x) continue;
    int64_t m = 1;  // tokens matched, ending at j and at n - 1
    while (m < cap && m <= j && seq[j - m] == seq[n - 1 - m]) ++m;
    found.emplace_back(m, j);
  }
  std::sort(found.begin(), found.end(), std::greater<>());
  taken.clear();  // (start, length) of each continuation taken
  for (const auto& [m, j] : found) {
    if (static_cast<int64_t>(taken.size()) >= limit) break;
    const int64_t start = j + 1, len = std::min(std::min(max_len, 4 * m), n - start);
    const bool covered = std::any_of(taken.begin(), taken.end(), [&](const std::pair<int64_t, int64_t>& prev) {
      return prev.second >= len && std::equal(seq + start, seq + start + len, seq + prev.first);
    });
    if (covered) continue;
    taken.emplace_back(start, len);
    std::get<0>(out).insert(std::get<0>(out).end(), seq + start, seq + start + len);
    std::get<1>(out).push_back(len);
    std::get<2>(out).push_back(m);
  }
  return static_cast<int64_t>(taken.size());
}

}  // namespace

Spans suffix_spans(at::TensorList buffers, at::IntArrayRef lengths, at::IntArrayRef new_tokens,
                   at::IntArrayRef new_counts, int64_t max_match, int64_t max_len, int64_t limit) {
  const size_t rows = buffers.size();
  TORCH_CHECK(lengths.size() == rows && new_counts.size() == rows,
              "lookahead_draft.suffix_spans: one length and one new-token count per buffer");
  TORCH_CHECK(max_match >= 1 && max_len >= 1 && limit >= 0, "lookahead_draft.suffix_spans: need max_match >= 1, "
              "max_len >= 1 and limit >= 0, got ", max_match, ", ", max_len, ", ", limit);
  int64_t listed = 0;
  for (size_t i = 0; i < rows; ++i) {
    const at::Tensor& b = buffers[i];
    TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == at::kLong && b.dim() == 1 && b.is_contiguous(),
                "lookahead_draft.suffix_spans: buffers must be contiguous int64 CPU tensors [capacity], got ",
                b.sizes(), " ", b.scalar_type(), " on ", b.device());
    TORCH_CHECK(lengths[i] >= 0 && new_counts[i] >= 0 && lengths[i] + new_counts[i] <= b.size(0),
                "lookahead_draft.suffix_spans: row ", i, " has ", lengths[i], " tokens and ", new_counts[i],
                " new ones, its buffer room for ", b.size(0));
    listed += new_counts[i];
  }
  TORCH_CHECK(listed == static_cast<int64_t>(new_tokens.size()), "lookahead_draft.suffix_spans: new_counts sums to ",
              listed, " but new_tokens has ", new_tokens.size());
  Spans out;
  std::vector<std::pair<int64_t, int64_t>> found, taken;
  const int64_t* next = new_tokens.data();
  for (size_t i = 0; i < rows; ++i) {
    int64_t* seq = buffers[i].data_ptr<int64_t>();
    std::copy(next, next + new_counts[i], seq + lengths[i]);
    next += new_counts[i];
    std::get<3>(out).push_back(
        match_row(seq, lengths[i] + new_counts[i], max_match, max_len, limit, found, taken, out));
  }
  return out;
}

}  // namespace suffix_match

TORCH_LIBRARY_FRAGMENT(lookahead_draft, m) {
  m.def("suffix_spans(Tensor(a!)[] buffers, int[] lengths, int[] new_tokens, int[] new_counts, int max_match, "
        "int max_len, int limit) -> (int[], int[], int[], int[])");
}

TORCH_LIBRARY_IMPL(lookahead_draft, CPU, m) { m.impl("suffix_spans", &suffix_match::suffix_spans); }
