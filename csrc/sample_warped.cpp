// A plain sampled step's draw on the CPU: one token per logits row from the distribution that temperature, top-k
// and top-p leave (lookahead/sampling.py's warp_logits), by sample_rows' rule (inverse CDF in token order at one
// uniform a row), without the warped row of the whole vocabulary.
//
// Why: in torch the draw is a dozen passes over the vocabulary and their allocations; for SmolLM2's 49k tokens it
// took 0.5-0.7 ms of a 13-15 ms sampled step on this project's 2-core CPU. Here: one pass for the tempered logits
// and their maximum, one for the exponentials and their sum (cpu_vec's exp, relative error ~1e-7), one that collects
// the tokens above a threshold holding at least top_p of the mass (every token of the nucleus is among them:
// each one outside comes after all of them in the descending order, with at least top_p of the mass before it),
// a sort of those few, and the draw among the nucleus (without top-p: among every token). Sums in float64 in index
// order; the probabilities are float32 exponentials as torch's softmax has them, up to its rounding: a token can
// differ from sample_rows(warp_logits(...)) only where the uniform meets a step of the CDF to the last bits.
// The warped row is a WarpedRow (cpu_ops.h), which the sampled tree walk (csrc/verify_sample.cpp) reads too.
//
// Op (namespace lookahead_draft, CPU):
//   sample_warped(Tensor logits, float temperature, int top_k, float top_p, float min_p, Tensor uniforms) -> Tensor
//     logits float32 [R, V] (the last dimension contiguous), temperature > 0, top_k >= 0 (0: off), top_p in
//     (0, 1], min_p in [0, 1] (0: off), uniforms float64 [R] in [0, 1). Returns int64 [R]; -1 for a row whose largest logit is not finite
//     (+inf, or every entry NaN or -inf). A row with some NaN among finite logits gives an unspecified token, as
//     the torch path's NaN probabilities would; the model's logits hold none.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace sample_warped {
namespace {

// The row's passes, compiled per instruction set (8-lane vectors; cpu_vec.h). temper: s = x / temperature and
// its maximum. exps: e = exp(s - top) where s >= floor, else 0, and the sum (float64, a partial sum per lane).
// above: the tokens with e > t (blocks of 8 without one are skipped). (ATTR on each function: an attribute before
// the macro would reach its first function only.)
#define SAMPLE_PASSES(SUFFIX, ATTR)                                                                               \
  ATTR float temper_##SUFFIX(const float* x, int64_t V, float temperature, float* s) {                             \
    using V8 = cpu_vec::v8sf;                                                                                  \
    V8 top = V8{} - INFINITY;                                                                                  \
    int64_t i = 0;                                                                                             \
    for (; i + 8 <= V; i += 8) {                                                                               \
      const V8 y = cpu_vec::load<V8>(x + i) / temperature;                                                     \
      cpu_vec::store(s + i, y);                                                                                \
      top = y > top ? y : top;                                                                                 \
    }                                                                                                          \
    float m = -INFINITY;                                                                                       \
    for (int l = 0; l < 8; ++l) m = std::max(m, top[l]);                                                       \
    for (; i < V; ++i) m = std::max(m, s[i] = x[i] / temperature);                                            \
    return m;                                                                                                  \
  }                                                                                                            \
  ATTR double exps_##SUFFIX(const float* s, int64_t V, float top, float floor, float* e) {                        \
    using V8 = cpu_vec::v8sf;                                                                                  \
    double lane[8] = {};                                                                                       \
    int64_t i = 0;                                                                                             \
    for (; i + 8 <= V; i += 8) {                                                                               \
      const V8 x = cpu_vec::load<V8>(s + i);                                                                   \
      V8 y = cpu_vec::exp_nonpositive<V8>(x - top);                                                            \
      y = x >= floor ? y : V8{};                                                                               \
      cpu_vec::store(e + i, y);                                                                                \
      for (int l = 0; l < 8; ++l) lane[l] += static_cast<double>(y[l]);                                       \
    }                                                                                                          \
    double sum = 0.0;                                                                                          \
    for (int l = 0; l < 8; ++l) sum += lane[l];                                                                \
    for (; i < V; ++i) sum += (e[i] = s[i] >= floor ? std::exp(s[i] - top) : 0.f);                            \
    return sum;                                                                                                \
  }                                                                                                            \
  ATTR void above_##SUFFIX(const float* e, int64_t V, float t, std::vector<std::pair<int64_t, float>>& out,    \
                           double& mass) {                                                                     \
    using V8 = cpu_vec::v8sf;                                                                                  \
    using I8 = cpu_vec::v8si;                                                                                  \
    int64_t i = 0;                                                                                             \
    for (; i + 8 <= V; i += 8) {                                                                               \
      const I8 hit = cpu_vec::load<V8>(e + i) > t;                                                             \
      bool any = false;                                                                                        \
      for (int l = 0; l < 8; ++l) any |= hit[l] != 0;                                                          \
      if (!any) continue;                                                                                      \
      for (int l = 0; l < 8; ++l)                                                                              \
        if (e[i + l] > t) {                                                                                    \
          out.emplace_back(i + l, e[i + l]);                                                                   \
          mass += static_cast<double>(e[i + l]);                                                               \
        }                                                                                                      \
    }                                                                                                          \
    for (; i < V; ++i)                                                                                         \
      if (e[i] > t) {                                                                                          \
        out.emplace_back(i, e[i]);                                                                             \
        mass += static_cast<double>(e[i]);                                                                     \
      }                                                                                                        \
  }
SAMPLE_PASSES(avx2, __attribute__((target("avx2,fma"))))
SAMPLE_PASSES(plain, )

struct Passes {
  float (*temper)(const float*, int64_t, float, float*);
  double (*exps)(const float*, int64_t, float, float, float*);
  void (*above)(const float*, int64_t, float, std::vector<std::pair<int64_t, float>>&, double&);
};

const Passes& passes() {
  static const Passes avx2{temper_avx2, exps_avx2, above_avx2}, plain{temper_plain, exps_plain, above_plain};
  return small_gemm::current_isa() != "scalar" ? avx2 : plain;
}

// e = the row's weights after temperature and top-k, exp(x / temperature - top) (0 for removed tokens); returns
// their float64 sum, NaN if the largest tempered logit is not finite.
double tempered_weights(const float* x, int64_t V, float temperature, int64_t top_k, float* s, float* e,
                        const Passes& pass) {
  const float top = pass.temper(x, V, temperature, s);
  if (!std::isfinite(top)) return NAN;
  float floor = -FLT_MAX;  // tokens below have no mass: -inf logits, and top-k's (ties with its k-th kept)
  if (top_k > 0 && top_k < V) {
    std::vector<float> vals(top_k);
    std::vector<int64_t> idx(top_k);
    row_topk::top_row(s, V, top_k, vals.data(), idx.data());
    floor = vals[top_k - 1];
  }
  return pass.exps(s, V, top, floor, e);
}

// top-p's kept tokens of e (total: its sum) into kept, in token order.
void nucleus(const float* e, int64_t V, double total, double top_p, const Passes& pass,
             std::vector<std::pair<int64_t, float>>& kept) {
  // Candidates above a threshold holding at least top_p of the mass; each miss lowers it 1024-fold, and at last
  // every token is one.
  const double need = top_p * total;
  std::vector<std::pair<int64_t, float>> cand;  // (token, weight)
  for (float tau = 1.f / 1024;; tau /= 1024) {
    const float t = tau < 1e-30f ? -1.f : tau;
    cand.clear();
    double mass = 0.0;
    pass.above(e, V, t, cand, mass);
    if (mass >= need || t < 0) break;
  }
  // Value descending, ties by index: the stable sort's order; keep while the mass before is below top_p.
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  });
  kept.clear();
  double before = 0.0;
  for (const auto& c : cand) {
    if (!kept.empty() && !(before < need)) break;
    kept.push_back(c);
    before += static_cast<double>(c.second);
  }
  std::sort(kept.begin(), kept.end());  // token order, the CDF's
}

// The smallest i with target < cdf[i] over e[0 .. V) (float64 sums in index order); past the end, the last index
// of positive weight; -1 if none.
int64_t inverse_cdf(const float* e, int64_t V, double target) {
  double cdf = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < V; ++i) {
    cdf += static_cast<double>(e[i]);
    if (e[i] > 0) last = i;
    if (target < cdf) return i;
  }
  return last;
}

}  // namespace

void WarpedRow::check(const char* op, double temperature, int64_t top_k, double top_p, double min_p) {
  TORCH_CHECK_VALUE(temperature > 0 && std::isfinite(temperature), op, ": temperature must be > 0, got ",
                    temperature);
  TORCH_CHECK_VALUE(top_k >= 0, op, ": top_k must be >= 0, got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0 && top_p <= 1, op, ": top_p must be in (0, 1], got ", top_p);
  TORCH_CHECK_VALUE(min_p >= 0 && min_p <= 1, op, ": min_p must be in [0, 1], got ", min_p);
}

WarpedRow::WarpedRow(int64_t V) : V_(V), s_(new float[V]), e_(new float[V]) {}  // every warp writes first

void WarpedRow::warp(const float* x, float temperature, int64_t top_k, double top_p, double min_p) {
  const Passes& pass = passes();
  kept_.clear();
  dense_ = false;
  mass_ = tempered_weights(x, V_, temperature, top_k, s_.get(), e_.get(), pass);
  if (std::isnan(mass_)) {  // no finite logit: nothing kept
    mass_ = 0.0;
    return;
  }
  if (top_p < 1.0) {
    nucleus(e_.get(), V_, mass_, top_p, pass, kept_);
    if (min_p > 0) {  // min-p: drop the tokens below min_p times the likeliest's weight (its ratio of probabilities)
      float top = 0.f;
      for (const auto& k : kept_) top = std::max(top, k.second);
      const float floor = static_cast<float>(min_p * static_cast<double>(top));
      kept_.erase(std::remove_if(kept_.begin(), kept_.end(), [floor](const auto& k) { return k.second < floor; }),
                  kept_.end());
    }
    mass_ = 0.0;
    for (const auto& k : kept_) mass_ += static_cast<double>(k.second);
  } else if (min_p > 0) {  // the tokens at or above min_p times the likeliest's weight
    const float top = *std::max_element(e_.get(), e_.get() + V_);
    const float floor = static_cast<float>(min_p * static_cast<double>(top));
    mass_ = 0.0;
    pass.above(e_.get(), V_, std::nextafter(floor, -INFINITY), kept_, mass_);
  } else {
    dense_ = true;
  }
}

float* WarpedRow::weight(int64_t t) {
  if (t < 0 || t >= V_) return nullptr;
  if (dense_) return e_[t] > 0 ? &e_[t] : nullptr;
  auto it = std::lower_bound(kept_.begin(), kept_.end(), t, [](const auto& w, int64_t tok) { return w.first < tok; });
  return it != kept_.end() && it->first == t ? &it->second : nullptr;
}

int64_t WarpedRow::draw(double target) const {
  if (dense_) return inverse_cdf(e_.get(), V_, target);
  double cdf = 0.0;
  int64_t last = -1;
  for (const auto& [i, w] : kept_) {
    cdf += static_cast<double>(w);
    if (w > 0) last = i;
    if (target < cdf) return i;
  }
  return last;
}

namespace {

at::Tensor sample(const at::Tensor& logits, double temperature, int64_t top_k, double top_p, double min_p,
                  const at::Tensor& uniforms) {
  const char* name = "lookahead_draft.sample_warped";
  TORCH_CHECK_VALUE(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                        logits.size(1) >= 1 && logits.stride(1) == 1,
                    name, ": logits must be a CPU float32 [R, V] tensor with V >= 1 and a contiguous last dimension");
  const int64_t R = logits.size(0), V = logits.size(1);
  WarpedRow::check(name, temperature, top_k, top_p, min_p);
  TORCH_CHECK_VALUE(uniforms.device().is_cpu() && uniforms.scalar_type() == at::kDouble && uniforms.dim() == 1 &&
                        uniforms.size(0) == R,
                    name, ": uniforms must be a CPU float64 [R] tensor");
  at::Tensor out = at::empty({R}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor u = uniforms.contiguous();
  const float* x = logits.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  const float t = static_cast<float>(temperature);
  at::parallel_for(0, R, 1, [&](int64_t lo, int64_t hi) {
    WarpedRow row(V);
    for (int64_t r = lo; r < hi; ++r) {
      row.warp(x + r * stride, t, top_k, top_p, min_p);
      op[r] = row.draw(up[r] * row.mass());
    }
  });
  return out;
}

}  // namespace
}  // namespace sample_warped

TORCH_LIBRARY_FRAGMENT(lookahead_draft, m) {
  m.def("sample_warped(Tensor logits, float temperature, int top_k, float top_p, float min_p, Tensor uniforms) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(lookahead_draft, CPU, m) { m.impl("sample_warped", &sample_warped::sample); }
