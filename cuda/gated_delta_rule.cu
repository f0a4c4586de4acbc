// The gated delta rule (include/gated_delta_rule.h) by chunks of C tokens, in the WY form of fla and HF's
// torch_chunk_gated_delta_rule. Within a chunk, with gamma the running sum of g from the chunk's start,
// G = exp(gamma), D[i][j] = exp(gamma_i - gamma_j) for j <= i (else 0) and h the state at the chunk's start:
//   A = strictly lower(beta_i k_i . k_j D[i][j]),   X = (I + A)^-1
//   W = X (beta G k),   U = X (beta v),   v' = U - W h
//   o = G q h + (lower(q k^T) * D) v'        (q normalized and scaled)
//   h <- G_last h + (exp(gamma_last - gamma) k)^T v'
// The backward walks the chunks in reverse with dh, the gradient of the chunk's final state:
//   dv' = M^T do + (exp(gamma_last - gamma) k) dh            (M = lower(q k^T) * D)
//   dh <- G_last dh + (G q)^T do - W^T dv'
//   dW = -dv' h^T,  dU = dv',  dT = dU (beta v)^T + dW (beta G k)^T,  dA = -X^T dT X^T (strictly lower)
// and q, k, beta and gamma take the terms of every product above (gamma's summed from the chunk's end into g's).
// The columns of the state never mix: a block takes one sequence, value head and VS of its columns and walks
// the chunks, so the key side (A, X, W) is computed by each of a head's blocks, and the gradients of q, k, g
// and beta are sums over the blocks of a head (and over the value heads that share a key head), which the
// reduce kernel takes, with the l2norm's backward. Everything multiplies in f32 on the CUDA cores.
#include "common.cuh"
#include "gated_delta_rule.h"

using namespace bastile;

namespace {

constexpr int C = GDR_CHUNK, KMAX = GDR_MAX_DIM, VS = GDR_V_SLICE, THREADS = 256, WARPS = THREADS / 32;
// Rows padded by one float: a warp reading a column of a row-major tile hits 32 banks.
constexpr int KP = KMAX + 1, CP = C + 1, VP = VS + 1;
static_assert(C == 32, "a warp's lane is a chunk's row");

// What forward and backward both compute of a chunk.
struct Chunk {
  float k[C][KP], q[C][KP], w[C][KP];  // the backward's w becomes dW
  float a[C][CP];   // k_i . k_j D[i][j], j < i (A without beta)
  float x[C][CP];   // X
  float qk[C][CP];  // M
  float v[C][VP];   // v of the block's columns
  float vn[C][VP];  // U, then v'
  float h[KMAX][VP];
  float gamma[C], beta[C], bg[C], tail[C];  // bg = beta G, tail = exp(gamma_last - gamma)
};

// The backward's tiles besides.
struct Backward {
  Chunk c;
  float dout[C][VP], dvn[C][VP];
  float dh[KMAX][VP], dh_next[KMAX][VP];
  float dm[C][CP], xm[C][CP], dt[C][CP], y[C][CP];
  float part[4][WARPS][C];  // per-warp row sums: q's and k's terms of gamma, X^T dW . k, v . dVb
  float dgamma[C], dbeta[C], hdh[THREADS];
};

static_assert(sizeof(Chunk) == GDR_FORWARD_SHARED && sizeof(Backward) == GDR_BACKWARD_SHARED);

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

// Where a block's work is: sequence, value head, key head, first column, columns.
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
};

// Loads chunk [t0, t0 + L) into the tiles: k and q (normalized, q scaled), v of the block's columns, the decays.
// Rows past L are zeros (beta 0, g 0): they change nothing.
template <class T, class P>
__device__ void load_chunk(Chunk &m, const P &p, const Place &at, int64_t t0, int L) {
  const DeltaShape &s = p.shape;
  const int K = s.k_dim, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T *q = static_cast<const T *>(p.q), *k = static_cast<const T *>(p.k), *v = static_cast<const T *>(p.v);
  for (int i = warp; i < C; i += WARPS) {
    const int64_t t = at.sp.start + t0 + i;
    float qs = 0.f, ks = 0.f;
    for (int d = lane; d < K; d += 32) {
      float qv = 0.f, kv = 0.f;
      if (i < L) {
        qv = to_f32(q[at.sp.row * p.q_st.batch + t * p.q_st.token + at.hk * p.q_st.head + d]);
        kv = to_f32(k[at.sp.row * p.k_st.batch + t * p.k_st.token + at.hk * p.k_st.head + d]);
      }
      m.q[i][d] = qv;
      m.k[i][d] = kv;
      qs += qv * qv;
      ks += kv * kv;
    }
    float rq = s.scale, rk = 1.f;
    if (s.l2norm_qk) {
      rq *= rsqrtf(warp_sum(qs) + 1e-6f);
      rk = rsqrtf(warp_sum(ks) + 1e-6f);
    }
    for (int d = lane; d < K; d += 32) {
      m.q[i][d] *= rq;
      m.k[i][d] *= rk;
    }
  }
  for (int e = tid; e < C * VS; e += THREADS) {
    const int i = e / VS, j = e % VS;
    const int64_t t = at.sp.start + t0 + i;
    m.v[i][j] = i < L && j < at.cols
                    ? to_f32(v[at.sp.row * p.v_st.batch + t * p.v_st.token + at.h * p.v_st.head + at.j0 + j])
                    : 0.f;
  }
  if (warp == 0) {  // the running sum of g
    const int64_t row = at.token(s, t0, lane) * s.v_heads + at.h;
    const float g = lane < L ? static_cast<const float *>(p.g)[row] : 0.f;
    const float beta = lane < L ? static_cast<const float *>(p.beta)[row] : 0.f;
    float run = g;
    for (int o = 1; o < 32; o *= 2) {
      const float up = __shfl_up_sync(0xffffffffu, run, o);
      if (lane >= o) run += up;
    }
    const float last = __shfl_sync(0xffffffffu, run, L - 1);
    m.gamma[lane] = run;
    m.beta[lane] = beta;
    m.bg[lane] = beta * __expf(run);
    m.tail[lane] = __expf(last - run);
  }
  __syncthreads();
}

// A (without beta), M, X; then W and U (in vn).
__device__ void key_side(Chunk &m, int K) {
  const int tid = threadIdx.x;
  for (int e = tid; e < C * C; e += THREADS) {
    const int i = e / C, j = e % C;
    float kk = 0.f, qk = 0.f;
    if (j <= i)
      for (int d = 0; d < K; ++d) {
        kk += m.k[i][d] * m.k[j][d];
        qk += m.q[i][d] * m.k[j][d];
      }
    const float decay = j <= i ? __expf(m.gamma[i] - m.gamma[j]) : 0.f;
    m.a[i][j] = j < i ? decay * kk : 0.f;
    m.qk[i][j] = qk * decay;
  }
  __syncthreads();
  if (tid < C) {  // a column of X needs only its own entries
    const int j = tid;
    for (int i = 0; i < C; ++i) m.x[i][j] = i == j ? 1.f : 0.f;
    for (int i = j + 1; i < C; ++i) {
      float acc = m.a[i][j];
      for (int l = j + 1; l < i; ++l) acc += m.a[i][l] * m.x[l][j];
      m.x[i][j] = -m.beta[i] * acc;
    }
  }
  __syncthreads();
  for (int e = tid; e < C * K; e += THREADS) {
    const int i = e / K, d = e % K;
    float acc = 0.f;
    for (int l = 0; l <= i; ++l) acc += m.x[i][l] * m.bg[l] * m.k[l][d];
    m.w[i][d] = acc;
  }
  for (int e = tid; e < C * VS; e += THREADS) {
    const int i = e / VS, j = e % VS;
    float acc = 0.f;
    for (int l = 0; l <= i; ++l) acc += m.x[i][l] * m.beta[l] * m.v[l][j];
    m.vn[i][j] = acc;
  }
  __syncthreads();
}

// v' = U - W h.
__device__ void new_values(Chunk &m, int K) {
  for (int e = threadIdx.x; e < C * VS; e += THREADS) {
    const int i = e / VS, j = e % VS;
    float acc = m.vn[i][j];
    for (int d = 0; d < K; ++d) acc -= m.w[i][d] * m.h[d][j];
    m.vn[i][j] = acc;
  }
  __syncthreads();
}

// h <- G_last h + (tail k)^T v'.
__device__ void advance(Chunk &m, int K, int L) {
  const float last = __expf(m.gamma[L - 1]);
  for (int e = threadIdx.x; e < K * VS; e += THREADS) {
    const int d = e / VS, j = e % VS;
    float acc = last * m.h[d][j];
    for (int l = 0; l < L; ++l) acc += m.k[l][d] * m.tail[l] * m.vn[l][j];
    m.h[d][j] = acc;
  }
  __syncthreads();
}

// The block's columns of a [N, Hv, K, V] state into (or from) the tile.
__device__ void state_in(float (&h)[KMAX][VP], const float *src, int K, int64_t V, const Place &at) {
  for (int e = threadIdx.x; e < KMAX * VS; e += THREADS) {
    const int d = e / VS, j = e % VS;
    h[d][j] = src && d < K && j < at.cols ? src[d * V + at.j0 + j] : 0.f;
  }
  __syncthreads();
}

__device__ void state_out(float *dst, const float (&h)[KMAX][VP], int K, int64_t V, const Place &at) {
  for (int e = threadIdx.x; e < K * VS; e += THREADS)
    if (e % VS < at.cols) dst[(e / VS) * V + at.j0 + e % VS] = h[e / VS][e % VS];
}

template <class T> __device__ __forceinline__ void forward(const GatedDeltaRuleForward &p) {
  Chunk &m = *reinterpret_cast<Chunk *>(shared_raw);
  const DeltaShape &s = p.shape;
  const int K = s.k_dim;
  const int64_t V = s.v_dim;
  const Place at(s, p.cu_seqlens);
  const int64_t head_state = (at.n * s.v_heads + at.h) * K * V;
  state_in(m.h, p.initial_state ? static_cast<const float *>(p.initial_state) + head_state : nullptr, K, V, at);
  T *o = static_cast<T *>(p.o);
  for (int64_t t0 = 0; t0 < at.sp.len; t0 += C) {
    const int L = (int)min((int64_t)C, at.sp.len - t0);
    if (p.states)
      state_out(p.states + (slot(s, p.cu_seqlens, at.n, at.sp.start + t0) * s.v_heads + at.h) * K * V, m.h, K, V, at);
    load_chunk<T>(m, p, at, t0, L);
    key_side(m, K);
    new_values(m, K);
    if (o)
      for (int e = threadIdx.x; e < C * VS; e += THREADS) {
        const int i = e / VS, j = e % VS;
        if (i >= L || j >= at.cols) continue;
        float inter = 0.f, intra = 0.f;
        for (int d = 0; d < K; ++d) inter += m.q[i][d] * m.h[d][j];
        for (int l = 0; l <= i; ++l) intra += m.qk[i][l] * m.vn[l][j];
        o[(at.token(s, t0, i) * s.v_heads + at.h) * V + at.j0 + j] = from_f32<T>(__expf(m.gamma[i]) * inter + intra);
      }
    __syncthreads();
    advance(m, K, L);
  }
  if (p.final_state) state_out(static_cast<float *>(p.final_state) + head_state, m.h, K, V, at);
}

// The sum over the warps of per-warp row sums part[r], in a fixed order.
__device__ __forceinline__ float rows_total(const float (&part)[WARPS][C], int i) {
  float s = 0.f;
  for (int w = 0; w < WARPS; ++w) s += part[w][i];
  return s;
}

template <class T> __device__ __forceinline__ void backward(const GatedDeltaRuleBackward &p) {
  Backward &b = *reinterpret_cast<Backward *>(shared_raw);
  Chunk &m = b.c;
  const DeltaShape &s = p.shape;
  const int K = s.k_dim, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t V = s.v_dim;
  const Place at(s, p.cu_seqlens);
  const int64_t head_state = (at.n * s.v_heads + at.h) * K * V;
  const int64_t rows = s.batch * s.tokens * s.v_heads, slices = gridDim.y;
  float *dq_part = p.partial + blockIdx.y * rows * K;
  float *dk_part = p.partial + (slices + blockIdx.y) * rows * K;
  float *dg_part = p.partial + 2 * slices * rows * K + blockIdx.y * rows;
  float *db_part = p.partial + 2 * slices * rows * K + (slices + blockIdx.y) * rows;
  const T *grad_o = static_cast<const T *>(p.grad_o);
  state_in(b.dh, p.grad_final_state ? static_cast<const float *>(p.grad_final_state) + head_state : nullptr, K, V, at);
  const int64_t chunks = (at.sp.len + C - 1) / C;
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t t0 = c * C;
    const int L = (int)min((int64_t)C, at.sp.len - t0);
    state_in(m.h, p.states + (slot(s, p.cu_seqlens, at.n, at.sp.start + t0) * s.v_heads + at.h) * K * V, K, V, at);
    load_chunk<T>(m, p, at, t0, L);
    for (int e = tid; e < C * VS; e += THREADS) {
      const int i = e / VS, j = e % VS;
      b.dout[i][j] = i < L && j < at.cols ? to_f32(grad_o[(at.token(s, t0, i) * s.v_heads + at.h) * V + at.j0 + j]) : 0.f;
    }
    key_side(m, K);
    new_values(m, K);
    // dv' = M^T do + tail k dh
    for (int e = tid; e < C * VS; e += THREADS) {
      const int i = e / VS, j = e % VS;
      float acc = 0.f, kdh = 0.f;
      for (int l = i; l < C; ++l) acc += m.qk[l][i] * b.dout[l][j];
      for (int d = 0; d < K; ++d) kdh += m.k[i][d] * b.dh[d][j];
      b.dvn[i][j] = acc + m.tail[i] * kdh;
    }
    __syncthreads();
    // dh_next = G_last dh + (G q)^T do - W^T dv', and the sum of h * dh for gamma_last
    const float last = __expf(m.gamma[L - 1]);
    float hdh = 0.f;
    for (int e = tid; e < K * VS; e += THREADS) {
      const int d = e / VS, j = e % VS;
      float acc = last * b.dh[d][j];
      for (int i = 0; i < C; ++i) acc += __expf(m.gamma[i]) * m.q[i][d] * b.dout[i][j] - m.w[i][d] * b.dvn[i][j];
      b.dh_next[d][j] = acc;
      hdh += m.h[d][j] * b.dh[d][j];
    }
    b.hdh[tid] = hdh;
    __syncthreads();
    // Per (row i = lane, key coordinate d = warp + 8 r): dq, dk's first terms, and dW in w.
    float dq[KMAX / WARPS], dk[KMAX / WARPS];
    float inter = 0.f, kterm = 0.f;
    const int i = lane;
    const float gi = __expf(m.gamma[i]);
#pragma unroll
    for (int r = 0; r < KMAX / WARPS; ++r) {
      const int d = warp + WARPS * r;
      dq[r] = dk[r] = 0.f;
      if (d >= K) continue;
      float doh = 0.f, vdh = 0.f, dw = 0.f;
      for (int j = 0; j < VS; ++j) {
        doh += b.dout[i][j] * m.h[d][j];
        vdh += m.vn[i][j] * b.dh[d][j];
        dw -= b.dvn[i][j] * m.h[d][j];
      }
      dq[r] = gi * doh;
      inter += m.q[i][d] * gi * doh;
      dk[r] = m.tail[i] * vdh;
      kterm += m.k[i][d] * m.tail[i] * vdh;
      m.w[i][d] = dw;
    }
    b.part[0][warp][i] = inter;
    b.part[1][warp][i] = kterm;
    __syncthreads();
    // Per (i, l): dM * D, dM * M (gamma's share), dT (l < i)
    for (int e = tid; e < C * C; e += THREADS) {
      const int r = e / C, l = e % C;
      float dm = 0.f, dt = 0.f;
      if (l <= r) {
        for (int j = 0; j < VS; ++j) dm += b.dout[r][j] * m.vn[l][j];
      }
      if (l < r) {
        for (int j = 0; j < VS; ++j) dt += b.dvn[r][j] * m.beta[l] * m.v[l][j];
        for (int d = 0; d < K; ++d) dt += m.w[r][d] * m.bg[l] * m.k[l][d];
      }
      b.dm[r][l] = l <= r ? dm * __expf(m.gamma[r] - m.gamma[l]) : 0.f;
      b.xm[r][l] = dm * m.qk[r][l];
      b.dt[r][l] = dt;
    }
    __syncthreads();
    // Y = dT X^T
    for (int e = tid; e < C * C; e += THREADS) {
      const int r = e / C, j = e % C;
      float acc = 0.f;
      for (int n = 0; n <= j; ++n) acc += b.dt[r][n] * m.x[j][n];
      b.y[r][j] = acc;
    }
    __syncthreads();
    // dA = -X^T Y, strictly lower, into dt
    for (int e = tid; e < C * C; e += THREADS) {
      const int r = e / C, j = e % C;
      float acc = 0.f;
      if (j < r)
        for (int n = r; n < C; ++n) acc -= m.x[n][r] * b.y[n][j];
      b.dt[r][j] = acc;
    }
    __syncthreads();
    // Row i's scalars: gamma from M and A, beta from A; then dA becomes G2 = dA beta_i D (for k).
    if (tid < C) {
      float dgam = 0.f, dbet = 0.f;
      for (int l = 0; l < C; ++l) {
        dgam += b.xm[i][l] - b.xm[l][i];
        const float da = b.dt[i][l] * m.a[i][l], da_t = b.dt[l][i] * m.a[l][i];
        dbet += da;
        dgam += m.beta[i] * da - m.beta[l] * da_t;
      }
      b.dgamma[i] = dgam;
      b.dbeta[i] = dbet;
    }
    __syncthreads();
    for (int e = tid; e < C * C; e += THREADS) {
      const int r = e / C, j = e % C;
      b.dt[r][j] *= j < r ? m.beta[r] * __expf(m.gamma[r] - m.gamma[j]) : 0.f;
    }
    __syncthreads();
    // The rest of dq and dk: M's, W's (through X^T dW) and A's.
    float z = 0.f;
#pragma unroll
    for (int r = 0; r < KMAX / WARPS; ++r) {
      const int d = warp + WARPS * r;
      if (d >= K) continue;
      float q_acc = 0.f, k_acc = 0.f, dkb = 0.f;
      for (int l = 0; l <= i; ++l) q_acc += b.dm[i][l] * m.k[l][d];
      for (int l = i; l < C; ++l) {
        k_acc += b.dm[l][i] * m.q[l][d];
        dkb += m.x[l][i] * m.w[l][d];
      }
      for (int l = 0; l < C; ++l) k_acc += b.dt[i][l] * m.k[l][d] + b.dt[l][i] * m.k[l][d];
      dq[r] += q_acc;
      dk[r] += k_acc + m.bg[i] * dkb;
      z += m.k[i][d] * dkb;
    }
    b.part[2][warp][i] = z;
    // dv = beta X^T dv', and beta's share of v
    float bv = 0.f;
    for (int j = warp; j < VS; j += WARPS) {
      float acc = 0.f;
      for (int l = i; l < C; ++l) acc += m.x[l][i] * b.dvn[l][j];
      bv += m.v[i][j] * acc;
      if (i < L && j < at.cols)
        static_cast<T *>(p.grad_v)[(at.token(s, t0, i) * s.v_heads + at.h) * V + at.j0 + j] = from_f32<T>(m.beta[i] * acc);
    }
    b.part[3][warp][i] = bv;
    if (i < L) {
      const int64_t row = at.token(s, t0, i) * s.v_heads + at.h;
#pragma unroll
      for (int r = 0; r < KMAX / WARPS; ++r) {
        const int d = warp + WARPS * r;
        if (d >= K) continue;
        dq_part[row * K + d] = dq[r];
        dk_part[row * K + d] = dk[r];
      }
    }
    __syncthreads();
    if (warp == 0) {  // row i's scalars; gamma_last's terms; g's gradient: gamma's summed from the chunk's end
      const float y = lane < L ? rows_total(b.part[1], i) : 0.f, z_i = rows_total(b.part[2], i);
      float hdh = 0.f;
      for (int t = lane; t < THREADS; t += 32) hdh += b.hdh[t];
      const float y_all = warp_sum(y), hdh_all = warp_sum(hdh);
      float dgam = b.dgamma[i] + rows_total(b.part[0], i) - y + m.bg[i] * z_i;
      if (i == L - 1) dgam += y_all + last * hdh_all;
      if (i >= L) dgam = 0.f;
      float run = dgam;
      for (int o = 1; o < 32; o *= 2) {
        const float below = __shfl_down_sync(0xffffffffu, run, o);
        if (lane + o < 32) run += below;
      }
      if (i < L) {
        const int64_t row = at.token(s, t0, i) * s.v_heads + at.h;
        dg_part[row] = run;
        db_part[row] = b.dbeta[i] + rows_total(b.part[3], i) + gi * z_i;
      }
    }
    for (int e = tid; e < KMAX * VS; e += THREADS) b.dh[e / VS][e % VS] = b.dh_next[e / VS][e % VS];
    __syncthreads();
  }
  state_out(static_cast<float *>(p.grad_initial_state) + head_state, b.dh, K, V, at);
}

// A warp per token and key head: q's and k's gradients summed over the blocks and value heads that read them,
// through the l2norm (dx = r (dy - y (y . dy)), y = x r), and g's and beta's summed over the blocks.
template <class T> __device__ __forceinline__ void reduce(const GatedDeltaRuleBackward &p) {
  const DeltaShape &s = p.shape;
  const int K = s.k_dim, lane = threadIdx.x % 32, rep = s.v_heads / s.k_heads;
  const int64_t pair = blockIdx.x * (int64_t)WARPS + threadIdx.x / 32;  // (b * T + t) * Hk + hk
  if (pair >= s.batch * s.tokens * s.k_heads) return;
  const int64_t token = pair / s.k_heads, bt = token / s.tokens, t = token % s.tokens;
  const int hk = pair % s.k_heads;
  const int64_t rows = s.batch * s.tokens * s.v_heads, slices = (s.v_dim + VS - 1) / VS;
  const float *dq_part = p.partial, *dk_part = p.partial + slices * rows * K;
  const float *dg_part = p.partial + 2 * slices * rows * K, *db_part = dg_part + slices * rows;
  constexpr int PER = KMAX / 32;
  float q[PER], k[PER], dq[PER], dk[PER];
  float qq = 0.f, kk = 0.f;
#pragma unroll
  for (int r = 0; r < PER; ++r) {
    const int d = lane + 32 * r;
    q[r] = k[r] = dq[r] = dk[r] = 0.f;
    if (d >= K) continue;
    q[r] = to_f32(static_cast<const T *>(p.q)[bt * p.q_st.batch + t * p.q_st.token + hk * p.q_st.head + d]);
    k[r] = to_f32(static_cast<const T *>(p.k)[bt * p.k_st.batch + t * p.k_st.token + hk * p.k_st.head + d]);
    qq += q[r] * q[r];
    kk += k[r] * k[r];
    for (int h = hk * rep; h < (hk + 1) * rep; ++h)
      for (int64_t sl = 0; sl < slices; ++sl) {
        const int64_t at = (sl * rows + token * s.v_heads + h) * K + d;
        dq[r] += dq_part[at];
        dk[r] += dk_part[at];
      }
    dq[r] *= s.scale;
  }
  float rq = 1.f, rk = 1.f, qdq = 0.f, kdk = 0.f;
  if (s.l2norm_qk) {
    rq = rsqrtf(warp_sum(qq) + 1e-6f);
    rk = rsqrtf(warp_sum(kk) + 1e-6f);
#pragma unroll
    for (int r = 0; r < PER; ++r) {
      qdq += q[r] * rq * dq[r];
      kdk += k[r] * rk * dk[r];
    }
    qdq = warp_sum(qdq);
    kdk = warp_sum(kdk);
  }
  T *grad_q = static_cast<T *>(p.grad_q) + pair * K, *grad_k = static_cast<T *>(p.grad_k) + pair * K;
#pragma unroll
  for (int r = 0; r < PER; ++r) {
    const int d = lane + 32 * r;
    if (d >= K) continue;
    grad_q[d] = from_f32<T>(s.l2norm_qk ? rq * (dq[r] - q[r] * rq * qdq) : dq[r]);
    grad_k[d] = from_f32<T>(s.l2norm_qk ? rk * (dk[r] - k[r] * rk * kdk) : dk[r]);
  }
  for (int h = hk * rep + lane; h < (hk + 1) * rep; h += 32) {
    float dg = 0.f, db = 0.f;
    for (int64_t sl = 0; sl < slices; ++sl) {
      dg += dg_part[sl * rows + token * s.v_heads + h];
      db += db_part[sl * rows + token * s.v_heads + h];
    }
    static_cast<float *>(p.grad_g)[token * s.v_heads + h] = dg;
    static_cast<float *>(p.grad_beta)[token * s.v_heads + h] = db;
  }
}

}  // namespace

#define FORWARD(dir, dt) \
  extern "C" __global__ void __launch_bounds__(THREADS) gated_delta_rule_##dir##_##dt(const GatedDeltaRuleForward p) { \
    forward<BASTILE_TYPE_##dt>(p);                                                                                       \
  }
#define BACKWARD(dir, dt) \
  extern "C" __global__ void __launch_bounds__(THREADS) gated_delta_rule_##dir##_##dt(const GatedDeltaRuleBackward p) { \
    backward<BASTILE_TYPE_##dt>(p);                                                                                       \
  }
#define REDUCE(dir, reduce_, dt)                                                                          \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                  \
      gated_delta_rule_##dir##_##reduce_##_##dt(const GatedDeltaRuleBackward p) {                        \
    reduce<BASTILE_TYPE_##dt>(p);                                                                         \
  }
GATED_DELTA_RULE_FORWARD_KERNELS(FORWARD)
GATED_DELTA_RULE_BACKWARD_KERNELS(BACKWARD, REDUCE)
