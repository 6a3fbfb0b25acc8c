// Single-token (decode) GQA attention for float32 on CPU, called from JAX through XLA FFI.
//
// Why it exists: at decode time XLA:CPU runs attention's two dots as batched GEMMs with 2-8 rows
// (the query heads sharing a KV head), and its small-row GEMM packs the whole right-hand matrix
// (this row's keys or values) into a scratch layout on every call, over every slot of the cache
// whether it holds a token yet or not. This kernel reads keys and values once, as they lie in
// `qwen.KVCache`, and stops at each row's last valid slot. Work is spread over XLA's intra-op
// thread pool. Built and loaded by cleaner_jax/models/cpu_kernels.py; checked against NumPy in
// tests/test_cpu_kernels.py and against Hugging Face through the engine's parity tests.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Runs fn(i) for i in [0, n) on the calling thread and XLA's pool, returning when all are done.
// Helpers that start late find no work left; the state they touch is shared, so it outlives us.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const F& fn) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  const F* f = &fn;  // valid until done == n, after which no helper calls it
  auto work = [state, f, n] {
    for (int64_t i; (i = state->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      (*f)(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// One (batch row, KV head) of single-token GQA attention: q [G, hd]; k_t [hd, S]; v [S, hd];
// mask [S]; out [G, hd]. Same math as `layers._grouped_attention` (f32 scores, softmax, probs @ v)
// with masked slots at zero weight, which lets slots after the last valid one be skipped. With
// no valid slot at all, XLA's finite mask value makes the softmax uniform over all S: so here.
void DecodeAttentionHead(const float* q, const float* k_t, const float* v, const bool* mask, float* out,
                         int64_t G, int64_t hd, int64_t S, float scale, float* scores) {
  int64_t end = S;
  while (end > 0 && !mask[end - 1]) --end;
  if (end == 0) {  // nothing to attend to: uniform weights over every slot, as XLA computes it
    for (int64_t g = 0; g < G; ++g) {
      float* o = out + g * hd;
      std::fill(o, o + hd, 0.f);
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < hd; ++d) o[d] += v[s * hd + d];
      for (int64_t d = 0; d < hd; ++d) o[d] /= static_cast<float>(S);
    }
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * S;
    const float* qg = q + g * hd;
    std::fill(sc, sc + end, 0.f);
    for (int64_t d = 0; d < hd; ++d) {
      const float a = qg[d];
      const float* kd = k_t + d * S;
      for (int64_t s = 0; s < end; ++s) sc[s] += a * kd[s];
    }
    float mx = -INFINITY;
    for (int64_t s = 0; s < end; ++s) {
      sc[s] = mask[s] ? sc[s] * scale : -INFINITY;
      mx = std::max(mx, sc[s]);
    }
    float sum = 0.f;
    for (int64_t s = 0; s < end; ++s) {
      sc[s] = std::exp(sc[s] - mx);
      sum += sc[s];
    }
    const float inv = 1.f / sum;
    float* o = out + g * hd;
    std::fill(o, o + hd, 0.f);
    for (int64_t s = 0; s < end; ++s) {
      const float p = sc[s] * inv;
      const float* vs = v + s * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] += p * vs[d];
    }
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_t,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, float scale,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();    // [B, KV, G, hd]
  const auto kd = k_t.dimensions();  // [B, KV, hd, S]
  const auto vd = v.dimensions();    // [B, KV, S, hd]
  const auto md = mask.dimensions(); // [B, S]
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 2)
    return ffi::Error::InvalidArgument("cj_decode_attention: expected q/k_t/v of rank 4 and mask of rank 2");
  const int64_t B = qd[0], KV = qd[1], G = qd[2], hd = qd[3], S = kd[3];
  if (kd[0] != B || kd[1] != KV || kd[2] != hd || vd[0] != B || vd[1] != KV || vd[2] != S || vd[3] != hd ||
      md[0] != B || md[1] != S)
    return ffi::Error::InvalidArgument("cj_decode_attention: shapes of q, k_t, v and mask disagree");
  const float* qp = q.typed_data();
  const float* kp = k_t.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  ParallelFor(pool, B * KV, [&](int64_t i) {
    const int64_t b = i / KV;
    std::vector<float> scores(G * S);
    DecodeAttentionHead(qp + i * G * hd, kp + i * hd * S, vp + i * S * hd, mp + b * S, op + i * G * hd,
                        G, hd, S, scale, scores.data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CjDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
