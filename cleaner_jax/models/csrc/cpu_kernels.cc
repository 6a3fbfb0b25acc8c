// Float32 CPU kernels for few-row decode, called from JAX through XLA FFI: small matmuls (weights
// stored [K, N], or [N, K] for a tied lm head) and single-token GQA attention.
//
// Why they exist: at decode time every matmul has one row per sequence, and XLA:CPU runs a dot
// of a few rows as a GEMM that packs the whole right-hand matrix into a scratch layout on every
// call; attention's two dots (the query heads sharing a KV head) pay the same, over every cache
// slot whether it holds a token yet or not. These kernels read weights, keys and values once,
// as they lie, and attention stops at each row's last valid slot. Work is spread over XLA's
// intra-op thread pool. Built and loaded by cleaner_jax/models/cpu_kernels.py; checked against
// NumPy in tests/test_cpu_kernels.py and against Hugging Face through the engine's parity tests.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// Runs fn(i) for i in [0, n) on the calling thread and XLA's pool, returning when all are done.
// XLA may call us from a thread outside its pool (the host thread runs a program's thunks), so
// only num_threads - 1 helpers are asked for: one worker per pool thread, not one more. Work is
// handed out one index at a time, so uneven tasks still balance. Helpers that start late find
// no work left; the state they touch is shared, so it outlives us.
int64_t Workers(ffi::ThreadPool& pool) { return std::max<int64_t>(1, pool.num_threads()); }

// Below this many multiply-adds in all, waking a pool thread costs more than it saves.
constexpr int64_t kMinParallelWork = int64_t{1} << 16;

template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t madds, const F& fn) {
  const int64_t helpers = madds < kMinParallelWork ? 0 : std::min<int64_t>(Workers(pool) - 1, n - 1);
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

// y[:, n0:n1] = x[M, K] @ w[K, n0:n1] for row-major x, w, y (ldy = ldw = N). Four rows of w at a
// time are held in registers and applied to every row of x (rank-4 updates), so w streams
// through once in memory order while the output panel stays in L1.
void MatmulPanel(const float* __restrict x, const float* __restrict w, float* __restrict y,
                 int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m) std::memset(y + m * N + n0, 0, sizeof(float) * (n1 - n0));
  int64_t k = 0;
#ifdef CJ_AVX2
  const int64_t nv = n0 + (n1 - n0) / 16 * 16;
  for (; k + 4 <= K; k += 4) {
    const float* w0 = w + k * N;
    for (int64_t n = n0; n < nv; n += 16) {
      const __m256 a0 = _mm256_loadu_ps(w0 + n), b0 = _mm256_loadu_ps(w0 + n + 8);
      const __m256 a1 = _mm256_loadu_ps(w0 + N + n), b1 = _mm256_loadu_ps(w0 + N + n + 8);
      const __m256 a2 = _mm256_loadu_ps(w0 + 2 * N + n), b2 = _mm256_loadu_ps(w0 + 2 * N + n + 8);
      const __m256 a3 = _mm256_loadu_ps(w0 + 3 * N + n), b3 = _mm256_loadu_ps(w0 + 3 * N + n + 8);
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K + k;
        float* ym = y + m * N + n;
        __m256 c0 = _mm256_loadu_ps(ym), c1 = _mm256_loadu_ps(ym + 8);
        __m256 s = _mm256_broadcast_ss(xm);
        c0 = _mm256_fmadd_ps(s, a0, c0);
        c1 = _mm256_fmadd_ps(s, b0, c1);
        s = _mm256_broadcast_ss(xm + 1);
        c0 = _mm256_fmadd_ps(s, a1, c0);
        c1 = _mm256_fmadd_ps(s, b1, c1);
        s = _mm256_broadcast_ss(xm + 2);
        c0 = _mm256_fmadd_ps(s, a2, c0);
        c1 = _mm256_fmadd_ps(s, b2, c1);
        s = _mm256_broadcast_ss(xm + 3);
        c0 = _mm256_fmadd_ps(s, a3, c0);
        c1 = _mm256_fmadd_ps(s, b3, c1);
        _mm256_storeu_ps(ym, c0);
        _mm256_storeu_ps(ym + 8, c1);
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K + k;
      for (int64_t n = nv; n < n1; ++n)
        y[m * N + n] += xm[0] * w0[n] + xm[1] * w0[N + n] + xm[2] * w0[2 * N + n] + xm[3] * w0[3 * N + n];
    }
  }
#endif
  for (; k < K; ++k) {  // the K % 4 tail, and every row where AVX2 is absent (auto-vectorised)
    const float* wk = w + k * N;
    for (int64_t m = 0; m < M; ++m) {
      const float a = x[m * K + k];
      float* ym = y + m * N;
      for (int64_t n = n0; n < n1; ++n) ym[n] += a * wk[n];
    }
  }
}

// y[:, n0:n1] = x[M, K] @ w_t[n0:n1, K]^T, for a weight stored [N, K] (a tied embedding used as the
// lm head): each output is a dot product of two contiguous rows; two rows of w_t are applied to
// four rows of x at a time, so w_t streams through once.
void MatmulTPanel(const float* __restrict x, const float* __restrict w_t, float* __restrict y,
                  int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
#ifdef CJ_AVX2
  const int64_t kv = K / 8 * 8;
  auto hsum = [](__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
  };
  for (; n + 2 <= n1; n += 2) {
    const float* e0 = w_t + n * K;
    const float* e1 = e0 + K;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t rows = std::min<int64_t>(4, M - m0);
      __m256 c0[4], c1[4];
      for (int r = 0; r < 4; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
      for (int64_t k = 0; k < kv; k += 8) {
        const __m256 a = _mm256_loadu_ps(e0 + k), b = _mm256_loadu_ps(e1 + k);
        for (int64_t r = 0; r < rows; ++r) {
          const __m256 xv = _mm256_loadu_ps(x + (m0 + r) * K + k);
          c0[r] = _mm256_fmadd_ps(xv, a, c0[r]);
          c1[r] = _mm256_fmadd_ps(xv, b, c1[r]);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* xm = x + (m0 + r) * K;
        float s0 = hsum(c0[r]), s1 = hsum(c1[r]);
        for (int64_t k = kv; k < K; ++k) {
          s0 += xm[k] * e0[k];
          s1 += xm[k] * e1[k];
        }
        y[(m0 + r) * N + n] = s0;
        y[(m0 + r) * N + n + 1] = s1;
      }
    }
  }
#endif
  for (; n < n1; ++n)  // the odd last row, and every row where AVX2 is absent (auto-vectorised)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w_t[n * K + k];
      y[m * N + n] = s;
    }
}

// Column panels of at least this many outputs per task (narrower ones cost more in scheduling
// than they save), and at most this many tasks per worker (enough to even out the load).
constexpr int64_t kMinPanel = 128;
constexpr int64_t kTasksPerWorker = 4;

// Splits the N outputs into panels (multiples of 16) and runs `panel` on each.
template <typename Panel>
ffi::Error SmallMatmul(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w,
                       ffi::ResultBuffer<ffi::F32>& y, bool transposed, Panel panel) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int64_t K = transposed ? wd[1] : wd[0];
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != K)
    return ffi::Error::InvalidArgument(transposed ? "cj_small_matmul_t: expected x [M, K] and w_t [N, K]"
                                                  : "cj_small_matmul: expected x [M, K] and w [K, N]");
  const int64_t M = xd[0], N = transposed ? wd[0] : wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(kTasksPerWorker * Workers(pool), N / kMinPanel));
  const int64_t per = ((N + tasks - 1) / tasks + 15) / 16 * 16;
  ParallelFor(pool, (N + per - 1) / per, M * K * N, [&](int64_t t) {
    panel(xp, wp, yp, M, K, N, t * per, std::min(N, (t + 1) * per));
  });
  return ffi::Error::Success();
}

ffi::Error SmallMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  return SmallMatmul(pool, x, w, y, /*transposed=*/false, MatmulPanel);
}

ffi::Error SmallMatmulTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w_t,
                            ffi::ResultBuffer<ffi::F32> y) {
  return SmallMatmul(pool, x, w_t, y, /*transposed=*/true, MatmulTPanel);
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
  ParallelFor(pool, B * KV, 2 * B * KV * G * hd * S, [&](int64_t i) {
    const int64_t b = i / KV;
    std::vector<float> scores(G * S);
    DecodeAttentionHead(qp + i * G * hd, kp + i * hd * S, vp + i * S * hd, mp + b * S, op + i * G * hd,
                        G, hd, S, scale, scores.data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CjSmallMatmul, SmallMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(CjSmallMatmulT, SmallMatmulTImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(CjDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
