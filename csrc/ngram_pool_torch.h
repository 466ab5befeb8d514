// Input checks of the n-gram pool's ops (layout in ngram_pool.h): shapes, dtypes and devices; the ops check the
// token values themselves.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <limits>

namespace ngram_pool {

// Checks conts int32 [V, G, M], stamp int64 [V, G], all contiguous and on one device.
inline void check_tables(const at::Tensor& conts, const at::Tensor& stamp) {
  TORCH_CHECK_VALUE(conts.dim() == 3 && conts.scalar_type() == at::kInt && conts.is_contiguous(),
                    "lookahead_pool: conts must be a contiguous int32 tensor [vocab, guess, ngram-1], got ",
                    conts.scalar_type(), " ", conts.sizes());
  TORCH_CHECK_VALUE(conts.size(0) >= 1 && conts.size(0) <= std::numeric_limits<int32_t>::max(),
                    "lookahead_pool: vocab size must be in [1, 2^31 - 1], got ", conts.size(0));
  TORCH_CHECK_VALUE(conts.size(2) >= 1, "lookahead_pool: ngram-1 must be >= 1, got conts ", conts.sizes());
  TORCH_CHECK_VALUE(stamp.dim() == 2 && stamp.scalar_type() == at::kLong && stamp.is_contiguous() &&
                        stamp.size(0) == conts.size(0) && stamp.size(1) == conts.size(1),
                    "lookahead_pool: stamp must be a contiguous int64 tensor [vocab, guess] = [", conts.size(0),
                    ", ", conts.size(1), "], got ", stamp.scalar_type(), " ", stamp.sizes());
  TORCH_CHECK_VALUE(stamp.device() == conts.device(), "lookahead_pool: stamp must be on the device of conts (",
                    conts.device(), "), got ", stamp.device());
}

// Checks the insert op's clock (int64 [1]) and ngrams (int64 [K, M + 1], contiguous) against the tables.
inline void check_insert_args(const at::Tensor& conts, const at::Tensor& stamp, const at::Tensor& clock,
                              const at::Tensor& ngrams) {
  check_tables(conts, stamp);
  TORCH_CHECK_VALUE(clock.dim() == 1 && clock.numel() == 1 && clock.scalar_type() == at::kLong,
                    "lookahead_pool: clock must be an int64 tensor [1], got ", clock.scalar_type(), " ",
                    clock.sizes());
  TORCH_CHECK_VALUE(ngrams.dim() == 2 && ngrams.size(1) == conts.size(2) + 1 &&
                        ngrams.scalar_type() == at::kLong && ngrams.is_contiguous(),
                    "lookahead_pool: ngrams must be a contiguous int64 tensor [K, ", conts.size(2) + 1,
                    "], got ", ngrams.scalar_type(), " ", ngrams.sizes());
  TORCH_CHECK_VALUE(clock.device() == conts.device() && ngrams.device() == conts.device(),
                    "lookahead_pool: clock and ngrams must be on the pool's device (", conts.device(), "), got ",
                    clock.device(), " and ", ngrams.device());
}

// Checks the lookup op's key: an int64 scalar (0-d, or 1 element) on the pool's device.
inline void check_key(const at::Tensor& conts, const at::Tensor& key) {
  TORCH_CHECK_VALUE(key.numel() == 1 && key.dim() <= 1 && key.scalar_type() == at::kLong,
                    "lookahead_pool: key must be a 0-d int64 tensor, got ", key.scalar_type(), " ", key.sizes());
  TORCH_CHECK_VALUE(key.device() == conts.device(), "lookahead_pool: key must be on the pool's device (",
                    conts.device(), "), got ", key.device());
}

}  // namespace ngram_pool
