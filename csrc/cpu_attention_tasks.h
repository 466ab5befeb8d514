// The step attention's tasks (csrc/cpu_attention.cpp runs them): one build per instruction set, each in a source
// file of its own (cpu_attention_avx512.cpp, cpu_attention_avx512_split.cpp, cpu_attention_avx2.cpp; the SSE build in
// cpu_attention.cpp) so that they compile in parallel: in one file the 16-lane builds' instantiations (5 head
// dimensions, 12 few-row counts) took 99 s of a 2-core Zen 4's single thread and were the last of the library's
// files to finish. The tasks need no torch header (the arguments are plain pointers and strides).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu_vec.h"

namespace cpu_attention {

struct Args {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  const int64_t* cache_len;
  const bool* visible;
  int64_t B, T, Hq, Hkv, D;
  int64_t q_sb, q_st, q_sh;   // q strides (batch, token, head); the last dim is contiguous
  int64_t k_sb, k_ss, k_sh;   // k_cache strides
  int64_t v_sb, v_ss, v_sh;   // v_cache strides
  int64_t vis_sb;             // 0 when one [T, T] block serves every sequence
  float scale;
};

// A decode step's few-row task whose parts split_step spreads over the threads: its scores [2R, stride] (rows past R
// padding for the output's passes) and each range's row maxima [ranges, R].
struct SplitTask {
  int64_t b, kv;
  float* scores;
  float* maxima;
  int64_t stride, ranges;
};
constexpr int64_t kSplitKeys = 512;             // keys per range: tens of microseconds of work, a few a thread
constexpr int64_t kSplitMinKeys = 1024;         // the longest cache a split step needs
constexpr int64_t kSplitMaxTasksPerThread = 4;  // beyond, one task more on some threads costs little

// A task of at most this many rows runs few_row_task (keys in the vector lanes). Measured on a 2-core Zen 4,
// SmolLM2's heads (9 over 3), 30 layers, against rows in the lanes (ms, 150 / 1000 keys), one thread with caches
// warm: 6 rows 0.66 / 3.39 against 0.74 / 4.04, 9 rows 0.87 / 4.52 against 0.91 / 5.07, 12 rows 0.97 / 5.14 against
// 0.93 / 5.15, 15 rows 1.15 / 6.30 against 0.99 / 5.59; two threads, each layer's K and V cold: 12 rows 1.56 / 6.52
// against 1.64 / 7.23, 15 rows 1.75 / 7.50 against 1.72 / 7.69. With 8 lanes (AVX2, forced on that CPU) 6 rows
// were even and 9 lost.
constexpr int kFewRowsAvx512 = 12;
constexpr int kFewRowsAvx2 = 4;

using TaskFn = void (*)(const Args&, int64_t, int64_t, int64_t, float*, float*);
using SplitFn = void (*)(const Args&, const SplitTask&, int, int64_t, float*);

namespace {

using cpu_vec::exp_nonpositive;
using cpu_vec::load;
using cpu_vec::splat;
using cpu_vec::store;

// A decoding step's committed keys and values come from DRAM (a long context's cache is far larger than the
// caches), in rows Hkv * D apart; with the hardware prefetcher alone a task read them at a third of what one core
// streams. So the score pass prefetches K's lines and the output pass V's into L2 this many keys ahead, over the
// committed keys only (a prefill's own keys were just written and sit in the caches; prefetching them made a
// 4000-token prefill's attention 11% slower). Session 39, 2-core Zen 4, SmolLM2's heads, 30 layers, 2 threads,
// paired with the build before: a plain step over 1000 / 4000 keys 3.5-5.5 / 14.0-15.9 ms -> 1.9-2.7 / 8.7-10.5,
// 16 rows over 4000 keys 40.6-44.0 -> 29.5-33.8; 16 to 64 keys ahead measured alike, into L1 (hint 3) no better
// than none, V prefetched during the score pass (as before) no better than during its own.
constexpr int64_t kPrefetchKeys = 32;

// Every 64-byte line of `floats` floats from p into L2.
__attribute__((always_inline)) inline void prefetch_lines(const float* p, int64_t floats) {
  for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(p + f, 0, 2);
}

// The lanes of L vectors of L lanes transposed in place (r[d] lane u becomes r[u] lane d): log2(L) rounds of
// interleaving row i with row i + L/2, a perfect shuffle each round.
template <typename V>
__attribute__((always_inline)) inline void transpose(V* r) {
  constexpr int L = cpu_vec::Traits<V>::lanes;
  for (int round = 1; round < L; round *= 2) {
    V n[L];
    for (int i = 0; i < L / 2; ++i) {
      if constexpr (L == 16) {
        n[2 * i] = __builtin_shufflevector(r[i], r[i + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        n[2 * i + 1] = __builtin_shufflevector(r[i], r[i + 8], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                               15, 31);
      } else {
        static_assert(L == 8, "16 or 8 lanes");
        n[2 * i] = __builtin_shufflevector(r[i], r[i + 4], 0, 8, 1, 9, 2, 10, 3, 11);
        n[2 * i + 1] = __builtin_shufflevector(r[i], r[i + 4], 4, 12, 5, 13, 6, 14, 7, 15);
      }
    }
    for (int i = 0; i < L; ++i) r[i] = n[i];
  }
}

// qt [D, L]: the task's `rows` query rows (row r of the group: token r / G, query head kv * G + r % G), transposed
// and scaled (row i in lane i, the unused lanes zero).
template <int L>
inline void load_queries(const Args& a, int64_t b, int64_t kv, int64_t r0, int64_t rows, float* qt) {
  const int64_t G = a.Hq / a.Hkv, D = a.D;
  std::fill(qt, qt + D * L, 0.f);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = r0 + i, t = r / G, h = kv * G + r % G;
    const float* qr = a.q + b * a.q_sb + t * a.q_st + h * a.q_sh;
    for (int64_t d = 0; d < D; ++d) qt[d * L + i] = qr[d] * a.scale;
  }
}

// Scores of R rows over NB blocks of L keys from kb (K's rows k_ss apart), into scores[i * stride + u] (row i, key
// u of the blocks): each block's [L, D] slice of K transposed a vector of L dims at a time (lane u: key u), then
// acc += k[d] * q_i[d] over d in order; qt [D, L] holds the rows' scaled queries (row i in lane i). K's rows
// kPrefetchKeys ahead are prefetched.
template <typename V, int NV, int R, int NB>
__attribute__((always_inline)) inline void few_row_block_scores(const float* kb, int64_t k_ss, const float* qt,
                                                                float* scores, int64_t stride) {
  constexpr int L = cpu_vec::Traits<V>::lanes;
  constexpr int64_t D = NV * L;
  V kt[NB][D];
  for (int bk = 0; bk < NB; ++bk)
    for (int c = 0; c < NV; ++c) {
      V r[L];
      const float* kp = kb + bk * L * k_ss + c * L;
      for (int u = 0; u < L; ++u) {
        r[u] = load<V>(kp);
        __builtin_prefetch(kp + kPrefetchKeys * k_ss, 0, 2);
        kp += k_ss;
        asm("" : "+r"(kp));  // stepped: the compiler would keep L offsets, which spill
      }
      transpose(r);
      for (int d = 0; d < L; ++d) kt[bk][c * L + d] = r[d];
    }
  V acc[NB][R] = {};
  for (int64_t d = 0; d < D; ++d)
    for (int i = 0; i < R; ++i) {
      const V qd = splat<V>(qt[d * L + i]);
      for (int bk = 0; bk < NB; ++bk) acc[bk][i] += kt[bk][d] * qd;
    }
  for (int bk = 0; bk < NB; ++bk)
    for (int i = 0; i < R; ++i) store(scores + i * stride + bk * L, acc[bk][i]);
}

// Rows weighted_values takes a pass over the keys: CHUNK accumulators (sized to the registers of the instruction
// set) of NV vectors a row, at most MAXR rows.
template <int NV, int CHUNK, int MAXR>
constexpr int rows_per_pass() { return NV >= CHUNK ? 1 : (CHUNK / NV < MAXR ? CHUNK / NV : MAXR); }

// The output of a task's `rows` rows (row r0 + i of the GQA group) from their unnormalised weights, row i's for key
// s at p[i * row_stride + s * key_stride]: for each (row, vector of D) the weighted sum of V's rows in key order, then
// scaled by 1 / the row's sum. NW of the row's NV vectors are computed, from vector w_first on (a decode step's
// output split over threads: every value is computed the same way whatever the split). The sums come in inv, or
// (inv null) are taken in key order during the first pass (the same additions as a separate loop). A pass's rows
// past `rows` read p's next rows, which must be readable (their sums are dropped).
template <typename V, int NW, int CHUNK, int MAXR>
__attribute__((always_inline)) inline void weighted_values(const Args& a, int64_t b, int64_t kv, int64_t r0,
                                                           int64_t rows, int64_t keys, const float* p,
                                                           int64_t row_stride, int64_t key_stride, const float* inv,
                                                           int64_t w_first = 0) {
  constexpr int L = cpu_vec::Traits<V>::lanes;
  const int64_t G = a.Hq / a.Hkv, T = a.T, n = a.cache_len[b], D = a.D;
  const float* vb = a.v + b * a.v_sb + kv * a.v_sh;
  constexpr int kChunk = rows_per_pass<NW, CHUNK, MAXR>();
  constexpr int WB = NW >= CHUNK ? CHUNK : NW;
  for (int64_t c0 = 0; c0 < rows; c0 += kChunk) {
    const int64_t cn = std::min<int64_t>(kChunk, rows - c0);
    float scale[kChunk];
    for (int64_t w0 = w_first; w0 < w_first + NW; w0 += WB) {
      V o[kChunk][WB] = {};
      float l[kChunk] = {};
      const bool sum = inv == nullptr && w0 == w_first;
      for (int64_t s = 0; s < keys; ++s) {
        const float* vr = vb + s * a.v_ss + w0 * L;
        if (s + kPrefetchKeys < n) prefetch_lines(vr + kPrefetchKeys * a.v_ss, WB * L);
        for (int i = 0; i < kChunk; ++i) {
          const float weight = p[(c0 + i) * row_stride + s * key_stride];
          if (sum) l[i] += weight;
          const V ps = splat<V>(weight);
          for (int w = 0; w < WB; ++w) o[i][w] += ps * load<V>(vr + w * L);
        }
      }
      if (w0 == w_first)
        for (int64_t i = 0; i < cn; ++i)
          scale[i] = inv != nullptr ? inv[c0 + i] : (l[i] > 0.f ? 1.f / l[i] : 0.f);
      for (int64_t i = 0; i < cn; ++i) {
        const int64_t r = r0 + c0 + i, t = r / G, h = kv * G + r % G;
        float* dst = a.out + ((b * T + t) * a.Hq + h) * D + w0 * L;
        for (int w = 0; w < WB; ++w) store(dst + w * L, o[i][w] * scale[i]);
      }
    }
  }
}

// Rows a task's probabilities are padded to for weighted_values<V, NW, CHUNK, R> (its last pass reads whole passes).
template <int NW, int CHUNK, int R>
constexpr int padded_rows() {
  constexpr int pass = rows_per_pass<NW, CHUNK, R>();
  return (R + pass - 1) / pass * pass;
}

// One task of R rows (R at most FEW: a plain step's 3 rows of a GQA group would use 3 of 16 lanes with rows in the
// lanes) computed with keys in the lanes instead, every value as group_task computes it:
// - the scores (few_row_block_scores): for every (row, key) the very FMAs of group_task's loops, in the same order
//   from the same zero; keys past the last whole block as group_task scores them;
// - the softmax per row over [R, keys] (keys in lanes: R / L vectors of exps a key, not one): the same exp of the
//   same differences from the same exact max, and each row's sum in key order;
// - the output as group_task's, from the same probabilities in the same order.
// So a row's result is the same bits whichever path its step's size picks. `scores` holds [R, stride] (stride: the
// keys rounded up to L), and zero rows up to the output's last pass. The task runs in three parts, which a long
// decode step with fewer tasks than threads can spread over them (step_attention's split_step): the scores of a
// range of keys with each row's max over it; the weights of a range from the rows' maxima; the output, whole or by
// parts of D. Each value is computed the same way however the parts are spread.

// Part 1: the scores of keys [j0, j1) (j0 a multiple of L, j1 too or the task's last key), the step keys the rows
// do not see set to -inf (and the lanes past the last key), and each row's max over them in mx[i].
template <typename V, int NV, int R>
__attribute__((always_inline)) inline void few_row_scores(const Args& a, int64_t b, int64_t kv, int64_t r0,
                                                          int64_t j0, int64_t j1, float* scores, float* qt,
                                                          float* mx) {
  constexpr int L = cpu_vec::Traits<V>::lanes;
  constexpr int64_t D = NV * L;
  const int64_t G = a.Hq / a.Hkv, T = a.T, n = a.cache_len[b], keys = n + T;
  const int64_t stride = (keys + L - 1) / L * L;
  const float* kb = a.k + b * a.k_sb + kv * a.k_sh;
  const bool* vis = a.visible + b * a.vis_sb;
  load_queries<L>(a, b, kv, r0, R, qt);
  // Two or four blocks at once where R is small: R * NB independent sums hide the FMA's latency.
  constexpr int NB = std::max<int>(1, std::min<int>(R >= 4 ? 1 : (R == 1 ? 4 : 2), 4096 / (D * L)));
  int64_t j = j0;
  for (; j + NB * L <= j1; j += NB * L)
    few_row_block_scores<V, NV, R, NB>(kb + j * a.k_ss, a.k_ss, qt, scores + j, stride);
  for (; j + L <= j1; j += L)
    few_row_block_scores<V, NV, R, 1>(kb + j * a.k_ss, a.k_ss, qt, scores + j, stride);
  for (; j < j1; ++j) {
    V acc = {};
    for (int64_t d = 0; d < D; ++d) acc += splat<V>(kb[j * a.k_ss + d]) * load<V>(qt + d * L);
    for (int i = 0; i < R; ++i) scores[i * stride + j] = acc[i];
  }
  const float neg_inf = -INFINITY;
  const int64_t end = j1 == keys ? stride : j1;
  for (int i = 0; i < R; ++i) {
    float* row = scores + i * stride;
    const bool* row_vis = vis + ((r0 + i) / G) * T;
    for (int64_t s = std::max(j0, n) - n; s < j1 - n; ++s)
      if (!row_vis[s]) row[n + s] = neg_inf;
    for (int64_t s = keys; s < end; ++s) row[s] = neg_inf;  // the last block's lanes past the keys: p = 0
    V m = splat<V>(neg_inf);
    for (int64_t s = j0; s < end; s += L) {
      const V x = load<V>(row + s);
      m = x > m ? x : m;
    }
    float mx_i = neg_inf;
    for (int u = 0; u < L; ++u) mx_i = m[u] > mx_i ? m[u] : mx_i;
    mx[i] = mx_i;
  }
}

// Part 2: the unnormalised weights of keys [j0, j1) (both multiples of L, or j1 the padded end) in place, from each
// row's max over all its keys (mx[i]; -inf for a row that sees nothing: its weights are all zero); rows R to
// pad_rows zeroed over the range.
template <typename V>
__attribute__((always_inline)) inline void few_row_weights(int R, int pad_rows, int64_t stride, int64_t j0,
                                                           int64_t j1, float* scores, const float* mx) {
  constexpr int L = cpu_vec::Traits<V>::lanes;
  const float neg_inf = -INFINITY;
  for (int i = 0; i < R; ++i) {
    float* row = scores + i * stride;
    const V shift = splat<V>(mx[i] == neg_inf ? 0.f : mx[i]);
    for (int64_t s = j0; s < j1; s += L) {
      const V x = load<V>(row + s);
      V p = exp_nonpositive(x - shift);
      p = x == neg_inf ? V{} : p;
      store(row + s, p);
    }
  }
  for (int i = R; i < pad_rows; ++i) std::fill(scores + i * stride + j0, scores + i * stride + j1, 0.f);
}

template <typename V, int NV, int CHUNK, int R>
__attribute__((always_inline)) inline void few_row_task(const Args& a, int64_t b, int64_t kv, int64_t r0,
                                                        float* scores, float* qt) {
  constexpr int L = cpu_vec::Traits<V>::lanes;
  const int64_t keys = a.cache_len[b] + a.T, stride = (keys + L - 1) / L * L;
  float mx[R];
  few_row_scores<V, NV, R>(a, b, kv, r0, 0, keys, scores, qt, mx);
  few_row_weights<V>(R, padded_rows<NV, CHUNK, R>(), stride, 0, stride, scores, mx);
  // Part 3, whole: the output, each row's sum taken in key order on the way.
  weighted_values<V, NV, CHUNK, R>(a, b, kv, r0, R, keys, scores, stride, 1, nullptr);
}

template <typename V, int NV, int CHUNK, int... Rs>
__attribute__((always_inline)) inline void few_row_task_for(int64_t rows, const Args& a, int64_t b, int64_t kv,
                                                            int64_t r0, float* scores, float* qt,
                                                            std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? (few_row_task<V, NV, CHUNK, Rs + 1>(a, b, kv, r0, scores, qt), 0) : 0), ...);
}


// Part `phase` (0: scores, 1: weights, 2: output) of a split task's R = G * T rows, for range `index` (phases 0, 1)
// or output part `index` of kParts (phase 2; D's vectors in halves where there are two or more).
template <typename V, int NV, int CHUNK, int R>
__attribute__((always_inline)) inline void split_part(const Args& a, const SplitTask& t, int phase, int64_t index,
                                                      float* qt) {
  constexpr int kParts = NV >= 2 ? 2 : 1, kNW = NV / kParts;
  const int64_t keys = a.cache_len[t.b] + a.T;
  if (phase == 2) {
    weighted_values<V, kNW, CHUNK, R>(a, t.b, t.kv, 0, R, keys, t.scores, t.stride, 1, nullptr, index * kNW);
    return;
  }
  const int64_t j0 = index * kSplitKeys, j1 = std::min(keys, j0 + kSplitKeys);
  if (phase == 0) {
    few_row_scores<V, NV, R>(a, t.b, t.kv, 0, j0, j1, t.scores, qt, t.maxima + index * R);
    return;
  }
  float mx[R];
  for (int i = 0; i < R; ++i) {
    mx[i] = -INFINITY;
    for (int64_t r = 0; r < t.ranges; ++r) mx[i] = std::max(mx[i], t.maxima[r * R + i]);
  }
  few_row_weights<V>(R, padded_rows<kNW, CHUNK, R>(), t.stride, j0, j1 == keys ? t.stride : j1, t.scores, mx);
}

template <typename V, int NV, int CHUNK, int... Rs>
__attribute__((always_inline)) inline void split_part_for(int64_t rows, const Args& a, const SplitTask& t, int phase,
                                                          int64_t index, float* qt, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? (split_part<V, NV, CHUNK, Rs + 1>(a, t, phase, index, qt), 0) : 0), ...);
}

// One task: up to L query rows of sequence b that share the KV head kv, L the lanes of the vector type V; row r of
// the group is token r / G, query head kv * G + r % G. Scores and probabilities are [keys, L rows] (rows in vector
// lanes); the output is accumulated row by row over D in vectors (NV = D / L of them). KEYS keys are scored at once
// (independent accumulators hide the FMA latency); the output holds CHUNK vectors of accumulators: CHUNK / NV rows
// at a time, or, where one row's NV exceed CHUNK, one row and CHUNK of its vectors at a time. Both are sized to
// the registers of the instruction set V is compiled for.
template <typename V, int NV, int KEYS, int CHUNK, int FEW>
__attribute__((always_inline)) inline void group_task(const Args& a, int64_t b, int64_t kv, int64_t r0, float* scores,
                                                      float* qt) {
  constexpr int L = cpu_vec::Traits<V>::lanes;
  constexpr int64_t D = NV * L;
  const int64_t G = a.Hq / a.Hkv, T = a.T, n = a.cache_len[b];
  const int64_t rows = std::min<int64_t>(L, G * T - r0);
  if constexpr (FEW > 0) {
    if (rows <= FEW) {
      few_row_task_for<V, NV, CHUNK>(rows, a, b, kv, r0, scores, qt, std::make_integer_sequence<int, FEW>{});
      return;
    }
  }
  const float* kb = a.k + b * a.k_sb + kv * a.k_sh;
  const bool* vis = a.visible + b * a.vis_sb;
  // Keys after the last step key any of the task's rows sees are skipped: their weights are zeros (a prefill's
  // causal block gives a task early in the step half the keys or fewer; the work on the rest was half a long
  // prompt's attention).
  int64_t seen = 0;  // step keys up to the last one visible to a row of the task
  for (int64_t t = r0 / G; t <= (r0 + rows - 1) / G; ++t) {
    const bool* row_vis = vis + t * T;
    int64_t s = T;
    for (; s - 8 >= seen; s -= 8) {  // 8 hidden keys at a time: a causal row's tail
      uint64_t word;
      std::memcpy(&word, row_vis + s - 8, 8);
      if (word != 0) break;
    }
    for (; s > seen; --s)
      if (row_vis[s - 1]) {
        seen = s;
        break;
      }
  }
  const int64_t keys = n + seen;
  load_queries<L>(a, b, kv, r0, rows, qt);
  // Scores: KEYS keys at a time, then one at a time.
  int64_t j = 0;
  for (; j + KEYS <= keys; j += KEYS) {
    V acc[KEYS] = {};
    // Committed keys only: a prefill's own keys were just written and sit in the caches (prefetching them made a
    // 4000-token prefill's attention 11% slower).
    if (j + kPrefetchKeys < n)
      for (int u = 0; u < KEYS; ++u) prefetch_lines(kb + (j + u + kPrefetchKeys) * a.k_ss, D);
    for (int64_t d = 0; d < D; ++d) {
      const V qd = load<V>(qt + d * L);
      for (int u = 0; u < KEYS; ++u) acc[u] += splat<V>(kb[(j + u) * a.k_ss + d]) * qd;
    }
    for (int u = 0; u < KEYS; ++u) store(scores + (j + u) * L, acc[u]);
  }
  for (; j < keys; ++j) {
    V acc = {};
    for (int64_t d = 0; d < D; ++d) acc += splat<V>(kb[j * a.k_ss + d]) * load<V>(qt + d * L);
    store(scores + j * L, acc);
  }
  // The step's own keys: hidden ones get -inf. The G rows of a token share its visibility row, read once, 8 keys at
  // a time where all 8 are visible (a prefill's causal rows almost everywhere): key by key for every row, this loop
  // was a sixth of a long prompt's attention.
  const float neg_inf = -INFINITY;
  constexpr uint64_t kAllVisible = 0x0101010101010101ull;  // 8 bools, each true (stored as byte 1)
  for (int64_t t = r0 / G; t <= (r0 + rows - 1) / G; ++t) {
    const bool* row_vis = vis + t * T;
    const int64_t i0 = std::max(r0, t * G) - r0, i1 = std::min(r0 + rows, (t + 1) * G) - r0;
    for (int64_t s = 0; s < seen;) {
      uint64_t word = 0;
      if (s + 8 <= seen) std::memcpy(&word, row_vis + s, 8);
      if (word == kAllVisible) {
        s += 8;
        continue;
      }
      if (!row_vis[s])
        for (int64_t i = i0; i < i1; ++i) scores[(n + s) * L + i] = neg_inf;
      ++s;
    }
  }
  // Softmax per lane: max, exp, sum. A lane that sees nothing keeps max -inf: its weights are all zero.
  V m = splat<V>(neg_inf);
  for (int64_t s = 0; s < keys; ++s) {
    const V x = load<V>(scores + s * L);
    m = x > m ? x : m;
  }
  const V shift = m == neg_inf ? V{} : m;
  V l = {};
  for (int64_t s = 0; s < keys; ++s) {
    const V x = load<V>(scores + s * L);
    V p = exp_nonpositive(x - shift);
    p = x == neg_inf ? V{} : p;
    l += p;
    store(scores + s * L, p);
  }
  float inv[L];
  for (int i = 0; i < L; ++i) inv[i] = l[i] > 0.f ? 1.f / l[i] : 0.f;
  weighted_values<V, NV, CHUNK, L>(a, b, kv, r0, rows, keys, scores, 1, L, inv);
}

}  // namespace


// D = 16, 32, 64, 128 or 256 (checked by the caller), in vectors of L lanes.
#define CPU_ATTENTION_TASK(NAME, V, KEYS, CHUNK, FEW)                                                              \
  void NAME(const Args& a, int64_t b, int64_t kv, int64_t r0, float* scores, float* qt) {                          \
    constexpr int L = cpu_vec::Traits<V>::lanes;                                                                   \
    switch (a.D) {                                                                                                 \
      case 16: group_task<V, 16 / L, KEYS, CHUNK, FEW>(a, b, kv, r0, scores, qt); break;                           \
      case 32: group_task<V, 32 / L, KEYS, CHUNK, FEW>(a, b, kv, r0, scores, qt); break;                           \
      case 64: group_task<V, 64 / L, KEYS, CHUNK, FEW>(a, b, kv, r0, scores, qt); break;                           \
      case 128: group_task<V, 128 / L, KEYS, CHUNK, FEW>(a, b, kv, r0, scores, qt); break;                         \
      default: group_task<V, 256 / L, KEYS, CHUNK, FEW>(a, b, kv, r0, scores, qt); break;                          \
    }                                                                                                              \
  }


#define CPU_ATTENTION_SPLIT(NAME, V, CHUNK, FEW)                                                                   \
  void NAME(const Args& a, const SplitTask& t, int phase, int64_t index, float* qt) {                              \
    constexpr int L = cpu_vec::Traits<V>::lanes;                                                                   \
    const int64_t rows = a.Hq / a.Hkv * a.T;                                                                       \
    constexpr auto few = std::make_integer_sequence<int, FEW>{};                                                   \
    switch (a.D) {                                                                                                 \
      case 16: split_part_for<V, 16 / L, CHUNK>(rows, a, t, phase, index, qt, few); break;                         \
      case 32: split_part_for<V, 32 / L, CHUNK>(rows, a, t, phase, index, qt, few); break;                         \
      case 64: split_part_for<V, 64 / L, CHUNK>(rows, a, t, phase, index, qt, few); break;                         \
      case 128: split_part_for<V, 128 / L, CHUNK>(rows, a, t, phase, index, qt, few); break;                       \
      default: split_part_for<V, 256 / L, CHUNK>(rows, a, t, phase, index, qt, few); break;                        \
    }                                                                                                              \
  }

// One build per instruction set, each with the vectors one of its registers holds (16 lanes with AVX-512, 8 with
// AVX2, 4 with SSE; cpu_vec.h says why) and blocking that fits its 32 or 16 registers; chosen at run time as the
// GEMM chooses (tests force narrower ones). Before, one source of 16-lane vectors compiled by target_clones for
// "avx2" (no FMA) spent 0.43-0.6 ms a layer at T=1 on a Zen 1 EPYC (bench/results/forward-cpu-avx2.md).
__attribute__((target("avx512f,fma"))) void task_avx512(const Args& a, int64_t b, int64_t kv, int64_t r0,
                                                        float* scores, float* qt);
__attribute__((target("avx2,fma"))) void task_avx2(const Args& a, int64_t b, int64_t kv, int64_t r0, float* scores,
                                                   float* qt);
__attribute__((target("avx512f,fma"))) void split_avx512(const Args& a, const SplitTask& t, int phase,
                                                         int64_t index, float* qt);
__attribute__((target("avx2,fma"))) void split_avx2(const Args& a, const SplitTask& t, int phase, int64_t index,
                                                    float* qt);

}  // namespace cpu_attention
