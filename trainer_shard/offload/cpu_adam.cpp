// The one-pass CPU Adam/AdamW step of the offload engine: see cpu_adam.py, which builds this
// file at first use (torch.utils.cpp_extension.load_inline, with the bindings of `adam_step`)
// and says what the kernel does and why it equals torch's fused CPU Adam bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef TS_PREFETCH
#define TS_PREFETCH 512  // elements ahead the read streams are prefetched (0: the hardware prefetchers alone)
#endif
#ifndef TS_BLOCK
#define TS_BLOCK 16384  // elements a thread takes at a time (a multiple of 16)
#endif
#ifndef TS_STREAM
#define TS_STREAM 1  // streaming (non-temporal) stores for the 16-bit parameters: written, never read here
#endif

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kVec = fVec::size();
constexpr int64_t kBlock = TS_BLOCK;
static_assert(kBlock % 16 == 0, "blocks must keep torch's vector boundaries");

// Moving values of type T between memory and fp32 vectors: kVec or 2 * kVec at a time.
template <typename T>
struct Io {  // BFloat16, Half: at::vec's conversions, what torch's own casts use
  static inline void load2(const T* p, fVec& a, fVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
  }
  static inline void store2(T* p, const fVec& a, const fVec& b) {
    auto v = at::vec::convert_from_float<T>(a, b);
#if TS_STREAM && defined(__AVX2__) && !defined(CPU_CAPABILITY_AVX512)
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), __m256i(v));
      return;
    }
#endif
    v.store(p);
  }
  static inline fVec load1(const T* p) {
    fVec a;
    at::vec::load_to_float<T>(p, a);
    return a;
  }
  static inline void store1(T* p, const fVec& a) { at::vec::convert_from_float<T>(a, a).store(p, kVec); }
  static inline float get(const T* p) { return static_cast<float>(*p); }
  static inline void put(T* p, float x) { *p = T(x); }
};

template <>
struct Io<float> {
  static inline void load2(const float* p, fVec& a, fVec& b) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + kVec);
  }
  static inline void store2(float* p, const fVec& a, const fVec& b) {
    a.store(p);
    b.store(p + kVec);
  }
  static inline fVec load1(const float* p) { return fVec::loadu(p); }
  static inline void store1(float* p, const fVec& a) { a.store(p); }
  static inline float get(const float* p) { return *p; }
  static inline void put(float* p, float x) { *p = x; }
};

struct Hyper {
  // as FusedAdamKernel.cpp computes them, in double, then used as float
  double lr, beta1, beta2, weight_decay, eps, step_size, bias_correction2_sqrt, grad_scale;
  bool scaled, maximize, amsgrad, fresh, write_grad;
  int64_t segment;
};

// The vector step: FusedAdamKernel.cpp's fp32 `adam_math`, expression for expression.
template <bool ADAMW>
struct VecMath {
  fVec grad_scale, minus_one, weight_decay, decay, lerp_weight, coeff, beta2, sq_coeff, bc2_sqrt, eps, neg_step, mask;
  const Hyper& h;

  explicit VecMath(const Hyper& hyper) : h(hyper) {
    grad_scale = fVec(float(h.grad_scale));
    minus_one = fVec(float(-1.0));
    weight_decay = fVec(float(h.weight_decay));
    decay = fVec(float(1 - h.lr * h.weight_decay));
    lerp_weight = fVec(float(1 - h.beta1));
    mask = lerp_weight.abs() < fVec(0.5);
    coeff = fVec::blendv(lerp_weight - fVec(1), lerp_weight, mask);
    beta2 = fVec(float(h.beta2));
    sq_coeff = fVec(float(1 - h.beta2));
    bc2_sqrt = fVec(float(h.bias_correction2_sqrt));
    eps = fVec(float(h.eps));
    neg_step = fVec(float(-h.step_size));
  }

  // grad is divided by grad_scale in place (the caller may store it back)
  inline void operator()(fVec& param, fVec& grad, fVec& exp_avg, fVec& exp_avg_sq, fVec& max_exp_avg_sq) const {
    if (h.scaled) grad = grad / grad_scale;
    fVec g = grad;
    if (h.maximize) g = g * minus_one;
    if (h.weight_decay != 0.f) {
      if constexpr (ADAMW) {
        param = param * decay;
      } else {
        g += param * weight_decay;
      }
    }
    auto base = fVec::blendv(g, exp_avg, mask);
    exp_avg = at::vec::fmadd(coeff, g - exp_avg, base);
    exp_avg_sq = exp_avg_sq * beta2 + sq_coeff * g * g;
    fVec denom;
    if (h.amsgrad) {
      max_exp_avg_sq = at::vec::maximum(max_exp_avg_sq, exp_avg_sq);
      denom = (max_exp_avg_sq.sqrt() / bc2_sqrt) + eps;
    } else {
      denom = (exp_avg_sq.sqrt() / bc2_sqrt) + eps;
    }
    param = param + neg_step * exp_avg / denom;
  }
};

// The scalar step of the elements after the last whole vector: FusedAdamKernel.cpp's scalar
// loop (fp32), which the compiler contracts differently from the vector one: the last elements
// of a call are bit for bit torch's only if they take this path in both.
template <bool ADAMW>
inline void scalar_math(const Hyper& h, float& param, float& grad, float& exp_avg, float& exp_avg_sq,
                        float& max_exp_avg_sq) {
  if (h.scaled) grad = grad / float(h.grad_scale);
  float g = grad;
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.f) {
    if constexpr (ADAMW) {
      param = param * float(1 - h.lr * h.weight_decay);
    } else {
      g += param * float(h.weight_decay);
    }
  }
  const double c1 = 1 - h.beta1;
  if (std::abs(float(c1)) < float(0.5)) {
    exp_avg = exp_avg + float(c1) * (g - exp_avg);
  } else {
    exp_avg = g - (g - exp_avg) * (float(1) - float(c1));
  }
  exp_avg_sq = exp_avg_sq * float(h.beta2);
  exp_avg_sq = exp_avg_sq + float(1 - h.beta2) * g * g;
  float denom;
  if (h.amsgrad) {
    max_exp_avg_sq = std::max(max_exp_avg_sq, exp_avg_sq);
    denom = std::sqrt(max_exp_avg_sq) / float(h.bias_correction2_sqrt) + float(h.eps);
  } else {
    denom = std::sqrt(exp_avg_sq) / float(h.bias_correction2_sqrt) + float(h.eps);
  }
  param = param - float(h.step_size) * exp_avg / denom;
}

// Where the updated weights go: pieces [begin, end) of the call's elements, in order, each its
// own tensor (this rank's slices of a flat buffer, bucket by bucket), none for no output.
template <typename O>
struct Piece {
  O* ptr;
  int64_t begin, end;
};

template <typename O>
struct Out {
  const std::vector<Piece<O>>& pieces;
  size_t i = 0;

  Out(const std::vector<Piece<O>>& all, int64_t from) : pieces(all) {
    auto first = std::upper_bound(pieces.begin(), pieces.end(), from,
                                  [](int64_t d, const Piece<O>& piece) { return d < piece.end; });
    i = first - pieces.begin();
  }
  inline O* at(int64_t d) {  // the piece of element d (d only grows)
    while (pieces[i].end <= d) i++;
    return pieces[i].ptr + (d - pieces[i].begin);
  }
  inline void put(int64_t d, float x) { Io<O>::put(at(d), x); }
  inline void store2(int64_t d, const fVec& a, const fVec& b) {
    O* p = at(d);
    if (d + 2 * kVec <= pieces[i].end) return Io<O>::store2(p, a, b);
    float values[2 * kVec];
    a.store(values);
    b.store(values + kVec);
    for (int64_t k = 0; k < 2 * kVec; k++) put(d + k, values[k]);
  }
  inline void store1(int64_t d, const fVec& a) {
    float values[kVec];
    a.store(values);
    for (int64_t k = 0; k < kVec; k++) put(d + k, values[k]);
  }
};

template <typename T>
inline void prefetch(const T* p) {
#if TS_PREFETCH > 0 && defined(__AVX2__)
  _mm_prefetch(reinterpret_cast<const char*>(p + TS_PREFETCH), _MM_HINT_T0);
#endif
}

// Elements [begin, end) of the call: vectors of 2 * kVec, one of kVec, then one by one, as
// torch's kernel steps a range (begin is a multiple of 16, so vectors fall where torch's do).
template <bool ADAMW, typename G, typename O>
void adam_range(const Hyper& h, float* param, float* exp_avg, float* exp_avg_sq, float* max_sq, G* grad,
                const std::vector<Piece<O>>* pieces, int64_t begin, int64_t end) {
  const VecMath<ADAMW> math(h);
  const fVec zero(0.f);
  std::optional<Out<O>> out;
  if (pieces && !pieces->empty()) out.emplace(*pieces, begin);
  int64_t d = begin;
  for (; d + 2 * kVec <= end; d += 2 * kVec) {
    fVec p0, p1, g0, g1, m0 = zero, m1 = zero, v0 = zero, v1 = zero, x0 = zero, x1 = zero;
    prefetch(param + d);
    prefetch(grad + d);
    Io<float>::load2(param + d, p0, p1);
    Io<G>::load2(grad + d, g0, g1);
    if (!h.fresh) {
      prefetch(exp_avg + d);
      prefetch(exp_avg_sq + d);
      Io<float>::load2(exp_avg + d, m0, m1);
      Io<float>::load2(exp_avg_sq + d, v0, v1);
      if (h.amsgrad) Io<float>::load2(max_sq + d, x0, x1);
    }
    math(p0, g0, m0, v0, x0);
    math(p1, g1, m1, v1, x1);
    Io<float>::store2(param + d, p0, p1);
    Io<float>::store2(exp_avg + d, m0, m1);
    Io<float>::store2(exp_avg_sq + d, v0, v1);
    if (h.amsgrad) Io<float>::store2(max_sq + d, x0, x1);
    if constexpr (std::is_same_v<G, float>) {
      if (h.write_grad) Io<float>::store2(grad + d, g0, g1);
    }
    if (out) out->store2(d, p0, p1);
  }
  for (; d + kVec <= end; d += kVec) {
    fVec p = Io<float>::load1(param + d), g = Io<G>::load1(grad + d), m = zero, v = zero, x = zero;
    if (!h.fresh) {
      m = Io<float>::load1(exp_avg + d);
      v = Io<float>::load1(exp_avg_sq + d);
      if (h.amsgrad) x = Io<float>::load1(max_sq + d);
    }
    math(p, g, m, v, x);
    Io<float>::store1(param + d, p);
    Io<float>::store1(exp_avg + d, m);
    Io<float>::store1(exp_avg_sq + d, v);
    if (h.amsgrad) Io<float>::store1(max_sq + d, x);
    if constexpr (std::is_same_v<G, float>) {
      if (h.write_grad) Io<float>::store1(grad + d, g);
    }
    if (out) out->store1(d, p);
  }
  for (; d < end; d++) {
    float p = param[d], g = Io<G>::get(grad + d);
    float m = h.fresh ? 0.f : exp_avg[d], v = h.fresh ? 0.f : exp_avg_sq[d];
    float x = (h.fresh || !h.amsgrad) ? 0.f : max_sq[d];
    scalar_math<ADAMW>(h, p, g, m, v, x);
    param[d] = p;
    exp_avg[d] = m;
    exp_avg_sq[d] = v;
    if (h.amsgrad) max_sq[d] = x;
    if constexpr (std::is_same_v<G, float>) {
      if (h.write_grad) grad[d] = g;
    }
    if (out) out->put(d, p);
  }
#if TS_STREAM && defined(__AVX2__)
  _mm_sfence();  // streaming stores are visible before the threads join
#endif
}

template <bool ADAMW, typename G, typename O>
void adam_all(const Hyper& h, const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
              const at::Tensor& max_sq, const at::Tensor& grad, const std::vector<at::Tensor>& outs,
              const std::vector<int64_t>& offsets) {
  std::vector<Piece<O>> pieces;
  for (size_t k = 0; k < outs.size(); k++) {
    pieces.push_back({static_cast<O*>(outs[k].data_ptr()), offsets[k], offsets[k] + outs[k].numel()});
  }
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  float* x = h.amsgrad ? max_sq.data_ptr<float>() : nullptr;
  G* g = static_cast<G*>(grad.data_ptr());
  const int64_t numel = param.numel();
  // The call's elements are segments of `segment` elements (the last one shorter), each stepped
  // as torch's kernel steps a tensor of its own: vectors from its start, the scalar loop for its
  // last elements. Segments are cut into blocks of kBlock elements (a multiple of 16, so
  // vectors stay where torch's fall), handed out one at a time to whichever thread of torch's
  // pool is free: a thread slowed down by another process on its core takes fewer.
  const int64_t segment = std::max<int64_t>(h.segment, 1);
  const int64_t per_segment = (segment + kBlock - 1) / kBlock;
  const int64_t segments = (numel + segment - 1) / segment;
  const int64_t blocks = segments == 0 ? 0 : (segments - 1) * per_segment +
                                                 (numel - (segments - 1) * segment + kBlock - 1) / kBlock;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), blocks), 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
      const int64_t first = (b / per_segment) * segment;
      const int64_t begin = first + (b % per_segment) * kBlock;
      const int64_t end = std::min({begin + kBlock, first + segment, numel});
      adam_range<ADAMW, G, O>(h, p, m, v, x, g, &pieces, begin, end);
    }
  });
}

template <bool ADAMW, typename G>
void dispatch_out(const Hyper& h, const at::Tensor& param, const at::Tensor& m, const at::Tensor& v,
                  const at::Tensor& x, const at::Tensor& grad, const std::vector<at::Tensor>& outs,
                  const std::vector<int64_t>& offsets) {
  switch (outs.empty() ? at::kFloat : outs[0].scalar_type()) {
    case at::kFloat: return adam_all<ADAMW, G, float>(h, param, m, v, x, grad, outs, offsets);
    case at::kBFloat16: return adam_all<ADAMW, G, at::BFloat16>(h, param, m, v, x, grad, outs, offsets);
    case at::kHalf: return adam_all<ADAMW, G, at::Half>(h, param, m, v, x, grad, outs, offsets);
    default: TORCH_CHECK(false, "cpu_adam: outs must be float32, bfloat16 or float16");
  }
}

template <bool ADAMW>
void dispatch_grad(const Hyper& h, const at::Tensor& param, const at::Tensor& m, const at::Tensor& v,
                   const at::Tensor& x, const at::Tensor& grad, const std::vector<at::Tensor>& outs,
                   const std::vector<int64_t>& offsets) {
  switch (grad.scalar_type()) {
    case at::kFloat: return dispatch_out<ADAMW, float>(h, param, m, v, x, grad, outs, offsets);
    case at::kBFloat16: return dispatch_out<ADAMW, at::BFloat16>(h, param, m, v, x, grad, outs, offsets);
    case at::kHalf: return dispatch_out<ADAMW, at::Half>(h, param, m, v, x, grad, outs, offsets);
    default: TORCH_CHECK(false, "cpu_adam: grad must be float32, bfloat16 or float16");
  }
}

void check(const at::Tensor& t, const char* name, int64_t numel, bool fp32) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && (numel < 0 || t.numel() == numel),
              "cpu_adam: ", name, " must be a contiguous CPU tensor of ", numel, " elements");
  TORCH_CHECK(!fp32 || t.scalar_type() == at::kFloat, "cpu_adam: ", name, " must be float32");
}

}  // namespace

void adam_step(at::Tensor param, at::Tensor exp_avg, at::Tensor exp_avg_sq, std::optional<at::Tensor> max_exp_avg_sq,
               at::Tensor grad, std::vector<at::Tensor> outs, std::vector<int64_t> offsets, double step, double lr,
               double beta1, double beta2, double weight_decay, double eps, bool amsgrad, bool maximize, bool adamw,
               std::optional<double> grad_scale, bool fresh, bool write_grad, int64_t segment) {
  const int64_t numel = param.numel();
  check(param, "param", numel, true);
  check(exp_avg, "exp_avg", numel, true);
  check(exp_avg_sq, "exp_avg_sq", numel, true);
  check(grad, "grad", numel, false);
  at::Tensor x;
  if (amsgrad) {
    TORCH_CHECK(max_exp_avg_sq.has_value(), "cpu_adam: amsgrad needs max_exp_avg_sq");
    x = *max_exp_avg_sq;
    check(x, "max_exp_avg_sq", numel, true);
  }
  TORCH_CHECK(outs.size() == offsets.size(), "cpu_adam: one offset an output");
  int64_t covered = 0;
  for (size_t k = 0; k < outs.size(); k++) {
    check(outs[k], "each output", -1, false);
    TORCH_CHECK(offsets[k] == covered && outs[k].scalar_type() == outs[0].scalar_type(),
                "cpu_adam: the outputs must be of one dtype and cover the elements in order");
    covered += outs[k].numel();
  }
  TORCH_CHECK(outs.empty() || covered == numel, "cpu_adam: the outputs cover ", covered, " of ", numel, " elements");
  Hyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.weight_decay = weight_decay;
  h.eps = eps;
  // as FusedAdamKernel.cpp: "need to use double here to align with non-fused adam"
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  h.step_size = lr / bias_correction1;
  h.bias_correction2_sqrt = std::sqrt(bias_correction2);
  h.scaled = grad_scale.has_value();
  h.grad_scale = grad_scale.value_or(1.0);
  h.maximize = maximize;
  h.amsgrad = amsgrad;
  h.fresh = fresh;
  h.write_grad = write_grad && h.scaled;
  h.segment = segment > 0 ? segment : numel;
  if (adamw) {
    dispatch_grad<true>(h, param, exp_avg, exp_avg_sq, x, grad, outs, offsets);
  } else {
    dispatch_grad<false>(h, param, exp_avg, exp_avg_sq, x, grad, outs, offsets);
  }
}
