// The n-gram pool's table layout and the torch-free helpers of its CPU ops (ngram_pool.cpp).
//
// Sizes: V = vocab size, G = continuations kept per key (guess set size), M = N - 1 tokens per continuation.
//
//   conts  int32 [V, G, M]  conts[k, s, :] is the continuation held in slot s of key k (meaningless when empty)
//   stamp  int64 [V, G]     insertion clock value of slot s of key k when it was last inserted; -1 = empty
//   clock  int64 [1]        next stamp to hand out (starts at 0, +1 per inserted row)
//
// Semantics (equal to the Python reference lookahead/pool.py): rows are inserted in order; a row whose
// continuation is already held under its key only gets a fresh stamp (moves to the newest end); otherwise it
// takes an empty slot or, when all G are full, the slot with the smallest stamp (the least recently inserted).
// Lookup lists a key's occupied slots by increasing stamp (oldest first). Stamps are unique, so the order is
// total. Because empty slots carry -1, "the slot with the smallest stamp" picks an empty slot first: one rule
// serves both cases.
#pragma once

#include <stdint.h>

namespace ngram_pool {

constexpr int64_t kEmpty = -1;

// True when every token of row[0 .. n) lies in [0, vocab).
inline bool row_in_range(const int64_t* row, int64_t n, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] < 0 || row[i] >= vocab) return false;
  }
  return true;
}

// True when the continuation in a slot (int32[M]) equals cont (int64[M]).
inline bool same_continuation(const int32_t* slot, const int64_t* cont, int64_t m) {
  for (int64_t i = 0; i < m; ++i) {
    if (static_cast<int64_t>(slot[i]) != cont[i]) return false;
  }
  return true;
}

}  // namespace ngram_pool
