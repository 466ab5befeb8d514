// Attention of one decoding step on the CPU, float32: T new queries per sequence over that sequence's committed
// prefix (every row visible) and the step's own T keys (visible as the step's [T, T] block says), read straight
// from the KV cache with its per-sequence length, grouped-query heads included.
//
// Why not torch's SDPA: a step has few queries (1 for a plain step, a few dozen for a tree), so SDPA's fixed costs
// dominate (45 us per layer at T=1, 116 us at T=16 for SmolLM2's 9 heads over 300 keys, measured), a [T, n+T]
// mask must be built, and a batch whose sequences have different lengths needs one call per sequence. Here each
// (sequence, KV head, query rows of its group up to a vector's lanes) is one task and each query row one pass over
// its keys: scores, an exact softmax (max-subtracted, an exp accurate to float32) and the weighted sum of values,
// every sum in key order. A query row's result depends on its own visible keys only, not on T, the batch or the
// threads (a long decode step with fewer tasks than divide the threads runs their parts over all of them,
// split_step).
//
// Op (namespace lookahead_cpu):
//   step_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_len, Tensor visible, float scale) -> Tensor
//     q [B, T, Hq, D], k_cache / v_cache [B, S, Hkv, D] (float32, last dim contiguous), cache_len int64 [B],
//     visible bool [1 or B, T, T] (query t sees step key j); returns [B, T, Hq, D]; a query that sees no key at all
//     (no prefix and nothing visible) gets zeros.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "cpu_attention_tasks.h"

namespace cpu_attention {
namespace {

CPU_ATTENTION_TASK(task_scalar, cpu_vec::v4sf, 4, 4, 0)  // every x86-64's SSE (cpu_attention_tasks.h)

struct Task {
  TaskFn run;
  int64_t rows;      // query rows per task: the vectors' lanes
  int64_t few_rows;  // a task of at most this many rows runs few_row_task
  SplitFn split;     // its parts, for split_step (null: none)
};

Task pick_task() {
  const std::string isa = small_gemm::current_isa();
  if (isa == "avx512") return {task_avx512, 16, kFewRowsAvx512, split_avx512};
  if (isa == "avx2") return {task_avx2, 8, kFewRowsAvx2, split_avx2};
  return {task_scalar, 4, 0, nullptr};
}

// A decode step of few tasks over long caches (a plain step: SmolLM2's 3 key heads, 3 tasks) on more threads than
// divide them evenly: 2 threads took its 3 tasks 2 + 1. Its tasks run instead in three phases over every thread:
// the scores by ranges of kSplitKeys keys, the weights by the same ranges, the output by halves of D; each value
// computed as few_row_task computes it (the same bits). Every task has R = G * T <= the build's few rows.
void split_step(const Args& a, const Task& task) {
  const int64_t R = a.Hq / a.Hkv * a.T, L = task.rows;
  std::vector<SplitTask> tasks;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (task, range)
  int64_t floats = 0;
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t kv = 0; kv < a.Hkv; ++kv) {
      const int64_t keys = a.cache_len[b] + a.T, stride = (keys + L - 1) / L * L;
      const int64_t n_ranges = (keys + kSplitKeys - 1) / kSplitKeys;
      for (int64_t r = 0; r < n_ranges; ++r) ranges.emplace_back(tasks.size(), r);
      tasks.push_back({b, kv, nullptr, nullptr, stride, n_ranges});
      floats += 2 * R * stride + n_ranges * R;
    }
  // Every entry a phase reads an earlier one wrote (rows past R: zeroed by the weights phase where read).
  const std::unique_ptr<float[]> scratch(new float[floats]);
  float* p = scratch.get();
  for (SplitTask& t : tasks) {
    t.scores = p;
    t.maxima = p + 2 * R * t.stride;
    p = t.maxima + t.ranges * R;
  }
  const int64_t parts = a.D / L >= 2 ? 2 : 1;
  for (int phase = 0; phase < 3; ++phase) {
    const int64_t items = phase < 2 ? ranges.size() : tasks.size() * parts;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      const std::unique_ptr<float[]> qt(phase == 0 ? new float[a.D * L] : nullptr);  // the scores' queries only
      for (int64_t i = begin; i < end; ++i) {
        if (phase < 2)
          task.split(a, tasks[ranges[i].first], phase, ranges[i].second, qt.get());
        else
          task.split(a, tasks[i / parts], phase, i % parts, qt.get());
      }
    });
  }
}

}  // namespace

at::Tensor step_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& cache_len, const at::Tensor& visible, double scale) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
                    "lookahead_cpu.step_attention: q [B, T, Hq, D] and k_cache, v_cache [B, S, Hkv, D] expected, got ",
                    q.sizes(), ", ", k_cache.sizes(), ", ", v_cache.sizes());
  for (const at::Tensor* t : {&q, &k_cache, &v_cache})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(3) == 1,
                      "lookahead_cpu.step_attention: q, k_cache and v_cache must be float32 CPU tensors with a "
                      "contiguous last dimension, got ", t->scalar_type(), " ", t->sizes(), " strides ", t->strides());
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t S = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(D == 16 || D == 32 || D == 64 || D == 128 || D == 256,
                    "lookahead_cpu.step_attention: head_dim must be 16, 32, 64, 128 or 256, got ", D);
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B && k_cache.size(3) == D &&
                        Hkv > 0 && Hq % Hkv == 0,
                    "lookahead_cpu.step_attention: k_cache and v_cache must both be [B=", B, ", S, Hkv, D=", D,
                    "] with Hq=", Hq, " a multiple of Hkv, got ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK_VALUE(cache_len.dim() == 1 && cache_len.size(0) == B && cache_len.scalar_type() == at::kLong,
                    "lookahead_cpu.step_attention: cache_len must be int64 [B=", B, "], got ", cache_len.scalar_type(),
                    " ", cache_len.sizes());
  TORCH_CHECK_VALUE(visible.dim() == 3 && (visible.size(0) == 1 || visible.size(0) == B) && visible.size(1) == T &&
                        visible.size(2) == T && visible.scalar_type() == at::kBool,
                    "lookahead_cpu.step_attention: visible must be bool [1 or B, T=", T, ", T=", T, "], got ",
                    visible.scalar_type(), " ", visible.sizes());
  const at::Tensor lens = cache_len.contiguous();
  const at::Tensor vis = visible.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lp[b] >= 0 && lp[b] + T <= S, "lookahead_cpu.step_attention: cache_len[", b, "]=", lp[b],
                      " plus T=", T, " must lie within the cache's ", S, " rows");
    longest = std::max(longest, lp[b]);
  }
  at::Tensor out = at::empty({B, T, Hq, D}, q.options());
  if (out.numel() == 0) return out;
  Args a{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>(), lp,
         vis.data_ptr<bool>(), B, T, Hq, Hkv, D, q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0),
         k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
         vis.size(0) == 1 ? 0 : T * T, static_cast<float>(scale)};
  const Task task = pick_task();
  const int64_t G = Hq / Hkv, chunks = (G * T + task.rows - 1) / task.rows;
  const int64_t tasks = B * Hkv * chunks, threads = at::get_num_threads();
  if (task.split != nullptr && G * T <= task.few_rows && threads > 1 && tasks % threads != 0 &&
      tasks < kSplitMaxTasksPerThread * threads && longest >= kSplitMinKeys) {
    split_step(a, task);
    return out;
  }
  // Small steps run on the calling thread: a plain step's few tasks take microseconds, about what waking the
  // other threads would cost.
  const int64_t work_per_task = task.rows * (longest + T) * D;
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(work_per_task, 1));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    // Scores: [keys, L] with rows in the lanes, or [R (< L), keys rounded up to L] for few rows; every entry a task
    // reads it writes first, so left uninitialised (zeroing 128 KB a task at 2000 keys cost 0.1 ms a SmolLM2 step).
    const std::unique_ptr<float[]> scores(new float[(longest + T + task.rows) * task.rows]);
    const std::unique_ptr<float[]> qt(new float[D * task.rows]);
    for (int64_t i = begin; i < end; ++i)
      task.run(a, i / (Hkv * chunks), (i / chunks) % Hkv, (i % chunks) * task.rows, scores.get(), qt.get());
  });
  return out;
}

}  // namespace cpu_attention

TORCH_LIBRARY(lookahead_cpu, m) {
  m.def("step_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_len, Tensor visible, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(lookahead_cpu, CPU, m) { m.impl("step_attention", &cpu_attention::step_attention); }
