//! GEGLU of GPT-OSS (HF `GptOssExperts._apply_gate`; the formulas are in `cuda/geglu.cu`): the launches
//! of its kernels and the CPU kernels, the reference the GPU is tested against. Every result is computed
//! in f64 (f32 on the GPU) and rounded once to T, where HF rounds after each op; gate_up + bias is rounded
//! to T first, as HF's sum.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, Result};
use crate::elementwise::{row_dots, vector_width, Elementwise};
use crate::kernels::{Launch, Plan, Tag};
use crate::params::{BastileDType, GegluBackward, GegluBias, GegluForward, GEGLU_BLOCK, GEGLU_UNROLL};
use std::ffi::c_void;

const SHAPE: Elementwise = Elementwise { block: GEGLU_BLOCK, unroll: GEGLU_UNROLL };

/// The n pairs as rows of `inter` where a bias or the dot reads them (`rows`), and the bias's experts.
fn rows_valid(n: i64, inter: i64, bias: &GegluBias, rows: bool) -> Result<()> {
    if n > 0 && (rows || !bias.bias.is_null()) && (inter <= 0 || n % inter != 0) {
        return Err(format!("bastile.geglu: {n} pairs are not rows of {inter} pairs"));
    }
    if n > 0 && !bias.bias.is_null() && bias.experts <= 0 {
        return Err(format!("bastile.geglu: a bias of {} experts", bias.experts));
    }
    Ok(())
}

/// Pairs an access: a vector of y covers two of gate_up (and of the bias), which start 16-byte aligned when their
/// pointers are; with a bias, vectors only where each row is whole ones (a vector reads one row's bias).
fn width(dt: BastileDType, ptrs: &[*const c_void], bias: &GegluBias, inter: i64) -> i64 {
    let vec = vector_width(dt, &[ptrs, &[bias.bias]].concat());
    if bias.bias.is_null() || inter % vec == 0 { vec } else { 1 }
}

impl Launch for GegluForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        rows_valid(self.n, self.inter, &self.bias, false)?;
        let dt = BastileDType::from_raw(self.dtype)?;
        SHAPE.plan(dev, *self, Tag::Fwd, dt, width(dt, &[self.gate_up, self.y], &self.bias, self.inter), self.n)
    }

    fn cpu(&self) -> Result<()> {
        rows_valid(self.n, self.inter, &self.bias, false)?;
        let dt = BastileDType::from_raw(self.dtype)?;
        // SAFETY: the C++ layer checked that every pointer holds the block's elements of `dt`.
        crate::with_dtypes!(dt, dt, |T, _W, _Y| unsafe { forward_cpu::<T>(self) })
    }
}

impl Launch for GegluBackward {
    /// With a dot, the kernel's row path.
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let rows = !self.dot.is_null();
        rows_valid(self.n, self.inter, &self.bias, rows)?;
        let dt = BastileDType::from_raw(self.dtype)?;
        let ptrs = [self.grad_y, self.gate_up, self.grad_gate_up as *const c_void];
        let vec = width(dt, &ptrs, &self.bias, self.inter);
        if rows {
            return SHAPE.plan_rows(dev, *self, Tag::Bwd, dt, vec, self.n, self.inter);
        }
        SHAPE.plan(dev, *self, Tag::Bwd, dt, vec, self.n)
    }

    fn cpu(&self) -> Result<()> {
        rows_valid(self.n, self.inter, &self.bias, !self.dot.is_null())?;
        let dt = BastileDType::from_raw(self.dtype)?;
        // SAFETY: as in the forward.
        crate::with_dtypes!(dt, dt, |T, _W, _Y| unsafe { backward_cpu::<T>(self) })
    }
}

/// gate_up's n pairs as the activation takes them: plus their row's expert's bias, rounded to T, where there is
/// one.
struct Input<'a, T> {
    x: &'a [T],
    bias: Option<(&'a [T], &'a [i64], usize)>,
}

impl<T: Element> Input<'_, T> {
    /// SAFETY: `x` holds 2n elements of T and, with a bias, `b` holds valid pointers of its shapes.
    unsafe fn new<'a>(x: *const c_void, b: &GegluBias, n: usize, inter: i64) -> Result<Input<'a, T>> {
        let x = cpu::slice::<T>(x, 2 * n);
        if b.bias.is_null() || n == 0 {
            return Ok(Input { x, bias: None });
        }
        let (inter, experts) = (inter as usize, b.experts as usize);
        let expert = cpu::slice::<i64>(b.expert.cast(), n / inter);
        cpu::check_indices("geglu", "expert", expert, experts, false)?;
        Ok(Input { x, bias: Some((cpu::slice::<T>(b.bias, experts * 2 * inter), expert, inter)) })
    }

    /// Pair i's (gate, up).
    fn pair(&self, i: usize) -> (f64, f64) {
        let (g, u) = (self.x[2 * i].to_f64(), self.x[2 * i + 1].to_f64());
        match self.bias {
            None => (g, u),
            Some((bias, expert, inter)) => {
                let at = expert[i / inter] as usize * 2 * inter + 2 * (i % inter);
                (T::round(g + bias[at].to_f64()), T::round(u + bias[at + 1].to_f64()))
            }
        }
    }
}

/// alpha and the limit as T's clamp applies it, and whether the gradient passes at the limit itself
/// (`GegluBackward::at_limit`).
#[derive(Clone, Copy)]
struct Gate {
    alpha: f64,
    limit: f64,
    at_limit: bool,
}

impl Gate {
    fn new<T: Element>(alpha: f64, limit: f64, at_limit: bool) -> Self {
        Gate { alpha, limit: T::round(limit), at_limit }
    }

    // Comparisons in this order keep a NaN, as torch's clamp does (f64::min would drop it).
    fn gate(self, g: f64) -> f64 {
        if g > self.limit { self.limit } else { g }
    }

    fn up(self, u: f64) -> f64 {
        let u = if u < -self.limit { -self.limit } else { u };
        if u > self.limit { self.limit } else { u }
    }

    fn sigmoid(self, g: f64) -> f64 {
        1.0 / (1.0 + (-self.alpha * g).exp())
    }

    fn forward(self, g: f64, u: f64) -> f64 {
        let g = self.gate(g);
        (self.up(u) + 1.0) * (g * self.sigmoid(g))
    }

    /// (grad_gate, grad_up); a NaN input fails its mask test and gets 0, as torch's clamp backward.
    fn backward(self, dy: f64, g: f64, u: f64) -> (f64, f64) {
        let (gc, l) = (self.gate(g), self.limit);
        let s = self.sigmoid(gc);
        let (g_in, u_in) = if self.at_limit { (g <= l, u >= -l && u <= l) } else { (g < l, u > -l && u < l) };
        let dg = if g_in { dy * (self.up(u) + 1.0) * (s * (1.0 + self.alpha * gc * (1.0 - s))) } else { 0.0 };
        let du = if u_in { dy * (gc * s) } else { 0.0 };
        (dg, du)
    }
}

unsafe fn forward_cpu<T: Element>(p: &GegluForward) -> Result<()> {
    let n = p.n as usize;
    let (x, y) = (Input::<T>::new(p.gate_up, &p.bias, n, p.inter)?, Disjoint::new(cpu::slice_mut::<T>(p.y, n)));
    let f = Gate::new::<T>(p.alpha, p.limit, true);
    cpu::parallel_for(n, cpu::GRAIN, |r| {
        // SAFETY (here and below): the ranges of parallel_for do not overlap.
        for (y, i) in y.part(r.clone()).iter_mut().zip(r) {
            let (g, u) = x.pair(i);
            *y = T::from_f64(f.forward(g, u));
        }
    });
    Ok(())
}

unsafe fn backward_cpu<T: Element>(p: &GegluBackward) -> Result<()> {
    let n = p.n as usize;
    let (dy, x) = (cpu::slice::<T>(p.grad_y, n), Input::<T>::new(p.gate_up, &p.bias, n, p.inter)?);
    let dx = Disjoint::new(cpu::slice_mut::<T>(p.grad_gate_up, 2 * n));
    let f = Gate::new::<T>(p.alpha, p.limit, p.at_limit != 0);
    cpu::parallel_for(n, cpu::GRAIN, |r| {
        for ((d, i), dy) in dx.part(2 * r.start..2 * r.end).chunks_exact_mut(2).zip(r.clone()).zip(&dy[r]) {
            let (g, u) = x.pair(i);
            let (dg, du) = f.backward(dy.to_f64(), g, u);
            d[0] = T::from_f64(dg);
            d[1] = T::from_f64(du);
        }
    });
    if !p.dot.is_null() && n > 0 {
        let inter = p.inter as usize;
        row_dots::<T>(p.dot, n / inter, inter, |i| {
            let (g, u) = x.pair(i);
            dy[i].to_f64() * T::round(f.forward(g, u))
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Launch;
    use crate::params::BastileDType;
    use crate::testing::{cast, noise};
    use half::{bf16, f16};
    use BastileDType::*;

    const ALPHA: f64 = 1.702;
    const LIMIT: f64 = 7.0;

    /// Exact (y, grad_gate, grad_up) in f64 from another formula than the kernels': sig(x) =
    /// exp(-ln(1 + e^-x)), d/dg [g sig(a g)] = sig(a g) + a g sig(a g) sig(-a g), clamps by f64::clamp
    /// and the masks as ranges, closed where the gradient passes `at_limit`. `limit` must be representable
    /// in the dtype under test.
    fn reference(dy: f64, g: f64, u: f64, alpha: f64, limit: f64, at_limit: bool) -> (f64, f64, f64) {
        let sig = |x: f64| (-(-x).exp().ln_1p()).exp();
        let gc = g.min(limit);
        let glu = gc * sig(alpha * gc);
        let dglu = sig(alpha * gc) + alpha * gc * sig(alpha * gc) * sig(-alpha * gc);
        let uc = u.clamp(-limit, limit);
        let inside = |x: f64, lo: f64| if at_limit { (lo..=limit).contains(&x) } else { x > lo && x < limit };
        let dg = if inside(g, f64::NEG_INFINITY) { dy * (uc + 1.0) * dglu } else { 0.0 };
        let du = if inside(u, -limit) { dy * glu } else { 0.0 };
        ((uc + 1.0) * glu, dg, du)
    }

    /// Runs both CPU kernels on (gate, up, dy) of T and returns (y, grad_gate_up).
    fn run<T: Element>(dt: BastileDType, gu: &[T], dy: &[T], alpha: f64, limit: f64, at_limit: bool) -> (Vec<T>, Vec<T>) {
        let n = dy.len();
        let (mut y, mut dx) = (vec![T::from_f64(f64::NAN); n], vec![T::from_f64(f64::NAN); 2 * n]);
        let (n, dtype) = (n as i64, dt as i32);
        GegluForward { gate_up: gu.as_ptr().cast(), y: y.as_mut_ptr().cast(), n, alpha, limit, dtype, ..Default::default() }
            .cpu()
            .unwrap();
        let b = GegluBackward {
            grad_y: dy.as_ptr().cast(),
            gate_up: gu.as_ptr().cast(),
            grad_gate_up: dx.as_mut_ptr().cast(),
            n,
            alpha,
            limit,
            dtype,
            at_limit: at_limit.into(),
            ..Default::default()
        };
        b.cpu().unwrap();
        (y, dx)
    }

    /// Both CPU kernels with each row of `inter` pairs' expert's bias: (y, grad_gate_up), or the error.
    fn run_biased<T: Element>(dt: BastileDType, gu: &[T], dy: &[T], bias: &[T], expert: &[i64], inter: i64)
                              -> Result<(Vec<T>, Vec<T>)> {
        let n = dy.len();
        let (mut y, mut dx) = (vec![T::from_f64(f64::NAN); n], vec![T::from_f64(f64::NAN); 2 * n]);
        let b = GegluBias { bias: bias.as_ptr().cast(), expert: expert.as_ptr(), experts: bias.len() as i64 / (2 * inter) };
        let (n, dtype, alpha, limit) = (n as i64, dt as i32, ALPHA, LIMIT);
        GegluForward { gate_up: gu.as_ptr().cast(), y: y.as_mut_ptr().cast(), bias: b, n, inter, alpha, limit, dtype }.cpu()?;
        GegluBackward { grad_y: dy.as_ptr().cast(), gate_up: gu.as_ptr().cast(), grad_gate_up: dx.as_mut_ptr().cast(),
                        dot: std::ptr::null_mut(), bias: b, n, inter, alpha, limit, dtype, at_limit: 1 }
            .cpu()?;
        Ok((y, dx))
    }

    /// Checks every result against [`reference`] on the same (rounded) inputs: rounded once (through
    /// f32 for 16-bit types), so within `unit` (T's unit roundoff) relative, and `tiny` absolute.
    fn check<T: Element>(dt: BastileDType, gu: &[T], dy: &[T], unit: f64, tiny: f64) {
        for at_limit in [true, false] {
            check_rule(dt, gu, dy, unit, tiny, at_limit);
        }
    }

    fn check_rule<T: Element>(dt: BastileDType, gu: &[T], dy: &[T], unit: f64, tiny: f64, at_limit: bool) {
        let (y, dx) = run(dt, gu, dy, ALPHA, LIMIT, at_limit);
        let tol = |r: f64| 1.01 * unit * r.abs() + tiny;
        for i in 0..dy.len() {
            let (g, u, d) = (gu[2 * i].to_f64(), gu[2 * i + 1].to_f64(), dy[i].to_f64());
            let (ry, rdg, rdu) = reference(d, g, u, ALPHA, LIMIT, at_limit);
            for (what, got, want) in [("y", y[i], ry), ("grad_gate", dx[2 * i], rdg), ("grad_up", dx[2 * i + 1], rdu)] {
                let err = (got.to_f64() - want).abs();
                assert!(err <= tol(want), "{dt:?} pair {i}: {what} = {} but exact {want} (g={g}, u={u}, dy={d})",
                        got.to_f64());
            }
        }
    }

    /// gate across the clamp (|g| < 12, limit 7), up beyond +-7, dy O(1).
    fn random<T: Element>(n: usize) -> (Vec<T>, Vec<T>) {
        let (g, u) = (noise(n, 1, 12.0), noise(n, 2, 9.0));
        let gu: Vec<f64> = g.iter().zip(&u).flat_map(|(&g, &u)| [g, u]).collect();
        (cast(&gu), cast(&noise(n, 3, 3.0)))
    }

    fn check_all(gu: &[f64], dy: &[f64]) {
        // f64: the reference rounds in exp and ln and cancels in 1 + a g (1 - s) near g = -0.75.
        check::<f64>(BASTILE_F64, &cast(gu), &cast(dy), 2f64.powi(-44), 1e-13);
        check::<f32>(BASTILE_F32, &cast(gu), &cast(dy), 2f64.powi(-24), 1e-15);
        // Through f32 to 16 bits: at most 2^-24 more than one rounding.
        check::<f16>(BASTILE_F16, &cast(gu), &cast(dy), 2f64.powi(-11), 2f64.powi(-25));
        check::<bf16>(BASTILE_BF16, &cast(gu), &cast(dy), 2f64.powi(-8), 1e-40);
    }

    #[test]
    fn cpu_kernels_match_f64_reference() {
        // Sizes around a thread's least share, so that every boundary case runs.
        for n in [0, 1, 7, 1000, cpu::GRAIN, 2 * cpu::GRAIN + 3] {
            let (gu, dy) = random::<f64>(n);
            check_all(&gu, &dy);
        }
    }

    #[test]
    fn clamp_edges() {
        // Exactly at the limits (the gradient passes or not, by the rule), just beyond them in every dtype
        // (it stops), and far beyond: large gates saturate the sigmoid, large negative ones zero it.
        let above = 7.0 + 2f64.powi(-5);
        let below = 7.0 - 2f64.powi(-5);
        let gates = [7.0, -7.0, above, below, -above, -below, 20.0, -20.0, 100.0, -100.0, 0.0, -0.75];
        let ups = [7.0, -7.0, above, below, -above, -below, 20.0, -20.0, -1.0, 0.5];
        let pairs: Vec<(f64, f64)> = gates.iter().flat_map(|&g| ups.iter().map(move |&u| (g, u))).collect();
        let gu: Vec<f64> = pairs.iter().flat_map(|&(g, u)| [g, u]).collect();
        let dy: Vec<f64> = (0..pairs.len()).map(|i| [1.0, -0.5, 2.25][i % 3]).collect();
        check_all(&gu, &dy);
        for at_limit in [true, false] {
            let (y, dx) = run::<f32>(BASTILE_F32, &cast(&gu), &cast(&dy), ALPHA, LIMIT, at_limit);
            let out = |x: f64| if at_limit { x > 7.0 } else { x >= 7.0 };
            for (i, &(g, u)) in pairs.iter().enumerate() {
                if g < -50.0 {
                    continue; // sigmoid(alpha * g) underflows f32: every result is 0
                }
                assert_eq!(dx[2 * i] == 0.0, out(g) || u == -1.0, "grad_gate at gate {g}, up {u}: {}", dx[2 * i]);
                assert_eq!(dx[2 * i + 1] == 0.0, out(u.abs()) || g == 0.0, "grad_up at gate {g}, up {u}: {}",
                           dx[2 * i + 1]);
                if g >= 7.0 {
                    // Every gate from the limit up gives the y of gate 7 (gates[0]) with the same up.
                    assert_eq!(y[i], y[i % ups.len()], "y at gate {g}, up {u}");
                }
            }
        }
    }

    #[test]
    fn limit_is_rounded_to_the_dtype() {
        // bf16(7.1) = 7.09375: a gate of 7.09375 is at the limit (gradient passes) and 7.125 beyond it,
        // clamped to 7.09375, as torch's clamp of a bf16 tensor with max=7.1 does.
        let v = <bf16 as Element>::from_f64;
        let pairs = [(7.09375, 0.0), (7.125, 7.09375), (-7.125, -7.09375), (0.5, -7.125)];
        let gu: Vec<bf16> = pairs.iter().flat_map(|&(g, u)| [v(g), v(u)]).collect();
        let (y, dx) = run::<bf16>(BASTILE_BF16, &gu, &[v(1.0); 4], ALPHA, 7.1, true);
        let exact: Vec<bf16> = pairs.iter().map(|&(g, u)| v(reference(1.0, g, u, ALPHA, 7.09375, true).0)).collect();
        assert_eq!(y, exact);
        let passed: Vec<bool> = dx.iter().map(|d| d.to_f64() != 0.0).collect();
        assert_eq!(passed, [true, true, false, true, true, true, true, false]);
    }

    #[test]
    fn nan_propagates_forward_and_is_masked_backward() {
        let nan = f64::NAN;
        let (y, dx) = run::<f32>(BASTILE_F32, &[nan as f32, 1.0, 1.0, nan as f32], &[1.0, 1.0], ALPHA, LIMIT, false);
        assert!(y[0].is_nan() && y[1].is_nan());
        // torch: where(gate <= L, NaN, 0) = 0 for the NaN gate, and NaN through up's mask.
        assert_eq!(dx[0], 0.0);
        assert!(dx[1].is_nan());
        assert!(dx[2].is_nan());
        assert_eq!(dx[3], 0.0);
    }

    /// With a bias, the kernels give what they give without one on gate_up + bias[expert] rounded to T (the sums
    /// made here), whatever the row length (vectors of a row, or pairs across them on the GPU).
    fn biased_is_unbiased_on_the_sums<T: Element>(dt: BastileDType) {
        for (rows, inter, experts) in [(5usize, 3usize, 4usize), (7, 16, 3), (2, 1, 2)] {
            let (gu, dy) = random::<T>(rows * inter);
            let bias: Vec<T> = cast(&noise(experts * 2 * inter, 4, 4.0));
            let expert: Vec<i64> = (0..rows).map(|r| ((r * 5 + 1) % experts) as i64).collect();
            let sums: Vec<T> = (0..2 * rows * inter)
                .map(|e| {
                    let (r, c) = (e / (2 * inter), e % (2 * inter));
                    T::from_f64(gu[e].to_f64() + bias[expert[r] as usize * 2 * inter + c].to_f64())
                })
                .collect();
            let bits = |(y, dx): (Vec<T>, Vec<T>)| y.iter().chain(&dx).map(|v| v.to_f64().to_bits()).collect::<Vec<_>>();
            let want = bits(run(dt, &sums, &dy, ALPHA, LIMIT, true));
            let got = bits(run_biased(dt, &gu, &dy, &bias, &expert, inter as i64).unwrap());
            assert_eq!(got, want, "{dt:?}: {rows} rows of {inter} pairs");
        }
    }

    #[test]
    fn bias_of_each_rows_expert_is_added_first() {
        biased_is_unbiased_on_the_sums::<f64>(BASTILE_F64);
        biased_is_unbiased_on_the_sums::<f32>(BASTILE_F32);
        biased_is_unbiased_on_the_sums::<f16>(BASTILE_F16);
        biased_is_unbiased_on_the_sums::<bf16>(BASTILE_BF16);
    }

    /// The backward's row dots (with the rows' biases) are each row's sum of dy * y (y as the forward gives it) in
    /// f64, stored in f32 (f64 for f64); its gradients are those it gives without them. Rows must be whole.
    fn row_dots_are_sums_of_dy_times_y<T: Element, D: Copy + PartialEq + std::fmt::Debug>(dt: BastileDType, to: fn(f64) -> D) {
        let (rows, inter, experts) = (6usize, 5usize, 3usize);
        let (gu, dy) = random::<T>(rows * inter);
        let bias: Vec<T> = cast(&noise(experts * 2 * inter, 4, 4.0));
        let expert: Vec<i64> = (0..rows).map(|r| (r % experts) as i64).collect();
        let (y, dx) = run_biased(dt, &gu, &dy, &bias, &expert, inter as i64).unwrap();
        let (mut dx2, mut dot) = (vec![T::from_f64(f64::NAN); 2 * dy.len()], vec![to(f64::NAN); rows]);
        let b = GegluBias { bias: bias.as_ptr().cast(), expert: expert.as_ptr(), experts: experts as i64 };
        let mut p = GegluBackward { grad_y: dy.as_ptr().cast(), gate_up: gu.as_ptr().cast(),
                                    grad_gate_up: dx2.as_mut_ptr().cast(), dot: dot.as_mut_ptr().cast(), bias: b,
                                    n: dy.len() as i64, inter: inter as i64, alpha: ALPHA, limit: LIMIT,
                                    dtype: dt as i32, at_limit: 1 };
        p.cpu().unwrap();
        let f64s = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
        assert_eq!(f64s(&dx2), f64s(&dx));
        let want: Vec<D> = (0..rows)
            .map(|r| to((r * inter..(r + 1) * inter).map(|e| dy[e].to_f64() * y[e].to_f64()).sum()))
            .collect();
        assert_eq!(dot, want);
        p.bias = GegluBias::default();
        p.inter = 4;
        assert_eq!(p.cpu().unwrap_err(), "bastile.geglu: 30 pairs are not rows of 4 pairs");
    }

    #[test]
    fn row_dots() {
        row_dots_are_sums_of_dy_times_y::<bf16, f32>(BASTILE_BF16, |v| v as f32);
        row_dots_are_sums_of_dy_times_y::<f64, f64>(BASTILE_F64, |v| v);
    }

    #[test]
    fn bad_experts_and_rows_are_errors() {
        let (gu, dy) = random::<f32>(6);
        let bias = vec![0f32; 2 * 2 * 3];
        let err = run_biased(BASTILE_F32, &gu, &dy, &bias, &[0, 2], 3).unwrap_err();
        assert_eq!(err, "bastile.geglu: expert holds 2, outside 0..2");
        let err = run_biased(BASTILE_F32, &gu, &dy, &bias, &[0, -1], 3).unwrap_err();
        assert_eq!(err, "bastile.geglu: expert holds -1, outside 0..2");
        let err = run_biased(BASTILE_F32, &gu, &dy, &bias[..8], &[0, 0, 0], 4).unwrap_err();
        assert_eq!(err, "bastile.geglu: 6 pairs are not rows of 4 pairs");
    }

    #[test]
    fn bad_dtype_code_is_an_error() {
        let p = GegluForward { dtype: 9, n: 1, ..Default::default() };
        assert!(p.cpu().unwrap_err().contains("unknown dtype"));
    }
}
