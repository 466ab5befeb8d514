// KV compaction after a lookahead step on the CPU: lookahead_kernels/kv_compact_ref.py's rule (per sequence b, the
// rows of its accepted tree nodes, cache_len[b] + offset + path[b, j] for j < accept_len[b], move to
// cache_len[b] + 1 + j, in every layer, in ascending j: a source never lies below a destination still to be read)
// as one row copy each.
//
// Why: the torch reference (nonzero, a gather and a scatter per cache) took 0.12-0.15 ms of a SmolLM2 tree step on
// this project's 2-core CPU, for 30 layers' copies of a row or two of 768 bytes (session 40).
//
// Op (namespace lookahead_cpu, CPU):
//   compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_len, int offset, Tensor accept_len,
//              Tensor path) -> ()
//     k_cache, v_cache [L, B, S, Hkv, D] of one dtype, each position's [Hkv, D] contiguous (any strides before);
//     cache_len, accept_len int64 [B]; path int64 [B, A]; offset >= 1. accept_len is clamped to 0 .. A; a row
//     copied from or to outside 0 .. S is a ValueError, checked before anything is written.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kv_compact_cpu {
namespace {

void compact_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_len, int64_t offset,
                const at::Tensor& accept_len, const at::Tensor& path) {
  const char* name = "lookahead_cpu.compact_kv";
  TORCH_CHECK_VALUE(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() &&
                        k_cache.scalar_type() == v_cache.scalar_type() && k_cache.device().is_cpu() &&
                        v_cache.device().is_cpu(),
                    name, ": k_cache and v_cache must both be [L, B, S, Hkv, D] CPU tensors of one dtype, got ",
                    k_cache.sizes(), " ", k_cache.scalar_type(), " and ", v_cache.sizes(), " ",
                    v_cache.scalar_type());
  const int64_t L = k_cache.size(0), B = k_cache.size(1), S = k_cache.size(2), H = k_cache.size(3),
                D = k_cache.size(4);
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK_VALUE(c->stride(4) == 1 && (H == 1 || c->stride(3) == D), name,
                      ": each cache position's [Hkv, D] must be contiguous, got strides ", c->strides());
  for (const at::Tensor* t : {&cache_len, &accept_len})
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == B && t->scalar_type() == at::kLong && t->device().is_cpu(),
                      name, ": cache_len and accept_len must be int64 [B=", B, "] CPU tensors, got ", t->sizes(), " ",
                      t->scalar_type());
  TORCH_CHECK_VALUE(path.dim() == 2 && path.size(0) == B && path.scalar_type() == at::kLong && path.device().is_cpu(),
                    name, ": path must be an int64 [B=", B, ", A] CPU tensor, got ", path.sizes(), " ",
                    path.scalar_type());
  TORCH_CHECK_VALUE(offset >= 1, name, ": offset (the step's rows before its first tree node) must be >= 1, got ",
                    offset);
  const at::Tensor lens = cache_len.contiguous(), acc = accept_len.contiguous(), pth = path.contiguous();
  const int64_t A = pth.size(1);
  const int64_t* n = lens.data_ptr<int64_t>();
  const int64_t* a = acc.data_ptr<int64_t>();
  const int64_t* p = pth.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < std::clamp<int64_t>(a[b], 0, A); ++j) {
      const int64_t src = n[b] + offset + p[b * A + j], dst = n[b] + 1 + j;
      TORCH_CHECK_VALUE(src >= 0 && src < S && dst >= 0 && dst < S, name, ": sequence ", b, "'s node ", j,
                        " moves row ", src, " to row ", dst, ", outside the cache's ", S, " rows");
    }
  const int64_t bytes = H * D * static_cast<int64_t>(k_cache.element_size());
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    auto* base = static_cast<char*>(c->data_ptr());
    const int64_t sl = c->stride(0), sb = c->stride(1), ss = c->stride(2), es = c->element_size();
    for (int64_t l = 0; l < L; ++l)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < std::clamp<int64_t>(a[b], 0, A); ++j) {
          const int64_t src = n[b] + offset + p[b * A + j], dst = n[b] + 1 + j;
          if (src == dst) continue;
          char* row = base + (l * sl + b * sb) * es;
          std::memmove(row + dst * ss * es, row + src * ss * es, bytes);
        }
  }
}

}  // namespace
}  // namespace kv_compact_cpu

TORCH_LIBRARY_FRAGMENT(lookahead_cpu, m) {
  m.def("compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_len, int offset, Tensor accept_len, "
        "Tensor path) -> ()");
}

TORCH_LIBRARY_IMPL(lookahead_cpu, CPU, m) { m.impl("compact_kv", &kv_compact_cpu::compact_kv); }
