//! The gated delta rule (include/gated_delta_rule.h): CUDA launchers for `cuda/gated_delta_rule.cu` and the
//! CPU kernels, the reference the GPU is tested against. The CPU runs the recurrence token by token, one
//! sequence and value head at a time, in f64, and rounds each result once. Its backward walks the tokens in
//! reverse with the adjoint of the state, replaying each stretch of REPLAY tokens from the state the forward
//! replay kept at its start.
use crate::cpu::{self, Element};
use crate::driver::{self, Device, LaunchConfig};
use crate::geometry::ceil_div;
use crate::kernels::{self, Launch, Plan, Tag};
use crate::params::{
    BastileDType, DeltaShape, GatedDeltaRuleBackward, GatedDeltaRuleForward, TokenStrides, GDR_BACKWARD_SHARED,
    GDR_CHUNK, GDR_MAX_DIM, GDR_PREP_SHARED, GDR_STATE_SHARED, GDR_V_SLICE, GDR_WALK_SHARED, GDR_WALK_WARPS, GDR_WARPS,
};
use std::ops::Range;

type Result<T> = std::result::Result<T, String>;

/// The CPU kernels' view of a forward or backward block's inputs.
macro_rules! inputs {
    ($p:expr) => {
        Inputs {
            q: Rows::new($p.q, $p.q_st, $p.shape.k_dim),
            k: Rows::new($p.k, $p.k_st, $p.shape.k_dim),
            v: Rows::new($p.v, $p.v_st, $p.shape.v_dim),
            g: $p.g.cast(),
            beta: $p.beta.cast(),
            initial: $p.initial_state.cast(),
            shape: $p.shape,
        }
    };
}

/// l2norm_qk's epsilon: HF's `l2norm`, fla's.
const L2_EPS: f64 = 1e-6;
/// Tokens between the states the CPU backward keeps.
const REPLAY: usize = 64;
/// The chunks and slices of V of the saved states and v'.
const CHUNK: usize = GDR_CHUNK as usize;
const VS: usize = GDR_V_SLICE as usize;

/// The tokens of sequence n: its batch row and their range in it.
#[derive(Clone)]
struct Span {
    row: usize,
    tokens: Range<usize>,
}

/// Every sequence's span; cu_seqlens is checked here, on the CPU (a CUDA kernel cannot stop the call).
unsafe fn spans(s: &DeltaShape, cu: *const i64) -> Result<Vec<Span>> {
    let (n, t) = (s.sequences as usize, s.tokens as usize);
    if cu.is_null() {
        return Ok((0..n).map(|row| Span { row, tokens: 0..t }).collect());
    }
    let cu = std::slice::from_raw_parts(cu, n + 1);
    let ok = cu[0] == 0 && cu[n] == t as i64 && cu.windows(2).all(|w| w[0] <= w[1]);
    if !ok {
        return Err(format!(
            "bastile.gated_delta_rule: cu_seqlens must rise from 0 to the {t} tokens of the row, got {cu:?}"
        ));
    }
    Ok(cu.windows(2).map(|w| Span { row: 0, tokens: w[0] as usize..w[1] as usize }).collect())
}

/// A [B, T, heads, dim] tensor of unit last stride, read as f64.
struct Rows<T> {
    ptr: *const T,
    st: TokenStrides,
    dim: usize,
}

// SAFETY: inputs only, read by every thread.
unsafe impl<T> Sync for Rows<T> {}

impl<T: Element> Rows<T> {
    fn new(ptr: *const std::ffi::c_void, st: TokenStrides, dim: i64) -> Self {
        Rows { ptr: ptr.cast(), st, dim: dim as usize }
    }

    fn contiguous(ptr: *const std::ffi::c_void, s: &DeltaShape, heads: i64, dim: i64) -> Self {
        let head = dim;
        let token = heads * head;
        Rows::new(ptr, TokenStrides { batch: s.tokens * token, token, head }, dim)
    }

    unsafe fn read(&self, row: usize, t: usize, head: usize) -> Vec<f64> {
        let at = row as i64 * self.st.batch + t as i64 * self.st.token + head as i64 * self.st.head;
        std::slice::from_raw_parts(self.ptr.offset(at as isize), self.dim).iter().map(|x| x.to_f64()).collect()
    }
}

/// x scaled to unit norm as l2norm_qk does, and the factor it took: x * r with r = rsqrt(sum x^2 + eps).
fn l2norm(x: &[f64]) -> (Vec<f64>, f64) {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() + L2_EPS).sqrt();
    (x.iter().map(|v| v * r).collect(), r)
}

/// What one token of one value head reads.
struct Token {
    q: Vec<f64>, // normalized with l2norm_qk; not yet scaled
    k: Vec<f64>,
    v: Vec<f64>,
    a: f64,
    b: f64,
    // With l2norm_qk, the factors r of q and k; else 1.
    rq: f64,
    rk: f64,
}

/// The inputs of a forward or backward block, as the CPU kernels read them.
struct Inputs<T, S> {
    q: Rows<T>,
    k: Rows<T>,
    v: Rows<T>,
    g: *const S,
    beta: *const S,
    initial: *const S,
    shape: DeltaShape,
}

// SAFETY: inputs only, read by every thread.
unsafe impl<T, S> Sync for Inputs<T, S> {}

impl<T: Element, S: Element> Inputs<T, S> {
    unsafe fn token(&self, span: &Span, t: usize, h: usize) -> Token {
        let s = &self.shape;
        let hk = h / (s.v_heads / s.k_heads) as usize;
        let (mut q, mut k) = (self.q.read(span.row, t, hk), self.k.read(span.row, t, hk));
        let (mut rq, mut rk) = (1.0, 1.0);
        if s.l2norm_qk != 0 {
            (q, rq) = l2norm(&q);
            (k, rk) = l2norm(&k);
        }
        let at = (span.row * s.tokens as usize + t) * s.v_heads as usize + h;
        let a = (*self.g.add(at)).to_f64().exp();
        Token { q, k, v: self.v.read(span.row, t, h), a, b: (*self.beta.add(at)).to_f64(), rq, rk }
    }

    /// Sequence n's initial state of value head h, [K, V].
    unsafe fn initial(&self, n: usize, h: usize) -> Vec<f64> {
        let size = (self.shape.k_dim * self.shape.v_dim) as usize;
        if self.initial.is_null() {
            return vec![0.0; size];
        }
        let at = (n * self.shape.v_heads as usize + h) * size;
        std::slice::from_raw_parts(self.initial.add(at), size).iter().map(|x| x.to_f64()).collect()
    }
}

/// One token's update of the state s [K, V] (row i of s is key coordinate i): s = a s, then [`absorb`].
fn update(s: &mut [f64], tok: &Token) {
    s.iter_mut().for_each(|x| *x *= tok.a);
    absorb(s, tok);
}

/// The delta write of a token into its decayed state s: s += k (b (v - s^T k))^T. Returns the p = s^T k it
/// read.
fn absorb(s: &mut [f64], tok: &Token) -> Vec<f64> {
    let vd = tok.v.len();
    let p = read(s, &tok.k, vd);
    for (row, ki) in s.chunks_exact_mut(vd).zip(&tok.k) {
        for ((x, v), p) in row.iter_mut().zip(&tok.v).zip(&p) {
            *x += ki * tok.b * (v - p);
        }
    }
    p
}

/// s^T x: the V-vector the state gives for key-space vector x.
fn read(s: &[f64], x: &[f64], vd: usize) -> Vec<f64> {
    let mut out = vec![0.0; vd];
    for (row, xi) in s.chunks_exact(vd).zip(x) {
        for (o, si) in out.iter_mut().zip(row) {
            *o += xi * si;
        }
    }
    out
}

/// s y: the K-vector the state gives for value-space vector y.
fn apply(s: &[f64], y: &[f64]) -> Vec<f64> {
    s.chunks_exact(y.len()).map(|row| row.iter().zip(y).map(|(a, b)| a * b).sum()).collect()
}

fn inner(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Writes f64 values into an output of element type E at offset `at`.
unsafe fn store<E: Element>(out: *mut std::ffi::c_void, at: usize, values: &[f64]) {
    let out = std::slice::from_raw_parts_mut(out.cast::<E>().add(at), values.len());
    out.iter_mut().zip(values).for_each(|(o, v)| *o = E::from_f64(*v));
}

/// Runs `$f::<T, S>` for the block's dtypes: T that of q, k, v, S the state's, f32 but for f64 input.
macro_rules! on_dtypes {
    ($p:expr, $f:ident) => {{
        use half::{bf16, f16};
        use BastileDType::*;
        let s = &$p.shape;
        let (t, st) = (BastileDType::from_raw(s.dtype)?, BastileDType::from_raw(s.state_dtype)?);
        if st != t.stats() {
            return Err(format!("bastile.gated_delta_rule: the state must be {:?} for {t:?} input", t.stats()));
        }
        // SAFETY: the C++ layer checked every pointer of the block against its shape and dtype.
        unsafe {
            match t {
                BASTILE_F32 => $f::<f32, f32>($p),
                BASTILE_F16 => $f::<f16, f32>($p),
                BASTILE_BF16 => $f::<bf16, f32>($p),
                BASTILE_F64 => $f::<f64, f64>($p),
            }
        }
    }};
}

/// Threads of every kernel's blocks but the walks', and of those.
const THREADS: u32 = 32 * GDR_WARPS;
const WALK_THREADS: u32 = 32 * GDR_WALK_WARPS;

/// The grid of the state pass and the backward: a block per sequence and value head, times the slices of V.
fn grid(s: &DeltaShape) -> Result<(u32, u32)> {
    if s.k_dim > GDR_MAX_DIM as i64 {
        return Err(format!("bastile.gated_delta_rule: CUDA kernels take a key head_dim up to {GDR_MAX_DIM}, got {}", s.k_dim));
    }
    let blocks = s.sequences * s.v_heads;
    if blocks > i32::MAX as i64 {
        return Err(format!("bastile.gated_delta_rule: {blocks} sequences x heads is more than one launch takes"));
    }
    Ok((blocks as u32, ceil_div(s.v_dim, GDR_V_SLICE as i64) as u32))
}

fn dtype(s: &DeltaShape) -> Result<Tag> {
    Ok(BastileDType::from_raw(s.dtype)?.tag())
}

/// The forward's kernels and their scratch (include/gated_delta_rule.h): `launch(params, scratch, stream)`
/// points the params at the scratch and runs the key side, then, where o is asked for, the state pass.
#[derive(Clone, Copy)]
struct Forward {
    prep: driver::Kernel,
    state: driver::Kernel,
    slots: i64,
    grid: (u32, u32),
}

impl Forward {
    fn new(s: &DeltaShape, packed: bool, dev: &'static Device) -> Result<Forward> {
        let tag = dtype(s)?;
        let chunk = GDR_CHUNK as i64;
        let slots = if packed { s.tokens / chunk + s.sequences } else { s.sequences * ceil_div(s.tokens, chunk) };
        if slots > i32::MAX as i64 {
            return Err(format!("bastile.gated_delta_rule: {slots} chunks are more than one launch takes"));
        }
        Ok(Forward {
            prep: kernels::kernel_sharing::<GatedDeltaRuleForward>(dev, &[Tag::Fwd, Tag::Prep, tag], THREADS, 1)?,
            state: kernels::kernel_sharing::<GatedDeltaRuleForward>(dev, &[Tag::Fwd, Tag::State, tag], WALK_THREADS, 1)?,
            slots,
            grid: grid(s)?,
        })
    }

    /// Floats of scratch: W, kt, gamma, X, G q and M of every slot and value head, and U for the state pass.
    fn scratch(&self, s: &DeltaShape, state_pass: bool) -> i64 {
        let (c, k) = (GDR_CHUNK as i64, GDR_MAX_DIM as i64);
        let u = if state_pass { c * s.v_dim } else { 0 };
        self.slots * s.v_heads * (3 * c * k + u + c + 2 * c * c)
    }

    /// # Safety
    /// `memory` holds `scratch(s, state_pass)` floats, the state pass running where `p.o` is set; the C++ layer
    /// checked every other pointer of `p`.
    unsafe fn launch(&self, p: &mut GatedDeltaRuleForward, memory: *mut f32, stream: usize) -> Result<()> {
        let s = p.shape;
        let state_pass = !p.o.is_null();
        let (c, k) = (GDR_CHUNK as i64, GDR_MAX_DIM as i64);
        let chunks = self.slots * s.v_heads;
        // The tiles the kernels copy 16 bytes at a time first.
        p.w = memory;
        p.kt = p.w.add((chunks * c * k) as usize);
        p.qg = p.kt.add((chunks * c * k) as usize);
        p.x = p.qg.add((chunks * c * k) as usize);
        p.m = p.x.add((chunks * c * c) as usize);
        p.gamma = p.m.add((chunks * c * c) as usize);
        p.u = if state_pass { p.gamma.add((chunks * c) as usize) } else { std::ptr::null_mut() };
        let prep = LaunchConfig { grid: (self.slots as u32, s.v_heads as u32), block: (THREADS, 1), shared: GDR_PREP_SHARED };
        driver::launch(self.prep, prep, stream, p)?;
        if !state_pass {
            return Ok(());
        }
        let walk = LaunchConfig { grid: self.grid, block: (WALK_THREADS, 1), shared: GDR_STATE_SHARED };
        driver::launch(self.state, walk, stream, p)
    }
}

fn forward_plan(p: &GatedDeltaRuleForward, dev: &'static Device) -> Result<Plan> {
    let forward = Forward::new(&p.shape, !p.cu_seqlens.is_null(), dev)?;
    let mut p = *p;
    // SAFETY: the plan's scratch is forward.scratch floats.
    Ok(Plan::new(forward.scratch(&p.shape, true) * 4, move |memory, stream| unsafe {
        forward.launch(&mut p, memory.cast(), stream)
    }))
}

/// The backward runs the forward's key side again into its scratch (the first part of its own), walks the chunks
/// in reverse for dh and dv', takes the rest of each chunk's gradients from them and the forward's states and v',
/// the chunks in parallel, a block summing q's and k's over the value heads of its key head.
fn backward_plan(p: &GatedDeltaRuleBackward, dev: &'static Device) -> Result<Plan> {
    let s = p.shape;
    let tag = dtype(&s)?;
    let forward = Forward::new(&s, !p.cu_seqlens.is_null(), dev)?;
    let walk = kernels::kernel_sharing::<GatedDeltaRuleBackward>(dev, &[Tag::Bwd, Tag::Walk, tag], WALK_THREADS, 1)?;
    let chunked = kernels::kernel_sharing::<GatedDeltaRuleBackward>(dev, &[Tag::Bwd, tag], THREADS, 2)?;
    let grid = forward.grid;
    let keys = forward.scratch(&s, false);
    let chunks = forward.slots * s.v_heads;
    // The walk's dv' and dh by slice of V (as the saved v' and states).
    let slices = ceil_div(s.v_dim, GDR_V_SLICE as i64);
    let by_slice = |rows: i64| chunks * slices * rows * GDR_V_SLICE as i64;
    let (dvn, walked) = (by_slice(GDR_CHUNK as i64), by_slice(GDR_CHUNK as i64 + s.k_dim));
    let partial = if s.v_heads > s.k_heads { 2 * s.batch * s.tokens * s.k_heads * s.k_dim } else { 0 };
    let mut key_side = GatedDeltaRuleForward {
        q: p.q,
        k: p.k,
        v: p.v,
        g: p.g,
        beta: p.beta,
        initial_state: p.initial_state,
        cu_seqlens: p.cu_seqlens,
        o: std::ptr::null_mut(),
        final_state: std::ptr::null_mut(),
        states: std::ptr::null_mut(),
        v_new: std::ptr::null_mut(),
        w: std::ptr::null_mut(),
        kt: std::ptr::null_mut(),
        u: std::ptr::null_mut(),
        gamma: std::ptr::null_mut(),
        x: std::ptr::null_mut(),
        qg: std::ptr::null_mut(),
        m: std::ptr::null_mut(),
        q_st: p.q_st,
        k_st: p.k_st,
        v_st: p.v_st,
        shape: s,
    };
    let mut p = *p;
    p.chunks = chunks;
    Ok(Plan::new((keys + walked + partial) * 4, move |memory, stream| {
        let memory = memory.cast::<f32>();
        // SAFETY: the scratch holds the key side's part, the walk's dh and dv', then q's and k's gradients by
        // value head; the C++ layer checked every other pointer.
        unsafe {
            forward.launch(&mut key_side, memory, stream)?;
            p.w = key_side.w;
            p.kt = key_side.kt;
            p.gamma = key_side.gamma;
            p.x = key_side.x;
            p.qg = key_side.qg;
            p.m = key_side.m;
            p.dvn = memory.add(keys as usize);
            p.dstates = p.dvn.add(dvn as usize);
            p.partial = if partial > 0 { memory.add((keys + walked) as usize) } else { std::ptr::null_mut() };
            let cfg = |grid, shared| LaunchConfig { grid, block: (THREADS, 1), shared };
            driver::launch(walk, LaunchConfig { grid, block: (WALK_THREADS, 1), shared: GDR_WALK_SHARED }, stream, &p)?;
            let per_chunk = (forward.slots as u32, s.k_heads as u32);
            driver::launch(chunked, cfg(per_chunk, GDR_BACKWARD_SHARED), stream, &p)
        }
    }))
}

impl Launch for GatedDeltaRuleForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        forward_plan(self, dev)
    }

    fn cpu(&self) -> Result<()> {
        on_dtypes!(self, forward_cpu)
    }
}

impl Launch for GatedDeltaRuleBackward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        backward_plan(self, dev)
    }

    fn cpu(&self) -> Result<()> {
        on_dtypes!(self, backward_cpu)
    }
}

unsafe fn forward_cpu<T: Element, S: Element>(p: &GatedDeltaRuleForward) -> Result<()> {
    let s = p.shape;
    let x: Inputs<T, S> = inputs!(p);
    let spans = spans(&s, p.cu_seqlens)?;
    let (hv, kd, vd) = (s.v_heads as usize, s.k_dim as usize, s.v_dim as usize);
    let save = !p.states.is_null();
    let x = &x;
    let results = cpu::parallel_map(spans.len() * hv, |task| {
        let (n, h) = (task / hv, task % hv);
        let mut state = x.initial(n, h);
        let (mut o, mut starts, mut v_new) = (vec![], vec![], vec![]);
        for (i, t) in spans[n].tokens.clone().enumerate() {
            if save && i % CHUNK == 0 {
                starts.push(state.clone());
            }
            let tok = x.token(&spans[n], t, h);
            state.iter_mut().for_each(|x| *x *= tok.a);
            let read = absorb(&mut state, &tok);
            if save {
                v_new.push(tok.v.iter().zip(read).map(|(v, r)| tok.b * (v - r)).collect::<Vec<_>>());
            }
            o.push(self::read(&state, &tok.q, vd).iter().map(|o| o * s.scale).collect::<Vec<_>>());
        }
        (o, state, starts, v_new)
    });
    let slices = vd.div_ceil(VS);
    // Row `row` of the slices of the saved tile [rows, V] of chunk `chunk`, value head h.
    let saved = |out: *mut std::ffi::c_void, rows: usize, chunk: usize, h: usize, row: usize, values: &[f64]| {
        for (slice, part) in values.chunks(VS).enumerate() {
            store::<T>(out, (((chunk * hv + h) * slices + slice) * rows + row) * VS, part);
        }
    };
    for (task, (o, state, starts, v_new)) in results.iter().enumerate() {
        let (n, h) = (task / hv, task % hv);
        let span = &spans[n];
        for (t, o) in span.tokens.clone().zip(o) {
            store::<T>(p.o, ((span.row * s.tokens as usize + t) * hv + h) * vd, o);
        }
        store::<S>(p.final_state, task * state.len(), state);
        let chunk = |i: usize| slot(&s, !p.cu_seqlens.is_null(), n, span.tokens.start + i);
        for (c, start) in starts.iter().enumerate() {
            for (d, row) in start.chunks_exact(vd).enumerate() {
                saved(p.states, kd, chunk(c * CHUNK), h, d, row);
            }
        }
        for (i, row) in v_new.iter().enumerate() {
            saved(p.v_new, CHUNK, chunk(i / CHUNK * CHUNK), h, i % CHUNK, row);
        }
    }
    Ok(())
}

/// The slot of the chunk at token `at` of sequence n's row (cuda/gated_delta_rule.cu's `slot`).
fn slot(s: &DeltaShape, packed: bool, n: usize, at: usize) -> usize {
    if packed {
        at / CHUNK + n
    } else {
        n * (s.tokens as usize).div_ceil(CHUNK) + at / CHUNK
    }
}

/// The gradients of one sequence and value head.
struct Grads {
    q: Vec<Vec<f64>>, // per token, of the raw (unnormalized) q
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    g: Vec<f64>,
    beta: Vec<f64>,
    initial: Vec<f64>,
}

/// The gradient of x from that of y = x r, its l2norm_qk (r = rsqrt(sum x^2 + eps)): r (dy - y (y . dy)).
fn l2norm_backward(y: &[f64], dy: Vec<f64>, r: f64, normalized: bool) -> Vec<f64> {
    if !normalized {
        return dy;
    }
    let c = inner(y, &dy);
    dy.iter().zip(y).map(|(d, y)| r * (d - y * c)).collect()
}

unsafe fn backward_head<T: Element, S: Element>(
    x: &Inputs<T, S>,
    grad_o: &Rows<T>,
    grad_final: Option<&[S]>,
    span: &Span,
    n: usize,
    h: usize,
) -> Grads {
    let s = &x.shape;
    let (kd, vd) = (s.k_dim as usize, s.v_dim as usize);
    let len = span.tokens.len();
    let start = span.tokens.start;
    // The state before each REPLAY-th token.
    let mut kept = Vec::new();
    let mut state = x.initial(n, h);
    for i in 0..len {
        if i % REPLAY == 0 {
            kept.push(state.clone());
        }
        update(&mut state, &x.token(span, start + i, h));
    }
    let at = (n * s.v_heads as usize + h) * kd * vd;
    let mut lambda = match grad_final {
        None => vec![0.0; kd * vd],
        Some(g) => g[at..at + kd * vd].iter().map(|x| x.to_f64()).collect(),
    };
    let mut out = Grads {
        q: vec![Vec::new(); len],
        k: vec![Vec::new(); len],
        v: vec![Vec::new(); len],
        g: vec![0.0; len],
        beta: vec![0.0; len],
        initial: Vec::new(),
    };
    for (c, first) in kept.iter().enumerate().rev() {
        let stretch = c * REPLAY..(c * REPLAY + REPLAY).min(len);
        let tokens: Vec<Token> = stretch.clone().map(|i| x.token(span, start + i, h)).collect();
        // The state before each token of the stretch.
        let mut before = vec![first.clone()];
        for tok in &tokens[..tokens.len() - 1] {
            let mut next = before.last().unwrap().clone();
            update(&mut next, tok);
            before.push(next);
        }
        for ((i, tok), prev) in stretch.zip(&tokens).zip(&before).rev() {
            let decayed: Vec<f64> = prev.iter().map(|x| x * tok.a).collect();
            let mut now = decayed.clone();
            let p = absorb(&mut now, tok);
            let delta: Vec<f64> = tok.v.iter().zip(&p).map(|(v, p)| tok.b * (v - p)).collect();
            let d_o: Vec<f64> = grad_o.read(span.row, start + i, h).iter().map(|d| d * s.scale).collect();
            // o = now^T q scale: lambda, the gradient of `now`, takes q d_o^T
            let dq = apply(&now, &d_o);
            for (row, qi) in lambda.chunks_exact_mut(vd).zip(&tok.q) {
                row.iter_mut().zip(&d_o).for_each(|(l, d)| *l += qi * d);
            }
            // now = decayed + k delta^T, delta = b (v - decayed^T k)
            let d_delta = read(&lambda, &tok.k, vd);
            let dp: Vec<f64> = d_delta.iter().map(|d| -tok.b * d).collect();
            let mut dk = apply(&lambda, &delta);
            dk.iter_mut().zip(apply(&decayed, &dp)).for_each(|(a, b)| *a += b);
            out.v[i] = d_delta.iter().map(|d| tok.b * d).collect();
            out.beta[i] = tok.v.iter().zip(&p).zip(&d_delta).map(|((v, p), d)| (v - p) * d).sum();
            for (row, ki) in lambda.chunks_exact_mut(vd).zip(&tok.k) {
                row.iter_mut().zip(&dp).for_each(|(l, d)| *l += ki * d);
            }
            // decayed = a prev
            out.g[i] = inner(&decayed, &lambda);
            lambda.iter_mut().for_each(|l| *l *= tok.a);
            let normalized = s.l2norm_qk != 0;
            out.q[i] = l2norm_backward(&tok.q, dq, tok.rq, normalized);
            out.k[i] = l2norm_backward(&tok.k, dk, tok.rk, normalized);
        }
    }
    out.initial = lambda;
    out
}

unsafe fn backward_cpu<T: Element, S: Element>(p: &GatedDeltaRuleBackward) -> Result<()> {
    let s = p.shape;
    let x: Inputs<T, S> = inputs!(p);
    let grad_o = Rows::<T>::contiguous(p.grad_o, &s, s.v_heads, s.v_dim);
    let spans = spans(&s, p.cu_seqlens)?;
    let (hk, hv, kd, vd) = (s.k_heads as usize, s.v_heads as usize, s.k_dim as usize, s.v_dim as usize);
    let rep = hv / hk.max(1);
    let grad_final = (!p.grad_final_state.is_null())
        .then(|| std::slice::from_raw_parts(p.grad_final_state.cast::<S>(), spans.len() * hv * kd * vd));
    let (x, grad_o) = (&x, &grad_o);
    // A task per sequence and key head: it sums the gradients of q and k over the value heads that read them.
    let results = cpu::parallel_map(spans.len() * hk, |task| {
        let (n, head) = (task / hk, task % hk);
        (head * rep..(head + 1) * rep).map(|h| backward_head(x, grad_o, grad_final, &spans[n], n, h)).collect::<Vec<_>>()
    });
    let zeros = |len: usize, dim: usize| vec![vec![0.0; dim]; len];
    for (task, heads) in results.iter().enumerate() {
        let (n, head) = (task / hk, task % hk);
        let span = &spans[n];
        let (mut dq, mut dk) = (zeros(span.tokens.len(), kd), zeros(span.tokens.len(), kd));
        for (j, gr) in heads.iter().enumerate() {
            let h = head * rep + j;
            for (i, t) in span.tokens.clone().enumerate() {
                dq[i].iter_mut().zip(&gr.q[i]).for_each(|(a, b)| *a += b);
                dk[i].iter_mut().zip(&gr.k[i]).for_each(|(a, b)| *a += b);
                let at = (span.row * s.tokens as usize + t) * hv + h;
                store::<T>(p.grad_v, at * vd, &gr.v[i]);
                store::<S>(p.grad_g, at, &gr.g[i..i + 1]);
                store::<S>(p.grad_beta, at, &gr.beta[i..i + 1]);
            }
            store::<S>(p.grad_initial_state, (n * hv + h) * kd * vd, &gr.initial);
        }
        for (i, t) in span.tokens.clone().enumerate() {
            let at = ((span.row * s.tokens as usize + t) * hk + head) * kd;
            store::<T>(p.grad_q, at, &dq[i]);
            store::<T>(p.grad_k, at, &dk[i]);
        }
    }
    Ok(())
}
