//! Qwen3.5's depthwise causal conv with SiLU (HF `causal_conv1d_fn`; the formulas are in
//! `cuda/causal_conv1d.cu`) over channels-last rows: the launches of its kernels and the CPU kernels, the
//! reference the GPU is tested against. Every result is computed in f64 (f32 on the GPU) and rounded once,
//! where HF rounds after the conv and again after SiLU.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, Kernel, LaunchConfig, Result};
use crate::geometry;
use crate::kernels::{self, Launch, Plan, Tag};
use crate::params::{
    BastileDType, CausalConv1dBackward, CausalConv1dForward, CausalConv1dInputs, CAUSAL_CONV1D_BACKWARD_VEC,
    CAUSAL_CONV1D_BLOCK,
};
use std::ffi::c_void;

/// Tokens a forward thread takes in order; the W - 1 before each tile are read again, from L2.
const FORWARD_TILE: i32 = 16;
/// Tokens a backward thread takes in order: it walks W - 1 more past each tile, recomputing their dpre.
const BACKWARD_TILE: i32 = 32;
/// Threads of a block along channel vectors at most: a warp (512 contiguous bytes a token with 16-byte
/// vectors); the block's other threads take other tiles of the same channels.
const LANES: i64 = 32;
const BLOCK: i64 = CAUSAL_CONV1D_BLOCK as i64;

fn dtypes(p: &CausalConv1dInputs) -> Result<(BastileDType, BastileDType)> {
    Ok((BastileDType::from_raw(p.x_dtype)?, BastileDType::from_raw(p.w_dtype)?))
}

/// Channels per access: `most` when the channels, the strides (in elements) and every pointer allow
/// vectors of that many elements of x's dtype, else 1.
fn vector(p: &CausalConv1dInputs, most: i64, strides: &[i64], ptrs: &[*const c_void]) -> Result<i64> {
    let bytes = most as usize * BastileDType::from_raw(p.x_dtype)?.size();
    let fits = p.channels % most == 0
        && strides.iter().all(|s| s % most == 0)
        && ptrs.iter().all(|&q| geometry::aligned(q, bytes));
    Ok(if fits { most } else { 1 })
}

/// A launch over the tiles of `p`: the kernel of `dir` for `vec` channels an access, blocks of `lanes` x
/// `rows` threads (a block's rows take different tiles), and a grid of channel blocks by enough blocks for
/// every tile, at most 65535 (the kernels stride over the rest; the backward caps it to one wave).
fn layout<P: kernels::Kernels>(dev: &Device, p: &CausalConv1dInputs, dir: Tag, vec: i64) -> Result<(Kernel, LaunchConfig)> {
    let (x, w) = dtypes(p)?;
    let access = if vec > 1 { Tag::Vec } else { Tag::Scalar };
    let units = p.channels / vec;
    let lanes = (units as u64).next_power_of_two().min(LANES as u64) as i64;
    let rows = BLOCK / lanes;
    let kernel = kernels::kernel::<P>(dev, &[dir, x.tag(), w.tag(), access], BLOCK as u32)?;
    let tiles = p.batch * geometry::ceil_div(p.seq, p.tile as i64);
    let grid = (geometry::ceil_div(units, lanes) as u32, geometry::ceil_div(tiles, rows).min(u16::MAX as i64) as u32);
    Ok((kernel, LaunchConfig { grid, block: (lanes as u32, rows as u32), shared: 0 }))
}

impl Launch for CausalConv1dForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let mut p = *self;
        p.inputs.tile = FORWARD_TILE;
        let q = &p.inputs;
        let most = 16 / BastileDType::from_raw(q.x_dtype)?.size() as i64;
        let vec = vector(q, most, &[q.x_batch_stride, q.x_seq_stride], &[q.x, p.y])?;
        let (kernel, cfg) = layout::<Self>(dev, q, Tag::Fwd, vec)?;
        Ok(Plan::single(kernel, cfg, p))
    }

    fn cpu(&self) -> Result<()> {
        let (x, w) = dtypes(&self.inputs)?;
        // SAFETY: the C++ layer checked shapes, strides and dtypes of every pointer in the block.
        crate::with_dtypes!(x, w, |X, W, _Y| unsafe { forward_cpu::<X, W>(self) });
        Ok(())
    }
}

impl Launch for CausalConv1dBackward {
    /// The tiles kernel, one resident wave of blocks, writes a partial row of the weight and bias gradients
    /// per row of blocks into the scratch; the reduce kernel folds them.
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let mut p = *self;
        p.inputs.tile = BACKWARD_TILE;
        let q = &p.inputs;
        let most = (16 / BastileDType::from_raw(q.x_dtype)?.size() as i64).min(CAUSAL_CONV1D_BACKWARD_VEC as i64);
        let strides = [q.x_batch_stride, q.x_seq_stride, p.grad_y_batch_stride, p.grad_y_seq_stride];
        let vec = vector(q, most, &strides, &[q.x, p.grad_y, p.grad_x])?;
        let (kernel, mut cfg) = layout::<Self>(dev, q, Tag::Bwd, vec)?;
        let w = dtypes(q)?.1;
        let (fold_threads, taps) = (geometry::FOLD_BLOCK.0 * geometry::FOLD_BLOCK.1, q.channels * q.width as i64);
        let reduce = kernels::kernel::<Self>(dev, &[Tag::Bwd, Tag::Reduce, w.tag()], fold_threads)?;
        let wave = dev.sm_count() as i64 * kernel.blocks_per_sm as i64;
        cfg.grid.1 = cfg.grid.1.min((wave / cfg.grid.0 as i64).max(1) as u32);
        p.partials = cfg.grid.1 as i64;
        let scratch = p.partials * (taps + q.channels) * 4;
        let reduce_cfg = LaunchConfig { grid: (geometry::ceil_div(taps, 32) as u32, 2), block: geometry::FOLD_BLOCK, shared: 0 };
        Ok(Plan::with_fold(scratch, p, |p| &mut p.partial, (kernel, cfg), (reduce, reduce_cfg)))
    }

    fn cpu(&self) -> Result<()> {
        let (x, w) = dtypes(&self.inputs)?;
        // SAFETY: as in the forward, and for grad_y and the gradients.
        crate::with_dtypes!(x, w, |X, W, _Y| unsafe { backward_cpu::<X, W>(self) });
        Ok(())
    }
}

/// Where each token's sequence starts in its row: at token 0, or at the last cu_seqlens offset at or before
/// the token. Offsets are clamped into [0, seq] as the CUDA kernels clamp them; the C++ layer has checked
/// that they run from 0 to seq without decreasing.
struct Starts(Option<Vec<usize>>);

impl Starts {
    fn first(&self, t: usize) -> usize {
        match &self.0 {
            None => 0,
            Some(cu) => match cu.partition_point(|&o| o <= t) {
                0 => 0,
                i => cu[i - 1].min(t),
            },
        }
    }
}

/// The elements of a [batch, seq, channels] tensor with these element strides (channels' 1), as a slice.
///
/// # Safety
/// `ptr` must address such a tensor of `T`.
unsafe fn strided<'a, T>(ptr: *const c_void, shape: [usize; 3], batch_stride: i64, seq_stride: i64) -> &'a [T] {
    let [b, s, c] = shape;
    let len = if b * s * c == 0 { 0 } else { (b - 1) * batch_stride as usize + (s - 1) * seq_stride as usize + c };
    cpu::slice(ptr, len)
}

/// A call's operands as the CPU kernels read them, the weight and bias in f64.
struct Conv<'a, X> {
    x: &'a [X],
    batch_stride: usize,
    seq_stride: usize,
    seq: usize,
    channels: usize,
    width: usize,
    weight: Vec<f64>,
    bias: Vec<f64>,
    starts: Starts,
    silu: bool,
}

impl<X: Element> Conv<'_, X> {
    unsafe fn new<W: Element>(p: &CausalConv1dInputs) -> Self {
        let (seq, channels, width) = (p.seq as usize, p.channels as usize, p.width as usize);
        let widen = |ptr: *const c_void, n: usize| cpu::slice::<W>(ptr, n).iter().map(|v| v.to_f64()).collect::<Vec<_>>();
        let clamp = |o: i64| o.clamp(0, p.seq) as usize;
        let n = p.sequences as usize + 1;
        let starts = match (p.cu_seqlens.is_null(), p.cu_int64 != 0) {
            (true, _) => None,
            (false, true) => Some(cpu::slice::<i64>(p.cu_seqlens, n).iter().map(|&o| clamp(o)).collect()),
            (false, false) => Some(cpu::slice::<i32>(p.cu_seqlens, n).iter().map(|&o| clamp(o as i64)).collect()),
        };
        Conv {
            x: strided(p.x, [p.batch as usize, seq, channels], p.x_batch_stride, p.x_seq_stride),
            batch_stride: p.x_batch_stride as usize,
            seq_stride: p.x_seq_stride as usize,
            seq,
            channels,
            width,
            weight: widen(p.weight, channels * width),
            bias: if p.bias.is_null() { vec![0.0; channels] } else { widen(p.bias, channels) },
            starts: Starts(starts),
            silu: p.silu != 0,
        }
    }

    fn x(&self, b: usize, t: usize, c: usize) -> f64 {
        self.x[b * self.batch_stride + t * self.seq_stride + c].to_f64()
    }

    /// The conv of channel c at token t of row b, whose sequence starts at `first`.
    fn pre(&self, b: usize, t: usize, first: usize, c: usize) -> f64 {
        let w = &self.weight[c * self.width..][..self.width];
        let taps = (t - first + 1).min(self.width);
        (0..taps).fold(self.bias[c], |s, k| s + w[self.width - 1 - k] * self.x(b, t - k, c))
    }

    fn act(&self, pre: f64) -> f64 {
        if self.silu { pre / (1.0 + (-pre).exp()) } else { pre }
    }

    /// d act / d pre.
    fn slope(&self, pre: f64) -> f64 {
        if !self.silu {
            return 1.0;
        }
        let s = 1.0 / (1.0 + (-pre).exp());
        s * (1.0 + pre * (1.0 - s))
    }
}

unsafe fn forward_cpu<X: Element, W: Element>(f: &CausalConv1dForward) {
    let conv = Conv::<X>::new::<W>(&f.inputs);
    let (seq, ch) = (conv.seq, conv.channels);
    let tokens = f.inputs.batch as usize * seq;
    if tokens * ch == 0 {
        return;
    }
    let y = Disjoint::new(cpu::slice_mut::<X>(f.y, tokens * ch));
    cpu::parallel_for(tokens, cpu::GRAIN.div_ceil(ch), |range| {
        // SAFETY: the ranges of parallel_for do not overlap.
        for (yt, token) in y.part(range.start * ch..range.end * ch).chunks_mut(ch).zip(range) {
            let (b, t) = (token / seq, token % seq);
            let first = conv.starts.first(t);
            for (c, y) in yt.iter_mut().enumerate() {
                *y = X::from_f64(conv.act(conv.pre(b, t, first, c)));
            }
        }
    });
}

unsafe fn backward_cpu<X: Element, W: Element>(g: &CausalConv1dBackward) {
    let p = &g.inputs;
    let conv = Conv::<X>::new::<W>(p);
    let (seq, ch, width) = (conv.seq, conv.channels, conv.width);
    let tokens = p.batch as usize * seq;
    let (gw, gb) = (cpu::slice_mut::<W>(g.grad_weight, ch * width), cpu::slice_mut::<W>(g.grad_bias, ch));
    if tokens * ch == 0 {
        gw.fill(W::from_f64(0.0));
        gb.fill(W::from_f64(0.0));
        return;
    }
    let dy = strided::<X>(g.grad_y, [p.batch as usize, seq, ch], g.grad_y_batch_stride, g.grad_y_seq_stride);
    let (dy_b, dy_t) = (g.grad_y_batch_stride as usize, g.grad_y_seq_stride as usize);
    let dpre = |b: usize, t: usize, first: usize, c: usize| {
        dy[b * dy_b + t * dy_t + c].to_f64() * conv.slope(conv.pre(b, t, first, c))
    };
    let dx = Disjoint::new(cpu::slice_mut::<X>(g.grad_x, tokens * ch));
    cpu::parallel_for(tokens, cpu::GRAIN.div_ceil(ch * width), |range| {
        // SAFETY: the ranges of parallel_for do not overlap.
        for (dxt, token) in dx.part(range.start * ch..range.end * ch).chunks_mut(ch).zip(range) {
            let (b, t) = (token / seq, token % seq);
            // The tokens t + k that read t: those of t's sequence, with their sequences' start.
            let readers: Vec<(usize, usize, usize)> = (0..width)
                .map(|k| (k, t + k))
                .take_while(|&(_, s)| s < seq)
                .map(|(k, s)| (k, s, conv.starts.first(s)))
                .take_while(|&(_, _, first)| first <= t)
                .collect();
            for (c, dx) in dxt.iter_mut().enumerate() {
                let w = &conv.weight[c * width..][..width];
                *dx = X::from_f64(readers.iter().map(|&(k, s, first)| w[width - 1 - k] * dpre(b, s, first, c)).sum());
            }
        }
    });
    // Chunks that depend on the shape alone: the sums' order (and value) does not depend on the threads.
    let chunk = tokens.div_ceil(256).max(16);
    let partials = cpu::parallel_map(tokens.div_ceil(chunk), |i| {
        let mut sums = vec![0f64; ch * (width + 1)];
        let (dw, db) = sums.split_at_mut(ch * width);
        for token in i * chunk..((i + 1) * chunk).min(tokens) {
            let (b, t) = (token / seq, token % seq);
            let first = conv.starts.first(t);
            let taps = (t - first + 1).min(width);
            for c in 0..ch {
                let d = dpre(b, t, first, c);
                db[c] += d;
                for k in 0..taps {
                    dw[c * width + width - 1 - k] += d * conv.x(b, t - k, c);
                }
            }
        }
        sums
    });
    let total = |j: usize| partials.iter().map(|s| s[j]).sum::<f64>();
    for (j, o) in gw.iter_mut().enumerate() {
        *o = W::from_f64(total(j));
    }
    for (c, o) in gb.iter_mut().enumerate() {
        *o = W::from_f64(total(ch * width + c));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Kernels;
    use crate::testing::{cast, noise, unit, widen};
    use half::{bf16, f16};
    use BastileDType::*;

    /// A call: x [batch, seq, channels] laid out with `pad` unused elements after each token's channels.
    #[derive(Clone)]
    struct Case {
        batch: usize,
        seq: usize,
        channels: usize,
        width: usize,
        bias: bool,
        silu: bool,
        cu_seqlens: Option<Vec<i64>>,
        pad: usize,
    }

    impl Case {
        fn new(batch: usize, seq: usize, channels: usize, width: usize) -> Self {
            Case { batch, seq, channels, width, bias: true, silu: true, cu_seqlens: None, pad: 0 }
        }

        /// Each sequence's tokens [start, end) in each row.
        fn sequences(&self) -> Vec<(usize, usize)> {
            match &self.cu_seqlens {
                None => vec![(0, self.seq)],
                Some(cu) => cu.windows(2).map(|w| (w[0] as usize, w[1] as usize)).collect(),
            }
        }
    }

    /// (y, dx, dw, db) in f64 from the definition, each sequence on its own and zero-padded in front:
    /// y[t] = act(b + sum_i w[i] x[t - (W-1) + i]), and the gradients scattered from each output to the
    /// inputs it read. Inputs contiguous.
    fn reference(case: &Case, x: &[f64], w: &[f64], bias: &[f64], dy: &[f64]) -> [Vec<f64>; 4] {
        let (seq, ch, width) = (case.seq, case.channels, case.width);
        let sig = |v: f64| (-(-v).exp().ln_1p()).exp();
        let (mut y, mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; x.len()], vec![0.0; w.len()], vec![0.0; ch]);
        for b in 0..case.batch {
            for (start, end) in case.sequences() {
                let at = |t: usize, c: usize| (b * seq + t) * ch + c;
                let input = |t: isize, c: usize| if t >= start as isize { x[at(t as usize, c)] } else { 0.0 };
                for t in start..end {
                    for c in 0..ch {
                        let reads = |i: usize| t as isize - (width - 1 - i) as isize;
                        let pre = bias[c] + (0..width).map(|i| w[c * width + i] * input(reads(i), c)).sum::<f64>();
                        let (out, slope) = if case.silu {
                            (pre * sig(pre), sig(pre) + pre * sig(pre) * sig(-pre))
                        } else {
                            (pre, 1.0)
                        };
                        y[at(t, c)] = out;
                        let d = dy[at(t, c)] * slope;
                        db[c] += d;
                        for i in 0..width {
                            dw[c * width + i] += d * input(reads(i), c);
                            if reads(i) >= start as isize {
                                dx[at(reads(i) as usize, c)] += w[c * width + i] * d;
                            }
                        }
                    }
                }
            }
        }
        [y, dx, dw, db]
    }

    /// The CPU kernels' (y, dx, dw, db) for x, dy of X and w, bias of W; x and dy padded as the case says.
    fn run<X: Element, W: Element>(case: &Case, x: &[f64], w: &[f64], bias: &[f64], dy: &[f64], int64: bool) -> [Vec<f64>; 4] {
        let (ch, row) = (case.channels, case.channels + case.pad);
        let pad = |v: &[f64]| -> Vec<X> {
            let mut out = vec![X::from_f64(f64::NAN); case.batch * case.seq * row];
            for (token, values) in v.chunks(ch.max(1)).enumerate().take(case.batch * case.seq) {
                for (o, &v) in out[token * row..].iter_mut().zip(values) {
                    *o = X::from_f64(v);
                }
            }
            out
        };
        let (xs, dys, ws, bs) = (pad(x), pad(dy), cast::<W>(w), cast::<W>(bias));
        let cu32: Vec<i32> = case.cu_seqlens.iter().flatten().map(|&o| o as i32).collect();
        let cu64: Vec<i64> = case.cu_seqlens.iter().flatten().copied().collect();
        let cu_seqlens: *const c_void = match (&case.cu_seqlens, int64) {
            (None, _) => std::ptr::null(),
            (Some(_), true) => cu64.as_ptr().cast(),
            (Some(_), false) => cu32.as_ptr().cast(),
        };
        let inputs = CausalConv1dInputs {
            x: xs.as_ptr().cast(),
            weight: ws.as_ptr().cast(),
            bias: if case.bias { bs.as_ptr().cast() } else { std::ptr::null() },
            cu_seqlens,
            batch: case.batch as i64,
            seq: case.seq as i64,
            channels: ch as i64,
            x_batch_stride: (case.seq * row) as i64,
            x_seq_stride: row as i64,
            sequences: case.cu_seqlens.as_ref().map_or(0, |cu| cu.len() as i64 - 1),
            width: case.width as i32,
            silu: case.silu.into(),
            x_dtype: X::DTYPE as i32,
            w_dtype: W::DTYPE as i32,
            cu_int64: int64.into(),
            tile: 0,
        };
        let n = case.batch * case.seq * ch;
        let (mut y, mut dx) = (vec![X::from_f64(f64::NAN); n], vec![X::from_f64(f64::NAN); n]);
        let (mut dw, mut db) = (vec![W::from_f64(f64::NAN); w.len()], vec![W::from_f64(f64::NAN); ch]);
        CausalConv1dForward { inputs, y: y.as_mut_ptr().cast() }.cpu().unwrap();
        let b = CausalConv1dBackward {
            inputs,
            grad_y: dys.as_ptr().cast(),
            grad_y_batch_stride: inputs.x_batch_stride,
            grad_y_seq_stride: inputs.x_seq_stride,
            grad_x: dx.as_mut_ptr().cast(),
            grad_weight: dw.as_mut_ptr().cast(),
            grad_bias: db.as_mut_ptr().cast(),
            ..Default::default()
        };
        b.cpu().unwrap();
        [widen(&y), widen(&dx), widen(&dw), widen(&db)]
    }

    fn rounded<T: Element>(v: Vec<f64>) -> Vec<f64> {
        widen(&cast::<T>(&v))
    }

    /// x, w, bias, dy of a case, rounded to X and W, so that the reference sees what the kernels see.
    fn inputs<X: Element, W: Element>(case: &Case, seed: u64) -> [Vec<f64>; 4] {
        let n = case.batch * case.seq * case.channels;
        let bias = if case.bias { noise(case.channels, seed + 2, 0.5) } else { vec![0.0; case.channels] };
        [rounded::<X>(noise(n, seed, 3.0)), rounded::<W>(noise(case.channels * case.width, seed + 1, 0.8)),
         rounded::<W>(bias), rounded::<X>(noise(n, seed + 3, 1.0))]
    }

    /// Every result of the kernels against the reference: rounded once from f64 (16-bit through f32), so
    /// within half an ulp of its dtype of the exact value (f64: a few ulps, `unit`), half fp16's smallest
    /// subnormal near 0, plus what f64 sums in another order differ by (2^-50 of the terms' magnitude).
    fn check<X: Element, W: Element>(case: &Case) {
        for int64 in [false, true] {
            let [x, w, bias, dy] = inputs::<X, W>(case, case.seq as u64 * 7 + case.width as u64);
            let got = run::<X, W>(case, &x, &w, &bias, &dy, int64);
            let want = reference(case, &x, &w, &bias, &dy);
            let scale = 8.0 * (case.batch * case.seq) as f64;
            for (what, got, want, dt) in [("y", &got[0], &want[0], X::DTYPE), ("grad_x", &got[1], &want[1], X::DTYPE),
                                          ("grad_weight", &got[2], &want[2], W::DTYPE), ("grad_bias", &got[3], &want[3], W::DTYPE)] {
                assert_eq!(got.len(), want.len());
                for (i, (g, e)) in got.iter().zip(want.iter()).enumerate() {
                    let tiny = if dt == BASTILE_F16 { 2f64.powi(-25) } else { 0.0 };
                    let tol = 1.01 * unit(dt) * e.abs() + tiny + 2f64.powi(-50) * scale;
                    assert!((g - e).abs() <= tol, "{:?}/{:?} {what}[{i}] = {g}, exact {e} (W={}, silu {}, bias {}, cu {:?})",
                            X::DTYPE, W::DTYPE, case.width, case.silu, case.bias, case.cu_seqlens);
                }
            }
        }
    }

    fn check_dtypes(case: &Case) {
        check::<f64, f64>(case);
        check::<f32, f32>(case);
        check::<bf16, f32>(case);
        check::<f16, f16>(case);
        check::<bf16, bf16>(case);
        check::<f32, bf16>(case);
    }

    #[test]
    fn cpu_kernels_match_f64_reference() {
        // Odd channels, sequences shorter than the conv, every width, with and without bias and SiLU.
        for (batch, seq, channels) in [(2, 9, 37), (1, 3, 6), (3, 1, 5), (2, 17, 8), (1, 2, 1)] {
            for width in 1..=4 {
                for (bias, silu) in [(true, true), (false, true), (true, false)] {
                    check_dtypes(&Case { bias, silu, ..Case::new(batch, seq, channels, width) });
                }
            }
        }
    }

    #[test]
    fn strided_rows() {
        for width in [2, 4] {
            check_dtypes(&Case { pad: 3, ..Case::new(3, 11, 7, width) });
        }
    }

    #[test]
    fn packed_sequences_restart() {
        // Empty sequences first, between and last; sequences of 1 and 2 tokens, shorter than the conv.
        let cu = vec![0, 0, 1, 3, 3, 7, 12, 12];
        for width in 1..=4 {
            check_dtypes(&Case { cu_seqlens: Some(cu.clone()), ..Case::new(1, 12, 37, width) });
        }
        // One sequence through cu_seqlens is the unpacked row.
        let case = Case::new(1, 10, 9, 4);
        let [x, w, bias, dy] = inputs::<f32, f32>(&case, 5);
        let packed = Case { cu_seqlens: Some(vec![0, 10]), ..case.clone() };
        assert_eq!(run::<f32, f32>(&case, &x, &w, &bias, &dy, false), run::<f32, f32>(&packed, &x, &w, &bias, &dy, false));
    }

    #[test]
    fn packed_row_equals_its_sequences_run_alone() {
        let cu = [0usize, 4, 5, 11, 11, 16];
        let packed = Case { cu_seqlens: Some(cu.iter().map(|&o| o as i64).collect()), ..Case::new(1, 16, 13, 4) };
        let [x, w, bias, dy] = inputs::<bf16, f32>(&packed, 9);
        let whole = run::<bf16, f32>(&packed, &x, &w, &bias, &dy, false);
        let (mut dw, mut db) = (vec![0.0; w.len()], vec![0.0; 13]);
        for s in cu.windows(2).filter(|s| s[1] > s[0]) {
            let alone = Case::new(1, s[1] - s[0], 13, 4);
            let part = |v: &[f64]| v[s[0] * 13..s[1] * 13].to_vec();
            let [y, dx, w_part, b_part] = run::<bf16, f32>(&alone, &part(&x), &w, &bias, &part(&dy), false);
            assert_eq!(y, part(&whole[0]));
            assert_eq!(dx, part(&whole[1]));
            dw.iter_mut().zip(&w_part).for_each(|(a, b)| *a += b);
            db.iter_mut().zip(&b_part).for_each(|(a, b)| *a += b);
        }
        // The gradients of the weight and bias sum the sequences' (each rounded to f32 here, once there).
        for (got, want) in whole[2].iter().chain(&whole[3]).zip(dw.iter().chain(&db)) {
            assert!((got - want).abs() <= 1e-6 * want.abs().max(1.0), "{got} against {want}");
        }
    }

    #[test]
    fn weight_gradient_sums_many_chunks() {
        // Tokens across many of the backward's chunks.
        check::<f32, f32>(&Case::new(2, 3000, 3, 4));
    }

    #[test]
    fn bad_dtype_code_is_an_error() {
        let p = CausalConv1dForward { inputs: CausalConv1dInputs { x_dtype: 9, ..Default::default() }, ..Default::default() };
        assert!(p.cpu().unwrap_err().contains("unknown dtype"));
    }

    #[test]
    fn every_dtype_pair_and_access_has_a_kernel() {
        for x in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
            for w in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
                for access in [Tag::Vec, Tag::Scalar] {
                    CausalConv1dForward::find(&[Tag::Fwd, x.tag(), w.tag(), access]).unwrap();
                    CausalConv1dBackward::find(&[Tag::Bwd, x.tag(), w.tag(), access]).unwrap();
                }
            }
            CausalConv1dBackward::find(&[Tag::Bwd, Tag::Reduce, x.tag()]).unwrap();
        }
        let err = CausalConv1dForward::find(&[Tag::Fwd, Tag::F64, Tag::F64, Tag::Vec]).unwrap_err();
        assert_eq!(err, "bastile.causal_conv1d: float64 is supported on CPU only");
    }

    #[test]
    fn vectors_need_channels_strides_and_pointers_to_allow_them() {
        let p = CausalConv1dInputs { channels: 64, x_dtype: BASTILE_BF16 as i32, ..Default::default() };
        let (aligned, odd) = (4096 as *const c_void, 4098 as *const c_void);
        assert_eq!(vector(&p, 8, &[64 * 9, 64], &[aligned, aligned]).unwrap(), 8);
        assert_eq!(vector(&p, 8, &[64 * 9, 68], &[aligned]).unwrap(), 1);
        assert_eq!(vector(&p, 8, &[64 * 9, 64], &[aligned, odd]).unwrap(), 1);
        assert_eq!(vector(&CausalConv1dInputs { channels: 37, ..p }, 8, &[37, 37], &[aligned]).unwrap(), 1);
        // The backward's 4-channel vectors of bf16 need 8-byte alignment only.
        assert_eq!(vector(&p, 4, &[64 * 9, 64], &[4104 as *const c_void]).unwrap(), 4);
    }
}
