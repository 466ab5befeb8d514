// The n-gram pool's torch ops: schemas (namespace lookahead_pool) and the CPU implementation.
// Table layout and semantics: ngram_pool.h.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "ngram_pool.h"
#include "ngram_pool_torch.h"

namespace ngram_pool {
namespace {

// Inserts rows of ngrams [K, M + 1] in order. Every token is range-checked first, so bad input changes nothing.
void insert_cpu(at::Tensor conts, at::Tensor stamp, at::Tensor clock, const at::Tensor& ngrams) {
  check_insert_args(conts, stamp, clock, ngrams);
  const int64_t vocab = conts.size(0), guess = conts.size(1), m = conts.size(2);
  const int64_t rows = ngrams.size(0), width = m + 1;
  const int64_t* ng = ngrams.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* row = ng + r * width;
    if (!row_in_range(row, width, vocab)) {
      for (int64_t i = 0; i < width; ++i) {
        TORCH_CHECK_VALUE(row[i] >= 0 && row[i] < vocab, "lookahead_pool.insert: token ids must be in [0, ",
                          vocab, "), got ", row[i], " at ngrams[", r, ", ", i, "]");
      }
    }
  }
  if (guess == 0 || rows == 0) return;

  int32_t* ct = conts.data_ptr<int32_t>();
  int64_t* st = stamp.data_ptr<int64_t>();
  int64_t now = clock.data_ptr<int64_t>()[0];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* row = ng + r * width;
    const int64_t* cont = row + 1;
    int64_t* key_stamp = st + row[0] * guess;
    int32_t* key_conts = ct + row[0] * guess * m;
    int64_t match = -1, oldest = 0;
    for (int64_t s = 0; s < guess; ++s) {
      if (key_stamp[s] != kEmpty && same_continuation(key_conts + s * m, cont, m)) {
        match = s;
        break;
      }
      if (key_stamp[s] < key_stamp[oldest]) oldest = s;
    }
    if (match < 0) {
      // The loop above stopped early only on a match, so `oldest` saw every slot.
      match = oldest;
      for (int64_t i = 0; i < m; ++i) key_conts[match * m + i] = static_cast<int32_t>(cont[i]);
    }
    key_stamp[match] = now++;
  }
  clock.data_ptr<int64_t>()[0] = now;
}

// Key k's filled slots, oldest first, into held as (stamp, slot).
void held_slots(const at::Tensor& stamp, int64_t k, std::vector<std::pair<int64_t, int64_t>>& held) {
  const int64_t guess = stamp.size(1);
  const int64_t* key_stamp = stamp.data_ptr<int64_t>() + k * guess;
  held.clear();
  for (int64_t s = 0; s < guess; ++s) {
    if (key_stamp[s] != kEmpty) held.emplace_back(key_stamp[s], s);
  }
  std::sort(held.begin(), held.end());
}

// Writes key k's continuations in the order of held (held_slots) as rows of out [held.size(), M] (int64).
void write_continuations(const at::Tensor& conts, int64_t k, const std::vector<std::pair<int64_t, int64_t>>& held,
                         int64_t* out) {
  const int64_t guess = conts.size(1), m = conts.size(2);
  const int32_t* key_conts = conts.data_ptr<int32_t>() + k * guess * m;
  for (size_t r = 0; r < held.size(); ++r) {
    for (int64_t i = 0; i < m; ++i) out[r * m + i] = key_conts[held[r].second * m + i];
  }
}

// Returns (out int64 [G, M] with the key's continuations oldest first then rows of -1, count int64 []).
std::tuple<at::Tensor, at::Tensor> lookup_cpu(const at::Tensor& conts, const at::Tensor& stamp,
                                              const at::Tensor& key) {
  check_tables(conts, stamp);
  check_key(conts, key);
  const int64_t vocab = conts.size(0);
  const int64_t k = key.item<int64_t>();
  TORCH_CHECK_VALUE(k >= 0 && k < vocab, "lookahead_pool.lookup: key must be in [0, ", vocab, "), got ", k);
  at::Tensor out = at::full({conts.size(1), conts.size(2)}, -1, conts.options().dtype(at::kLong));
  std::vector<std::pair<int64_t, int64_t>> held;
  held_slots(stamp, k, held);
  write_continuations(conts, k, held, out.data_ptr<int64_t>());
  return {out, at::scalar_tensor(static_cast<int64_t>(held.size()), conts.options().dtype(at::kLong))};
}

// Every row's lookup in one call (a call from Python costs microseconds, which a 16-row batch paid per row):
// pool i's tables and keys[i] give an int64 [count_i, M] tensor of that key's continuations, oldest first.
std::vector<at::Tensor> lookup_rows_cpu(at::TensorList conts, at::TensorList stamp, at::IntArrayRef keys) {
  TORCH_CHECK_VALUE(conts.size() == keys.size() && stamp.size() == keys.size(),
                    "lookahead_pool.lookup_rows: one conts, one stamp and one key per row");
  std::vector<at::Tensor> rows;
  rows.reserve(keys.size());
  std::vector<std::pair<int64_t, int64_t>> held;
  for (size_t i = 0; i < keys.size(); ++i) {
    check_tables(conts[i], stamp[i]);
    TORCH_CHECK_VALUE(conts[i].device().is_cpu(), "lookahead_pool.lookup_rows: the tables must be on the CPU");
    const int64_t vocab = conts[i].size(0), m = conts[i].size(2);
    TORCH_CHECK_VALUE(keys[i] >= 0 && keys[i] < vocab, "lookahead_pool.lookup_rows: key must be in [0, ", vocab,
                      "), got ", keys[i], " for row ", i);
    held_slots(stamp[i], keys[i], held);  // the count first: each row's tensor is written in place
    at::Tensor out = at::empty({static_cast<int64_t>(held.size()), m}, conts[i].options().dtype(at::kLong));
    write_continuations(conts[i], keys[i], held, out.data_ptr<int64_t>());
    rows.push_back(std::move(out));
  }
  return rows;
}

}  // namespace
}  // namespace ngram_pool

TORCH_LIBRARY(lookahead_pool, m) {
  m.def("insert(Tensor(a!) conts, Tensor(b!) stamp, Tensor(c!) clock, Tensor ngrams) -> ()");
  m.def("lookup(Tensor conts, Tensor stamp, Tensor key) -> (Tensor, Tensor)");
  m.def("lookup_rows(Tensor[] conts, Tensor[] stamp, int[] keys) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(lookahead_pool, CPU, m) {
  m.impl("insert", &ngram_pool::insert_cpu);
  m.impl("lookup", &ngram_pool::lookup_cpu);
  m.impl("lookup_rows", &ngram_pool::lookup_rows_cpu);
}
