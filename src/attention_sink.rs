//! The sink's share of an attention row (the formulas are in `include/attention_sink.h`): the launches of
//! `cuda/attention_sink.cu` and the CPU kernels, the reference the GPU is tested against. Every result is
//! computed in f64 (f32 on the GPU) and rounded once; the normaliser is rounded to its dtype before y is
//! made from it, so that y and the normaliser the backward reads agree.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, Result};
use crate::elementwise::vector_width;
use crate::geometry;
use crate::kernels::{self, Kernels, Launch, Plan, Tag};
use crate::params::{AttentionSinkBackward, AttentionSinkForward, BastileDType, ATTENTION_SINK_BLOCK};
use half::{bf16, f16};
use std::ffi::c_void;

/// One launch over `rows` rows of `dim` elements of `dt`, 16-byte vectors where `dim` and every row pointer
/// allow them; `p.group` is set here.
fn plan<P: Kernels>(dev: &Device, mut p: P, group_of: fn(&mut P) -> &mut i32, dir: Tag, dt: BastileDType,
                    ptrs: &[*const c_void], rows: i64, dim: i64) -> Result<Plan> {
    if dt == BastileDType::BASTILE_F64 {
        return Err(format!("bastile.{}: float64 is supported on CPU only", P::OP));
    }
    let width = vector_width(dt, ptrs);
    let vec = if dim % width == 0 { width } else { 1 };
    let g = geometry::lane_group(dim / vec);
    *group_of(&mut p) = g;
    let access = if vec > 1 { Tag::Vec } else { Tag::Scalar };
    let kernel = kernels::kernel::<P>(dev, &[dir, dt.tag(), access], ATTENTION_SINK_BLOCK)?;
    Ok(Plan::single(kernel, geometry::lane_group_launch(rows, g, ATTENTION_SINK_BLOCK), p))
}

impl Launch for AttentionSinkForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let dt = BastileDType::from_raw(self.dtype)?;
        plan(dev, *self, |p| &mut p.group, Tag::Fwd, dt, &[self.out, self.y], self.tokens * self.heads, self.dim)
    }

    fn cpu(&self) -> Result<()> {
        on_dtype!(self, forward_cpu)
    }
}

impl Launch for AttentionSinkBackward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let dt = BastileDType::from_raw(self.dtype)?;
        let ptrs = [self.grad_y, self.y, self.grad_out as *const c_void];
        plan(dev, *self, |p| &mut p.group, Tag::Bwd, dt, &ptrs, self.tokens * self.heads, self.dim)
    }

    fn cpu(&self) -> Result<()> {
        on_dtype!(self, backward_cpu)
    }
}

/// Runs `$kernel::<T, S>(p)`: T the rows' element type, S the per-row tensors' (f64 with f64, else f32).
macro_rules! on_dtype {
    ($p:expr, $kernel:ident) => {{
        // SAFETY: the C++ layer checked every pointer of the block against its tensor's shape and dtype.
        unsafe {
            match BastileDType::from_raw($p.dtype)? {
                BastileDType::BASTILE_F64 => $kernel::<f64, f64>($p),
                BastileDType::BASTILE_F32 => $kernel::<f32, f32>($p),
                BastileDType::BASTILE_F16 => $kernel::<f16, f32>($p),
                BastileDType::BASTILE_BF16 => $kernel::<bf16, f32>($p),
            }
        }
        Ok(())
    }};
}
use on_dtype;

/// A per-row tensor [tokens, heads] at its strides (elements).
struct PerRow<S> {
    ptr: *mut S,
    strides: [i64; 2],
}

// SAFETY: each row's element is read or written by the one thread that takes the row.
unsafe impl<S> Sync for PerRow<S> {}

impl<S: Element> PerRow<S> {
    fn new(ptr: *const c_void, strides: [i64; 2]) -> Self {
        PerRow { ptr: ptr as *mut S, strides }
    }

    unsafe fn at(&self, t: usize, h: usize) -> *mut S {
        self.ptr.offset(t as isize * self.strides[0] as isize + h as isize * self.strides[1] as isize)
    }

    unsafe fn get(&self, t: usize, h: usize) -> f64 {
        (*self.at(t, h)).to_f64()
    }

    /// Stores v rounded to S, and returns the rounded value.
    unsafe fn set(&self, t: usize, h: usize, v: f64) -> f64 {
        *self.at(t, h) = S::from_f64(v);
        (*self.at(t, h)).to_f64()
    }
}

/// torch.logaddexp.
fn logaddexp(a: f64, b: f64) -> f64 {
    if a.is_infinite() && a == b {
        a
    } else {
        a.max(b) + (-(a - b).abs()).exp().ln_1p()
    }
}

/// Rows of `dim` elements a CPU task takes at least.
fn grain(dim: usize) -> usize {
    (cpu::GRAIN / dim.max(1)).max(1)
}

unsafe fn forward_cpu<T: Element, S: Element>(p: &AttentionSinkForward) {
    let (heads, dim) = (p.heads as usize, p.dim as usize);
    let rows = p.tokens as usize * heads;
    let out = cpu::slice::<T>(p.out, rows * dim);
    let y = Disjoint::new(cpu::slice_mut::<T>(p.y, rows * dim));
    let sinks = cpu::slice::<S>(p.sinks, heads);
    let (lse, normaliser) = (PerRow::<S>::new(p.lse, p.lse_strides), PerRow::<S>::new(p.normaliser, p.normaliser_strides));
    cpu::parallel_for(rows, grain(dim), |r| {
        // SAFETY (here and below): the ranges of parallel_for do not overlap, and each row is one element of the
        // per-row tensors.
        for row in r {
            let (t, h) = (row / heads, row % heads);
            let y = y.part(row * dim..(row + 1) * dim);
            let x = lse.get(t, h);
            let l = normaliser.set(t, h, logaddexp(x, sinks[h].to_f64()));
            let f = (x - l).exp();
            for (y, o) in y.iter_mut().zip(&out[row * dim..(row + 1) * dim]) {
                *y = T::from_f64(o.to_f64() * f);
            }
        }
    });
}

unsafe fn backward_cpu<T: Element, S: Element>(p: &AttentionSinkBackward) {
    let (heads, dim) = (p.heads as usize, p.dim as usize);
    let rows = p.tokens as usize * heads;
    let (dy, y) = (cpu::slice::<T>(p.grad_y, rows * dim), cpu::slice::<T>(p.y, rows * dim));
    let grad_out = (!p.lse.is_null()).then(|| (PerRow::<S>::new(p.lse, p.lse_strides), Disjoint::new(cpu::slice_mut::<T>(p.grad_out, rows * dim))));
    let sinks = cpu::slice::<S>(p.sinks, heads);
    let normaliser = PerRow::<S>::new(p.normaliser, p.normaliser_strides);
    let grad_lse = PerRow::<S>::new(p.grad_lse, p.grad_lse_strides);
    cpu::parallel_for(rows, grain(dim), |r| {
        for row in r {
            let (t, h) = (row / heads, row % heads);
            let cols = row * dim..(row + 1) * dim;
            let d: f64 = dy[cols.clone()].iter().zip(&y[cols.clone()]).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
            let l = normaliser.get(t, h);
            grad_lse.set(t, h, (sinks[h].to_f64() - l).exp() * d);
            if let Some((lse, g)) = &grad_out {
                let keep = (lse.get(t, h) - l).exp();
                for (g, dy) in g.part(cols.clone()).iter_mut().zip(&dy[cols]) {
                    *g = T::from_f64(dy.to_f64() * keep);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::BastileDType::*;
    use crate::testing::{cast, noise};

    /// One row of a sink attention from its definition: the softmax over the row's scores and the sink logit
    /// with the sink's column dropped (y), and without the sink (o), over values v. Returns lse (the scores'
    /// log-sum-exp), o, y, and given dy: grad_lse, the size of its terms, and grad_o.
    struct Row {
        lse: f64,
        o: Vec<f64>,
        y: Vec<f64>,
        grad_lse: f64,
        grad_lse_terms: f64,
        grad_o: Vec<f64>,
    }

    fn row(scores: &[f64], v: &[Vec<f64>], sink: f64, dy: &[f64]) -> Row {
        let m = scores.iter().cloned().fold(sink, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let (free, with_sink) = (e.iter().sum::<f64>(), e.iter().sum::<f64>() + (sink - m).exp());
        let mix: Vec<f64> = (0..dy.len()).map(|j| (0..e.len()).map(|i| e[i] * v[i][j]).sum()).collect();
        let y: Vec<f64> = mix.iter().map(|x| x / with_sink).collect();
        // y = o * free / with_sink, and lse = m + ln(free): dy/do = free / with_sink, dy/dlse = y * p_sink.
        let p_sink = (sink - m).exp() / with_sink;
        let dot = |f: fn(f64) -> f64| dy.iter().zip(&y).map(|(d, y)| f(d * y)).sum::<f64>() * p_sink;
        Row {
            lse: m + free.ln(),
            o: mix.iter().map(|x| x / free).collect(),
            grad_lse: dot(|x| x),
            grad_lse_terms: dot(f64::abs),
            grad_o: dy.iter().map(|d| d * free / with_sink).collect(),
            y,
        }
    }

    fn check<T: Element>(dt: BastileDType, unit: f64) {
        let (tokens, heads, dim, keys) = (5usize, 3usize, 7usize, 4usize);
        let sinks = noise(heads, 1, 3.0);
        let (mut o, mut lse, mut dys, mut rows) = (vec![], vec![], vec![], vec![]);
        for r in 0..tokens * heads {
            let v: Vec<Vec<f64>> = (0..keys).map(|i| noise(dim, 100 + (r * keys + i) as u64, 1.0)).collect();
            let dy = noise(dim, 1000 + r as u64, 1.0);
            let x = row(&noise(keys, 10 + r as u64, 4.0), &v, sinks[r % heads], &dy);
            o.extend_from_slice(&x.o);
            dys.extend(dy);
            rows.push(x);
        }
        // lse as [heads, tokens] (the flash kernel's layout); the normaliser and its gradient [tokens, heads].
        for i in 0..heads * tokens {
            lse.push(rows[(i % tokens) * heads + i / tokens].lse);
        }
        let (o, dy): (Vec<T>, Vec<T>) = (cast(&o), cast(&dys));
        let (t, h, d) = (tokens as i64, heads as i64, dim as i64);
        macro_rules! run {
            ($s:ty) => {{
                let (sinks, lse): (Vec<$s>, Vec<$s>) = (cast(&sinks), cast(&lse));
                let (mut y, mut grad_out) = (vec![T::from_f64(f64::NAN); o.len()], vec![T::from_f64(f64::NAN); o.len()]);
                let (mut norm, mut grad_lse) = (vec![<$s>::from_f64(f64::NAN); lse.len()], vec![<$s>::from_f64(f64::NAN); lse.len()]);
                AttentionSinkForward { out: o.as_ptr().cast(), lse: lse.as_ptr().cast(), sinks: sinks.as_ptr().cast(),
                    y: y.as_mut_ptr().cast(), normaliser: norm.as_mut_ptr().cast(), tokens: t, heads: h, dim: d,
                    lse_strides: [1, t], normaliser_strides: [h, 1], dtype: dt as i32, group: 0 }.cpu().unwrap();
                AttentionSinkBackward { grad_y: dy.as_ptr().cast(), y: y.as_ptr().cast(), normaliser: norm.as_ptr().cast(),
                    sinks: sinks.as_ptr().cast(), lse: lse.as_ptr().cast(), grad_out: grad_out.as_mut_ptr().cast(),
                    grad_lse: grad_lse.as_mut_ptr().cast(), tokens: t, heads: h, dim: d, normaliser_strides: [h, 1],
                    lse_strides: [1, t], grad_lse_strides: [h, 1], dtype: dt as i32,
                    group: 0 }.cpu().unwrap();
                (y, grad_lse.iter().map(|v| v.to_f64()).collect::<Vec<f64>>(), grad_out)
            }};
        }
        let (y, grad_lse, grad_out) = if dt == BASTILE_F64 { run!(f64) } else { run!(f32) };
        // Inputs rounded to T, lse and the normaliser to f32 (their difference off by a few f32 units of |lse|
        // <= 6), the result rounded once.
        let stats = if dt == BASTILE_F64 { unit } else { 2f64.powi(-24) };
        let near = |what: &str, got: f64, want: f64, tol: f64| assert!((got - want).abs() <= tol, "{dt:?} {what}: {got}, exact {want}");
        for (i, r) in rows.iter().enumerate() {
            for j in 0..dim {
                let k = i * dim + j;
                near("y", y[k].to_f64(), r.y[j], 3.0 * unit * r.y[j].abs() + 32.0 * stats * r.y[j].abs());
                near("grad_out", grad_out[k].to_f64(), r.grad_o[j], 3.0 * unit * r.grad_o[j].abs() + 32.0 * stats);
            }
            near("grad_lse", grad_lse[i], r.grad_lse, 4.0 * unit * r.grad_lse_terms + 32.0 * stats * r.grad_lse_terms);
        }
    }

    #[test]
    fn cpu_kernels_match_the_softmax_with_a_sink() {
        check::<f64>(BASTILE_F64, 2f64.powi(-50));
        check::<f32>(BASTILE_F32, 2f64.powi(-24));
        check::<f16>(BASTILE_F16, 2f64.powi(-11));
        check::<bf16>(BASTILE_BF16, 2f64.powi(-8));
    }

    #[test]
    fn rows_that_see_nothing() {
        // lse = -inf (no key visible): the sink takes the whole row, y = 0 and the normaliser is the sink; a sink
        // of -inf over such a row gives torch's NaN.
        let (o, lse, sinks) = ([1.5f32, -2.0], [f32::NEG_INFINITY, f32::NEG_INFINITY], [0.5f32, f32::NEG_INFINITY]);
        let (mut y, mut norm) = ([f32::NAN; 2], [0f32; 2]);
        AttentionSinkForward { out: o.as_ptr().cast(), lse: lse.as_ptr().cast(), sinks: sinks.as_ptr().cast(),
            y: y.as_mut_ptr().cast(), normaliser: norm.as_mut_ptr().cast(), tokens: 1, heads: 2, dim: 1,
            lse_strides: [2, 1], normaliser_strides: [2, 1], dtype: BASTILE_F32 as i32, group: 0 }.cpu().unwrap();
        assert_eq!((y[0], norm[0]), (0.0, 0.5));
        assert!(y[1].is_nan() && norm[1] == f32::NEG_INFINITY);
    }

    #[test]
    fn bad_dtype_code_is_an_error() {
        let p = AttentionSinkForward { dtype: 9, tokens: 1, heads: 1, dim: 1, ..Default::default() };
        assert!(p.cpu().unwrap_err().contains("unknown dtype"));
    }
}
