// Small-M float32 GEMM for the CPU forward: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), for the few dozen rows of a
// decoding step, where the cost is reading W (hundreds of MB per step) and the few FLOPs per weight must hide
// behind that stream.
//
// W is packed once into groups of 32 output columns, [G = ceil(N/32), K, 32] (zero-padded), so each thread
// streams a contiguous range of groups. Within a group, K is cut into blocks of kKB rows (8 KB of weights):
// all M rows go over a block (in passes of MR rows whose accumulators fill the registers) before the next
// block is read, so the weight block is read from memory once and from L1 for the later passes, and the next
// block is prefetched into L2 during the current one, which keeps the memory busy while the FMAs run.
// Partial sums live in a small per-thread buffer [M, 32] between blocks; every output is one fp32 sum over
// k in order.
//
// Quantised checkpoints (the default model is a Q4_1 GGUF) hold weights that are exactly d * q + m for 4-bit q, or d *
// q for 8-bit q, per block of 32 along K with a half-precision d (Q4_K, the usual 4-bit GGUF type: d a half times a
// 6-bit scale): their float32 copies waste 6.4x or 3.8x the bytes a step must read. pack finds such weights (every
// block must reproduce every float's bits, a -0.0 as +0.0 aside (same_weight), else the plain float32 layout is kept)
// and stores them as those integers.
// The GEMM expands them to the very floats the float32 layout holds and runs the same FMAs in the same order, so every
// format gives identical results: for up to kFusedRowsAvx2 (AVX2) or kFusedRowsAvx512 rows each k row of weights is
// expanded into registers and used at once, or (no AVX2) for up to kFusedRows each 64 x 32 block into an L1 buffer
// that the row passes then read. On a Zen 1 EPYC (2 threads) a SmolLM2 forward of one token took 23.1 ms instead of
// 33.7 (the expansion, not memory, now bounds it); on a Zen 4 (AVX-512), a one-token step 8.2 ms in registers
// against 12.4 through L1.
//   f32: float32 [G, K, 32]
//   q4:  per group and 32 x 32 block (768 bytes), d[32] and m[32] as float32 (one per column), then for each of
//        the 32 k 16 bytes, column c's q in the low nibble of byte c (c < 16) or the high nibble of byte c - 16
//   q8:  per group and block (1152 bytes), d[32] as float32, then for each k the 32 columns' q as int8
//   q8h: as q8 with a d per 16 along K (1280 bytes): d[32] for k 0..15, d[32] for k 16..31, then the q (GGUF's Q6_K:
//        a half per 256 weights times an 8-bit scale per 16, q in [-32, 31]; Q3_K: times a 6-bit one, q in [-4, 3])
//   q8m: as q4 with a byte a q (1280 bytes): d[32], m[32], then for each k the 32 columns' q as uint8 (GGUF's
//        5-bit types with an offset, Q5_1 and Q5_K)
//   mixed: per group one of the above or none (a fused weight of tensors of several types): after the header a
//        table of (format, byte offset) per group, then each group's blocks, then the f32 layout (which groups of
//        no quantised form read at every step size)
// A quantised weight is one uint8 tensor: a 64-byte header (Header), the blocks [G, K/32], then the f32 layout:
// larger steps read that instead, where expanding costs FMAs the step needs (SmolLM2 on a Zen 1 EPYC, 16 rows: 98.0
// ms from the blocks, 90.4 from f32).
// d * q is exact in float32 (d has 11 significant bits, or 17 for Q4_K's, q at most 8 or 4), so d * q + m rounds once
// however it is computed (FMA or not): pack's check and the GEMM's expansion agree bit for bit.
//
// One source, two instruction sets chosen at run time (AVX-512 where the CPU has it, else AVX2+FMA), plus a
// plain loop for other CPUs. Ops (namespace lookahead_gemm):
//   pack(Tensor weight, str format="auto") -> Tensor   weight [N, K] float32 -> one of the layouts above; "auto":
//                                                      q4, q8, q8h or q8m where the weight is exactly one,
//                                                      else mixed where some group is, else f32
//   packed_format(Tensor packed) -> str                "f32", "q4", "q8", "q8h", "q8m" or "mixed"
//   linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor     x [M, K] -> y [M, n]
//   isa() -> str                                                       "avx512", "avx2" or "scalar"
//   force_isa(str isa) -> ()            tests: run this GEMM and the step attention as "avx2" or "scalar" even
//                                       where the CPU has more; "" undoes
//   chunked_rows() -> int               the most rows that read a quantised weight's blocks (in chunks past the
//                                       kernels' own limit; beyond, the f32 layout)
//   force_chunked_rows(int rows) -> ()  tests: read the blocks up to `rows` rows in chunks; -1 undoes

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cpu_ops.h"

namespace small_gemm {
namespace {

constexpr int64_t kCols = 32;  // output columns per packed group
#ifndef SMALL_GEMM_KB
#define SMALL_GEMM_KB 64
#endif
constexpr int64_t kKB = SMALL_GEMM_KB;  // k rows per block: 64 * 32 floats = 8 KB (measured best of 64/128/256)
static_assert(kKB % 32 == 0, "a GEMM block holds whole quantised blocks");
// Without AVX2, up to this many rows a step reads a quantised weight's blocks (expanded once per block into L1);
// beyond, it reads the f32 layout beside them.
// Measured on a Zen 1 EPYC, SmolLM2's linear layers (minimum of 15 rounds): 3 rows 26.3 ms in registers against
// 29.0 from f32; 4 rows 30.0 against 35.0; 5 rows through L1 34.3 against 32.4.
constexpr int64_t kFusedRows = 4;
// On AVX2 up to 8, expanded in registers and used at once (k256_quantised_group). Past 4 rows the accumulators no
// longer all fit the registers, and it still beats the f32 layout (SmolLM2's forward on a Zen 1 EPYC, session 22,
// cost tables in alternating processes, t(R) / t(4): 5 rows 1.09-1.13 against 1.23-1.36 from f32, 6 rows
// 1.27-1.30 against 1.42-1.52, 7 rows 1.35-1.46 against 1.63-1.74, 8 rows 1.55-1.60 against 1.77-1.89; four
// slices of 8 columns, whose R accumulators fit, were slower: each reads the block's bytes and broadcasts x again).
constexpr int64_t kFusedRowsAvx2 = 8;
// On AVX-512 the same, up to this many rows (k512_quantised_group), where its 2 R accumulators still fit the 32
// registers. Measured on a 2-core Zen 4, SmolLM2's 120 decoder linear layers as random Q4_1 weights (medians of 9
// rounds): 1 row 3.9 ms from the blocks against 14.0 from f32, 8 rows 11.3-11.9 against 14.8-15.7, 11 rows 13.8
// against 14.8, 12 rows 15.0-16.0 against 14.9-16.4.
constexpr int64_t kFusedRowsAvx512 = 12;
// Past those rows a quantised weight's blocks can still be read, in balanced chunks of at most that many rows (each
// chunk expands the group's blocks again, from L1/L2), instead of the f32 layout (4x the bytes, read once). Which is
// faster depends on the core. SmolLM2's forward on a 2-core Zen 5 (two full 512-bit FMA pipes), alternating
// processes: 13 rows 10.5-10.7 ms from the blocks against 13.8-14.2 from f32, 16 rows 12.4-12.6 against 14.7-15.0,
// 20 rows 15.1-15.3 against 16.1-16.6, 24 rows 17.8-18.3 against 17.5-18.1. On a Zen 4 (512-bit ops in two halves)
// 12 rows from the blocks already cost what the f32 layout does (above), so a second chunk could only lose there.
// AMD cores from family 0x1A (Zen 5) take the chunks; elsewhere (Intel not measured) the f32 layout as before.
constexpr int64_t kChunkedRowsZen5 = 24;

// kMixed: each group of 32 columns in its own format (kF32: that group reads the f32 layout), from a table.
enum Format : int { kF32 = 0, kQ4 = 1, kQ8 = 2, kQ8H = 3, kQ8M = 4, kMixed = 5 };
constexpr int64_t kQK = 32;                           // k per quantised block
constexpr int64_t kQ4Bytes = 2 * kCols * 4 + kQK * 16;  // d, m, then 32 k of 16 bytes
constexpr int64_t kQ8Bytes = kCols * 4 + kQK * kCols;   // d, then 32 k of 32 bytes
constexpr int64_t kQ8HBytes = 2 * kCols * 4 + kQK * kCols;  // d for k 0..15 and for k 16..31, then as q8
constexpr int64_t kQ8MBytes = 2 * kCols * 4 + kQK * kCols;  // d, m, then 32 k of 32 bytes (uint8 q)

constexpr int64_t block_bytes(Format f) {
  return f == kQ4 ? kQ4Bytes : f == kQ8 ? kQ8Bytes : f == kQ8H ? kQ8HBytes : kQ8MBytes;
}
constexpr const char* format_name(Format f) {
  return f == kF32 ? "f32" : f == kQ4 ? "q4" : f == kQ8 ? "q8" : f == kQ8H ? "q8h" : f == kQ8M ? "q8m" : "mixed";
}

// A packed weight as linear reads it: its float32 layout and, for a quantised weight, its blocks (q not null).
struct Packed {
  Format format;
  int64_t K, groups;
  const float* f32;
  const uint8_t* q;
  const int64_t* table = nullptr;  // kMixed: per group its format and its blocks' byte offset from q

  // Group g's format and first block (its format kF32: read the f32 layout).
  const uint8_t* group(int64_t g, Format* f) const {
    if (table != nullptr) {
      *f = static_cast<Format>(table[2 * g]);
      return q + table[2 * g + 1];
    }
    *f = format;
    return format == kF32 ? nullptr : q + g * (K / kQK) * block_bytes(format);
  }
};

// Whether the CPU is an AMD core of at least this family (0x1A: Zen 5), from cpuid.
bool amd_family_at_least(unsigned family) {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541 || d != 0x69746e65 || c != 0x444d4163) return false;  // AMD
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  unsigned f = (a >> 8) & 0xf;
  if (f == 0xf) f += (a >> 20) & 0xff;  // the extended family
  return f >= family;
}

// A Zen 5 or later AMD core (full-width AVX-512): where measured, its best kernel choices differ from the Zen 4's.
bool zen5_or_later() {
  static const bool zen5 = amd_family_at_least(0x1A);
  return zen5;
}

// A quantised group's blocks are one stream per thread, which the hardware prefetcher follows. Prefetching into L2
// the whole block 8 blocks ahead, every 64-byte line of it, beats it wherever a block takes a while: on AVX2 at every
// row count, on AVX-512 from 4 rows; below, one line 4 blocks ahead serves best (the prefetch instructions for the
// whole block cost more than they bring there). Measured on a 2-core Zen 4, SmolLM2's 120 decoder linear layers as
// random Q4_1 weights (in one process, 21-41 rounds alternating, medians of the per-round ratios against one line 8
// blocks ahead): the whole block, AVX2 (forced) 0.99 / 0.97 / 0.87 / 0.86 / 0.90 / 0.94 at 1 / 2 / 3 / 4 / 6 / 8
// rows, AVX-512 1.02 / 1.03 / 1.01 at 1-3 rows, 0.98 / 0.95 / 0.95 at 4 / 6 / 8 rows (4 or 12 blocks ahead instead
// of 8: within 1%); one line 4 blocks ahead, AVX-512, 0.93-0.98 at 1 row, 0.94-0.98 at 2, 0.97 at 3 (in four runs).
// On a 2-core Zen 5 the whole block pays at every row count (k512_quantised_group): SmolLM2's forward, builds
// alternating over 3 rounds, t(1) 3.6-3.9 ms against 3.8-3.9, t(2) 4.0-4.3 against 4.4, t(3) 4.4-4.7 against
// 4.9-5.0; its 120 decoder layers alone 2.15-2.21 ms against 2.34-2.41 at 1 row, 2.44-2.54 against 2.81-2.95 at 3.
template <bool kWhole>
inline void prefetch_block(const uint8_t* block, int64_t bytes) {
  if constexpr (kWhole) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(block + 8 * bytes + line, 0, 2);
  } else {
    __builtin_prefetch(block + 4 * bytes, 0, 2);
  }
}

// MR rows of one group over k in [0, kn) of a block: acc (from / to buf, row stride 32) += x[:, k] * w[k, :].
// x points at column k0 of row 0 (row stride K); w at row k0 of the group; pf at the next block (prefetched).
#define SMALL_GEMM_KERNEL(NAME, VW, MAXR)                                                                      \
  typedef float NAME##_vf __attribute__((vector_size((VW) * 4), aligned(4)));                                  \
  template <int R>                                                                                              \
  static void NAME##_block(const float* x, int64_t K, int64_t kn, const float* w, float* buf, bool first,      \
                           const char* pf) {                                                                    \
    constexpr int NV = kCols / (VW);                                                                            \
    NAME##_vf acc[R][NV];                                                                                       \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)                                                        \
      _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) {                                                    \
        if (first) acc[r][j] = (NAME##_vf){};                                                                   \
        else std::memcpy(&acc[r][j], buf + r * kCols + j * (VW), sizeof(NAME##_vf));                            \
      }                                                                                                         \
    for (int64_t k = 0; k < kn; ++k) {                                                                          \
      __builtin_prefetch(pf + k * kCols * 4, 0, 2); /* without: 1.6x slower at M=16 */                                                             \
      __builtin_prefetch(pf + k * kCols * 4 + 64, 0, 2);                                                        \
      NAME##_vf wv[NV];                                                                                         \
      _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j)                                                      \
        std::memcpy(&wv[j], w + k * kCols + j * (VW), sizeof(NAME##_vf));                                       \
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {                                                    \
        const float s = x[r * K + k];                                                                           \
        _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) acc[r][j] += wv[j] * s;                            \
      }                                                                                                         \
    }                                                                                                           \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)                                                        \
      _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j)                                                      \
        std::memcpy(buf + r * kCols + j * (VW), &acc[r][j], sizeof(NAME##_vf));                                 \
  }                                                                                                             \
  template <int... Rs>                                                                                          \
  static constexpr std::array<BlockFn, sizeof...(Rs)> NAME##_table(std::integer_sequence<int, Rs...>) {         \
    return {NAME##_block<Rs + 1>...};                                                                           \
  }                                                                                                             \
  static void NAME##_groups(const float* x, int64_t M, const Packed& w, int64_t g0, int64_t g1, float* buf,     \
                            float* scratch, int64_t rows_per, float* y, int64_t n, const float* bias) {        \
    static constexpr auto blocks = NAME##_table(std::make_integer_sequence<int, MAXR>{});                       \
    run_groups(blocks.data(), x, M, w, g0, g1, buf, scratch, rows_per, y, n, bias);                              \
  }

// Copies buf [M, 32] to y's columns c0 .. c0+31 (those < n), adding bias.
inline void store_rows(const float* buf, int64_t M, float* y, int64_t n, int64_t c0, const float* bias) {
  const int64_t width = std::min<int64_t>(kCols, n - c0);
  for (int64_t i = 0; i < M; ++i) {
    float* dst = y + i * n + c0;
    const float* src = buf + i * kCols;
    if (bias == nullptr) {
      std::memcpy(dst, src, width * sizeof(float));
    } else {
      for (int64_t c = 0; c < width; ++c) dst[c] = src[c] + bias[c0 + c];
    }
  }
}

// One quantised group for all of a step's rows (one function per row count): sums into buf [M, 32].
using GroupFn = void (*)(const float*, int64_t, const uint8_t*, float*);

// An instruction set's GEMM over groups [g0, g1): (x, M, w, g0, g1, buf, scratch, rows_per, y, n, bias).
using GroupsFn = void (*)(const float*, int64_t, const Packed&, int64_t, int64_t, float*, float*, int64_t, float*,
                          int64_t, const float*);

// One block of R rows (R = 1 .. the kernel's most): as SMALL_GEMM_KERNEL's NAME##_block says.
using BlockFn = void (*)(const float*, int64_t, int64_t, const float*, float*, bool, const char*);

// Expands `blocks` quantised blocks of 32 x 32 weights at `src` into out [32 * blocks, 32] floats: q4 (kNibbles,
// column c's q in byte c % 16) or q8m (a byte a q), both d * q + m. Only CPUs without AVX2 read weights this way
// (AVX2 and AVX-512 expand them in registers), so these are plain loops, compiled once.
template <bool kNibbles>
static inline void expand_affine(const uint8_t* src, int64_t blocks, float* out) {
  constexpr int64_t bytes = kNibbles ? kQ4Bytes : kQ8MBytes;
  for (int64_t b = 0; b < blocks; ++b, src += bytes, out += kQK * kCols) {
    float d[kCols], m[kCols];
    std::memcpy(d, src, sizeof d);
    std::memcpy(m, src + sizeof d, sizeof m);
    const uint8_t* q = src + sizeof d + sizeof m;
    for (int64_t k = 0; k < kQK; ++k) {
      float* o = out + k * kCols;
      if constexpr (kNibbles) {  // two plain loops of 16: the low nibbles, then the high ones
        const uint8_t* qk = q + k * 16;
        for (int c = 0; c < 16; ++c) o[c] = d[c] * static_cast<float>(qk[c] & 15) + m[c];
        for (int c = 0; c < 16; ++c) o[16 + c] = d[16 + c] * static_cast<float>(qk[c] >> 4) + m[16 + c];
      } else {
        const uint8_t* qk = q + k * kCols;
        for (int c = 0; c < kCols; ++c) o[c] = d[c] * static_cast<float>(qk[c]) + m[c];
      }
    }
  }
}

void expand_q4(const uint8_t* src, int64_t blocks, float* out) { expand_affine<true>(src, blocks, out); }

void expand_q8m(const uint8_t* src, int64_t blocks, float* out) { expand_affine<false>(src, blocks, out); }

void expand_q8(const uint8_t* src, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, src += kQ8Bytes, out += kQK * kCols) {
    float d[kCols];
    std::memcpy(d, src, sizeof d);
    const int8_t* q = reinterpret_cast<const int8_t*>(src + sizeof d);
    for (int64_t k = 0; k < kQK; ++k)
      for (int c = 0; c < kCols; ++c) out[k * kCols + c] = d[c] * static_cast<float>(q[k * kCols + c]);
  }
}

void expand_q8h(const uint8_t* src, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, src += kQ8HBytes, out += kQK * kCols) {
    float d[2][kCols];
    std::memcpy(d, src, sizeof d);
    const int8_t* q = reinterpret_cast<const int8_t*>(src + sizeof d);
    for (int64_t k = 0; k < kQK; ++k)
      for (int c = 0; c < kCols; ++c) out[k * kCols + c] = d[k >= 16][c] * static_cast<float>(q[k * kCols + c]);
  }
}

// Groups [g0, g1) of the packed weight: each K block is read by every pass of rows_per rows (blocks[r - 1] runs a
// pass of r rows) before the next block, and each group's sums are stored once its last block is done. A quantised
// block (only without AVX2: the other sets expand in registers) is expanded into `scratch` [kKB, 32] first; the
// passes then read it from L1.
void run_groups(const BlockFn* blocks, const float* x, int64_t M, const Packed& w, int64_t g0, int64_t g1,
                float* buf, float* scratch, int64_t rows_per, float* y, int64_t n, const float* bias) {
  const int64_t K = w.K;
  for (int64_t g = g0; g < g1; ++g) {
    Format f;
    const uint8_t* blocks_of_g = w.group(g, &f);
    for (int64_t k0 = 0; k0 < K; k0 += kKB) {
      const int64_t kn = std::min(kKB, K - k0);
      const float* wb;
      const char* pf;  // the next block, contiguous
      if (f == kF32) {
        wb = w.f32 + (g * K + k0) * kCols;
        pf = reinterpret_cast<const char*>(wb + kn * kCols);
      } else {
        const int64_t bytes = block_bytes(f);
        const uint8_t* src = blocks_of_g + k0 / kQK * bytes;
        (f == kQ4 ? expand_q4 : f == kQ8 ? expand_q8 : f == kQ8H ? expand_q8h : expand_q8m)(src, kn / kQK, scratch);
        wb = scratch;
        pf = reinterpret_cast<const char*>(src + kn / kQK * bytes);
      }
      for (int64_t m0 = 0; m0 < M; m0 += rows_per) {
        const int r = static_cast<int>(std::min(rows_per, M - m0));
        blocks[r - 1](x + m0 * K + k0, K, kn, wb, buf + m0 * kCols, k0 == 0, pf);
      }
    }
    store_rows(buf, M, y, n, g * kCols, bias);
  }
}

// Groups [g0, g1) of a quantised or mixed weight for a step of M rows, each by its format's kernel that expands the
// integers in registers (tables q4, q8, q8h, q8m indexed by M - 1); a mixed weight's group of no quantised form
// by `f32` on its float32 columns.
static void fused_groups(const GroupFn* q4, const GroupFn* q8, const GroupFn* q8h, const GroupFn* q8m, int64_t fused,
                         GroupsFn f32, const float* x, int64_t M, const Packed& w, int64_t g0, int64_t g1, float* buf,
                         float* scratch, int64_t rows_per, float* y, int64_t n, const float* bias) {
  const int64_t chunks = (M + fused - 1) / fused;
  const int64_t fused_per = (M + chunks - 1) / chunks;
  for (int64_t g = g0; g < g1; ++g) {
    Format f;
    const uint8_t* src = w.group(g, &f);
    if (f == kF32) {
      f32(x, M, w, g, g + 1, buf, scratch, rows_per, y, n, bias);
      continue;
    }
    const GroupFn* kernels = f == kQ4 ? q4 : f == kQ8 ? q8 : f == kQ8H ? q8h : q8m;
    for (int64_t m0 = 0; m0 < M; m0 += fused_per) {  // more rows than a kernel takes: balanced chunks
      kernels[std::min(fused_per, M - m0) - 1](x + m0 * w.K, w.K, src, buf + m0 * kCols);
    }
    store_rows(buf, M, y, n, g * kCols, bias);
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,fma")
SMALL_GEMM_KERNEL(k512, 16, 12)

// Row k of a quantised block's 32 columns as two vectors of floats, each weight fma(d, q, m) (q4, q8m) or d * q (q8,
// q8h), as the f32 layout holds it; d0/d1 and m0/m1 are the block's scales and offsets for columns 0-15 and 16-31.
// AVX512F instructions only (isa_name asks for no more).
template <Format F>
static inline void k512_expand(const uint8_t* q, int64_t k, __m512 d0, __m512 d1, __m512 m0, __m512 m1, __m512& w0,
                               __m512& w1) {
  if constexpr (F == kQ4) {  // columns 0-15: the low nibbles of the row's 16 bytes, 16-31: the high ones
    const __m128i by = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16));
    const __m128i low4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(by, low4), hi = _mm_and_si128(_mm_srli_epi16(by, 4), low4);
    w0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), m0);
    w1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), m1);
  } else {
    const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * kCols));
    const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * kCols + 16));
    if constexpr (F == kQ8M) {
      w0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v0)), m0);
      w1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v1)), m1);
    } else {
      w0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v0)));
      w1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v1)));
    }
  }
}

// A quantised group for R <= kFusedRowsAvx512 rows, all 32 columns at once: each k row of the blocks is expanded into
// registers and used at once (no round trip through L1), the 2 R accumulators kept over all of K. 32 registers hold
// them, the scales and offsets, the two weight vectors and the broadcast. The same FMAs in the same order as
// k512_block on the expanded floats: identical sums.
template <int R, Format F>
static void k512_quantised_group(const float* x, int64_t K, const uint8_t* group, float* buf) {
  constexpr int64_t bytes = block_bytes(F);
  constexpr int64_t scales = F == kQ8 ? kCols * 4 : 2 * kCols * 4;  // the bytes of d (and m) before the q
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const bool whole = R >= 4 || zen5_or_later();  // how far ahead to prefetch (above prefetch_block)
  const uint8_t* src = group;
  for (int64_t b = 0; b < K / kQK; ++b, src += bytes) {
    if (whole) {
      prefetch_block<true>(src, bytes);
    } else {
      prefetch_block<false>(src, bytes);
    }
    const float* d = reinterpret_cast<const float*>(src);
    const uint8_t* q = src + scales;
    const float* xb = x + b * kQK;
    __m512 d0 = _mm512_loadu_ps(d), d1 = _mm512_loadu_ps(d + 16), m0 = _mm512_setzero_ps(), m1 = m0;
    if constexpr (F == kQ4 || F == kQ8M) m0 = _mm512_loadu_ps(d + kCols), m1 = _mm512_loadu_ps(d + kCols + 16);
    for (int64_t k = 0; k < kQK; ++k) {
      if constexpr (F == kQ8H) {  // the second half of the block has scales of its own
        if (k == 16) d0 = _mm512_loadu_ps(d + kCols), d1 = _mm512_loadu_ps(d + kCols + 16);
      }
      __m512 w0, w1;
      k512_expand<F>(q, k, d0, d1, m0, m1, w0, w1);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(xb[r * K + k]);
        acc[r][0] = _mm512_fmadd_ps(w0, s, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w1, s, acc[r][1]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(buf + r * kCols, acc[r][0]);
    _mm512_storeu_ps(buf + r * kCols + 16, acc[r][1]);
  }
}

template <Format F, int... Rs>
static constexpr std::array<GroupFn, sizeof...(Rs)> k512_quantised_kernels(std::integer_sequence<int, Rs...>) {
  return {k512_quantised_group<Rs + 1, F>...};
}

// k512_groups, with a quantised weight's groups (steps of at most kFusedRowsAvx512 rows) expanded in registers.
static void k512_fused_groups(const float* x, int64_t M, const Packed& w, int64_t g0, int64_t g1, float* buf,
                              float* scratch, int64_t rows_per, float* y, int64_t n, const float* bias) {
  if (w.format == kF32) {
    k512_groups(x, M, w, g0, g1, buf, scratch, rows_per, y, n, bias);
    return;
  }
  constexpr auto rows = std::make_integer_sequence<int, kFusedRowsAvx512>{};  // one kernel per row count
  static constexpr auto q4 = k512_quantised_kernels<kQ4>(rows), q8 = k512_quantised_kernels<kQ8>(rows),
                        q8h = k512_quantised_kernels<kQ8H>(rows), q8m = k512_quantised_kernels<kQ8M>(rows);
  fused_groups(q4.data(), q8.data(), q8h.data(), q8m.data(), kFusedRowsAvx512, k512_groups, x, M, w, g0, g1, buf,
               scratch, rows_per, y, n, bias);
}
#pragma GCC pop_options

// AVX2 in intrinsics: 16 ymm registers hold the 12 accumulators of 3 rows, 3 of the 4 weight vectors and the
// broadcast (the 4th weight vector is an FMA's memory operand). Written as SMALL_GEMM_KERNEL above, GCC kept
// the accumulators on the stack and reloaded the weights through 128-bit spills: 20 GFLOP/s at M=64 on a Zen 1
// EPYC (2 threads), where this reaches 57-66, the cores' FMA peak (bench/results/forward-cpu-avx2.md).
#pragma GCC push_options
#pragma GCC target("avx2,fma")
template <int R>
static void k256_block(const float* x, int64_t K, int64_t kn, const float* w, float* buf, bool first,
                       const char* pf) {
  __m256 acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(buf + r * kCols + 8 * j);
  for (int64_t k = 0; k < kn; ++k) {
    __builtin_prefetch(pf + k * kCols * 4, 0, 2);
    __builtin_prefetch(pf + k * kCols * 4 + 64, 0, 2);
    const float* wk = w + k * kCols;
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8), w2 = _mm256_loadu_ps(wk + 16);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_broadcast_ss(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(w0, s, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, s, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(w2, s, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(_mm256_loadu_ps(wk + 24), s, acc[r][3]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(buf + r * kCols + 8 * j, acc[r][j]);
}

// Row k of a quantised block's columns [16 H, 16 H + 16) as two vectors of floats: each weight fma(d, q, m) (q4,
// q8m) or d * q (q8, q8h), as the f32 layout holds it. q points at the block's integers, d at its scales, m at its
// offsets (q4, q8m); q4's row is its 16 bytes `by`.
template <Format F, int H>
static inline void k256_expand_half(const uint8_t* q, const float* d, const float* m, int64_t k, __m128i by,
                                    __m256& w0, __m256& w1) {
  d += 16 * H;
  if constexpr (F == kQ8H) d += k >= 16 ? kCols : 0;  // the second half of the block has scales of its own
  __m128i v;
  if constexpr (F == kQ4) {  // columns 0-15: the low nibbles, 16-31: the high ones
    v = _mm_and_si128(H == 0 ? by : _mm_srli_epi16(by, 4), _mm_set1_epi8(15));
  } else {
    v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * kCols + 16 * H));
  }
  const __m128i v_hi = _mm_srli_si128(v, 8);
  if constexpr (F == kQ4 || F == kQ8M) {
    m += 16 * H;
    w0 = _mm256_fmadd_ps(_mm256_loadu_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_loadu_ps(m));
    w1 = _mm256_fmadd_ps(_mm256_loadu_ps(d + 8), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v_hi)),
                         _mm256_loadu_ps(m + 8));
  } else {
    w0 = _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    w1 = _mm256_mul_ps(_mm256_loadu_ps(d + 8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v_hi)));
  }
}

// Columns [C0, C0 + 8 NV) of a quantised group for R rows (NV = 4 with C0 = 0, or NV = 2 with C0 = 0 or 16): each
// k row of the blocks is expanded into registers and used at once (no round trip through L1), the accumulators
// kept over all of K.
template <int R, Format F, int NV, int C0>
static void k256_quantised_pass(const float* x, int64_t K, const uint8_t* group, float* buf) {
  constexpr int64_t bytes = block_bytes(F);
  constexpr int64_t scales = F == kQ8 ? kCols * 4 : 2 * kCols * 4;  // the bytes of d (and m) before the q
  __m256 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_setzero_ps();
  const uint8_t* src = group;
  for (int64_t b = 0; b < K / kQK; ++b, src += bytes) {
    prefetch_block<true>(src, bytes);
    const float* d = reinterpret_cast<const float*>(src);
    const float* m = d + kCols;
    const uint8_t* q = src + scales;
    const float* xb = x + b * kQK;
    for (int64_t k = 0; k < kQK; ++k) {
      const float* mk = m;
      // All 32 columns' scales and offsets would take 8 of the 16 registers: the offsets are read from L1 every k
      // (an empty asm hides that they do not change), or GCC keeps them all and spills an accumulator instead.
      if constexpr (NV == 4) asm("" : "+r"(mk));
      __m256 w[NV];
      __m128i by = _mm_setzero_si128();
      if constexpr (F == kQ4) by = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16));
      if constexpr (C0 == 0) k256_expand_half<F, 0>(q, d, mk, k, by, w[0], w[1]);
      if constexpr (NV == 4) k256_expand_half<F, 1>(q, d, mk, k, by, w[2], w[3]);
      if constexpr (C0 == 16) k256_expand_half<F, 1>(q, d, mk, k, by, w[0], w[1]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_broadcast_ss(xb + r * K + k);
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_fmadd_ps(w[j], s, acc[r][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(buf + r * kCols + C0 + 8 * j, acc[r][j]);
}

// A quantised group for one pass of R <= kFusedRowsAvx2 rows. Up to 2 rows a pass covers all 32 columns: 4
// accumulators a row are enough independent FMA chains to hide their latency (in halves a one-row step waits on
// them: SmolLM2's linear layers took 11% longer at one row, 5% at two, on a Zen 1 EPYC, session 23). From 3 rows it takes halves of 16 columns,
// so that up to 4 rows the 2 R accumulators and the weights fit the 16 registers. The same FMAs in the same order
// as k256_block on the expanded floats: identical sums.
template <int R, Format F>
static void k256_quantised_group(const float* x, int64_t K, const uint8_t* group, float* buf) {
  if constexpr (R <= 2) {
    k256_quantised_pass<R, F, 4, 0>(x, K, group, buf);
  } else {
    k256_quantised_pass<R, F, 2, 0>(x, K, group, buf);
    k256_quantised_pass<R, F, 2, 16>(x, K, group, buf);
  }
}

template <Format F, int... Rs>
static constexpr std::array<GroupFn, sizeof...(Rs)> quantised_kernels(std::integer_sequence<int, Rs...>) {
  return {k256_quantised_group<Rs + 1, F>...};
}

// The f32 layout's groups on AVX2.
static void k256_f32_groups(const float* x, int64_t M, const Packed& w, int64_t g0, int64_t g1, float* buf,
                            float* scratch, int64_t rows_per, float* y, int64_t n, const float* bias) {
  static constexpr BlockFn blocks[] = {k256_block<1>, k256_block<2>, k256_block<3>};
  run_groups(blocks, x, M, w, g0, g1, buf, scratch, rows_per, y, n, bias);
}

static void k256_groups(const float* x, int64_t M, const Packed& w, int64_t g0, int64_t g1, float* buf,
                        float* scratch, int64_t rows_per, float* y, int64_t n, const float* bias) {
  if (w.format == kF32) {  // linear hands quantised blocks only to steps of at most kFusedRowsAvx2 rows
    k256_f32_groups(x, M, w, g0, g1, buf, scratch, rows_per, y, n, bias);
    return;
  }
  constexpr auto rows = std::make_integer_sequence<int, kFusedRowsAvx2>{};  // one kernel per row count
  static constexpr auto q4 = quantised_kernels<kQ4>(rows), q8 = quantised_kernels<kQ8>(rows),
                        q8h = quantised_kernels<kQ8H>(rows), q8m = quantised_kernels<kQ8M>(rows);
  fused_groups(q4.data(), q8.data(), q8h.data(), q8m.data(), kFusedRowsAvx2, k256_f32_groups, x, M, w, g0, g1, buf,
               scratch, rows_per, y, n, bias);
}
#pragma GCC pop_options

// Other CPUs: one row at a time, a plain loop per output column over k in order.
static void scalar_block(const float* x, int64_t, int64_t kn, const float* w, float* buf, bool first, const char*) {
  for (int64_t c = 0; c < kCols; ++c) {
    float s = first ? 0.f : buf[c];
    for (int64_t k = 0; k < kn; ++k) s += x[k] * w[k * kCols + c];
    buf[c] = s;
  }
}

void groups_scalar(const float* x, int64_t M, const Packed& w, int64_t g0, int64_t g1, float* buf, float* scratch,
                   int64_t rows_per, float* y, int64_t n, const float* bias) {
  static constexpr BlockFn blocks[] = {scalar_block};
  run_groups(blocks, x, M, w, g0, g1, buf, scratch, rows_per, y, n, bias);
}

const char* isa_name() {
  if (__builtin_cpu_supports("avx512f")) return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "scalar";
}

// Tests force a narrower instruction set than the CPU's ("" restores the CPU's own).
std::string& isa_override() {
  static std::string isa;
  return isa;
}

// Tests force the rows up to which quantised blocks are read in chunks (-1 restores the CPU's own choice).
int64_t& chunked_rows_override() {
  static int64_t rows = -1;
  return rows;
}

// The instruction set's kernels, the most rows one pass of the f32 layout takes, the most rows that read a
// quantised weight's blocks (past the kernels' own limit, kFusedRows*, in chunks), and whether those blocks are
// expanded through an L1 buffer (then a thread needs one).
GroupsFn pick(int64_t* max_rows, int64_t* block_rows, bool* via_l1) {
  const std::string isa = current_isa();
  const int64_t fused = isa == "avx2" ? kFusedRowsAvx2 : isa == "avx512" ? kFusedRowsAvx512 : kFusedRows;
  int64_t chunked = zen5_or_later() && isa == "avx512" ? kChunkedRowsZen5 : fused;
  if (chunked_rows_override() >= 0) chunked = chunked_rows_override();
  *block_rows = std::max(fused, chunked);
  *via_l1 = isa != "avx2" && isa != "avx512";
  if (isa == "avx512") { *max_rows = 12; return k512_fused_groups; }
  if (isa == "avx2") { *max_rows = 3; return k256_groups; }
  *max_rows = 1;
  return groups_scalar;
}

bool same_bits(float a, float b) {
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

// Whether a block may hold `got` where the weight is `want`: the same bits, or both zeros of either sign. Why a
// -0.0 weight may be expanded as +0.0 (GGUF's Q4_0 and Q5_0 dequantise q = 8 or 16 under a negative scale to -0.0,
// which no fma(d, q, m) gives): every kernel starts its sums at +0.0, and a sum that is +0.0 or nonzero stays so
// when a product of either zero is added (+0 + -0 is +0; x + -0 is x), so the outputs are the same bits. The one
// way a sum could be -0.0 is a negative product below the smallest float (2^-149) rounding to it, then only the
// sign of that zero output could differ: nothing downstream reads it (argmax, norms and exp treat both alike).
bool same_weight(float got, float want) { return same_bits(got, want) || (got == 0.f && want == 0.f); }

// The half-precision value nearest `v` and the next one up and down: the scales a quantiser may have stored.
std::array<float, 3> half_scales(float v) {
  const c10::Half h(v);
  const c10::Half up(static_cast<uint16_t>(h.x + 1), c10::Half::from_bits());
  const c10::Half down(static_cast<uint16_t>(h.x - 1), c10::Half::from_bits());
  return {static_cast<float>(h), static_cast<float>(up), static_cast<float>(down)};
}

// The smallest and largest of v[0..32); false if one is not finite.
bool finite_range(const float* v, float* lo, float* hi) {
  *lo = *hi = v[0];
  for (int64_t i = 0; i < kQK; ++i) {
    if (!std::isfinite(v[i])) return false;
    *lo = std::min(*lo, v[i]);
    *hi = std::max(*hi, v[i]);
  }
  return true;
}

// Whether each v[i], i < n (a multiple of 8), is s * r_i + off (same_weight) for r_i = (v[i] - off) / s rounded to
// the nearest integer (ties to even, as std::nearbyint) in [qmin, qmax]; the r_i in qf. Eight weights at a time, in
// vectors where the CPU has AVX2, with an exit after each eight (a wrong scale is usually caught by the first): a
// scalar loop with a libm nearbyintf call per weight took 7-11 ns a weight.
__attribute__((target_clones("avx2", "default")))
bool scale_fits(const float* v, int64_t n, float s, float off, float qmin, float qmax, float* qf) {
  typedef float f8 __attribute__((vector_size(32)));
  typedef int32_t i8 __attribute__((vector_size(32)));
  // x + 1.5 * 2^23 keeps no fraction for |x| < 2^22 and rounds it to even; larger or NaN x land outside any q range
  // (float arithmetic is not reassociated here, so the two additions stay as written).
  constexpr float kShift = 0x1.8p23f;
  for (int64_t i = 0; i < n; i += 8) {
    f8 x;
    i8 xb, wb;
    std::memcpy(&x, v + i, sizeof x);
    const f8 r = ((x - off) / s + kShift) - kShift;
    const f8 w = s * r + off;  // no FMA in either clone: what the GEMM computes from q, as s * q is exact
    std::memcpy(&xb, &x, sizeof x);
    std::memcpy(&wb, &w, sizeof w);
    const i8 ok = (r >= qmin) & (r <= qmax) & ((wb == xb) | ((w == 0.f) & (x == 0.f)));  // same_weight
    std::memcpy(qf + i, &r, sizeof r);
    for (int j = 0; j < 8; ++j)
      if (!ok[j]) return false;
  }
  return true;
}

// v[0..32) as d * q + m with q in [0, qmax] and d a positive half, every float reproduced (same_weight): d, m, q or
// false.
bool fit_q4(const float* v, int qmax, float* d, float* m, uint8_t* q) {
  float lo, hi;
  if (!finite_range(v, &lo, &hi)) return false;
  *m = lo;
  if (hi == lo) {  // one value: q = 0 everywhere (d * 0 + m is m, though +0 for a -0 block: checked)
    *d = 0.f;
    std::fill(q, q + kQK, 0);
    for (int64_t i = 0; i < kQK; ++i)
      if (!same_weight(0.f * 0.f + lo, v[i])) return false;
    return true;
  }
  // The largest value's q: qmax from a min-max quantiser (llama.cpp's), smaller where the block's top was unused.
  float r[kQK];
  for (int top = qmax; top >= 1; --top)
    for (const float s : half_scales((hi - lo) / static_cast<float>(top))) {
      if (!(s > 0.f) || !std::isfinite(s) || !scale_fits(v, kQK, s, lo, 0.f, static_cast<float>(qmax), r)) continue;
      for (int64_t i = 0; i < kQK; ++i) q[i] = static_cast<uint8_t>(r[i]);
      *d = s;
      return true;
    }
  return false;
}

// v[0..n) as d * q with q in [-128, 127] and d positive (or all zeros), every float reproduced (same_weight): with
// `half`, d a half-precision value (Q8_0's); without, any float (Q6_K's d times an 8-bit scale, which the largest
// magnitude over its q gives exactly). n: 16 or 32.
bool fit_q8(const float* v, int64_t n, bool half, float* d, int8_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) return false;
    amax = std::max(amax, std::fabs(v[i]));
  }
  if (amax == 0.f) {
    *d = 0.f;
    std::fill(q, q + n, 0);
    for (int64_t i = 0; i < n; ++i)
      if (!same_weight(0.f, v[i])) return false;
    return true;
  }
  // The largest magnitude's |q|: first those llama.cpp's quantisers give it (Q8_0: 127; Q6_K: 32 or 31; Q3_K: 4 or
  // 3; 128 for a -128), then every other in turn, down to 1 where a block's top was unused.
  static const std::array<int, 128> tops = [] {
    std::array<int, 128> t{127, 128, 32, 31, 4, 3};
    int i = 6;
    for (int top = 126; top >= 1; --top)
      if (top != 32 && top != 31 && top != 4 && top != 3) t[i++] = top;
    return t;
  }();
  // Two other weights as probes: q_j / top = v_j / amax, so a top for which that is no integer is skipped at the
  // cost of two multiplications (a weight of one magnitude has none). Q6_K's blocks tried ~20-90 tops each.
  double probe[2];
  int probes = 0;
  for (int64_t i = 0; i < n && probes < 2; ++i)
    if (v[i] != 0.f && std::fabs(v[i]) != amax) probe[probes++] = static_cast<double>(v[i]) / amax;
  float r[kQK];
  for (const int top : tops) {
    bool skip = false;
    for (int j = 0; j < probes; ++j) {
      const double x = probe[j] * top;
      skip = skip || std::fabs(x - static_cast<double>(static_cast<int64_t>(x + (x < 0 ? -0.5 : 0.5)))) > 1e-3;
    }
    if (skip) continue;
    const float est = amax / static_cast<float>(top);
    const std::array<float, 3> scales = half ? half_scales(est) : std::array<float, 3>{est, 0.f, 0.f};
    for (const float s : scales) {
      if (!(s > 0.f) || !std::isfinite(s) || !scale_fits(v, n, s, 0.f, -128.f, 127.f, r)) continue;
      for (int64_t j = 0; j < n; ++j) q[j] = static_cast<int8_t>(r[j]);
      *d = s;
      return true;
    }
  }
  return false;
}

// The distance from finite x to the next float up (or down), in double: from its bits, without libm's nextafter.
double float_gap(float x, bool up) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) == 0) return 0x1p-149;  // +-0: the smallest subnormal either way
  const bool away = up == !(b >> 31);            // moving away from zero: the magnitude's bits grow
  const uint32_t nb = away ? b + 1 : b - 1;
  float y;
  std::memcpy(&y, &nb, 4);
  return std::fabs(static_cast<double>(y) - x);  // inf where x is the largest float: no constraint
}

// v[0..32) as fma(A, q, m) with q in [0, qmax], A a positive half times an integer in [1, 63] and m any float, every
// float reproduced (same_weight): d (= A), m, q or false. This is what GGUF's Q4_K (the "Q4_K_M" files most quantised
// models ship as) dequantises to: per 32 weights along K, (d * sc) * q - dmin * mn with a half d and dmin per 256
// and 6-bit sc and mn, each product exact in float32, so the one rounding is the subtraction's (the FMA's). A has at
// most 17 significant bits, so A * q is exact and the expansion rounds once, FMA or not. fit_q4 misses these: A is
// no half, and the block's smallest value need not have q = 0 (a block of positive weights gets mn = 0).
bool fit_q4_scaled(const float* v, int qmax, float* d, float* m, uint8_t* q, float* hint) {
  float lo, hi;
  if (!finite_range(v, &lo, &hi)) return false;
  if (hi == lo) return false;  // one value: fit_q4's case
  // hi - lo is A * span moved by the rounding of hi and lo: at most half a gap to the next float of each.
  const double slack = float_gap(hi, true) + float_gap(lo, false);
  // Whether A = h * sc (h a half, sc in [1, 63]) fits the block with the largest q minus the smallest `span`.
  const auto fits = [&](float h, int sc, int span) {
    const float a = h * static_cast<float>(sc);  // exact: 11 significant bits times 6
    if (!(h > 0.f) || std::fabs(a - (static_cast<double>(hi) - lo) / span) * span > slack) return false;
    // q_i - q_min from the spacing, then the m that puts every fma(a, q_i, m) in v_i's rounding interval (the
    // intervals' intersection, exact in double); the smallest value's q shifts that interval by a each.
    const double inv = 1.0 / a;
    double m_lo = -INFINITY, m_hi = INFINITY;
    int top = 0;
    for (int64_t i = 0; i < kQK; ++i) {
      const int n = static_cast<int>((static_cast<double>(v[i]) - lo) * inv + 0.5);  // >= 0: no libm rounding
      top = std::max(top, n);
      q[i] = static_cast<uint8_t>(std::min(std::max(n, 0), 255));
      const double rest = static_cast<double>(v[i]) - static_cast<double>(a) * q[i];  // v_i - A q_i
      m_lo = std::max(m_lo, rest - float_gap(v[i], false) / 2);
      m_hi = std::min(m_hi, rest + float_gap(v[i], true) / 2);
      if (top > qmax || m_lo > m_hi) return false;  // for good: the range only grows, the intersection shrinks
    }
    for (int q0 = 0; q0 + top <= qmax; ++q0) {  // the smallest value's q
      const double shift = static_cast<double>(a) * q0;
      const float mid = static_cast<float>((m_lo + m_hi) / 2 - shift);
      for (const float mc : {mid, std::nextafter(mid, -INFINITY), std::nextafter(mid, INFINITY)}) {
        bool ok = true;
        for (int64_t i = 0; i < kQK && ok; ++i) ok = same_weight(std::fma(a, static_cast<float>(q[i] + q0), mc), v[i]);
        if (ok) {
          for (int64_t i = 0; i < kQK; ++i) q[i] = static_cast<uint8_t>(q[i] + q0);
          *d = a;
          *m = mc;
          *hint = h;
          return true;
        }
      }
    }
    return false;
  };
  // Q4_K's half d serves 8 blocks of 32 in a row: first the last block's half, or it times a power of two (A = h * sc
  // factors several ways where sc is even). With h, hi - lo is h * sc * span within the slack; where the slack is
  // under h / 2, sc * span can only be the integer nearest (hi - lo) / h, whose factors are the candidates (else
  // each span's nearest sc is).
  if (*hint > 0.f)
    for (const float p : {1.f, 0.5f, 2.f, 0.25f, 4.f, 0.125f, 8.f, 0.0625f, 16.f, 0.03125f, 32.f}) {
      const float h = *hint * p;  // exact, bar the subnormal halves
      const double per_span = (static_cast<double>(hi) - lo) / h;
      const bool unique = slack < h / 2.0;
      const int64_t product = static_cast<int64_t>(per_span + 0.5);
      if (unique && (product < 1 || std::fabs(product * static_cast<double>(h) - (static_cast<double>(hi) - lo)) > slack))
        continue;
      for (int span = qmax; span >= 1; --span) {
        if (unique && product % span != 0) continue;
        const int sc = unique ? static_cast<int>(product / span) : static_cast<int>(per_span / span + 0.5);
        if (sc >= 1 && sc <= 63 && fits(h, sc, span)) return true;
      }
    }
  for (int span = qmax; span >= 1; --span) {  // the largest q minus the smallest
    const double a_est = (static_cast<double>(hi) - lo) / span;
    for (int sc = 1; sc <= 63; ++sc) {
      // The half nearest a_est / sc (11 significant bits; subnormal halves in steps of 2^-24): A is h * sc only
      // where that lands within the estimate's slack, which for a Q4_K block is about one sc in 60.
      const double h0 = a_est / sc;
      if (!(h0 > 0.) || h0 > 65504.) continue;
      double hr;
      if (h0 >= 0x1p-14) {  // a normal half: h0 rounded to 11 significant bits (Veltkamp's split, no libm call)
        const double c = h0 * (0x1p42 + 1.0);
        hr = c - (c - h0);
      } else {
        hr = std::nearbyint(h0 * 0x1p24) * 0x1p-24;
      }
      if (fits(static_cast<float>(hr), sc, span)) return true;
    }
  }
  return false;
}

// Packs group g of `src` [N, K] (columns 32 g .. 32 g + 31) into `format`'s blocks at dst (zeroed, K / 32 blocks);
// false (dst unfinished) if a block is not of that form. `scaled` carries which 4-bit fit served the last block.
bool pack_group(const float* src, int64_t N, int64_t K, Format format, int64_t g, uint8_t* dst, bool* scaled) {
  const int64_t bytes = block_bytes(format);
  float d[kCols], m[kCols];
  float hint[kCols] = {};  // per column, the half of its last block's scaled 4-bit fit (Q4_K's d serves 8 blocks)
  uint8_t q4[kQK];
  int8_t q8[kQK];
  for (int64_t b = 0; b < K / kQK; ++b, dst += bytes) {
    std::fill(d, d + kCols, 0.f);  // padded columns: d = m = 0, q = 0, the weight 0 the f32 layout pads with
    std::fill(m, m + kCols, 0.f);
    for (int64_t c = 0; c < kCols && g * kCols + c < N; ++c) {
      const float* v = src + (g * kCols + c) * K + b * kQK;
      if (format == kQ4 || format == kQ8M) {
        // The form that fitted the last block first: trying the other first cost Q4_K weights 40% more time.
        const int qmax = format == kQ4 ? 15 : 31;  // q8m: the 5-bit types (it could hold 8)
        bool fit = *scaled ? fit_q4_scaled(v, qmax, &d[c], &m[c], q4, &hint[c]) : fit_q4(v, qmax, &d[c], &m[c], q4);
        if (!fit && (fit = *scaled ? fit_q4(v, qmax, &d[c], &m[c], q4) : fit_q4_scaled(v, qmax, &d[c], &m[c], q4, &hint[c])))
          *scaled = !*scaled;
        if (!fit) return false;
        for (int64_t k = 0; k < kQK; ++k) {
          if (format == kQ4)
            dst[2 * kCols * 4 + k * 16 + (c & 15)] |= static_cast<uint8_t>(q4[k] << (c < 16 ? 0 : 4));
          else
            dst[2 * kCols * 4 + k * kCols + c] = q4[k];
        }
      } else {
        // q8h: d[] scales k 0..15 and m[] (the second d) k 16..31
        if (format == kQ8 ? !fit_q8(v, kQK, true, &d[c], q8)
                          : !fit_q8(v, kQK / 2, false, &d[c], q8) ||
                                !fit_q8(v + kQK / 2, kQK / 2, false, &m[c], q8 + kQK / 2))
          return false;
        const int64_t scales = format == kQ8 ? kCols * 4 : 2 * kCols * 4;
        for (int64_t k = 0; k < kQK; ++k) dst[scales + k * kCols + c] = static_cast<uint8_t>(q8[k]);
      }
    }
    std::memcpy(dst, d, sizeof d);
    if (format != kQ8) std::memcpy(dst + sizeof d, m, sizeof m);
  }
  return true;
}

// Writes src [N, K] into dst [ceil(N/32), K, 32], the padding columns left as they are (zero).
void pack_f32_into(const float* src, int64_t N, int64_t K, float* dst) {
  const int64_t groups = (N + kCols - 1) / kCols;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < kCols && g * kCols + c < N; ++c) {
        const float* row = src + (g * kCols + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[(g * K + k) * kCols + c] = row[k];
      }
  });
}

// The start of a quantised packed tensor. The magic number and the sizes are checked against the tensor's length,
// so that another uint8 tensor is refused rather than read out of bounds.
struct Header {
  int64_t magic, format, K, groups;
  int64_t f32_at;  // kMixed: the f32 layout's byte offset (the blocks' sizes vary by group)
};
constexpr int64_t kMagic = 0x3151'4d45'4747'414c;  // "LAGGEMQ1"
constexpr int64_t kHeaderBytes = 64;               // the blocks start 64-byte aligned, as torch allocates
static_assert(sizeof(Header) <= kHeaderBytes, "the header fits");

// Bytes from a quantised packed tensor's start to its f32 layout (a multiple of 64), and its whole length.
int64_t f32_offset(Format f, int64_t K, int64_t groups) { return kHeaderBytes + groups * (K / kQK) * block_bytes(f); }
int64_t quantised_bytes(Format f, int64_t K, int64_t groups) { return f32_offset(f, K, groups) + groups * K * kCols * 4; }

at::Tensor pack(const at::Tensor& weight, c10::string_view format) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
                    "lookahead_gemm.pack: weight must be a float32 CPU tensor [N, K], got ", weight.scalar_type(),
                    " ", weight.sizes());
  TORCH_CHECK_VALUE(format == "auto" || format == "f32" || format == "q4" || format == "q8" || format == "q8h" ||
                        format == "q8m",
                    "lookahead_gemm.pack: format must be 'auto', 'f32', 'q4', 'q8', 'q8h' or 'q8m', got '", format,
                    "'");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t groups = (N + kCols - 1) / kCols;  // the last one zero-padded
  const bool blocks_possible = K % kQK == 0 && N > 0 && K > 0;
  const float* src = w.data_ptr<float>();
  // Per group its form (kF32: none) and its blocks. Each group is fitted once: trying one form on the whole weight
  // first, then group by group, cost a mixed weight twice the time.
  std::vector<int64_t> form(groups, kF32);
  std::vector<std::vector<uint8_t>> blocks(groups);
  // Every group not yet in form f into f, where every one is of that form (else false, nothing changed).
  const auto fit_all = [&](Format f, bool scaled) {
    std::vector<std::vector<uint8_t>> fitted(groups);
    std::atomic<bool> ok{true};
    at::parallel_for(0, groups, 1, [&](int64_t a, int64_t b) {
      bool thread_scaled = scaled;  // a weight's blocks are all of one kind: the last 4-bit fit first
      for (int64_t g = a; g < b && ok.load(std::memory_order_relaxed); ++g) {
        if (form[g] == f) continue;
        fitted[g].assign(K / kQK * block_bytes(f), 0);
        if (!pack_group(src, N, K, f, g, fitted[g].data(), &thread_scaled)) ok = false;
      }
    });
    if (!ok.load()) return false;
    for (int64_t g = 0; g < groups; ++g)
      if (form[g] != f) {
        blocks[g] = std::move(fitted[g]);
        form[g] = f;
      }
    return true;
  };
  bool quantised = false;
  if (format != "auto") {  // a format asked for by name: every group in it, or an error
    const Format f = format == "q4" ? kQ4 : format == "q8" ? kQ8 : format == "q8h" ? kQ8H : kQ8M;
    if (format != "f32") {
      TORCH_CHECK_VALUE(blocks_possible && fit_all(f, false), "lookahead_gemm.pack: the weight is not exactly ",
                        format, " (",
                        f == kQ4   ? "d * q + m, q in [0, 15], d a half or a half times an integer below 64, per 32"
                        : f == kQ8  ? "d * q, q in [-128, 127], d a half, per 32"
                        : f == kQ8H ? "d * q, q in [-128, 127], a d per 16"
                                    : "d * q + m, q in [0, 31], d a half or a half times an integer below 64, per 32",
                        " along K, K a multiple of 32)");
      quantised = true;
    }
  } else if (blocks_possible) {
    // Group 0 takes the first form that fits it; then every group the first that fits it, its thread's last one
    // first. Only where group 0 has a quantised form: trying every group of a float weight cost its packing 3.5x
    // the time (the failing fits), and a fused weight of GGUF tensors (q/k/v with a Q6_K v beside Q4_K q and k)
    // starts with one.
    bool scaled = false;
    for (const Format f : {kQ4, kQ8, kQ8H, kQ8M}) {
      blocks[0].assign(K / kQK * block_bytes(f), 0);
      if (pack_group(src, N, K, f, 0, blocks[0].data(), &scaled)) {
        form[0] = f;
        break;
      }
      blocks[0].clear();
    }
    quantised = form[0] != kF32;
    if (quantised) {
      at::parallel_for(1, groups, 1, [&](int64_t g0, int64_t g1) {
        Format last = static_cast<Format>(form[0]);
        bool thread_scaled = scaled;
        for (int64_t g = g0; g < g1; ++g) {
          const std::array<Format, 5> order{last, kQ4, kQ8, kQ8H, kQ8M};
          for (size_t i = 0; i < order.size(); ++i) {
            if (i > 0 && order[i] == order[0]) continue;  // tried first
            blocks[g].assign(K / kQK * block_bytes(order[i]), 0);
            if (pack_group(src, N, K, order[i], g, blocks[g].data(), &thread_scaled)) {
              form[g] = last = order[i];
              break;
            }
            blocks[g].clear();
          }
        }
      });
      // Groups that fit several forms (Q3_K's fit q8 where no product is +128, q8h always) may have taken
      // different ones: one form that every group fits is preferred to mixed.
      for (const Format f : {kQ4, kQ8, kQ8H, kQ8M}) {
        if (std::all_of(form.begin(), form.end(), [&](int64_t x) { return x == form[0]; })) break;
        if (std::find(form.begin(), form.end(), f) != form.end()) fit_all(f, scaled);
      }
    }
  }
  if (quantised) {  // one form for all laid out as that form, several as mixed (a table of each group's)
    const bool uniform = std::all_of(form.begin(), form.end(), [&](int64_t x) { return x == form[0]; });
    std::vector<int64_t> table(2 * groups, 0);  // per group its format and its blocks' offset
    int64_t at = kHeaderBytes + (uniform ? 0 : (16 * groups + 63) / 64 * 64);
    for (int64_t g = 0; g < groups; ++g) {
      table[2 * g] = form[g];
      table[2 * g + 1] = form[g] == kF32 ? 0 : at;
      at += static_cast<int64_t>(blocks[g].size());
    }
    const int64_t f32_at = (at + 63) / 64 * 64;  // uniform: f32_offset's, the blocks' sizes being multiples of 64
    const Header h{kMagic, uniform ? form[0] : kMixed, K, groups, uniform ? 0 : f32_at};
    at::Tensor packed = at::zeros({f32_at + groups * K * kCols * 4}, w.options().dtype(at::kByte));
    uint8_t* base = packed.data_ptr<uint8_t>();
    std::memcpy(base, &h, sizeof h);
    if (!uniform) std::memcpy(base + kHeaderBytes, table.data(), table.size() * sizeof(int64_t));
    for (int64_t g = 0; g < groups; ++g)
      if (!blocks[g].empty()) std::memcpy(base + table[2 * g + 1], blocks[g].data(), blocks[g].size());
    pack_f32_into(src, N, K, reinterpret_cast<float*>(base + f32_at));
    return packed;
  }
  at::Tensor packed = at::zeros({groups, K, kCols}, w.options());
  pack_f32_into(w.data_ptr<float>(), N, K, packed.data_ptr<float>());
  return packed;
}

// The packed weight's layout, checked: what linear reads.
Packed view(const at::Tensor& packed, const char* op) {
  TORCH_CHECK_VALUE(packed.is_contiguous() && packed.device().is_cpu() &&
                        ((packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == kCols) ||
                         (packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.numel() >= kHeaderBytes)),
                    op, ": packed must come from lookahead_gemm.pack, got ", packed.scalar_type(), " ",
                    packed.sizes());
  if (packed.scalar_type() == at::kFloat)
    return {kF32, packed.size(1), packed.size(0), packed.data_ptr<float>(), nullptr};
  const uint8_t* base = packed.data_ptr<uint8_t>();
  Header h;
  std::memcpy(&h, base, sizeof h);
  const bool known = h.magic == kMagic && h.format >= kQ4 && h.format <= kMixed && h.K > 0 && h.K % kQK == 0 &&
                     h.groups > 0 && h.groups < (int64_t{1} << 40) && h.K < (int64_t{1} << 40);
  const char* refused = ": packed must come from lookahead_gemm.pack (a uint8 tensor of ";
  if (known && h.format == kMixed) {
    // The table must place every group's blocks between it and the f32 layout, which must end the tensor.
    const int64_t table_end = kHeaderBytes + 16 * h.groups;
    bool ok = h.f32_at >= table_end && h.f32_at % 64 == 0 && packed.numel() >= table_end &&
              packed.numel() - h.f32_at == h.groups * h.K * kCols * 4;
    const int64_t* table = reinterpret_cast<const int64_t*>(base + kHeaderBytes);
    for (int64_t g = 0; g < h.groups && ok; ++g) {
      const int64_t f = table[2 * g], at = table[2 * g + 1];
      ok = f == kF32 || (f >= kQ4 && f <= kQ8M && at >= table_end &&
                         at + h.K / kQK * block_bytes(static_cast<Format>(f)) <= h.f32_at);
    }
    TORCH_CHECK_VALUE(ok, op, refused, packed.numel(), " bytes whose group table does not fit it)");
    return {kMixed, h.K, h.groups, reinterpret_cast<const float*>(base + h.f32_at), base, table};
  }
  const Format f = static_cast<Format>(known ? h.format : kQ4);
  TORCH_CHECK_VALUE(known && packed.numel() == quantised_bytes(f, h.K, h.groups), op, refused, packed.numel(),
                    " bytes without its header)");
  return {f, h.K, h.groups, reinterpret_cast<const float*>(base + f32_offset(f, h.K, h.groups)),
          base + kHeaderBytes};
}

}  // namespace

std::string current_isa() {
  static const std::string cpu = isa_name();
  const std::string& forced = isa_override();
  if (forced == "scalar" || (forced == "avx2" && cpu != "scalar")) return forced;
  return cpu;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                    "lookahead_gemm.linear: x must be a float32 CPU tensor [M, K], got ", x.scalar_type(), " ",
                    x.sizes());
  Packed w = view(packed, "lookahead_gemm.linear");
  const int64_t M = x.size(0), K = x.size(1), groups = w.groups;
  int64_t max_rows = 0, block_rows = 0;
  bool via_l1 = false;
  const GroupsFn run = pick(&max_rows, &block_rows, &via_l1);
  if (M > block_rows) w = {kF32, w.K, w.groups, w.f32, nullptr};  // no expansion pays at this many rows
  TORCH_CHECK_VALUE(w.K == K, "lookahead_gemm.linear: x has K=", K, " but the weight has K=", w.K);
  TORCH_CHECK_VALUE(n > (groups - 1) * kCols && n <= groups * kCols, "lookahead_gemm.linear: n=", n,
                    " does not match the packed weight's ", groups, " groups of ", kCols, " columns");
  const float* b = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                      "lookahead_gemm.linear: bias must be float32 [", n, "], got ", bias->sizes());
    bc = bias->contiguous();
    b = bc.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const int64_t passes = (M + max_rows - 1) / max_rows;
  const int64_t rows_per = (M + passes - 1) / passes;  // balanced passes
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Each thread takes a contiguous range of groups: the weight is split, never a row's sum.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf(M * kCols + (via_l1 && w.format != kF32 ? kKB * kCols : 0));
    run(xp, M, w, g0, g1, buf.data(), buf.data() + M * kCols, rows_per, yp, n, b);
  });
  return y;
}

std::string packed_format(const at::Tensor& packed) {
  const Format f = view(packed, "lookahead_gemm.packed_format").format;
  return format_name(f);
}

namespace {

std::string isa() { return current_isa(); }

void force_isa(const std::string& isa) {
  TORCH_CHECK_VALUE(isa.empty() || isa == "avx2" || isa == "scalar",
                    "lookahead_gemm.force_isa: expected '', 'avx2' or 'scalar', got '", isa, "'");
  isa_override() = isa;
}

int64_t chunked_rows() {
  int64_t max_rows = 0, block_rows = 0;
  bool via_l1 = false;
  pick(&max_rows, &block_rows, &via_l1);
  return block_rows;
}

void force_chunked_rows(int64_t rows) {
  TORCH_CHECK_VALUE(rows >= -1, "lookahead_gemm.force_chunked_rows: expected -1 (the CPU's own) or rows >= 0, got ",
                    rows);
  chunked_rows_override() = rows;
}

}  // namespace
}  // namespace small_gemm

TORCH_LIBRARY(lookahead_gemm, m) {
  m.def("pack(Tensor weight, str format=\"auto\") -> Tensor");
  m.def("packed_format(Tensor packed) -> str");
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("isa() -> str", &small_gemm::isa);
  m.def("force_isa(str isa) -> ()", &small_gemm::force_isa);
  m.def("chunked_rows() -> int", &small_gemm::chunked_rows);
  m.def("force_chunked_rows(int rows) -> ()", &small_gemm::force_chunked_rows);
}

TORCH_LIBRARY_IMPL(lookahead_gemm, CPU, m) {
  m.impl("pack", &small_gemm::pack);
  m.impl("packed_format", &small_gemm::packed_format);
  m.impl("linear", &small_gemm::linear);
}
