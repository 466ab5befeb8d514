// CUDA kernels of the n-gram pool (layout and semantics: ngram_pool.h). No torch: ngram_pool_cuda.cu adds
// the torch glue, and this header can be compile-checked on its own with nvcc.
#pragma once

#include <stdint.h>

#include "ngram_pool.h"

namespace ngram_pool {

constexpr int kInsertThreads = 32;   // insert runs as exactly one warp
constexpr int kLookupThreads = 128;
constexpr unsigned kFullMask = 0xffffffffu;

// Inserts rows of ngrams [rows, m + 1] in order; launch <<<1, kInsertThreads>>>.
//
// Rows of one batch may share a key or repeat each other, so they are processed strictly one after another
// (K is ~15 per step; the launch dominates). Within a row, lane l looks at slots l, l + 32, ...: it finds a
// slot already holding the continuation, or else its candidate slot with the smallest stamp (empty = -1
// comes first); the warp then agrees on one slot. Rows with a token outside [0, vocab) are skipped (the
// host checks values before launching when asked; without that check the kernel must still stay in bounds).
__global__ void insert_kernel(int32_t* __restrict__ conts, int64_t* __restrict__ stamp,
                              int64_t* __restrict__ clock, const int64_t* __restrict__ ngrams, int64_t rows,
                              int64_t vocab, int64_t guess, int64_t m) {
  const int lane = threadIdx.x;
  long long now = clock[0];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* row = ngrams + r * (m + 1);
    bool bad = false;
    for (int64_t i = lane; i < m + 1; i += kInsertThreads) bad |= row[i] < 0 || row[i] >= vocab;
    if (__any_sync(kFullMask, bad)) continue;

    int64_t* key_stamp = stamp + row[0] * guess;
    int32_t* key_conts = conts + row[0] * guess * m;
    long long match = -1;                   // a slot holding this continuation (at most one exists)
    long long best_stamp = INT64_MAX;       // this lane's slot with the smallest stamp
    long long best_slot = -1;
    for (int64_t s = lane; s < guess; s += kInsertThreads) {
      const long long st = key_stamp[s];
      if (st != kEmpty && same_continuation(key_conts + s * m, row + 1, m)) match = s;
      if (st < best_stamp) {
        best_stamp = st;
        best_slot = s;
      }
    }
    for (int offset = kInsertThreads / 2; offset > 0; offset /= 2) {
      const long long other_match = __shfl_xor_sync(kFullMask, match, offset);
      const long long other_stamp = __shfl_xor_sync(kFullMask, best_stamp, offset);
      const long long other_slot = __shfl_xor_sync(kFullMask, best_slot, offset);
      match = other_match > match ? other_match : match;
      // Ties (several empty slots) go to the lower slot, so every lane ends with the same choice.
      if (other_stamp < best_stamp || (other_stamp == best_stamp && other_slot < best_slot && other_slot >= 0)) {
        best_stamp = other_stamp;
        best_slot = other_slot;
      }
    }
    const long long slot = match >= 0 ? match : best_slot;
    if (match < 0) {
      for (int64_t i = lane; i < m; i += kInsertThreads) key_conts[slot * m + i] = static_cast<int32_t>(row[1 + i]);
    }
    if (lane == 0) key_stamp[slot] = now;
    ++now;
    // Orders this row's writes before the next row's reads by other lanes.
    __syncwarp(kFullMask);
  }
  if (lane == 0) clock[0] = now;
}

// Writes out [guess, m] (int64): the key's continuations by increasing stamp, then rows of -1; and count []
// (int64). The key is read on the device, so the host never waits. A key outside [0, vocab) gives count 0.
// Launch <<<1, kLookupThreads>>>.
__global__ void lookup_kernel(const int32_t* __restrict__ conts, const int64_t* __restrict__ stamp,
                              const int64_t* __restrict__ key_ptr, int64_t* __restrict__ out,
                              int64_t* __restrict__ count, int64_t vocab, int64_t guess, int64_t m) {
  const int64_t key = *key_ptr;
  const bool valid = key >= 0 && key < vocab;
  const int64_t* key_stamp = stamp + (valid ? key : 0) * guess;
  const int32_t* key_conts = conts + (valid ? key : 0) * guess * m;
  int64_t held = 0;
  if (valid) {
    for (int64_t t = 0; t < guess; ++t) held += key_stamp[t] != kEmpty;
    // Stamps are unique, so each held slot's rank (how many held slots are older) is a distinct output row.
    for (int64_t s = threadIdx.x; s < guess; s += blockDim.x) {
      const int64_t st = key_stamp[s];
      if (st == kEmpty) continue;
      int64_t rank = 0;
      for (int64_t t = 0; t < guess; ++t) rank += key_stamp[t] != kEmpty && key_stamp[t] < st;
      for (int64_t i = 0; i < m; ++i) out[rank * m + i] = key_conts[s * m + i];
    }
  }
  for (int64_t e = held * m + threadIdx.x; e < guess * m; e += blockDim.x) out[e] = -1;
  if (threadIdx.x == 0) *count = held;
}

}  // namespace ngram_pool
