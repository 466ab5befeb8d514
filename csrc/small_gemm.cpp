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
// One source, two instruction sets chosen at run time (AVX-512 where the CPU has it, else AVX2+FMA), plus a
// plain loop for other CPUs. Ops (namespace lookahead_gemm):
//   pack(Tensor weight) -> Tensor                                      weight [N, K] -> [ceil(N/32), K, 32]
//   linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor     x [M, K] -> y [M, n]
//   isa() -> str                                                       "avx512", "avx2" or "scalar"
//   force_isa(str isa) -> ()            tests: run this GEMM and the step attention as "avx2" or "scalar" even
//                                       where the CPU has more; "" undoes

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
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
  static void NAME##_groups(const float* x, int64_t M, int64_t K, const float* w, int64_t g0, int64_t g1,      \
                            float* buf, int64_t rows_per, float* y, int64_t n, const float* bias) {            \
    static constexpr auto blocks = NAME##_table(std::make_integer_sequence<int, MAXR>{});                       \
    run_groups(blocks.data(), x, M, K, w, g0, g1, buf, rows_per, y, n, bias);                                    \
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

// One block of R rows (R = 1 .. the kernel's most): as SMALL_GEMM_KERNEL's NAME##_block says.
using BlockFn = void (*)(const float*, int64_t, int64_t, const float*, float*, bool, const char*);

// Groups [g0, g1) of the packed weight: each K block is read by every pass of rows_per rows (blocks[r - 1] runs a
// pass of r rows) before the next block, and each group's sums are stored once its last block is done.
void run_groups(const BlockFn* blocks, const float* x, int64_t M, int64_t K, const float* w, int64_t g0, int64_t g1,
                float* buf, int64_t rows_per, float* y, int64_t n, const float* bias) {
  for (int64_t g = g0; g < g1; ++g) {
    const float* wg = w + g * K * kCols;
    for (int64_t k0 = 0; k0 < K; k0 += kKB) {
      const int64_t kn = std::min(kKB, K - k0);
      const float* wb = wg + k0 * kCols;
      const char* pf = reinterpret_cast<const char*>(wb + kn * kCols);  // the next block, contiguous
      for (int64_t m0 = 0; m0 < M; m0 += rows_per) {
        const int r = static_cast<int>(std::min(rows_per, M - m0));
        blocks[r - 1](x + m0 * K + k0, K, kn, wb, buf + m0 * kCols, k0 == 0, pf);
      }
    }
    store_rows(buf, M, y, n, g * kCols, bias);
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,fma")
SMALL_GEMM_KERNEL(k512, 16, 12)
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

static void k256_groups(const float* x, int64_t M, int64_t K, const float* w, int64_t g0, int64_t g1, float* buf,
                        int64_t rows_per, float* y, int64_t n, const float* bias) {
  static constexpr BlockFn blocks[] = {k256_block<1>, k256_block<2>, k256_block<3>};
  run_groups(blocks, x, M, K, w, g0, g1, buf, rows_per, y, n, bias);
}
#pragma GCC pop_options

using GroupsFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, float*,
                          int64_t, const float*);

// Other CPUs: a plain loop, one sum per output over k in order.
void groups_scalar(const float* x, int64_t M, int64_t K, const float* w, int64_t g0, int64_t g1, float*,
                   int64_t, float* y, int64_t n, const float* bias) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = g0 * kCols; c < std::min(g1 * kCols, n); ++c) {
      const float* wp = w + (c / kCols) * K * kCols + (c % kCols);
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * wp[k * kCols];
      y[m * n + c] = bias == nullptr ? s : s + bias[c];
    }
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

GroupsFn pick(int64_t* max_rows) {
  const std::string isa = current_isa();
  if (isa == "avx512") { *max_rows = 12; return k512_groups; }
  if (isa == "avx2") { *max_rows = 3; return k256_groups; }
  *max_rows = 1;
  return groups_scalar;
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
                    "lookahead_gemm.pack: weight must be a float32 CPU tensor [N, K], got ", weight.scalar_type(),
                    " ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t groups = (N + kCols - 1) / kCols;  // the last one zero-padded
  at::Tensor packed = at::zeros({groups, K, kCols}, weight.options());
  const at::Tensor w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < kCols && g * kCols + c < N; ++c) {
        const float* row = src + (g * kCols + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[(g * K + k) * kCols + c] = row[k];
      }
  });
  return packed;
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
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.size(2) == kCols &&
                        packed.is_contiguous(),
                    "lookahead_gemm.linear: packed must come from lookahead_gemm.pack, got ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0);
  TORCH_CHECK_VALUE(packed.size(1) == K, "lookahead_gemm.linear: x has K=", K, " but the weight has K=",
                    packed.size(1));
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
  int64_t max_rows = 0;
  const GroupsFn run = pick(&max_rows);
  const int64_t passes = (M + max_rows - 1) / max_rows;
  const int64_t rows_per = (M + passes - 1) / passes;  // balanced passes
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Each thread takes a contiguous range of groups: the weight is split, never a row's sum.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf(M * kCols);
    run(xp, M, K, wp, g0, g1, buf.data(), rows_per, yp, n, b);
  });
  return y;
}

namespace {

std::string isa() { return current_isa(); }

void force_isa(const std::string& isa) {
  TORCH_CHECK_VALUE(isa.empty() || isa == "avx2" || isa == "scalar",
                    "lookahead_gemm.force_isa: expected '', 'avx2' or 'scalar', got '", isa, "'");
  isa_override() = isa;
}

}  // namespace
}  // namespace small_gemm

TORCH_LIBRARY(lookahead_gemm, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("isa() -> str", &small_gemm::isa);
  m.def("force_isa(str isa) -> ()", &small_gemm::force_isa);
}

TORCH_LIBRARY_IMPL(lookahead_gemm, CPU, m) {
  m.impl("pack", &small_gemm::pack);
  m.impl("linear", &small_gemm::linear);
}
