// CUDA implementation of the lookahead_pool ops (schemas in ngram_pool.cpp, kernels in ngram_pool_kernels.cuh).
// Neither op synchronises with the host: shapes are checked on the host, values only on the device.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ngram_pool_kernels.cuh"
#include "ngram_pool_torch.h"

namespace ngram_pool {
namespace {

// Token values are not checked here (that would need a sync): rows with an out-of-range token are skipped.
void insert_cuda(at::Tensor conts, at::Tensor stamp, at::Tensor clock, const at::Tensor& ngrams) {
  check_insert_args(conts, stamp, clock, ngrams);
  TORCH_CHECK_VALUE(conts.is_cuda(), "lookahead_pool.insert (CUDA): tables must be CUDA tensors, got ",
                    conts.device());
  const int64_t rows = ngrams.size(0), guess = conts.size(1);
  if (rows == 0 || guess == 0) return;
  const c10::cuda::CUDAGuard guard(conts.device());
  insert_kernel<<<1, kInsertThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      conts.data_ptr<int32_t>(), stamp.data_ptr<int64_t>(), clock.data_ptr<int64_t>(),
      ngrams.data_ptr<int64_t>(), rows, conts.size(0), guess, conts.size(2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> lookup_cuda(const at::Tensor& conts, const at::Tensor& stamp,
                                               const at::Tensor& key) {
  check_tables(conts, stamp);
  check_key(conts, key);
  TORCH_CHECK_VALUE(conts.is_cuda(), "lookahead_pool.lookup (CUDA): tables must be CUDA tensors, got ",
                    conts.device());
  const c10::cuda::CUDAGuard guard(conts.device());
  const int64_t guess = conts.size(1), m = conts.size(2);
  const auto long_opts = conts.options().dtype(at::kLong);
  if (guess == 0) return {at::empty({0, m}, long_opts), at::zeros({}, long_opts)};
  at::Tensor out = at::empty({guess, m}, long_opts);
  at::Tensor count = at::empty({}, long_opts);
  const at::Tensor key_c = key.contiguous();
  lookup_kernel<<<1, kLookupThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      conts.data_ptr<int32_t>(), stamp.data_ptr<int64_t>(), key_c.data_ptr<int64_t>(), out.data_ptr<int64_t>(),
      count.data_ptr<int64_t>(), conts.size(0), guess, m);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, count};
}

}  // namespace
}  // namespace ngram_pool

TORCH_LIBRARY_IMPL(lookahead_pool, CUDA, m) {
  m.impl("insert", &ngram_pool::insert_cuda);
  m.impl("lookup", &ngram_pool::lookup_cuda);
}
