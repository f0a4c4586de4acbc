//! Gated activations (HF `Qwen3MLP`'s and `Gemma3MLP`'s `act_fn(gate_proj(x)) * up_proj(x)` with SiLU or
//! GELU-tanh; the formulas and their roundings are in `cuda/swiglu.cu`): the launches of its kernels and
//! the CPU kernels, the reference the GPU is tested against.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, Result};
use crate::elementwise::{row_dots, vector_width, Elementwise};
use crate::kernels::{Launch, Plan, Tag};
use crate::params::{BastileDType, SwigluBackward, SwigluForward, SWIGLU_BLOCK, SWIGLU_GELU_TANH, SWIGLU_SILU, SWIGLU_UNROLL};
use std::ffi::c_void;

const SHAPE: Elementwise = Elementwise { block: SWIGLU_BLOCK, unroll: SWIGLU_UNROLL };

impl Launch for SwigluForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        rows_valid(self.n, self.cols, &[self.ld], self.activation)?;
        let dt = BastileDType::from_raw(self.dtype)?;
        let vec = width(dt, &[self.gate, self.up, self.y], self.cols, &[self.ld]);
        SHAPE.plan(dev, *self, Tag::Fwd, dt, vec, self.n)
    }

    fn cpu(&self) -> Result<()> {
        rows_valid(self.n, self.cols, &[self.ld], self.activation)?;
        let dt = BastileDType::from_raw(self.dtype)?;
        // SAFETY: the C++ layer checked that every pointer holds the block's elements of `dt`.
        crate::with_dtypes!(dt, dt, |T, _W, _Y| unsafe { forward_cpu::<T>(self) });
        Ok(())
    }
}

impl Launch for SwigluBackward {
    /// With a dot, the kernel's row path.
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        rows_valid(self.n, self.cols, &[self.ld, self.grad_ld], self.activation)?;
        let dt = BastileDType::from_raw(self.dtype)?;
        let ptrs = [self.grad_y, self.gate, self.up, self.grad_gate as _, self.grad_up as _];
        let vec = width(dt, &ptrs, self.cols, &[self.ld, self.grad_ld]);
        if self.dot.is_null() {
            return SHAPE.plan(dev, *self, Tag::Bwd, dt, vec, self.n);
        }
        SHAPE.plan_rows(dev, *self, Tag::Bwd, dt, vec, self.n, self.cols)
    }

    fn cpu(&self) -> Result<()> {
        rows_valid(self.n, self.cols, &[self.ld, self.grad_ld], self.activation)?;
        let dt = BastileDType::from_raw(self.dtype)?;
        // SAFETY: the C++ layer checked that every pointer holds the block's elements of `dt`.
        crate::with_dtypes!(dt, dt, |T, _W, _Y| unsafe { backward_cpu::<T>(self) });
        Ok(())
    }
}

/// The n elements are rows of `cols`, each of the strided tensors' rows `ld` apart (at least cols), and the
/// activation is known.
fn rows_valid(n: i64, cols: i64, lds: &[i64], activation: i32) -> Result<()> {
    Activation::of(activation)?;
    if let Some(ld) = lds.iter().find(|&&ld| n > 0 && (cols <= 0 || n % cols != 0 || ld < cols)) {
        return Err(format!("bastile.swiglu: {n} elements are not rows of {cols} at stride {ld}"));
    }
    Ok(())
}

/// Elements an access: a 16-byte vector where every pointer allows it and no vector spans two rows (the rows and
/// their strides whole vectors, or every tensor contiguous).
fn width(dt: BastileDType, ptrs: &[*const c_void], cols: i64, lds: &[i64]) -> i64 {
    let vec = vector_width(dt, ptrs);
    if lds.iter().all(|&ld| ld == cols) || (cols % vec == 0 && lds.iter().all(|&ld| ld % vec == 0)) { vec } else { 1 }
}

/// Where element `e` of the contiguous outputs lies in gate and up, and how many elements their rows span.
fn at_row(cols: i64, ld: i64, e: usize) -> usize {
    if ld == cols { e } else { e + e / cols as usize * (ld - cols) as usize }
}

fn span(n: i64, cols: i64, ld: i64) -> usize {
    if n == 0 { 0 } else { at_row(cols, ld, n as usize - 1) + 1 }
}

fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

const BETA: f64 = 0.7978845608028654; // sqrt(2 / pi)
const KAPPA: f64 = 0.044715;

#[derive(Clone, Copy)]
pub(crate) enum Activation {
    Silu,
    GeluTanh,
}

impl Activation {
    pub(crate) fn of(code: i32) -> Result<Self> {
        match code as u32 {
            SWIGLU_SILU => Ok(Self::Silu),
            SWIGLU_GELU_TANH => Ok(Self::GeluTanh),
            _ => Err(format!("bastile.swiglu: unknown activation code {code}")),
        }
    }

    /// The word for this activation in kernel names.
    pub(crate) fn tag(self) -> crate::kernels::Tag {
        match self {
            Self::Silu => crate::kernels::Tag::Silu,
            Self::GeluTanh => crate::kernels::Tag::GeluTanh,
        }
    }

    /// act(g). GELU-tanh in f32 unless T is f64 (`wide`): its 1 + tanh cancels for negative gates, where
    /// torch's f32 result (HF's, and the GPU's) is what training with it sees.
    pub(crate) fn value(self, g: f64, wide: bool) -> f64 {
        match (self, wide) {
            (Self::Silu, _) => g * sigmoid(g),
            (Self::GeluTanh, true) => 0.5 * g * (1.0 + (BETA * (g + KAPPA * g * g * g)).tanh()),
            (Self::GeluTanh, false) => {
                let g = g as f32;
                (0.5 * g * (1.0 + (BETA as f32 * (g + KAPPA as f32 * (g * g * g))).tanh())) as f64
            }
        }
    }

    /// d act / dg, in the precision `value` takes.
    fn derivative(self, g: f64, wide: bool) -> f64 {
        match (self, wide) {
            (Self::Silu, _) => {
                let sig = sigmoid(g);
                sig * (1.0 + g * (1.0 - sig))
            }
            (Self::GeluTanh, true) => {
                let t = (BETA * (g + KAPPA * g * g * g)).tanh();
                0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * BETA * (1.0 + 3.0 * KAPPA * g * g)
            }
            (Self::GeluTanh, false) => {
                let (g, beta, kappa) = (g as f32, BETA as f32, KAPPA as f32);
                let (g2, t) = (g * g, (beta * (g + kappa * (g * g * g))).tanh());
                (0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * (beta * (1.0 + 3.0 * kappa * g2))) as f64
            }
        }
    }
}

unsafe fn forward_cpu<T: Element>(p: &SwigluForward) {
    let (act, wide) = (Activation::of(p.activation).expect("rows_valid"), T::DTYPE == BastileDType::BASTILE_F64);
    let (n, cols, ld) = (p.n as usize, p.cols, p.ld);
    let rows = span(p.n, cols, ld);
    let (g, u) = (cpu::slice::<T>(p.gate, rows), cpu::slice::<T>(p.up, rows));
    let y = Disjoint::new(cpu::slice_mut::<T>(p.y, n));
    cpu::parallel_for(n, cpu::GRAIN, |r| {
        // SAFETY (here and below): the ranges of parallel_for do not overlap.
        for (y, e) in y.part(r.clone()).iter_mut().zip(r) {
            let i = at_row(cols, ld, e);
            *y = T::from_f64(T::round(act.value(g[i].to_f64(), wide)) * u[i].to_f64());
        }
    });
}

unsafe fn backward_cpu<T: Element>(p: &SwigluBackward) {
    let (act, wide) = (Activation::of(p.activation).expect("rows_valid"), T::DTYPE == BastileDType::BASTILE_F64);
    let (n, cols, ld, grad_ld) = (p.n as usize, p.cols, p.ld, p.grad_ld);
    let rows = span(p.n, cols, ld);
    let (dy, g, u) = (cpu::slice::<T>(p.grad_y, n), cpu::slice::<T>(p.gate, rows), cpu::slice::<T>(p.up, rows));
    // Row by row: grad_gate's and grad_up's rows may interleave in one tensor (the halves of one gradient).
    let grads = span(p.n, cols, grad_ld);
    let (dg, du) = (Disjoint::raw(p.grad_gate.cast::<T>(), grads), Disjoint::raw(p.grad_up.cast::<T>(), grads));
    let c = cols.max(1) as usize;
    cpu::parallel_for(n / c, (cpu::GRAIN / c).max(1), |range| {
        for r in range {
            let (o, i) = (at_row(cols, grad_ld, r * c), at_row(cols, ld, r * c));
            // SAFETY: the rows of grad_gate and grad_up do not overlap (swiglu.h), nor the ranges of parallel_for.
            for (k, (dg, du)) in dg.part(o..o + c).iter_mut().zip(du.part(o..o + c)).enumerate() {
                let (dy, g, u) = (dy[r * c + k].to_f64(), g[i + k].to_f64(), u[i + k].to_f64());
                *du = T::from_f64(dy * T::round(act.value(g, wide)));
                *dg = T::from_f64(T::round(dy * u) * act.derivative(g, wide));
            }
        }
    });
    if !p.dot.is_null() && n > 0 {
        row_dots::<T>(p.dot, n / c, c, |e| {
            let i = at_row(cols, ld, e);
            dy[e].to_f64() * T::round(T::round(act.value(g[i].to_f64(), wide)) * u[i].to_f64())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Launch;
    use crate::testing::{cast, noise};
    use half::{bf16, f16};
    use BastileDType::*;

    /// Exact values in f64 with no intermediate rounding, from other formulas than the kernels':
    /// sig(g) = exp(-ln(1 + e^-g)), silu(g) = g sig(g) with d/dg = sig(g) + silu(g) sig(-g), and
    /// gelu_tanh(g) = g sig(2z), z = b (g + k g^3), with d/dg = sig(2z) + g sig(2z) sig(-2z) 2 dz/dg.
    /// Also the sizes of the terms the kernels' GELU-tanh formula cancels (g/2 (1 + tanh z) for g << 0),
    /// which bound its error: none for SiLU.
    fn reference(activation: u32, dy: f64, g: f64, u: f64) -> ([f64; 3], [f64; 3]) {
        let sig = |x: f64| (-(-x).exp().ln_1p()).exp();
        if activation == SWIGLU_SILU {
            let (a, da) = (g * sig(g), sig(g) + g * sig(g) * sig(-g));
            return ([a * u, dy * u * da, dy * a], [0.0; 3]);
        }
        let dz = BETA * (1.0 + 3.0 * KAPPA * g * g);
        let z2 = 2.0 * BETA * (g + KAPPA * g.powi(3));
        let (a, da) = (g * sig(z2), sig(z2) + g * sig(z2) * sig(-z2) * 2.0 * dz);
        ([a * u, dy * u * da, dy * a], [(g * u).abs(), (dy * u).abs() * (1.0 + (g * dz).abs()), (dy * g).abs()])
    }

    /// Runs both CPU kernels on (g, u, dy) of T and returns (y, grad_gate, grad_up).
    fn run<T: Element>(activation: u32, g: &[T], u: &[T], dy: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let n = g.len() as i64;
        rows(activation, g, u, dy, n.max(1), n.max(1))
    }

    /// Both CPU kernels on gate and up given as rows of `cols` at stride `ld` (dy, and the results, contiguous).
    fn rows<T: Element>(activation: u32, g: &[T], u: &[T], dy: &[T], cols: i64, ld: i64) -> (Vec<T>, Vec<T>, Vec<T>) {
        let (n, dtype, activation) = (dy.len() as i64, T::DTYPE as i32, activation as i32);
        let nan = || vec![T::from_f64(f64::NAN); dy.len()];
        let (mut y, mut dg, mut du) = (nan(), nan(), nan());
        SwigluForward { gate: g.as_ptr().cast(), up: u.as_ptr().cast(), y: y.as_mut_ptr().cast(), n, cols, ld, dtype, activation }
            .cpu()
            .unwrap();
        let (gate, up, grad_y) = (g.as_ptr().cast(), u.as_ptr().cast(), dy.as_ptr().cast());
        let (grad_gate, grad_up) = (dg.as_mut_ptr().cast(), du.as_mut_ptr().cast());
        let grad_ld = cols;
        SwigluBackward { grad_y, gate, up, grad_gate, grad_up, dot: std::ptr::null_mut(), n, cols, ld, grad_ld, dtype, activation }
            .cpu()
            .unwrap();
        (y, dg, du)
    }

    /// The backward's gradients written as the halves of one [rows, 2 cols] tensor (grad_ld 2 cols).
    fn joined_grads<T: Element>(g: &[T], u: &[T], dy: &[T], cols: i64, ld: i64) -> Vec<T> {
        let mut grad = vec![T::from_f64(f64::NAN); 2 * dy.len()];
        let (grad_gate, grad_up) = (grad.as_mut_ptr(), grad[cols as usize..].as_mut_ptr());
        SwigluBackward { grad_y: dy.as_ptr().cast(), gate: g.as_ptr().cast(), up: u.as_ptr().cast(), grad_gate: grad_gate.cast(),
                         grad_up: grad_up.cast(), n: dy.len() as i64, cols, ld, grad_ld: 2 * cols, dtype: T::DTYPE as i32,
                         activation: SWIGLU_SILU as i32, ..Default::default() }
            .cpu()
            .unwrap();
        grad
    }

    /// The halves of a concatenated [rows, 2 cols] gate/up, read at stride 2 cols, give what their contiguous
    /// copies give, rows of whole 16-byte vectors or not (6 bf16); so does the gradient written as such halves.
    /// Rows that do not tile the elements, or overlap, are refused.
    #[test]
    fn rows_at_a_stride_read_as_their_copies() {
        for (rows_n, cols) in [(5usize, 24usize), (3, 6)] {
            let gate_up: Vec<bf16> = cast(&noise(rows_n * 2 * cols, 4, 4.0));
            let dy: Vec<bf16> = cast(&noise(rows_n * cols, 5, 2.0));
            let half = |k: usize| -> Vec<bf16> { gate_up.chunks(2 * cols).flat_map(|r| r[k * cols..(k + 1) * cols].to_vec()).collect() };
            let want = run(SWIGLU_SILU, &half(0), &half(1), &dy);
            let got = rows(SWIGLU_SILU, &gate_up, &gate_up[cols..], &dy, cols as i64, 2 * cols as i64);
            assert_eq!(bits(&got.0), bits(&want.0));
            assert_eq!(bits(&got.1), bits(&want.1));
            assert_eq!(bits(&got.2), bits(&want.2));
            let joined = joined_grads(&gate_up, &gate_up[cols..], &dy, cols as i64, 2 * cols as i64);
            let want_joined: Vec<bf16> =
                want.1.chunks(cols).zip(want.2.chunks(cols)).flat_map(|(g, u)| g.iter().chain(u).copied()).collect();
            assert_eq!(bits(&joined), bits(&want_joined));
        }
        let ragged = SwigluForward { n: 10, cols: 4, ld: 8, dtype: BASTILE_F32 as i32, ..Default::default() };
        assert!(ragged.cpu().unwrap_err().contains("not rows of 4"));
        let overlapping = SwigluBackward { n: 8, cols: 4, ld: 4, grad_ld: 2, dtype: BASTILE_F32 as i32, ..Default::default() };
        assert!(overlapping.cpu().unwrap_err().contains("not rows of 4 at stride 2"));
    }

    /// The backward's row dots are each row's sum of dy * y (y as the forward gives it) in f64, stored in f32 (f64
    /// for f64); its gradients are those it gives without them. gate and up as a concatenated gate/up's halves.
    fn row_dots_are_sums_of_dy_times_y<T: Element, D: Copy + PartialEq + std::fmt::Debug>(to: fn(f64) -> D) {
        let (rows_n, cols) = (5usize, 24usize);
        let gate_up: Vec<T> = cast(&noise(rows_n * 2 * cols, 4, 4.0));
        let dy: Vec<T> = cast(&noise(rows_n * cols, 5, 2.0));
        let (g, u) = (&gate_up[..], &gate_up[cols..]);
        let (y, dg, du) = rows(SWIGLU_SILU, g, u, &dy, cols as i64, 2 * cols as i64);
        let nan = || vec![T::from_f64(f64::NAN); dy.len()];
        let (mut dg2, mut du2, mut dot) = (nan(), nan(), vec![to(f64::NAN); rows_n]);
        SwigluBackward { grad_y: dy.as_ptr().cast(), gate: g.as_ptr().cast(), up: u.as_ptr().cast(),
                         grad_gate: dg2.as_mut_ptr().cast(), grad_up: du2.as_mut_ptr().cast(),
                         dot: dot.as_mut_ptr().cast(), n: dy.len() as i64, cols: cols as i64, ld: 2 * cols as i64,
                         grad_ld: cols as i64, dtype: T::DTYPE as i32, activation: SWIGLU_SILU as i32 }
            .cpu()
            .unwrap();
        let f64s = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
        assert_eq!((f64s(&dg2), f64s(&du2)), (f64s(&dg), f64s(&du)));
        let want: Vec<D> = (0..rows_n)
            .map(|r| to((r * cols..(r + 1) * cols).map(|e| dy[e].to_f64() * y[e].to_f64()).sum()))
            .collect();
        assert_eq!(dot, want);
    }

    #[test]
    fn row_dots() {
        row_dots_are_sums_of_dy_times_y::<bf16, f32>(|v| v as f32);
        row_dots_are_sums_of_dy_times_y::<f64, f64>(|v| v);
    }

    fn bits(v: &[bf16]) -> Vec<u16> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Runs both CPU kernels on `n` elements of T and checks every element against [`reference`] on
    /// the same (rounded) inputs. Each result is rounded at most twice: `unit` is T's unit roundoff,
    /// `tiny` the absolute error of results near T's underflow.
    fn check<T: Element>(activation: u32, dt: BastileDType, n: usize, unit: f64, tiny: f64) {
        let g: Vec<T> = cast(&noise(n, 1, 12.0));
        let u: Vec<T> = cast(&noise(n, 2, 3.0));
        let dy: Vec<T> = cast(&noise(n, 3, 3.0));
        let (y, dg, du) = run(activation, &g, &u, &dy);
        // The GELU's arithmetic on the cancelled terms (f64, or f32 for other types: a few roundings and tanh's
        // error), then at most two roundings to T, the first of a GELU near T's underflow (`tiny`) then
        // multiplied.
        let math = if dt == BASTILE_F64 { 4.0 * 2f64.powi(-53) } else { 16.0 * 2f64.powi(-24) };
        let tol = |r: f64, terms: f64| 2.5 * unit * r.abs() + (math + tiny) * terms + tiny;
        for i in 0..n {
            let (want, terms) = reference(activation, dy[i].to_f64(), g[i].to_f64(), u[i].to_f64());
            for (k, (what, got)) in [("y", y[i]), ("grad_gate", dg[i]), ("grad_up", du[i])].into_iter().enumerate() {
                let err = (got.to_f64() - want[k]).abs();
                assert!(err <= tol(want[k], terms[k]),
                        "{dt:?} activation {activation} n={n} element {i}: {what} = {} but exact {} (g={}, u={}, dy={})",
                        got.to_f64(), want[k], g[i].to_f64(), u[i].to_f64(), dy[i].to_f64());
            }
        }
    }

    #[test]
    fn cpu_kernels_match_f64_reference() {
        // Sizes around a thread's least share, so that every boundary case runs.
        for activation in [SWIGLU_SILU, SWIGLU_GELU_TANH] {
            for n in [0, 1, 7, 1000, cpu::GRAIN, 2 * cpu::GRAIN + 3] {
                // f64: exp and ln round at every step of the reference (|g| < 12), far below f32's 2^-24.
                check::<f64>(activation, BASTILE_F64, n, 2f64.powi(-44), 0.0);
                check::<f32>(activation, BASTILE_F32, n, 2f64.powi(-24), 1e-40);
                check::<f16>(activation, BASTILE_F16, n, 2f64.powi(-11), 2f64.powi(-24));
                check::<bf16>(activation, BASTILE_BF16, n, 2f64.powi(-8), 1e-40);
            }
        }
    }

    #[test]
    fn roundings_are_those_of_the_hf_expression() {
        // Inputs where every output of torch's bf16 autograd of F.silu(g) * u (the values asserted)
        // differs from the exact result rounded once (y -0.54296875, grad_gate 0.75390625,
        // grad_up -0.4296875).
        let (y, dg, du) = run(SWIGLU_SILU, &[bf16::from_f32(0.75)], &[bf16::from_f32(-1.0625)], &[bf16::from_f32(-0.84375)]);
        assert_eq!((y[0].to_f32(), dg[0].to_f32(), du[0].to_f32()), (-0.5390625, 0.7578125, -0.427734375));
    }

    #[test]
    fn bad_dtype_code_is_an_error() {
        let p = SwigluForward { dtype: 9, n: 1, cols: 1, ld: 1, ..Default::default() };
        assert!(p.cpu().unwrap_err().contains("unknown dtype"));
    }

    #[test]
    fn bad_activation_code_is_an_error() {
        let p = SwigluBackward { dtype: BASTILE_F32 as i32, activation: 7, n: 1, cols: 1, ld: 1, grad_ld: 1, ..Default::default() };
        assert_eq!(p.cpu().unwrap_err(), "bastile.swiglu: unknown activation code 7");
    }
}
