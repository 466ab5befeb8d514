// Each logits row's k largest entries and their softmax among themselves: what the successor table keeps of every
// row a CPU step computes (lookahead/successors.py, SuccessorTable.top).
//
// Why: torch.topk over 17 rows of SmolLM2's 49152 logits took 0.36-0.67 ms a step on this project's 2-core CPU
// (3-4% of a lookahead step; torch.max alone was as slow), while k is 8 and almost every entry is below the
// 8th-largest seen so far. One pass here compares blocks of 64 entries with that threshold and looks at an entry
// only when its block holds a larger one (or a NaN).
//
// Op (namespace lookahead_draft, CPU):
//   top_successors(Tensor logits, int k) -> (Tensor ids, Tensor probs)
//     logits float32 [R, V] or [B, R, V], the last dimension contiguous (any strides before it). ids int64 and
//     probs float32 of the leading shape + [min(k, V)]: each row's largest entries, largest first (NaN counts as
//     the largest, as in torch.topk; among equal entries the lower index first), and exp(v - v_max) / sum over
//     those entries.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_ops.h"

namespace row_topk {
namespace {

constexpr int64_t kBlock = 64;

// Whether entry (a, ia) comes before (b, ib): larger first, NaN the largest, the lower index first among equals.
inline bool before(float a, int64_t ia, float b, int64_t ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na || nb) return na && (!nb || ia < ib);
  return a > b || (a == b && ia < ib);
}

// Whether any of x[0 .. n) is not <= thr (larger, or NaN): vectorised by the compiler for each target.
__attribute__((target_clones("avx512f", "avx2", "default")))
bool any_above(const float* x, int64_t n, float thr) {
  int hit = 0;
  for (int64_t j = 0; j < n; ++j) hit |= !(x[j] <= thr);
  return hit != 0;
}

}  // namespace

// Row x[0 .. V)'s top k into vals / idx (k <= V), largest first. The entries held form a heap whose root is the
// one that comes last (the threshold a new entry must beat): an offer costs log k, not k (sorted insertion made a
// top 128 of 49k entries take 0.19 ms, slower than torch.topk; sampling's top-k, csrc/sample_warped.cpp).
void top_row(const float* x, int64_t V, int64_t k, float* vals, int64_t* idx) {
  int64_t n = 0;  // entries held
  // Entry a sits below b in the heap when b comes after it: the root comes after every other entry.
  auto sift_down = [&](int64_t p) {
    for (;;) {
      int64_t c = 2 * p + 1;
      if (c >= n) return;
      if (c + 1 < n && before(vals[c], idx[c], vals[c + 1], idx[c + 1])) ++c;  // the child that comes later
      if (!before(vals[p], idx[p], vals[c], idx[c])) return;
      std::swap(vals[p], vals[c]);
      std::swap(idx[p], idx[c]);
      p = c;
    }
  };
  auto offer = [&](float v, int64_t i) {
    if (n < k) {  // push, then sift up
      int64_t p = n++;
      vals[p] = v;
      idx[p] = i;
      while (p > 0 && before(vals[(p - 1) / 2], idx[(p - 1) / 2], vals[p], idx[p])) {
        std::swap(vals[p], vals[(p - 1) / 2]);
        std::swap(idx[p], idx[(p - 1) / 2]);
        p = (p - 1) / 2;
      }
      return;
    }
    if (!before(v, i, vals[0], idx[0])) return;
    vals[0] = v;
    idx[0] = i;
    sift_down(0);
  };
  int64_t j = 0;
  for (; j < std::min(k, V); ++j) offer(x[j], j);
  // Blocks: an entry equal to the threshold comes after it (a higher index), so only larger ones or NaN enter.
  for (; j < V; j += kBlock) {
    const int64_t m = std::min(kBlock, V - j);
    if (!any_above(x + j, m, vals[0])) continue;
    for (int64_t t = 0; t < m; ++t)
      if (!(x[j + t] <= vals[0])) offer(x[j + t], j + t);  // the same test, before the full comparison
  }
  // Pop the root (the last) into the end, k times: largest first.
  for (int64_t end = n - 1; end > 0; --end) {
    std::swap(vals[0], vals[end]);
    std::swap(idx[0], idx[end]);
    n = end;
    sift_down(0);
  }
}

namespace {

std::tuple<at::Tensor, at::Tensor> top_successors(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK_VALUE(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                        (logits.dim() == 2 || logits.dim() == 3) && logits.size(-1) >= 1 && logits.stride(-1) == 1,
                    "lookahead_draft.top_successors: logits must be a CPU float32 [R, V] or [B, R, V] tensor with "
                    "V >= 1 and a contiguous last dimension, got ", logits.scalar_type(), " of shape ",
                    logits.sizes(), " and strides ", logits.strides());
  TORCH_CHECK_VALUE(k >= 1, "lookahead_draft.top_successors: k must be >= 1, got ", k);
  const at::Tensor x = logits.dim() == 2 ? logits.unsqueeze(0) : logits;
  const int64_t B = x.size(0), R = x.size(1), V = x.size(2), kk = std::min(k, V);
  const int64_t sb = x.stride(0), sr = x.stride(1);
  at::Tensor ids = at::empty({B, R, kk}, at::TensorOptions().dtype(at::kLong));
  at::Tensor probs = at::empty({B, R, kk}, at::TensorOptions().dtype(at::kFloat));
  const float* base = x.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  float* pr = probs.data_ptr<float>();
  at::parallel_for(0, B * R, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t b = row / R, r = row % R;
      float* v = pr + row * kk;
      top_row(base + b * sb + r * sr, V, kk, v, id + row * kk);
      const float top = v[0];
      float sum = 0.f;
      for (int64_t j = 0; j < kk; ++j) sum += (v[j] = std::exp(v[j] - top));
      for (int64_t j = 0; j < kk; ++j) v[j] /= sum;
    }
  });
  if (logits.dim() == 2) return {ids.squeeze(0), probs.squeeze(0)};
  return {ids, probs};
}

}  // namespace
}  // namespace row_topk

TORCH_LIBRARY_FRAGMENT(lookahead_draft, m) {
  m.def("top_successors(Tensor logits, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lookahead_draft, CPU, m) { m.impl("top_successors", &row_topk::top_successors); }
