// One decoder layer of the CPU forward in float32 as one op: the layer's four linear layers on the small-M GEMM
// (csrc/small_gemm.cpp), its attention on the step attention (csrc/cpu_attention.cpp), and everything between
// them (RMSNorm, rotary embedding, the KV cache write, SwiGLU, the residual adds) in plain loops here.
//
// Why: at one to a few dozen rows those in-between parts are a few microseconds of arithmetic each but cost
// 10-20 us apiece as separate torch ops called from Python (dispatch, allocation, the Python layer's own checks):
// ~130 us a layer, ~4 ms of a 19 ms SmolLM2 forward on this project's CPU (measured). Every row's result depends on
// that row alone (its own inputs, its visible keys), computed in a fixed order, so a step of T rows gives each row
// what a step of one would.
//
// The op runs every layer of the model in one call: called a layer at a time from Python, the call itself (the
// module, the dispatcher parsing 23 arguments, the packed weights' check) cost ~90 us a layer, 2.7 ms of a 28 ms
// SmolLM2 step (measured).
//
// Op (namespace lookahead_cpu):
//   decoder_stack(x, cos, sin, k_cache!, v_cache!, cache_len, visible, scale, eps, num_heads, num_kv_heads,
//                 intermediate_size, attn_norm[], qkv[], qkv_bias?[], o[], o_bias?[], mlp_norm[], gate_up[],
//                 gate_up_bias?[], down[], down_bias?[], q_norm?[], k_norm?[], nope_layers[]) -> Tensor
//     x [B, T, hidden] float32, the first layer's input; cos, sin [B, T, D]; k_cache / v_cache [L, B, S, Hkv, D],
//     the whole cache (layer i written at rows cache_len[b] .. cache_len[b]+T-1); cache_len int64 [B]; visible
//     bool [1 or B, T, T]; then one entry per layer (L of each): attn_norm, mlp_norm [hidden]; qkv, o, gate_up,
//     down packed by lookahead_gemm::pack from weights [(Hq+2Hkv)*D, hidden], [hidden, Hq*D], [2*intermediate,
//     hidden] (gate rows first, then up) and [hidden, intermediate]; biases float32 [n] or None; q_norm, k_norm
//     float32 [D] (Qwen3's RMSNorm of each q and k head, before the rotary embedding) or None (no such norm), both
//     or neither; nope_layers: the layers whose q and k take no rotary embedding (SmolLM3's every fourth). Returns
//     the last layer's output [B, T, hidden].
//   rotary_tables(positions, inv_freq) -> (cos, sin)
//     positions int64 [...], inv_freq float32 [D/2] -> cos, sin float32 [..., D]: each angle float(p) * inv_freq[j]
//     in float32, its cosine and sine in double rounded to float, the D/2 columns repeated.
//   forward_step(input_ids, positions, max_positions, inv_freq, embed, k_cache!, v_cache!, cache_len, visible,
//                scale, eps, num_heads, num_kv_heads, intermediate_size, <decoder_stack's per-layer lists>,
//                final_norm, final_eps, head, logits_rows?) -> Tensor
//     A whole step: the embedding rows of input_ids [B, T] (int64 or int32, in [0, V)), the rotary tables of
//     positions [B, T] (in [0, max_positions)), decoder_stack, the final RMSNorm of the rows logits_rows (int64 [R],
//     negative from the end; None: all T) and the projection by head (embed [V, hidden]'s shape, packed): logits
//     float32 [B, R, V]. Why one op: after a step has streamed the weights through the caches, each torch op
//     called from Python between the large ones cost 15-150 us (session 35: 2-5% of a SmolLM2 step).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace cpu_layer {
namespace {

using cpu_vec::exp_nonpositive;
using cpu_vec::load;
using cpu_vec::store;
using cpu_vec::v16sf;

// Rows of a step's MLP at a time (decoder_layer says why).
constexpr int64_t kMlpRows = 512;

// Rows of work below which a loop stays on the calling thread (waking the others costs about as much).
constexpr int64_t kSerialFloats = 1 << 16;

int64_t grain(int64_t width) { return std::max<int64_t>(1, kSerialFloats / std::max<int64_t>(width, 1)); }

// y[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w, rows [r0, r1) of width n; y may be x.
__attribute__((target_clones("avx512f", "avx2", "default")))
void rms_norm_rows(const float* x, const float* w, float* y, int64_t r0, int64_t r1, int64_t n, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    v16sf acc = {};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
      const v16sf v = load<v16sf>(xr + d);
      acc += v * v;
    }
    float ss = 0.f;
    for (int i = 0; i < 16; ++i) ss += acc[i];
    for (; d < n; ++d) ss += xr[d] * xr[d];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (d = 0; d < n; ++d) yr[d] = (xr[d] * inv) * w[d];
  }
}

// Rotate-half rotary embedding, in place, on heads [0, heads) of rows [r0, r1): row r's head h starts at
// x + r * row_stride + h * D; cos / sin [rows, D].
__attribute__((target_clones("avx512f", "avx2", "default")))
void rotary_rows(float* x, const float* cos, const float* sin, int64_t r0, int64_t r1, int64_t heads,
                 int64_t row_stride, int64_t D) {
  const int64_t half = D / 2;
  float tmp[256];
  for (int64_t r = r0; r < r1; ++r) {
    const float* c = cos + r * D;
    const float* s = sin + r * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + h * D;
      std::memcpy(tmp, v, D * sizeof(float));
      for (int64_t d = 0; d < half; ++d) v[d] = tmp[d] * c[d] + (-tmp[d + half]) * s[d];
      for (int64_t d = half; d < D; ++d) v[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
    }
  }
}

// out[r] = silu(gate[r]) * up[r] for rows [r0, r1), gate and up the two halves of gu[r] (width 2 * n).
// silu(g) = g * sigmoid(g), with sigmoid from exp(-|g|) so that the exponential never overflows.
__attribute__((target_clones("avx512f", "avx2", "default")))
void silu_mul_rows(const float* gu, float* out, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gu + r * 2 * n;
    const float* u = g + n;
    float* o = out + r * n;
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
      const v16sf gv = load<v16sf>(g + d);
      const v16sf neg_abs = gv > 0.f ? -gv : gv;
      const v16sf e = exp_nonpositive(neg_abs);
      const v16sf sig = (gv > 0.f ? v16sf{} + 1.0f : e) / (1.0f + e);
      store(o + d, gv * sig * load<v16sf>(u + d));
    }
    for (; d < n; ++d) {
      const float e = std::exp(-std::fabs(g[d]));
      const float sig = (g[d] > 0.f ? 1.0f : e) / (1.0f + e);
      o[d] = g[d] * sig * u[d];
    }
  }
}

void add_in_place(float* y, const float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) y[i] = x[i] + y[i];
}

void check_vector(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kFloat && t.device().is_cpu(),
                    "lookahead_cpu.decoder_stack: ", name, " must be a float32 CPU tensor [", n, "], got ",
                    t.scalar_type(), " ", t.sizes());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t M = x.size(0), n = x.size(1);
  at::Tensor y = at::empty_like(x);
  const at::Tensor wc = w.contiguous();  // a strided weight view would be read wrong
  const float *xp = x.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, grain(n), [&](int64_t r0, int64_t r1) {
    rms_norm_rows(xp, wp, yp, r0, r1, n, static_cast<float>(eps));
  });
  return y;
}

}  // namespace

at::Tensor decoder_layer(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                         at::Tensor& k_all, at::Tensor& v_all, int64_t layer, const at::Tensor& cache_len,
                         const at::Tensor& visible, double scale, double eps, int64_t num_heads,
                         int64_t num_kv_heads, int64_t intermediate_size, const at::Tensor& attn_norm,
                         const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o,
                         const c10::optional<at::Tensor>& o_bias, const at::Tensor& mlp_norm,
                         const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias,
                         const at::Tensor& down, const c10::optional<at::Tensor>& down_bias,
                         const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                         bool rotate) {
  TORCH_CHECK_VALUE(x_in.dim() == 3 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
                    "lookahead_cpu.decoder_stack: x must be a float32 CPU tensor [B, T, hidden], got ",
                    x_in.scalar_type(), " ", x_in.sizes());
  const int64_t B = x_in.size(0), T = x_in.size(1), hidden = x_in.size(2), M = B * T;
  const int64_t Hq = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK_VALUE(Hq > 0 && Hkv > 0 && Hq % Hkv == 0 && intermediate_size > 0,
                    "lookahead_cpu.decoder_stack: num_heads must be a positive multiple of num_kv_heads and "
                    "intermediate_size positive, got ", Hq, ", ", Hkv, ", ", intermediate_size);
  TORCH_CHECK_VALUE(cos_in.dim() == 3 && cos_in.sizes() == sin_in.sizes() && cos_in.size(0) == B &&
                        cos_in.size(1) == T && cos_in.scalar_type() == at::kFloat &&
                        sin_in.scalar_type() == at::kFloat,
                    "lookahead_cpu.decoder_stack: cos and sin must be float32 [B=", B, ", T=", T, ", D], got ",
                    cos_in.sizes(), " and ", sin_in.sizes());
  const int64_t D = cos_in.size(2);
  TORCH_CHECK_VALUE(D % 2 == 0 && D <= 256, "lookahead_cpu.decoder_stack: head_dim must be even and at most 256, got ",
                    D);
  TORCH_CHECK_VALUE(k_all.dim() == 5 && k_all.sizes() == v_all.sizes() && layer >= 0 && layer < k_all.size(0),
                    "lookahead_cpu.decoder_stack: k_cache and v_cache must both be [L, B, S, Hkv, D] and layer in "
                    "[0, L), got ", k_all.sizes(), ", ", v_all.sizes(), " and layer ", layer);
  const at::Tensor k_cache = k_all.select(0, layer), v_cache = v_all.select(0, layer);
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B &&
                        k_cache.size(2) == Hkv && k_cache.size(3) == D && k_cache.scalar_type() == at::kFloat &&
                        v_cache.scalar_type() == at::kFloat && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                    "lookahead_cpu.decoder_stack: k_cache and v_cache must be float32 [B=", B, ", S, Hkv=", Hkv,
                    ", D=", D, "] with a contiguous last dimension, got ", k_cache.sizes(), " and ",
                    v_cache.sizes());
  TORCH_CHECK_VALUE(cache_len.dim() == 1 && cache_len.size(0) == B && cache_len.scalar_type() == at::kLong,
                    "lookahead_cpu.decoder_stack: cache_len must be int64 [B=", B, "], got ", cache_len.sizes());
  check_vector(attn_norm, hidden, "attn_norm");
  check_vector(mlp_norm, hidden, "mlp_norm");
  const bool qk_norm = q_norm.has_value() && q_norm->defined();
  TORCH_CHECK_VALUE(qk_norm == (k_norm.has_value() && k_norm->defined()),
                    "lookahead_cpu.decoder_stack: q_norm and k_norm must both be given or both be None");
  at::Tensor qn, kn;  // contiguous: a strided weight view would be read wrong
  if (qk_norm) {
    check_vector(*q_norm, D, "q_norm");
    check_vector(*k_norm, D, "k_norm");
    qn = q_norm->contiguous();
    kn = k_norm->contiguous();
  }
  const at::Tensor lens = cache_len.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t S = k_cache.size(1);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK_VALUE(lp[b] >= 0 && lp[b] + T <= S, "lookahead_cpu.decoder_stack: cache_len[", b, "]=", lp[b],
                      " plus T=", T, " must lie within the cache's ", S, " rows");

  const at::Tensor x = x_in.contiguous().view({M, hidden});
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t width = (Hq + 2 * Hkv) * D;

  // Attention block: norm, q/k/v, (each q and k head's norm,) rotary on q and k (unless the layer has none), the
  // cache write, attention, o, residual.
  const at::Tensor h = rms_norm(x, attn_norm, eps);
  at::Tensor q_k_v = small_gemm::linear(h, qkv, width, qkv_bias);  // [M, width]
  float* qkvp = q_k_v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const float* qnp = qk_norm ? qn.data_ptr<float>() : nullptr;
  const float* knp = qk_norm ? kn.data_ptr<float>() : nullptr;
  const float head_eps = static_cast<float>(eps);
  at::parallel_for(0, M, grain((Hq + Hkv) * D), [&](int64_t r0, int64_t r1) {
    if (qk_norm)
      for (int64_t r = r0; r < r1; ++r) {  // a row's heads are rows of D floats: q heads, then k heads
        float* row = qkvp + r * width;
        rms_norm_rows(row, qnp, row, 0, Hq, D, head_eps);
        rms_norm_rows(row + Hq * D, knp, row + Hq * D, 0, Hkv, D, head_eps);
      }
    if (rotate) rotary_rows(qkvp, cp, sp, r0, r1, Hq + Hkv, width, D);
  });
  float *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = qkvp + (b * T + t) * width;
      const int64_t slot = lp[b] + t;
      for (int64_t g = 0; g < Hkv; ++g) {
        std::memcpy(kp + b * k_cache.stride(0) + slot * k_cache.stride(1) + g * k_cache.stride(2),
                    row + (Hq + g) * D, D * sizeof(float));
        std::memcpy(vp + b * v_cache.stride(0) + slot * v_cache.stride(1) + g * v_cache.stride(2),
                    row + (Hq + Hkv + g) * D, D * sizeof(float));
      }
    }
  const at::Tensor q = q_k_v.view({B, T, Hq + 2 * Hkv, D}).narrow(2, 0, Hq);
  const at::Tensor attn = cpu_attention::step_attention(q, k_cache, v_cache, lens, visible, scale);
  at::Tensor y = small_gemm::linear(attn.view({M, Hq * D}), o, hidden, o_bias);
  add_in_place(y.data_ptr<float>(), x.data_ptr<float>(), M * hidden);

  // MLP block: norm, gate and up, SwiGLU, down, residual, for rows [r0, r0 + rows) of y.
  auto mlp = [&](int64_t r0, int64_t rows) {
    const at::Tensor yr = y.narrow(0, r0, rows);
    const at::Tensor gu = small_gemm::linear(rms_norm(yr, mlp_norm, eps), gate_up, 2 * intermediate_size,
                                             gate_up_bias);
    at::Tensor act = at::empty({rows, intermediate_size}, x.options());
    const float* gup = gu.data_ptr<float>();
    float* ap = act.data_ptr<float>();
    at::parallel_for(0, rows, grain(2 * intermediate_size), [&](int64_t a, int64_t b) {
      silu_mul_rows(gup, ap, a, b, intermediate_size);
    });
    at::Tensor z = small_gemm::linear(act, down, hidden, down_bias);
    add_in_place(z.data_ptr<float>(), yr.data_ptr<float>(), rows * hidden);
    return z;
  };
  // A long prompt's rows in chunks (every sum is a row's own): the gate and up activations of 4000 rows (49 MB) were
  // a fresh mapping of memory every layer, read back from DRAM; a chunk's stay in the caches.
  const int64_t chunks = (M + kMlpRows - 1) / kMlpRows;
  if (chunks == 1) return mlp(0, M).view({B, T, hidden});
  const int64_t chunk_rows = (M + chunks - 1) / chunks;
  at::Tensor out = at::empty({M, hidden}, x.options());
  for (int64_t r0 = 0; r0 < M; r0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, M - r0);
    out.narrow(0, r0, rows).copy_(mlp(r0, rows));
  }
  return out.view({B, T, hidden});
}

at::Tensor decoder_stack(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_all,
                         at::Tensor& v_all, const at::Tensor& cache_len, const at::Tensor& visible, double scale,
                         double eps, int64_t num_heads, int64_t num_kv_heads, int64_t intermediate_size,
                         at::TensorList attn_norm, at::TensorList qkv,
                         const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::TensorList o,
                         const c10::List<c10::optional<at::Tensor>>& o_bias, at::TensorList mlp_norm,
                         at::TensorList gate_up, const c10::List<c10::optional<at::Tensor>>& gate_up_bias,
                         at::TensorList down, const c10::List<c10::optional<at::Tensor>>& down_bias,
                         const c10::List<c10::optional<at::Tensor>>& q_norm,
                         const c10::List<c10::optional<at::Tensor>>& k_norm, at::IntArrayRef nope_layers) {
  const int64_t L = static_cast<int64_t>(attn_norm.size());
  TORCH_CHECK_VALUE(k_all.dim() == 5 && L == k_all.size(0),
                    "lookahead_cpu.decoder_stack: one attn_norm per layer of the cache [L, B, S, Hkv, D], got ", L,
                    " for a cache of ", k_all.sizes());
  const int64_t sizes[] = {static_cast<int64_t>(qkv.size()), static_cast<int64_t>(qkv_bias.size()),
                           static_cast<int64_t>(o.size()), static_cast<int64_t>(o_bias.size()),
                           static_cast<int64_t>(mlp_norm.size()), static_cast<int64_t>(gate_up.size()),
                           static_cast<int64_t>(gate_up_bias.size()), static_cast<int64_t>(down.size()),
                           static_cast<int64_t>(down_bias.size()), static_cast<int64_t>(q_norm.size()),
                           static_cast<int64_t>(k_norm.size())};
  for (int64_t n : sizes)
    TORCH_CHECK_VALUE(n == L, "lookahead_cpu.decoder_stack: every per-layer list must hold ", L,
                      " entries (one per layer), got one of ", n);
  std::vector<bool> rotate(L, true);
  for (const int64_t i : nope_layers) {
    TORCH_CHECK_VALUE(i >= 0 && i < L, "lookahead_cpu.decoder_stack: nope_layers must index the ", L,
                      " layers, got ", nope_layers);
    rotate[i] = false;
  }
  at::Tensor h = x;
  for (int64_t i = 0; i < L; ++i)
    h = decoder_layer(h, cos, sin, k_all, v_all, i, cache_len, visible, scale, eps, num_heads, num_kv_heads,
                      intermediate_size, attn_norm[i], qkv[i], qkv_bias.get(i), o[i], o_bias.get(i), mlp_norm[i],
                      gate_up[i], gate_up_bias.get(i), down[i], down_bias.get(i), q_norm.get(i), k_norm.get(i),
                      rotate[i]);
  return h;
}

// cos and sin [n, 2 half] of the rotary embedding at positions pos[0 .. n): angle j = float(pos) * inv_freq[j] in
// float32 (as the model's torch path computes it), its cosine and sine in double rounded to float, columns
// [0, half) repeated in [half, 2 half).
void rotary_tables_into(const int64_t* pos, int64_t n, const float* inv_freq, int64_t half, float* cos, float* sin) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = static_cast<float>(pos[i]);
    float* c = cos + i * 2 * half;
    float* s = sin + i * 2 * half;
    for (int64_t j = 0; j < half; ++j) {
      const double a = static_cast<double>(p * inv_freq[j]);
      c[j] = c[half + j] = static_cast<float>(std::cos(a));
      s[j] = s[half + j] = static_cast<float>(std::sin(a));
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rotary_tables(const at::Tensor& positions, const at::Tensor& inv_freq) {
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.device().is_cpu(),
                    "lookahead_cpu.rotary_tables: positions must be an int64 CPU tensor, got ",
                    positions.scalar_type(), " on ", positions.device());
  TORCH_CHECK_VALUE(inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat && inv_freq.device().is_cpu(),
                    "lookahead_cpu.rotary_tables: inv_freq must be a float32 CPU tensor [D / 2], got ",
                    inv_freq.scalar_type(), " ", inv_freq.sizes());
  const at::Tensor pos = positions.contiguous(), freq = inv_freq.contiguous();
  const int64_t half = freq.size(0);
  std::vector<int64_t> shape(pos.sizes().begin(), pos.sizes().end());
  shape.push_back(2 * half);
  at::Tensor cos = at::empty(shape, freq.options()), sin = at::empty(shape, freq.options());
  rotary_tables_into(pos.data_ptr<int64_t>(), pos.numel(), freq.data_ptr<float>(), half, cos.data_ptr<float>(),
                     sin.data_ptr<float>());
  return {cos, sin};
}

at::Tensor forward_step(const at::Tensor& input_ids, const at::Tensor& positions, int64_t max_positions,
                        const at::Tensor& inv_freq, const at::Tensor& embed, at::Tensor& k_all, at::Tensor& v_all,
                        const at::Tensor& cache_len, const at::Tensor& visible, double scale, double eps,
                        int64_t num_heads, int64_t num_kv_heads, int64_t intermediate_size, at::TensorList attn_norm,
                        at::TensorList qkv, const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::TensorList o,
                        const c10::List<c10::optional<at::Tensor>>& o_bias, at::TensorList mlp_norm,
                        at::TensorList gate_up, const c10::List<c10::optional<at::Tensor>>& gate_up_bias,
                        at::TensorList down, const c10::List<c10::optional<at::Tensor>>& down_bias,
                        const c10::List<c10::optional<at::Tensor>>& q_norm,
                        const c10::List<c10::optional<at::Tensor>>& k_norm, at::IntArrayRef nope_layers,
                        const at::Tensor& final_norm, double final_eps, const at::Tensor& head,
                        const c10::optional<at::Tensor>& logits_rows) {
  TORCH_CHECK_VALUE(input_ids.dim() == 2 && input_ids.device().is_cpu() &&
                        (input_ids.scalar_type() == at::kLong || input_ids.scalar_type() == at::kInt),
                    "lookahead_cpu.forward_step: input_ids must be an int64 or int32 CPU tensor [B, T], got ",
                    input_ids.scalar_type(), " ", input_ids.sizes());
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  TORCH_CHECK_VALUE(positions.sizes() == input_ids.sizes() && positions.device().is_cpu() &&
                        (positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt),
                    "lookahead_cpu.forward_step: positions must be an integer CPU tensor [B=", B, ", T=", T,
                    "], got ", positions.scalar_type(), " ", positions.sizes());
  TORCH_CHECK_VALUE(embed.dim() == 2 && embed.scalar_type() == at::kFloat && embed.device().is_cpu() &&
                        embed.stride(1) == 1,
                    "lookahead_cpu.forward_step: embed must be float32 [V, hidden] with contiguous rows, got ",
                    embed.scalar_type(), " ", embed.sizes());
  const int64_t V = embed.size(0), hidden = embed.size(1);
  check_vector(final_norm, hidden, "final_norm");
  const at::Tensor ids = input_ids.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  if (B * T > 0) {
    const auto [id_lo, id_hi] = std::minmax_element(ip, ip + B * T);
    TORCH_CHECK_VALUE(*id_lo >= 0 && *id_hi < V, "input_ids must lie in [0, vocab_size=", V, "), got min ", *id_lo,
                      " max ", *id_hi);
    const auto [p_lo, p_hi] = std::minmax_element(pp, pp + B * T);
    TORCH_CHECK_VALUE(*p_lo >= 0 && *p_hi < max_positions, "positions must lie in [0, max_position_embeddings=",
                      max_positions, "), got min ", *p_lo, " max ", *p_hi);
  }
  // The rows whose logits are wanted (Python's indexing: -T .. T - 1), all T by default.
  std::vector<int64_t> rows;
  if (logits_rows.has_value() && logits_rows->defined()) {
    const at::Tensor r = logits_rows->to(at::kLong).contiguous();
    TORCH_CHECK_VALUE(r.dim() == 1, "logits_rows must be None or an integer tensor [R], got ", r.sizes());
    for (int64_t i = 0; i < r.numel(); ++i) {
      const int64_t v = r.data_ptr<int64_t>()[i];
      TORCH_CHECK_VALUE(v >= -T && v < T, "logits_rows must index the step's T=", T, " tokens, got ", r);
      rows.push_back(v < 0 ? v + T : v);
    }
  } else {
    for (int64_t t = 0; t < T; ++t) rows.push_back(t);
  }
  const int64_t R = static_cast<int64_t>(rows.size());
  // The embedding rows, then the rotary tables from the positions.
  at::Tensor x = at::empty({B, T, hidden}, embed.options());
  const float* ep = embed.data_ptr<float>();
  const int64_t estride = embed.stride(0);
  for (int64_t i = 0; i < B * T; ++i)
    std::memcpy(x.data_ptr<float>() + i * hidden, ep + ip[i] * estride, hidden * sizeof(float));
  const auto [cos, sin] = rotary_tables(pos, inv_freq);
  const at::Tensor h = decoder_stack(x, cos, sin, k_all, v_all, cache_len, visible, scale, eps, num_heads,
                                     num_kv_heads, intermediate_size, attn_norm, qkv, qkv_bias, o, o_bias, mlp_norm,
                                     gate_up, gate_up_bias, down, down_bias, q_norm, k_norm, nope_layers);
  // The final norm of the rows wanted, then the vocabulary projection.
  at::Tensor picked = at::empty({B * R, hidden}, embed.options());
  const float* hp = h.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < R; ++i)
      std::memcpy(picked.data_ptr<float>() + (b * R + i) * hidden, hp + (b * T + rows[i]) * hidden,
                  hidden * sizeof(float));
  const at::Tensor normed = rms_norm(picked, final_norm, final_eps);
  return small_gemm::linear(normed, head, V, c10::nullopt).view({B, R, V});
}

}  // namespace cpu_layer

TORCH_LIBRARY_FRAGMENT(lookahead_cpu, m) {
  m.def("rotary_tables(Tensor positions, Tensor inv_freq) -> (Tensor, Tensor)");
  m.def("forward_step(Tensor input_ids, Tensor positions, int max_positions, Tensor inv_freq, Tensor embed, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_len, Tensor visible, float scale, float eps, "
        "int num_heads, int num_kv_heads, int intermediate_size, Tensor[] attn_norm, Tensor[] qkv, Tensor?[] qkv_bias, "
        "Tensor[] o, Tensor?[] o_bias, Tensor[] mlp_norm, Tensor[] gate_up, Tensor?[] gate_up_bias, Tensor[] down, "
        "Tensor?[] down_bias, Tensor?[] q_norm, Tensor?[] k_norm, int[] nope_layers, Tensor final_norm, "
        "float final_eps, Tensor head, Tensor? logits_rows) -> Tensor");
  m.def("decoder_stack(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_len, "
        "Tensor visible, float scale, float eps, int num_heads, int num_kv_heads, int intermediate_size, "
        "Tensor[] attn_norm, Tensor[] qkv, Tensor?[] qkv_bias, Tensor[] o, Tensor?[] o_bias, Tensor[] mlp_norm, "
        "Tensor[] gate_up, Tensor?[] gate_up_bias, Tensor[] down, Tensor?[] down_bias, Tensor?[] q_norm, "
        "Tensor?[] k_norm, int[] nope_layers) -> Tensor");
}

TORCH_LIBRARY_IMPL(lookahead_cpu, CPU, m) {
  m.impl("decoder_stack", &cpu_layer::decoder_stack);
  m.impl("rotary_tables", &cpu_layer::rotary_tables);
  m.impl("forward_step", &cpu_layer::forward_step);
}
