// Float32 GQA attention over a KV cache for the rollout engine's decode steps and prefill chunks
// on CPU, called from JAX through XLA FFI.
//
// Why it exists: at decode time attention's two dots (the 2-8 query heads sharing a KV head
// against every cache slot) are tiny batched GEMMs, and XLA:CPU packs their right-hand side into
// a scratch layout on every call, over every cache slot whether it holds a token yet or not; a
// prefill chunk's XLA attention likewise scores every query against every slot of the cache.
// This kernel reads keys and values once, as they lie, and stops at each query's last valid slot.
// Work is spread over XLA's intra-op thread pool. Built and loaded by
// cleaner_jax/rollout/cpu_kernels.py for the engine's `cpu_kernels` decode backend; checked
// against NumPy in tests/test_rollout_cpu_kernels.py and against Hugging Face `generate` through
// the engine's parity tests. (Few-row matmul kernels were removed on 2026-12-01: they lost to
// XLA's GEMM when the cores are contended; bench/RESULTS.md.)

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CJ_AVX2 1
#endif

namespace ffi = xla::ffi;

namespace {

#ifdef CJ_AVX2
float Hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#endif

// a[0:n] . b[0:n]
float Dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef CJ_AVX2
  __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    c0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), c0);
    c1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), c1);
  }
  for (; i + 8 <= n; i += 8) c0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), c0);
  s = Hsum(_mm256_add_ps(c0, c1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Runs fn(i) for i in [0, n) on the calling thread and XLA's pool, returning when all are done.
// XLA may call us from a thread outside its pool (the host thread runs a program's thunks), so
// only num_threads - 1 helpers are asked for: one worker per pool thread, not one more. Work is
// handed out one index at a time, so uneven tasks still balance. Helpers that start late find
// no work left; the state they touch is shared, so it outlives us.
//
// Below this many multiply-adds in all, waking a pool thread costs more than it saves.
constexpr int64_t kMinParallelWork = int64_t{1} << 16;

template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t madds, const F& fn) {
  const int64_t helpers = madds < kMinParallelWork ? 0 : std::min<int64_t>(pool.num_threads() - 1, n - 1);
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

// One query token of one (batch row, KV head) of GQA attention: q [G, hd]; k, v [S, hd]; mask [S]
// with its last valid slot at end - 1 (end >= 1); out [G, hd]. Same math as
// `models.layers.grouped_attention` (f32 scores, softmax, probs @ v) with masked slots at zero
// weight, which lets slots from `end` on be skipped. Each key and value row is read once and
// applied to all G query heads.
void AttendOneQuery(const float* q, const float* k, const float* v, const bool* mask, int64_t end, float* out,
                    int64_t G, int64_t hd, int64_t S, float scale, float* scores) {
  std::fill(out, out + G * hd, 0.f);
  for (int64_t s = 0; s < end; ++s) {  // scores [G, end], row-major by g
    const float* ks = k + s * hd;
    for (int64_t g = 0; g < G; ++g) scores[g * S + s] = mask[s] ? Dot(q + g * hd, ks, hd) * scale : -INFINITY;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * S;
    float mx = -INFINITY;
    for (int64_t s = 0; s < end; ++s) mx = std::max(mx, sc[s]);
    float sum = 0.f;
    for (int64_t s = 0; s < end; ++s) {
      sc[s] = std::exp(sc[s] - mx);
      sum += sc[s];
    }
    const float inv = 1.f / sum;
    for (int64_t s = 0; s < end; ++s) sc[s] *= inv;
  }
  for (int64_t s = 0; s < end; ++s) {
    if (!mask[s]) continue;
    const float* vs = v + s * hd;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * S + s];
      float* o = out + g * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] += p * vs[d];
    }
  }
}

// The mean of v [S, hd] over its S slots (sum in slot order, then one division per element).
void SlotMean(const float* v, int64_t S, int64_t hd, float* mean) {
  std::fill(mean, mean + hd, 0.f);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t d = 0; d < hd; ++d) mean[d] += v[s * hd + d];
  for (int64_t d = 0; d < hd; ++d) mean[d] /= static_cast<float>(S);
}

// T query tokens per row against a KV cache: one task per (batch row, KV head), its T queries
// in order. A decode step is T = 1; a prefill chunk is T = the chunk, each query masked to its
// own causal prefix of the cache, so the work follows the valid slots, not the cache size.
ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, float scale,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();    // [B, T, KV, G, hd]
  const auto kd = k.dimensions();    // [B, KV, S, hd]
  const auto vd = v.dimensions();    // [B, KV, S, hd]
  const auto md = mask.dimensions(); // [B, T, S]
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || md.size() != 3)
    return ffi::Error::InvalidArgument("cj_cache_attention: expected q of rank 5, k/v of rank 4 and mask of rank 3");
  const int64_t B = qd[0], T = qd[1], KV = qd[2], G = qd[3], hd = qd[4], S = kd[2];
  if (kd[0] != B || kd[1] != KV || kd[3] != hd || vd[0] != B || vd[1] != KV || vd[2] != S || vd[3] != hd ||
      md[0] != B || md[1] != T || md[2] != S)
    return ffi::Error::InvalidArgument("cj_cache_attention: shapes of q, k, v and mask disagree");
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  ParallelFor(pool, B * KV, 2 * B * KV * T * G * hd * S, [&](int64_t i) {
    const int64_t b = i / KV, h = i % KV;
    const float* ki = kp + i * S * hd;
    const float* vi = vp + i * S * hd;
    std::vector<float> scores(G * S);
    // A query with no valid slot at all gets XLA's answer, uniform weights over all S (its finite
    // mask value): the mean of v over every slot, computed at the first query that needs it.
    std::vector<float> uniform;
    for (int64_t t = 0; t < T; ++t) {
      const bool* mt = mp + (b * T + t) * S;
      const int64_t row = ((b * T + t) * KV + h) * G * hd;  // q and out [B, T, KV, G, hd]
      int64_t end = S;
      while (end > 0 && !mt[end - 1]) --end;
      if (end > 0) {
        AttendOneQuery(qp + row, ki, vi, mt, end, op + row, G, hd, S, scale, scores.data());
        continue;
      }
      if (uniform.empty()) {
        uniform.resize(hd);
        SlotMean(vi, S, hd, uniform.data());
      }
      for (int64_t g = 0; g < G; ++g) std::copy(uniform.begin(), uniform.end(), op + row + g * hd);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CjCacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
