// The gated delta rule (include/gated_delta_rule.h) by chunks of C tokens, in the WY form of fla and HF's
// torch_chunk_gated_delta_rule. Within a chunk, with gamma the running sum of g from the chunk's start,
// G = exp(gamma), D[i][j] = exp(gamma_i - gamma_j) for j <= i (else 0) and h the state at the chunk's start:
//   A = strictly lower(beta_i k_i . k_j D[i][j]),   X = (I + A)^-1
//   W = X (beta G k),   U = X (beta v),   v' = U - W h
//   o = G q h + (lower(q k^T) * D) v'        (q normalized and scaled)
//   h <- G_last h + (exp(gamma_last - gamma) k)^T v'
// The forward computes every chunk's key side (W, U, G q, M) in parallel, then walks each sequence's chunks in
// order with the state in registers: v', o and the update, keeping for the backward each chunk's starting state
// and v' (in q's dtype). The backward computes the key side again (X, W, G q, M), then walks the chunks in reverse
// with dh, the gradient of the chunk's final state, as the forward walks them, keeping each chunk's dh and dv':
//   dv' = M^T do + (exp(gamma_last - gamma) k) dh            (M = lower(q k^T) * D)
//   dh <- G_last dh + (G q)^T do - W^T dv'
// Everything else, the chunks in parallel, a block per chunk and key head taking its value heads in turn:
//   dW = -dv' h^T,  dU = dv',  dT = dU (beta v)^T + dW (beta G k)^T,  dA = -X^T dT X^T (strictly lower)
// and q, k, beta and gamma take the terms of every product above (gamma's summed from the chunk's end into g's).
// The block takes the state's columns VS at a time with what needs them (the terms through h and dh, dv),
// summing in registers what sums over them (do h^T, v' dh^T, dM, dT's v term, dW), then the products over the
// keys through X and A, q's and k's gradients summed over the value heads before the l2norm's backward. Every
// product runs on tensor cores (mma_add): TF32 for bf16 inputs, at f32's precision (3xTF32) for f16 and f32 ones.
#include "common.cuh"
#include "gated_delta_rule.h"
#include "tensor_cores.cuh"

using namespace bastile;

namespace {

constexpr int C = GDR_CHUNK, KMAX = GDR_MAX_DIM, VS = GDR_V_SLICE, WARPS = GDR_WARPS,
              THREADS = 32 * WARPS, ROWS = KMAX / WARPS;
// The walks' blocks (the state pass and the backward's).
constexpr int WALK_WARPS = GDR_WALK_WARPS, WALK_THREADS = 32 * WALK_WARPS;
// Rows padded by one float: a warp reading a column of a row-major tile hits 32 banks.
constexpr int CP = C + 1;
// Rows VS + 8 wide: the lanes of an mma reading rows t at columns g (see frag_b) hit 32 banks, 8t + g.
constexpr int SP = VS + 8;
// Rows KMAX + 4 wide: the lanes of an mma reading rows g at columns t (see frag_a) hit 32 banks, 4g + t;
// KMAX + 8 (C + 8, SP) wide for tiles read transposed, rows t at columns g: 8t + g.
constexpr int K4 = KMAX + 4, K8 = KMAX + 8, C4 = C + 4, C8 = C + 8;
static_assert(C == 32, "a warp's lane is a chunk's row (load_decays, suffix_sum)");

extern __shared__ __align__(16) unsigned char shared_raw[];

struct Span {
  int64_t row, start, len;
};

// Sequence n's tokens, clamped to the row whatever cu_seqlens holds.
__device__ __forceinline__ Span span_of(const DeltaShape &s, const int64_t *cu, int64_t n) {
  if (!cu) return {n, 0, s.tokens};
  const int64_t a = min(max(cu[n], (int64_t)0), s.tokens), b = min(max(cu[n + 1], a), s.tokens);
  return {0, a, b - a};
}

// The states' slot of the chunk at token `at` (of the row) of sequence n: distinct for every chunk of every
// sequence, below tokens / C + N packed, N * ceil(tokens / C) otherwise.
__device__ __forceinline__ int64_t slot(const DeltaShape &s, bool packed, int64_t n, int64_t at) {
  return packed ? at / C + n : n * ((s.tokens + C - 1) / C) + at / C;
}

__device__ __forceinline__ float warp_sum(float v) { return warp_group_sum(v, 32); }

// x[at] where `valid`, else x[0]: issued whatever `valid`, the loads of an unrolled loop are all in flight before
// the first is used (a load under a branch waits for its value there).
template <class T> __device__ __forceinline__ T load_any(const T *x, int64_t at, bool valid) { return x[valid ? at : 0]; }
template <class T> __device__ __forceinline__ float load_or_zero(const T *x, int64_t at, bool valid) {
  const float f = to_f32(load_any(x, at, valid));
  return valid ? f : 0.f;
}

// Where a walk's block works (blockIdx.x the sequence and value head, blockIdx.y the slice of V): sequence,
// value head, key head, first column, columns.
struct Place {
  int64_t n;
  int h, hk, j0, cols;
  Span sp;
  __device__ Place(const DeltaShape &s, const int64_t *cu) {
    n = blockIdx.x / s.v_heads;
    h = blockIdx.x % s.v_heads;
    hk = h / (s.v_heads / s.k_heads);
    j0 = blockIdx.y * VS;
    cols = min(VS, (int)s.v_dim - j0);
    sp = span_of(s, cu, n);
  }
  // The row of token i of the chunk at t0 in [B * T, heads] order.
  __device__ int64_t token(const DeltaShape &s, int64_t t0, int i) const { return sp.row * s.tokens + sp.start + t0 + i; }
  // The scratch's index of the chunk at t0, for this value head.
  __device__ int64_t chunk(const DeltaShape &s, const int64_t *cu, int64_t t0) const {
    return slot(s, cu, n, sp.start + t0) * s.v_heads + h;
  }
};

// Rows [start, start + L) of q (normalized and scaled) and k (normalized) of key head hk into tiles; zeros past
// L and past K; where `norms` is given, each row's factors of the normalization (1 without it) into norms[0]
// (q's) and norms[1] (k's). A warp's rows AT at a time: their loads all in flight before the first is used.
template <class T, int AT, class P>
__device__ void load_qk(float (&q)[C][K4], float (&k)[C][K4], const P &p, int64_t row, int64_t start, int hk, int L,
                        float (*norms)[C] = nullptr) {
  const DeltaShape &s = p.shape;
  const int K = s.k_dim, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T *qs = static_cast<const T *>(p.q) + row * p.q_st.batch + hk * p.q_st.head;
  const T *ks = static_cast<const T *>(p.k) + row * p.k_st.batch + hk * p.k_st.head;
  constexpr int D = KMAX / 32;
  static_assert(C % (WARPS * AT) == 0, "whole groups of rows");
  for (int i0 = warp; i0 < C; i0 += WARPS * AT) {
    T qr[AT][D], kr[AT][D];
#pragma unroll
    for (int a = 0; a < AT; ++a) {  // rows past L and columns past K read ones inside, zeroed below
      const int64_t t = start + min(i0 + a * WARPS, L - 1);
      const T *qrow = qs + t * p.q_st.token, *krow = ks + t * p.k_st.token;
#pragma unroll
      for (int c = 0; c < D; ++c) {
        const int d = min(lane + 32 * c, K - 1);
        qr[a][c] = qrow[d];
        kr[a][c] = krow[d];
      }
    }
#pragma unroll
    for (int a = 0; a < AT; ++a) {
      const int i = i0 + a * WARPS;
      float qv[D], kv[D], qq = 0.f, kk = 0.f;
#pragma unroll
      for (int c = 0; c < D; ++c) {
        const bool in = i < L && lane + 32 * c < K;
        qv[c] = in ? to_f32(qr[a][c]) : 0.f;
        kv[c] = in ? to_f32(kr[a][c]) : 0.f;
        qq += qv[c] * qv[c];
        kk += kv[c] * kv[c];
      }
      float nq = 1.f, rk = 1.f;
      if (s.l2norm_qk) {
        nq = rsqrtf(warp_sum(qq) + 1e-6f);
        rk = rsqrtf(warp_sum(kk) + 1e-6f);
      }
      const float rq = (float)s.scale * nq;
      if (norms && lane == 0) {
        norms[0][i] = nq;
        norms[1][i] = rk;
      }
#pragma unroll
      for (int c = 0; c < D; ++c) {
        q[i][lane + 32 * c] = qv[c] * rq;
        k[i][lane + 32 * c] = kv[c] * rk;
      }
    }
  }
}

// Warp 0: the running sum of g over the L tokens from row `first` (of [B * T]) of value head h, and beta,
// beta G and exp(gamma_last - gamma); past L, g and beta are 0 (those rows change nothing).
template <class P>
__device__ void load_decays(const P &p, int64_t first, int h, int L, float *gamma, float *beta, float *bg, float *tail) {
  const int lane = threadIdx.x % 32;
  const int64_t row = (first + lane) * p.shape.v_heads + h;
  const float g = load_or_zero(static_cast<const float *>(p.g), row, lane < L);
  const float b = load_or_zero(static_cast<const float *>(p.beta), row, lane < L);
  float run = g;
  for (int o = 1; o < 32; o *= 2) {
    const float up = __shfl_up_sync(0xffffffffu, run, o);
    if (lane >= o) run += up;
  }
  const float last = __shfl_sync(0xffffffffu, run, L - 1);
  gamma[lane] = run;
  beta[lane] = b;
  bg[lane] = b * __expf(run);
  tail[lane] = __expf(last - run);
}

// X = (I + beta A)^-1 from A without beta (strictly lower): the diagonal blocks of 8 by substitution, a column
// per thread, then blocks of 16 and 32 from their halves, [[P, 0], [Q, R]]^-1 = [[P^-1, 0], [-R^-1 Q P^-1, R^-1]],
// T = Q P^-1 in t: a chain of 8 steps where substitution over 32 rows takes 32.
__device__ void invert(const float (&a)[C][CP], float (&x)[C][CP], float (&t)[C][CP], const float *beta) {
  constexpr int B = 8;
  const int tid = threadIdx.x;
  if (tid < C) {
    const int j = tid, end = j / B * B + B;
    for (int i = 0; i < C; ++i) x[i][j] = i == j ? 1.f : 0.f;
    for (int i = j + 1; i < end; ++i) {
      float acc = a[i][j];
      for (int l = j + 1; l < i; ++l) acc += a[i][l] * x[l][j];
      x[i][j] = -beta[i] * acc;
    }
  }
  __syncthreads();
  for (int s = B; s < C; s *= 2) {  // Q and R rows [o + s, o + 2s), P columns [o, o + s), for each pair at o
    for (int e = threadIdx.x; e < C / 2 * s; e += THREADS) {
      const int o = e / (s * s) * 2 * s, r = o + s + e % (s * s) / s, c = o + e % s;
      float acc = 0.f;
      for (int l = c; l < o + s; ++l) acc += a[r][l] * x[l][c];
      t[r][c] = beta[r] * acc;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < C / 2 * s; e += THREADS) {
      const int o = e / (s * s) * 2 * s, r = o + s + e % (s * s) / s, c = o + e % s;
      float acc = 0.f;
      for (int l = o + s; l <= r; ++l) acc += x[r][l] * t[l][c];
      x[r][c] = -acc;
    }
    __syncthreads();
  }
}

// The chunk of slot `sigma` (see slot()): its sequence, first token (of the sequence) and length; L = 0 for a
// slot that no chunk has.
struct ChunkAt {
  int64_t n, t0;
  Span sp;
  int L;
  __device__ ChunkAt(const DeltaShape &s, const int64_t *cu, int64_t sigma) {
    if (!cu) {
      const int64_t per = (s.tokens + C - 1) / C;
      n = sigma / per;
      t0 = sigma % per * C;
    } else {  // sequence n's first slot, start / C + n, grows with n: the last one at or before sigma
      int64_t lo = 0, hi = s.sequences - 1;
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (span_of(s, cu, mid).start / C + mid <= sigma) lo = mid;
        else hi = mid - 1;
      }
      n = lo;
      t0 = (sigma - span_of(s, cu, n).start / C - n) * C;
    }
    sp = span_of(s, cu, n);
    L = t0 >= 0 && t0 < sp.len ? (int)min((int64_t)C, sp.len - t0) : 0;
  }
};

// The key side of a chunk (blockIdx.x its slot) and value head (blockIdx.y): W, kt, gamma, U, G q and M, into
// the scratch.
struct Prep {
  float q[C][K4], k[C][K4];  // q's takes beta v once W, kt and G q are out
  float a[C][CP], x[C][CP], t[C][CP];
  float gamma[C], beta[C], bg[C], tail[C];
};
static_assert(sizeof(Prep) == GDR_PREP_SHARED);

template <class T> __device__ __forceinline__ void prep(const GatedDeltaRuleForward &p) {
  Prep &m = *reinterpret_cast<Prep *>(shared_raw);
  const DeltaShape &s = p.shape;
  const ChunkAt c(s, p.cu_seqlens, blockIdx.x);
  if (c.L == 0) return;
  const int h = blockIdx.y, hk = h / (s.v_heads / s.k_heads), K = s.k_dim, tid = threadIdx.x;
  const int64_t V = s.v_dim, first = c.sp.row * s.tokens + c.sp.start + c.t0;
  load_qk<T, C / WARPS>(m.q, m.k, p, c.sp.row, c.sp.start + c.t0, hk, c.L);
  if (tid < 32) load_decays(p, first, h, c.L, m.gamma, m.beta, m.bg, m.tail);
  __syncthreads();
  const int64_t at = blockIdx.x * s.v_heads + h;
  // Warp w takes rows [16 (w / 4), + 16) and columns [8 (w % 4), + 8) of the C x C products, and every row
  // and key coordinates [16 w, 16 w + 16) of W.
  static_assert(WARPS == 8 && ROWS == 16 && C == 32 && VS == 32, "the warps' tiles of the products");
  const int warp = tid / 32, r0 = 16 * (warp / 4), c0 = 8 * (warp % 4), d0 = warp * ROWS;
  {
    float kk[4] = {}, qk[4] = {};
    if (c0 < r0 + 16)  // else above the diagonal
      for (int k0 = 0; k0 < K; k0 += 8) {  // zeros past K
        const FragB fk = frag_b([&](int d, int j) { return m.k[j][d]; }, k0, c0);
        mma_add<T>(kk, frag_a([&](int i, int d) { return m.k[i][d]; }, r0, k0), fk);
        mma_add<T>(qk, frag_a([&](int i, int d) { return m.q[i][d]; }, r0, k0), fk);
      }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = frag_row(r0, e), j = frag_col(c0, e);
      const float decay = j <= i ? __expf(m.gamma[i] - m.gamma[j]) : 0.f;
      m.a[i][j] = j < i ? decay * kk[e] : 0.f;
      p.m[at * C * C + i * C + j] = decay * qk[e];
    }
  }
  __syncthreads();
  invert(m.a, m.x, m.t, m.beta);
  float *w = p.w + at * C * KMAX, *kt = p.kt + at * C * KMAX, *qg = p.qg + at * C * KMAX;
  for (int e = tid; e < C * C; e += THREADS) p.x[at * C * C + e] = m.x[e / C][e % C];
  {  // W = X (beta G k)
    float acc[2][2][4] = {};
#pragma unroll
    for (int l0 = 0; l0 < C; l0 += 8) {
      FragB fk[2];
#pragma unroll
      for (int n = 0; n < 2; ++n) fk[n] = frag_b([&](int l, int d) { return m.k[l][d]; }, l0, d0 + 8 * n);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const FragA fx = frag_a([&](int i, int l) { return m.x[i][l] * m.bg[l]; }, 16 * r, l0);
#pragma unroll
        for (int n = 0; n < 2; ++n) mma_add<T>(acc[r][n], fx, fk[n]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          *reinterpret_cast<float2 *>(&w[frag_row(16 * r, e) * KMAX + frag_col(d0 + 8 * n, e)]) = make_float2(acc[r][n][e], acc[r][n][e + 1]);
  }
  for (int e = tid; e < C * KMAX / 4; e += THREADS) {  // 4 keys a thread, 16 bytes a load and store
    const int i = e / (KMAX / 4), d = e % (KMAX / 4) * 4;
    const float tail = m.tail[i], gq = __expf(m.gamma[i]);
    const float4 k4 = *reinterpret_cast<const float4 *>(&m.k[i][d]), q4 = *reinterpret_cast<const float4 *>(&m.q[i][d]);
    reinterpret_cast<float4 *>(kt)[e] = make_float4(tail * k4.x, tail * k4.y, tail * k4.z, tail * k4.w);
    reinterpret_cast<float4 *>(qg)[e] = make_float4(gq * q4.x, gq * q4.y, gq * q4.z, gq * q4.w);
  }
  if (tid < C) p.gamma[at * C + tid] = m.gamma[tid];
  if (!p.u) return;  // the backward's: no state pass
  // U = X (beta v), KMAX columns of V at a time, beta v in q's tile: warp w rows [16 (w / 4), + 16) and columns
  // [32 (w % 4), + 32).
  float (&bv)[C][K4] = m.q;
  const T *v = static_cast<const T *>(p.v) + c.sp.row * p.v_st.batch + h * p.v_st.head;
  float *u = p.u + at * C * V;
  const int n0 = 32 * (warp % 4);
  for (int64_t j0 = 0; j0 < V; j0 += KMAX) {
    __syncthreads();  // q's tile read
    {  // warp w rows [R w, + R): every load issued before the first is used; rows past L and columns past V
       // read ones inside
      constexpr int R = C / WARPS, D = KMAX / 32;
      const int lane = tid % 32;
      T vr[R][D];
#pragma unroll
      for (int a = 0; a < R; ++a) {
        const T *row = v + (c.sp.start + c.t0 + min(R * warp + a, c.L - 1)) * p.v_st.token;
#pragma unroll
        for (int d = 0; d < D; ++d) vr[a][d] = row[min(j0 + lane + 32 * d, V - 1)];
      }
#pragma unroll
      for (int a = 0; a < R; ++a)
#pragma unroll
        for (int d = 0; d < D; ++d) {
          const int i = R * warp + a, j = lane + 32 * d;
          bv[i][j] = i < c.L && j0 + j < V ? m.beta[i] * to_f32(vr[a][d]) : 0.f;
        }
    }
    __syncthreads();
    float acc[4][4] = {};
#pragma unroll
    for (int l0 = 0; l0 < C; l0 += 8) {
      const FragA fx = frag_a([&](int i, int l) { return m.x[i][l]; }, r0, l0);
#pragma unroll
      for (int n = 0; n < 4; ++n) mma_add<T>(acc[n], fx, frag_b([&](int l, int j) { return bv[l][j]; }, l0, n0 + 8 * n));
    }
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = frag_row(r0, e), j = frag_col(n0 + 8 * n, e);
        if (j0 + j < V) u[i * V + j0 + j] = acc[n][e];
      }
  }
}

// C rows of N floats (a chunk's W, kt, G q or M in the scratch) into a tile.
template <int N, int W> __device__ __forceinline__ void copy_rows(float (&dst)[C][W], const float *src) {
  for (int e = threadIdx.x; e < C * N / 4; e += WALK_THREADS) copy16(&dst[e / (N / 4)][e % (N / 4) * 4], src + 4 * e);
}

// A chunk's W, kt, G q, M and last decay from the scratch into the tiles of buffer `buf` (the state pass's and the
// backward walk's, which hold them at their own widths), with the copies `more` issues after kt's, as one group of
// copies sent.
template <class M, class P, class F>
__device__ __forceinline__ void fetch_chunk(M &m, const P &p, int64_t chunk, int buf, F more) {
  copy_rows<KMAX>(m.w[buf], p.w + chunk * C * KMAX);
  copy_rows<KMAX>(m.kt[buf], p.kt + chunk * C * KMAX);
  more();
  copy_rows<KMAX>(m.qg[buf], p.qg + chunk * C * KMAX);
  copy_rows<C>(m.mq[buf], p.m + chunk * C * C);
  if (threadIdx.x == 0) copy4(&m.gamma[buf], p.gamma + chunk * C + C - 1, true);
  copies_sent();
}

// The block's VS columns of C rows of V (a chunk's U in the scratch) into a tile, zeros past them; 16 bytes a
// copy where V's rows keep them aligned.
__device__ __forceinline__ void copy_columns(float (&dst)[C][VS + 4], const float *src, int64_t V, const Place &at) {
  if (V % 4 == 0) {
    for (int e = threadIdx.x; e < C * VS / 4; e += WALK_THREADS) {
      const int i = e / (VS / 4), j = e % (VS / 4) * 4;
      copy16(&dst[i][j], j < at.cols ? src + i * V + at.j0 + j : src, j < at.cols);
    }
    return;
  }
  for (int e = threadIdx.x; e < C * VS; e += WALK_THREADS) {
    const int i = e / VS, j = e % VS;
    copy4(&dst[i][j], j < at.cols ? src + i * V + at.j0 + j : src, j < at.cols);
  }
}

// A walk's state, K x VS of it, is held in registers as mma results: warp w rows [16 (w / 2), + 16) and
// columns [16 (w % 2), + 16), two 16 x 8 tiles. It comes from and goes to [K, V] states (zeros for none), and
// is mirrored into shared memory for the products that read all of it.
static_assert(WALK_WARPS == 16 && KMAX == 128 && C == 32 && VS == 32, "the walks' tiles of the state");
using Held = float[2][4];
template <class F> __device__ __forceinline__ void held_each(F f) {
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(n, e, frag_row(16 * (warp / 2), e), frag_col(16 * (warp % 2) + 8 * n, e));
}
__device__ __forceinline__ void held_in(Held &h, const float *src, int K, int64_t V, const Place &at) {
  held_each([&](int n, int e, int d, int j) { h[n][e] = src && d < K && j < at.cols ? src[d * V + at.j0 + j] : 0.f; });
}
__device__ __forceinline__ void held_out(float *dst, const Held &h, int K, int64_t V, const Place &at) {
  held_each([&](int n, int e, int d, int j) {
    if (d < K && j < at.cols) dst[d * V + at.j0 + j] = h[n][e];
  });
}
__device__ __forceinline__ void held_mirror(float (&mirror)[KMAX][SP], const Held &h) {
  held_each([&](int n, int e, int d, int j) { mirror[d][j] = h[n][e]; });
}
// A lane's share of a 16 x 8 result at (r0, c0) into or from an SP-wide tile, two columns at once: the lanes
// of each half warp hit 32 banks.
__device__ __forceinline__ void put_pairs(float (&tile)[C][SP], const float (&acc)[4], int r0, int c0) {
#pragma unroll
  for (int e = 0; e < 4; e += 2) *reinterpret_cast<float2 *>(&tile[frag_row(r0, e)][frag_col(c0, e)]) = make_float2(acc[e], acc[e + 1]);
}
__device__ __forceinline__ void add_pairs(float (&acc)[4], const float (&tile)[C][SP], int r0, int c0) {
#pragma unroll
  for (int e = 0; e < 4; e += 2) {
    const float2 x = *reinterpret_cast<const float2 *>(&tile[frag_row(r0, e)][frag_col(c0, e)]);
    acc[e] += x.x;
    acc[e + 1] += x.y;
  }
}
// x (C rows of keys) times the mirrored state by 4 S warps, w of them: the result's 16 x 16 tile w % 4 over
// keys [KMAX / S (w / 4), + KMAX / S), into part[w / 4] once `extra(acc, r0, n0, w / 4)` has added to it. A
// fragment of x serves two mma.
template <class T, int S, class F>
__device__ __forceinline__ void held_product(float (&part)[S][C][SP], const float (&x)[C][K4], const float (&mirror)[KMAX][SP], int w, F extra) {
  const int r0 = 16 * (w % 4 / 2), n0 = 16 * (w % 2), s = w / 4;
  float acc[2][4] = {};
#pragma unroll
  for (int k0 = KMAX / S * s; k0 < KMAX / S * (s + 1); k0 += 8) {
    const FragA fa = frag_a([&](int i, int d) { return x[i][d]; }, r0, k0);
#pragma unroll
    for (int n = 0; n < 2; ++n) mma_add<T>(acc[n], fa, frag_b([&](int d, int j) { return mirror[d][j]; }, k0, n0 + 8 * n));
  }
  extra(acc, r0, n0, s);
#pragma unroll
  for (int n = 0; n < 2; ++n) put_pairs(part[s], acc[n], r0, n0 + 8 * n);
}
// h += a^T b over the chunk's rows (a: C rows of keys, b: C rows of the block's columns).
template <class T> __device__ __forceinline__ void held_update(Held &h, const float (&a)[C][K8], const float (&b)[C][SP]) {
  const int warp = threadIdx.x / 32, d0 = 16 * (warp / 2), n0 = 16 * (warp % 2);
#pragma unroll
  for (int i0 = 0; i0 < C; i0 += 8) {
    const FragA fa = frag_a([&](int d, int i) { return a[i][d]; }, d0, i0);
#pragma unroll
    for (int n = 0; n < 2; ++n) mma_add<T>(h[n], fa, frag_b([&](int i, int j) { return b[i][j]; }, i0, n0 + 8 * n));
  }
}

// The saved slice (include/gated_delta_rule.h) of chunk `chunk` and columns [VS slice, + VS).
__device__ __forceinline__ int64_t saved_slice(const DeltaShape &s, int64_t chunk, int64_t slice) {
  return chunk * ((s.v_dim + VS - 1) / VS) + slice;
}
// Rows [0, K) of a mirrored state into a saved slice [K, VS] of T, 16 bytes a thread.
template <class T> __device__ __forceinline__ void save_mirror(T *dst, const float (&mirror)[KMAX][SP], int K) {
  constexpr int E = 16 / sizeof(T);
  for (int e = threadIdx.x; e < K * VS / E; e += WALK_THREADS) {
    const int d = e / (VS / E), j = e % (VS / E) * E;
    float x[E];
#pragma unroll
    for (int c = 0; c < E; ++c) x[c] = mirror[d][j + c];
    store<E>(dst + d * VS + j, x);
  }
}

// A sequence's chunks in order for one value head and VS columns of the state (Place): v' = U - W h, o = G q h
// + M v', then h <- G_last h + kt^T v' (Held), keeping each chunk's starting state and v' where the backward
// needs them. The next chunk's tiles are copied in while this one's products run.
struct State {
  float w[2][C][K4], kt[2][C][K8], qg[2][C][K4];
  float mq[2][C][C4];
  float u[2][C][VS + 4], vn[C][SP];
  float part[2][C][SP], partq[2][C][SP];
  float mirror[KMAX][SP];
  float gamma[4];  // [buf]: of the chunk's last token (4: the tiles stay a multiple of 16 bytes)
};
static_assert(sizeof(State) == GDR_STATE_SHARED);

template <class T> __device__ __forceinline__ void state(const GatedDeltaRuleForward &p) {
  State &m = *reinterpret_cast<State *>(shared_raw);
  const DeltaShape &s = p.shape;
  const Place at(s, p.cu_seqlens);
  const int K = s.k_dim, tid = threadIdx.x, warp = tid / 32;
  const int64_t V = s.v_dim, head_state = (at.n * s.v_heads + at.h) * K * V;
  const bool save = p.states != nullptr;
  const auto chunk_at = [&](int64_t t0) { return at.chunk(s, p.cu_seqlens, t0); };
  const auto fetch = [&](int64_t t0, int buf) {
    const int64_t chunk = chunk_at(t0);
    fetch_chunk(m, p, chunk, buf, [&] { copy_columns(m.u[buf], p.u + chunk * C * V, V, at); });
  };
  Held h;
  held_in(h, p.initial_state ? static_cast<const float *>(p.initial_state) + head_state : nullptr, K, V, at);
  held_mirror(m.mirror, h);
  if (at.sp.len > 0) fetch(0, 0);
  for (int64_t t0 = 0, buf = 0; t0 < at.sp.len; t0 += C, buf ^= 1) {
    const int64_t saved = saved_slice(s, chunk_at(t0), blockIdx.y);
    const bool ahead = t0 + C < at.sp.len;
    if (ahead) fetch(t0 + C, buf ^ 1);
    copies_landed(ahead);
    __syncthreads();
    if (save) save_mirror(static_cast<T *>(p.states) + saved * K * VS, m.mirror, K);
    const auto none = [](float (&)[2][4], int, int, int) {};
    if (warp < 8) held_product<T, 2>(m.part, m.w[buf], m.mirror, warp, none);
    else held_product<T, 2>(m.partq, m.qg[buf], m.mirror, warp - 8, none);
    __syncthreads();
    T *v_new = save ? static_cast<T *>(p.v_new) + saved * C * VS : nullptr;
    for (int e = tid; e < C * VS; e += WALK_THREADS) {
      const int i = e / VS, j = e % VS;
      const float vn = m.u[buf][i][j] - m.part[0][i][j] - m.part[1][i][j];
      m.vn[i][j] = vn;
      if (save) v_new[e] = from_f32<T>(vn);
    }
    __syncthreads();
    if (warp < 8) {  // o's 16 x 8 tile `warp`
      const int r0 = 16 * (warp / 4), c0 = 8 * (warp % 4), L = (int)min((int64_t)C, at.sp.len - t0);
      float acc[4] = {};
      add_pairs(acc, m.partq[0], r0, c0);
      add_pairs(acc, m.partq[1], r0, c0);
#pragma unroll
      for (int l0 = 0; l0 < C; l0 += 8)
        mma_add<T>(acc, frag_a([&](int i, int l) { return m.mq[buf][i][l]; }, r0, l0), frag_b([&](int l, int j) { return m.vn[l][j]; }, l0, c0));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = frag_row(r0, e), j = frag_col(c0, e);
        if (i < L && j < at.cols) static_cast<T *>(p.o)[(at.token(s, t0, i) * s.v_heads + at.h) * V + at.j0 + j] = from_f32<T>(acc[e]);
      }
    }
    const float last = __expf(m.gamma[buf]);
    held_each([&](int n, int e, int, int) { h[n][e] *= last; });
    held_update<T>(h, m.kt[buf], m.vn);
    held_mirror(m.mirror, h);
    __syncthreads();
  }
  if (p.final_state) held_out(static_cast<float *>(p.final_state) + head_state, h, K, V, at);
}

// The sum over the lanes from this one up (a warp's rows from i to the chunk's end).
__device__ __forceinline__ float suffix_sum(float v) {
  const int lane = threadIdx.x % 32;
  for (int o = 1; o < 32; o *= 2) {
    const float below = __shfl_down_sync(0xffffffffu, v, o);
    if (lane + o < 32) v += below;
  }
  return v;
}

// The sum over the warps of per-warp row sums part[r], in a fixed order.
template <int N> __device__ __forceinline__ float rows_total(const float (&part)[N][C], int i) {
  float s = 0.f;
  for (int w = 0; w < N; ++w) s += part[w][i];
  return s;
}

// A sequence's chunks in reverse for one value head and VS columns of dh (Place), as the state pass walks them
// forward: each chunk's dh (the gradient of its final state) into dstates, dv' = M^T do + kt dh, then
// dh <- G_last dh + (G q)^T do - W^T dv' (Held). The next chunk's W, kt, G q, M and do are read while this
// one's products run.
struct Walk {
  float w[2][C][K8], kt[2][C][K4], qg[2][C][K8];
  float mq[2][C][C8];
  float dout[C][SP], dvn[C][SP];
  float part[4][C][SP];
  float mirror[KMAX][SP];
  float gamma[4];  // [buf]: of the chunk's last token (4: the tiles stay a multiple of 16 bytes)
};
static_assert(sizeof(Walk) == GDR_WALK_SHARED);

template <class T> __device__ __forceinline__ void walk(const GatedDeltaRuleBackward &p) {
  Walk &m = *reinterpret_cast<Walk *>(shared_raw);
  const DeltaShape &s = p.shape;
  const Place at(s, p.cu_seqlens);
  const int K = s.k_dim, tid = threadIdx.x, warp = tid / 32;
  const int64_t V = s.v_dim, head_state = (at.n * s.v_heads + at.h) * K * V;
  const T *grad_o = static_cast<const T *>(p.grad_o);
  const auto chunk_at = [&](int64_t t0) { return at.chunk(s, p.cu_seqlens, t0); };
  constexpr int PER = C * VS / WALK_THREADS;  // of do, a thread's, converted once the step's products are issued
  T dout[PER];
  unsigned dout_in = 0;
  const auto fetch = [&](int64_t t0, int buf) {
    fetch_chunk(m, p, chunk_at(t0), buf, [] {});
    const int L = (int)min((int64_t)C, at.sp.len - t0);
    dout_in = 0;
#pragma unroll
    for (int r = 0; r < PER; ++r) {
      const int e = tid + r * WALK_THREADS, i = e / VS, j = e % VS;
      const bool in = i < L && j < at.cols;
      dout[r] = load_any(grad_o, (at.token(s, t0, i) * s.v_heads + at.h) * V + at.j0 + j, in);
      dout_in |= (unsigned)in << r;
    }
  };
  const auto keep_dout = [&] {
#pragma unroll
    for (int r = 0; r < PER; ++r)
      m.dout[(tid + r * WALK_THREADS) / VS][(tid + r * WALK_THREADS) % VS] = dout_in >> r & 1 ? to_f32(dout[r]) : 0.f;
  };
  Held dh;
  held_in(dh, p.grad_final_state ? static_cast<const float *>(p.grad_final_state) + head_state : nullptr, K, V, at);
  held_mirror(m.mirror, dh);
  const int64_t first = at.sp.len > 0 ? (at.sp.len - 1) / C * C : -1;
  if (first >= 0) {
    fetch(first, 0);
    keep_dout();
  }
  for (int64_t t0 = first, buf = 0; t0 >= 0; t0 -= C, buf ^= 1) {
    const int64_t saved = saved_slice(s, chunk_at(t0), blockIdx.y);
    const bool ahead = t0 > 0;
    if (ahead) fetch(t0 - C, buf ^ 1);
    copies_landed(ahead);
    __syncthreads();
    save_mirror(p.dstates + saved * K * VS, m.mirror, K);
    held_product<T, 4>(m.part, m.kt[buf], m.mirror, warp, [&](float (&acc)[2][4], int r0, int n0, int s) {  // + M^T do's rows [8 s, + 8)
      const FragA fm = frag_a([&](int i, int l) { return m.mq[buf][l][i]; }, r0, 8 * s);
#pragma unroll
      for (int n = 0; n < 2; ++n) mma_add<T>(acc[n], fm, frag_b([&](int l, int j) { return m.dout[l][j]; }, 8 * s, n0 + 8 * n));
    });
    __syncthreads();
    float *dvn = p.dvn + saved * C * VS;
    for (int e = tid; e < C * VS; e += WALK_THREADS) {
      const int i = e / VS, j = e % VS;
      const float dv = m.part[0][i][j] + m.part[1][i][j] + m.part[2][i][j] + m.part[3][i][j];
      m.dvn[i][j] = -dv;  // -dv': the update's W^T term adds
      dvn[e] = dv;
    }
    __syncthreads();
    const float last = __expf(m.gamma[buf]);
    held_each([&](int n, int e, int, int) { dh[n][e] *= last; });
    held_update<T>(dh, m.qg[buf], m.dout);
    held_update<T>(dh, m.w[buf], m.dvn);
    held_mirror(m.mirror, dh);
    __syncthreads();
    if (ahead) keep_dout();
  }
  held_out(static_cast<float *>(p.grad_initial_state) + head_state, dh, K, V, at);
}

// A backward block's tiles: the chunk's, then those of the slices of V (two in flight: the next one's tiles
// are copied in while this one's products run), or, once the slices are summed, the keys' products'. The
// slices of h and v' (in the input's dtype) and of dh and dv' (f32: in 16 bits, the sums over h dh in g's
// gradient lose too much) have rows VS + 16 bytes wide: the lanes of an mma reading rows g at columns t hit
// 32 banks.
template <class T> constexpr int SR = VS + 16 / sizeof(T);
template <class T> struct Slice {
  T h[KMAX][SR<T>], vn[C][SR<T>];
  float dh[KMAX][SR<float>], dvn[C][SR<float>];
};
// A saved slice's K x VS of a state (zeros past K) and C x VS of values into tiles, 16 bytes a copy.
template <class X>
__device__ __forceinline__ void slice_tiles(X (&state)[KMAX][SR<X>], X (&values)[C][SR<X>], const X *states, const X *by_row,
                                            int64_t saved, int K) {
  constexpr int E = 16 / sizeof(X);
  states += saved * K * VS;
  by_row += saved * C * VS;
  for (int e = threadIdx.x; e < KMAX * VS / E; e += THREADS) {
    const int d = e / (VS / E), j = e % (VS / E) * E;
    copy16(&state[d][j], states + min(d, K - 1) * VS + j, d < K);
  }
  for (int e = threadIdx.x; e < C * VS / E; e += THREADS) copy16(&values[e / (VS / E)][e % (VS / E) * E], by_row + e * E);
}
template <class T> struct Slices {
  Slice<T> buf[2];
  float v[C][VS + 4], dout[C][VS + 4];
};
struct KeyTiles {
  float q[C][K4], k[C][K4], dw[C][K4];
  float a[C][CP], qk[C][CP], dm[C][CP], xm[C][CP], dt[C][CP], y[C][CP];
};
template <class T> struct Backward {
  float x[C][C8];  // read transposed but by Y = dT X^T
  float gamma[C], beta[C], bg[C], tail[C];  // bg = beta G, tail = exp(gamma_last - gamma)
  union {
    Slices<T> slices;
    KeyTiles keys;
  };
  float part[3][WARPS][C];  // per-warp row sums
  float vdv[VS / 8][C];     // per column group row sums: v . dVb
  float hdh[THREADS];
  float dgamma[C], dbeta[C];
  float norms[2][C], dots[2][C];  // q's and k's rows: the l2norm's factors, y . dy
};
// GDR_BACKWARD_SHARED is the f32 instance's, the largest.
static_assert(sizeof(Backward<float>) == GDR_BACKWARD_SHARED && sizeof(Backward<bf16>) < GDR_BACKWARD_SHARED);

// Chunk c and value head h of key head hk, from its state h and the walk's dh and dv': the slices of V in turn
// (h, dh, v, v', do and dv' of VS columns each) sum do h^T, v' dh^T, dv' h^T, dM and dT's v term in registers
// and write dv; then the products over the keys take dM, dT and dW through X and A into q's, k's, g's and
// beta's gradients. q's and k's are summed over the key head's value heads, in order, in `partial`; the last
// one takes them through the l2norm.
template <class T>
__device__ __forceinline__ void value_head(const GatedDeltaRuleBackward &p, const ChunkAt &c, int hk, int h, bool first_head, bool last_head) {
  Backward<T> &m = *reinterpret_cast<Backward<T> *>(shared_raw);
  Slices<T> &sl = m.slices;
  KeyTiles &kt = m.keys;
  const DeltaShape &s = p.shape;
  const int K = s.k_dim, L = c.L;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t V = s.v_dim, chunk = blockIdx.x * s.v_heads + h, first = c.sp.row * s.tokens + c.sp.start + c.t0;
  for (int e = tid; e < C * C / 4; e += THREADS) copy16(&m.x[e / (C / 4)][e % (C / 4) * 4], p.x + chunk * C * C + 4 * e);
  // Warp w takes every row and key coordinates [16 w, 16 w + 16) of the C x K products, and rows
  // [16 (w / 4), + 16) and columns [8 (w % 4), + 8) of the C x C and C x VS ones.
  static_assert(WARPS == 8 && ROWS == 16 && C == 32 && VS == 32, "the warps' tiles of the products");
  const int d0 = warp * ROWS, r0 = 16 * (warp / 4), c0 = 8 * (warp % 4);
  float doh[2][2][4] = {}, vdh[2][2][4] = {}, dw[2][2][4] = {}, dm[4] = {}, dt[4] = {}, bv[2] = {}, hdh = 0.f;
  const T *v = static_cast<const T *>(p.v), *grad_o = static_cast<const T *>(p.grad_o);
  const auto fetch = [&](int64_t v0, Slice<T> &b) {
    const int64_t saved = saved_slice(s, chunk, v0 / VS);
    slice_tiles(b.h, b.vn, static_cast<const T *>(p.states), static_cast<const T *>(p.v_new), saved, K);
    slice_tiles(b.dh, b.dvn, p.dstates, p.dvn, saved, K);
    copies_sent();
  };
  fetch(0, sl.buf[0]);  // with X
  if (tid < 32) load_decays(p, first, h, L, m.gamma, m.beta, m.bg, m.tail);
  for (int64_t v0 = 0, buf = 0; v0 < V; v0 += VS, buf ^= 1) {
    const int cols = (int)min((int64_t)VS, V - v0);
    const bool ahead = v0 + VS < V;
    if (ahead) fetch(v0 + VS, sl.buf[buf ^ 1]);
    {  // v and do: every load issued before the first is used
      constexpr int PER = C * VS / THREADS;
      T vr[PER], dr[PER];
#pragma unroll
      for (int r = 0; r < PER; ++r) {
        const int e = tid + r * THREADS, i = e / VS, j = e % VS;
        const bool in = i < L && j < cols;
        const int64_t t = c.sp.start + c.t0 + i;
        vr[r] = load_any(v, c.sp.row * p.v_st.batch + t * p.v_st.token + h * p.v_st.head + v0 + j, in);
        dr[r] = load_any(grad_o, ((first + i) * s.v_heads + h) * V + v0 + j, in);
      }
#pragma unroll
      for (int r = 0; r < PER; ++r) {
        const int e = tid + r * THREADS, i = e / VS, j = e % VS;
        const bool in = i < L && j < cols;
        sl.v[i][j] = in ? to_f32(vr[r]) : 0.f;
        sl.dout[i][j] = in ? to_f32(dr[r]) : 0.f;
      }
    }
    copies_landed(ahead);
    __syncthreads();
    const Slice<T> &b = sl.buf[buf];
    constexpr int E = 16 / sizeof(T);  // of h, 16 bytes a load
    for (int e = tid; e < KMAX * VS / E; e += THREADS) {
      const int d = e / (VS / E), j = e % (VS / E) * E;
      T hv[E];
      float dhv[E];
      *reinterpret_cast<uint4 *>(hv) = *reinterpret_cast<const uint4 *>(&b.h[d][j]);
#pragma unroll
      for (int x = 0; x < E / 4; ++x) reinterpret_cast<float4 *>(dhv)[x] = reinterpret_cast<const float4 *>(&b.dh[d][j])[x];
#pragma unroll
      for (int x = 0; x < E; ++x) hdh += to_f32(hv[x]) * dhv[x];
    }
#pragma unroll
    for (int j0 = 0; j0 < VS; j0 += 8) {
      FragB fh[2], fdh[2];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        fh[n] = frag_b([&](int j, int d) { return to_f32(b.h[d][j]); }, j0, d0 + 8 * n);
        fdh[n] = frag_b([&](int j, int d) { return b.dh[d][j]; }, j0, d0 + 8 * n);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const FragA fo = frag_a([&](int i, int j) { return sl.dout[i][j]; }, 16 * r, j0);
        const FragA fvn = frag_a([&](int i, int j) { return to_f32(b.vn[i][j]); }, 16 * r, j0);
        const FragA fdv = frag_a([&](int i, int j) { return b.dvn[i][j]; }, 16 * r, j0);
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          mma_add<T>(doh[r][n], fo, fh[n]);
          mma_add<T>(vdh[r][n], fvn, fdh[n]);
          mma_add<T>(dw[r][n], fdv, fh[n]);
        }
      }
      mma_add<T>(dm, frag_a([&](int r, int j) { return sl.dout[r][j]; }, r0, j0), frag_b([&](int j, int l) { return to_f32(b.vn[l][j]); }, j0, c0));
      mma_add<T>(dt, frag_a([&](int r, int j) { return b.dvn[r][j]; }, r0, j0), frag_b([&](int j, int l) { return sl.v[l][j]; }, j0, c0));
    }
    float dv[4] = {};  // dv = beta X^T dv', and beta's share of v
#pragma unroll
    for (int l0 = 0; l0 < C; l0 += 8)
      mma_add<T>(dv, frag_a([&](int i, int l) { return m.x[l][i]; }, r0, l0), frag_b([&](int l, int j) { return b.dvn[l][j]; }, l0, c0));
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = frag_row(r0, e), j = frag_col(c0, e);
      bv[e / 2] += sl.v[i][j] * dv[e];
      if (i < L && j < cols)
        static_cast<T *>(p.grad_v)[((first + i) * s.v_heads + h) * V + v0 + j] = from_f32<T>(m.beta[i] * dv[e]);
    }
    __syncthreads();
  }
  load_qk<T, 2>(kt.q, kt.k, p, c.sp.row, c.sp.start + c.t0, hk, L, m.norms);
  __syncthreads();
  // The value side's terms: dq = G do h^T, dk = tail v' dh^T and their parts of gamma's gradient; dW, dM (before
  // the decay, l <= r) and dT's v term (l < r) into the tiles.
  m.hdh[tid] = hdh;
  float inter[4] = {}, kterm[4] = {};  // rows g, g + 8, g + 16, g + 24
  float (&dq)[2][2][4] = doh, (&dk)[2][2][4] = vdh;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = frag_row(16 * r, e), d = frag_col(d0 + 8 * n, e);
        dq[r][n][e] *= __expf(m.gamma[i]);
        dk[r][n][e] *= m.tail[i];
        inter[2 * r + e / 2] += kt.q[i][d] * dq[r][n][e];
        kterm[2 * r + e / 2] += kt.k[i][d] * dk[r][n][e];
        kt.dw[i][d] = -dw[r][n][e];
      }
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const float a = quad_sum(inter[x]), b = quad_sum(kterm[x]);
    if (lane % 4 == 0) {
      m.part[0][warp][frag_row(8 * x, 0)] = a;
      m.part[1][warp][frag_row(8 * x, 0)] = b;
    }
  }
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const float a = quad_sum(bv[x]);
    if (lane % 4 == 0) m.vdv[warp % 4][frag_row(r0 + 8 * x, 0)] = a;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int r = frag_row(r0, e), l = frag_col(c0, e);
    kt.dm[r][l] = l <= r ? dm[e] : 0.f;
    kt.dt[r][l] = l < r ? m.beta[l] * dt[e] : 0.f;
  }
  __syncthreads();
  if (warp == 0) {  // row i's shares of gamma's and beta's gradients from the value side
    const int i = lane;
    const float y = i < L ? rows_total(m.part[1], i) : 0.f;
    float hdh_sum = 0.f;
    for (int t = lane; t < THREADS; t += 32) hdh_sum += m.hdh[t];
    const float y_all = warp_sum(y), hdh_all = warp_sum(hdh_sum);
    float dgam = rows_total(m.part[0], i) - y;
    if (i == L - 1) dgam += y_all + __expf(m.gamma[L - 1]) * hdh_all;
    m.dgamma[i] = dgam;
    m.dbeta[i] = rows_total(m.vdv, i);
  }
  // A (without beta), M; dM * D and dM * M (gamma's share); dT's k term (l < r)
  {
    float kk[4] = {}, qk[4] = {}, dtk[4] = {};
    if (c0 < r0 + 16)  // else above the diagonal
      for (int k0 = 0; k0 < K; k0 += 8) {  // zeros past K
        const FragB fk = frag_b([&](int d, int l) { return kt.k[l][d]; }, k0, c0);
        mma_add<T>(kk, frag_a([&](int r, int d) { return kt.k[r][d]; }, r0, k0), fk);
        mma_add<T>(qk, frag_a([&](int r, int d) { return kt.q[r][d]; }, r0, k0), fk);
        mma_add<T>(dtk, frag_a([&](int r, int d) { return kt.dw[r][d]; }, r0, k0), fk);
      }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = frag_row(r0, e), l = frag_col(c0, e);
      const float decay = l <= r ? __expf(m.gamma[r] - m.gamma[l]) : 0.f;
      kt.a[r][l] = l < r ? decay * kk[e] : 0.f;
      kt.qk[r][l] = qk[e] * decay;
      kt.xm[r][l] = kt.dm[r][l] * qk[e] * decay;
      kt.dm[r][l] *= decay;
      if (l < r) kt.dt[r][l] += dtk[e] * m.bg[l];
    }
  }
  __syncthreads();
  {  // Y = dT X^T
    float y[4] = {};
#pragma unroll
    for (int n0 = 0; n0 < C; n0 += 8)
      mma_add<T>(y, frag_a([&](int r, int n) { return kt.dt[r][n]; }, r0, n0), frag_b([&](int n, int j) { return m.x[j][n]; }, n0, c0));
#pragma unroll
    for (int e = 0; e < 4; ++e) kt.y[frag_row(r0, e)][frag_col(c0, e)] = y[e];
  }
  __syncthreads();
  {  // dA = -X^T Y, strictly lower, into dt
    float da[4] = {};
#pragma unroll
    for (int n0 = 0; n0 < C; n0 += 8)
      mma_add<T>(da, frag_a([&](int r, int n) { return m.x[n][r]; }, r0, n0), frag_b([&](int n, int j) { return kt.y[n][j]; }, n0, c0));
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = frag_row(r0, e), j = frag_col(c0, e);
      kt.dt[r][j] = j < r ? -da[e] : 0.f;
    }
  }
  __syncthreads();
  // Row i's shares of gamma's (from M and A) and beta's (from A); then dA becomes dA beta_i D (for k).
  if (tid < C) {
    const int i = tid;
    float dgam = 0.f, dbet = 0.f;
    for (int l = 0; l < C; ++l) {
      dgam += kt.xm[i][l] - kt.xm[l][i];
      const float da = kt.dt[i][l] * kt.a[i][l], da_t = kt.dt[l][i] * kt.a[l][i];
      dbet += da;
      dgam += m.beta[i] * da - m.beta[l] * da_t;
    }
    m.dgamma[i] += dgam;
    m.dbeta[i] += dbet;
  }
  __syncthreads();
  for (int e = tid; e < C * C; e += THREADS) {
    const int r = e / C, j = e % C;
    kt.dt[r][j] *= j < r ? m.beta[r] * __expf(m.gamma[r] - m.gamma[j]) : 0.f;
  }
  __syncthreads();
  // dq and dk: M's, W's (through X^T dW) and A's terms, onto the value side's.
  float dkb[2][2][4] = {};
#pragma unroll
  for (int l0 = 0; l0 < C; l0 += 8) {
    FragB fk[2], fq[2], fw[2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      fk[n] = frag_b([&](int l, int d) { return kt.k[l][d]; }, l0, d0 + 8 * n);
      fq[n] = frag_b([&](int l, int d) { return kt.q[l][d]; }, l0, d0 + 8 * n);
      fw[n] = frag_b([&](int l, int d) { return kt.dw[l][d]; }, l0, d0 + 8 * n);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const FragA fm = frag_a([&](int i, int l) { return kt.dm[i][l]; }, 16 * r, l0);
      const FragA fmt = frag_a([&](int i, int l) { return kt.dm[l][i]; }, 16 * r, l0);
      const FragA fa = frag_a([&](int i, int l) { return kt.dt[i][l] + kt.dt[l][i]; }, 16 * r, l0);
      const FragA fx = frag_a([&](int i, int l) { return m.x[l][i]; }, 16 * r, l0);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        mma_add<T>(dq[r][n], fm, fk[n]);
        mma_add<T>(dk[r][n], fmt, fq[n]);
        mma_add<T>(dk[r][n], fa, fk[n]);
        mma_add<T>(dkb[r][n], fx, fw[n]);
      }
    }
  }
  float z[4] = {}, qdot[4] = {}, kdot[4] = {};  // rows g, g + 8, g + 16, g + 24
  float *sum_dq = p.partial, *sum_dk = p.partial + s.batch * s.tokens * s.k_heads * K;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // zeros past K but for the outputs
        const int i = frag_row(16 * r, e), d = frag_col(d0 + 8 * n, e);
        const int64_t at = ((first + i) * s.k_heads + hk) * K + d;
        const bool in = i < L && d < K;
        z[2 * r + e / 2] += kt.k[i][d] * dkb[r][n][e];
        dk[r][n][e] += m.bg[i] * dkb[r][n][e];
        if (!first_head && in) {
          dq[r][n][e] += sum_dq[at];
          dk[r][n][e] += sum_dk[at];
        }
        if (!last_head && in) {
          sum_dq[at] = dq[r][n][e];
          sum_dk[at] = dk[r][n][e];
        }
        qdot[2 * r + e / 2] += kt.q[i][d] * dq[r][n][e];
        kdot[2 * r + e / 2] += kt.k[i][d] * dk[r][n][e];
      }
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const float a = quad_sum(z[x]), b = quad_sum(qdot[x]), e = quad_sum(kdot[x]);
    if (lane % 4 == 0) {
      m.part[0][warp][frag_row(8 * x, 0)] = a;
      m.part[1][warp][frag_row(8 * x, 0)] = b;
      m.part[2][warp][frag_row(8 * x, 0)] = e;
    }
  }
  __syncthreads();
  if (warp == 0) {  // g's gradient: gamma's, summed from the chunk's end
    const int i = lane;
    const float z_i = rows_total(m.part[0], i);
    const float run = suffix_sum(i < L ? m.dgamma[i] + m.bg[i] * z_i : 0.f);
    if (i < L) {
      const int64_t row = (first + i) * s.v_heads + h;
      static_cast<float *>(p.grad_g)[row] = run;
      static_cast<float *>(p.grad_beta)[row] = m.dbeta[i] + __expf(m.gamma[i]) * z_i;
    }
    m.dots[0][i] = rows_total(m.part[1], i);
    m.dots[1][i] = rows_total(m.part[2], i);
  }
  if (!last_head) return;
  __syncthreads();
  // Through the l2norm, y = x r: dx = r (dy - y (y . dy)); q's dy is scale times its sum (kt.q = scale y).
  const float unscale = s.scale != 0 ? (float)(1 / s.scale) : 0.f;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = frag_row(16 * r, e), d = frag_col(d0 + 8 * n, e);
        if (i >= L || d >= K) continue;
        float gq = (float)s.scale * dq[r][n][e], gk = dk[r][n][e];
        if (s.l2norm_qk) {
          gq = m.norms[0][i] * (gq - kt.q[i][d] * unscale * m.dots[0][i]);
          gk = m.norms[1][i] * (gk - kt.k[i][d] * m.dots[1][i]);
        }
        const int64_t at = ((first + i) * s.k_heads + hk) * K + d;
        static_cast<T *>(p.grad_q)[at] = from_f32<T>(gq);
        static_cast<T *>(p.grad_k)[at] = from_f32<T>(gk);
      }
}

// A chunk (blockIdx.x its slot) and key head (blockIdx.y): the value heads that read the key head in turn.
template <class T> __device__ __forceinline__ void backward(const GatedDeltaRuleBackward &p) {
  const DeltaShape &s = p.shape;
  const ChunkAt c(s, p.cu_seqlens, blockIdx.x);
  if (c.L == 0) return;
  const int hk = blockIdx.y, rep = (int)(s.v_heads / s.k_heads);
  for (int h = hk * rep; h < hk * rep + rep; ++h) {
    if (h > hk * rep) __syncthreads();  // the last one's tiles read
    value_head<T>(p, c, hk, h, h == hk * rep, h == hk * rep + rep - 1);
  }
}

}  // namespace

// The threads of each stage's blocks, and the forward's blocks an SM holds: the key side's tiles let it hold four.
constexpr int prep_threads = THREADS, state_threads = WALK_THREADS, walk_threads = WALK_THREADS;
constexpr int prep_blocks = 4, state_blocks = 1;
#define FORWARD_STAGE(dir, stage, dt)                                                                  \
  extern "C" __global__ void __launch_bounds__(stage##_threads, stage##_blocks)                        \
      gated_delta_rule_##dir##_##stage##_##dt(const GatedDeltaRuleForward p) {                         \
    stage<BASTILE_TYPE_##dt>(p);                                                                        \
  }
GATED_DELTA_RULE_FORWARD_KERNELS(FORWARD_STAGE)
#define BACKWARD(dir, dt)                                                                                         \
  extern "C" __global__ void __launch_bounds__(THREADS, 2) gated_delta_rule_##dir##_##dt(const GatedDeltaRuleBackward p) { \
    backward<BASTILE_TYPE_##dt>(p);                                                                                       \
  }
#define BACKWARD_STAGE(dir, stage, dt)                                                                 \
  extern "C" __global__ void __launch_bounds__(stage##_threads)                                        \
      gated_delta_rule_##dir##_##stage##_##dt(const GatedDeltaRuleBackward p) {                        \
    stage<BASTILE_TYPE_##dt>(p);                                                                        \
  }
GATED_DELTA_RULE_BACKWARD_KERNELS(BACKWARD, BACKWARD_STAGE)
