//! SwiGLU (HF `Qwen3MLP`'s `act_fn(gate_proj(x)) * up_proj(x)`; the formulas and their roundings are in
//! `cuda/swiglu.cu`): the launches of its kernels and the CPU kernels, the reference the GPU is tested
//! against.
use crate::cpu::{self, Disjoint, Element};
use crate::elementwise::Elementwise;
use crate::params::{SwigluBackward, SwigluForward, SWIGLU_BLOCK, SWIGLU_UNROLL};

crate::elementwise_launch! { Elementwise { block: SWIGLU_BLOCK, unroll: SWIGLU_UNROLL },
    SwigluForward: Fwd(gate, up, y) => forward_cpu;
    SwigluBackward: Bwd(grad_y, gate, up, grad_gate, grad_up) => backward_cpu;
}

fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

unsafe fn forward_cpu<T: Element>(p: &SwigluForward) {
    let n = p.n as usize;
    let (g, u) = (cpu::slice::<T>(p.gate, n), cpu::slice::<T>(p.up, n));
    let y = Disjoint::new(cpu::slice_mut::<T>(p.y, n));
    cpu::parallel_for(n, cpu::GRAIN, |r| {
        // SAFETY (here and below): the ranges of parallel_for do not overlap.
        for ((y, g), u) in y.part(r.clone()).iter_mut().zip(&g[r.clone()]).zip(&u[r]) {
            let g = g.to_f64();
            *y = T::from_f64(T::round(g * sigmoid(g)) * u.to_f64());
        }
    });
}

unsafe fn backward_cpu<T: Element>(p: &SwigluBackward) {
    let n = p.n as usize;
    let (dy, g, u) = (cpu::slice::<T>(p.grad_y, n), cpu::slice::<T>(p.gate, n), cpu::slice::<T>(p.up, n));
    let (dg, du) = (Disjoint::new(cpu::slice_mut::<T>(p.grad_gate, n)), Disjoint::new(cpu::slice_mut::<T>(p.grad_up, n)));
    cpu::parallel_for(n, cpu::GRAIN, |r| {
        let inputs = dy[r.clone()].iter().zip(&g[r.clone()]).zip(&u[r.clone()]);
        for ((dg, du), ((dy, g), u)) in dg.part(r.clone()).iter_mut().zip(du.part(r).iter_mut()).zip(inputs) {
            let (dy, g, u) = (dy.to_f64(), g.to_f64(), u.to_f64());
            let sig = sigmoid(g);
            *du = T::from_f64(dy * T::round(g * sig));
            *dg = T::from_f64(T::round(dy * u) * sig * (1.0 + g * (1.0 - sig)));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Launch;
    use crate::params::BastileDType;
    use crate::testing::{cast, noise};
    use half::{bf16, f16};
    use BastileDType::*;

    /// Exact values in f64 with no intermediate rounding, from another formula than the kernels':
    /// sig(g) = exp(-ln(1 + e^-g)) and d silu / dg = sig(g) + silu(g) * sig(-g).
    fn reference(dy: f64, g: f64, u: f64) -> (f64, f64, f64) {
        let sig = |x: f64| (-(-x).exp().ln_1p()).exp();
        let silu = g * sig(g);
        (silu * u, dy * u * (sig(g) + silu * sig(-g)), dy * silu)
    }

    /// Runs both CPU kernels on (g, u, dy) of T and returns (y, grad_gate, grad_up).
    fn run<T: Element>(g: &[T], u: &[T], dy: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let (n, dtype) = (g.len() as i64, T::DTYPE as i32);
        let nan = || vec![T::from_f64(f64::NAN); g.len()];
        let (mut y, mut dg, mut du) = (nan(), nan(), nan());
        SwigluForward { gate: g.as_ptr().cast(), up: u.as_ptr().cast(), y: y.as_mut_ptr().cast(), n, dtype }.cpu().unwrap();
        let (gate, up, grad_y) = (g.as_ptr().cast(), u.as_ptr().cast(), dy.as_ptr().cast());
        let (grad_gate, grad_up) = (dg.as_mut_ptr().cast(), du.as_mut_ptr().cast());
        SwigluBackward { grad_y, gate, up, grad_gate, grad_up, n, dtype }.cpu().unwrap();
        (y, dg, du)
    }

    /// Runs both CPU kernels on `n` elements of T and checks every element against [`reference`] on
    /// the same (rounded) inputs. Each result is rounded at most twice: `unit` is T's unit roundoff,
    /// `tiny` the absolute error of results near T's underflow.
    fn check<T: Element>(dt: BastileDType, n: usize, unit: f64, tiny: f64) {
        let g: Vec<T> = cast(&noise(n, 1, 12.0));
        let u: Vec<T> = cast(&noise(n, 2, 3.0));
        let dy: Vec<T> = cast(&noise(n, 3, 3.0));
        let (y, dg, du) = run(&g, &u, &dy);
        let tol = |r: f64| 2.5 * unit * r.abs() + tiny;
        for i in 0..n {
            let (ry, rdg, rdu) = reference(dy[i].to_f64(), g[i].to_f64(), u[i].to_f64());
            for (what, got, want) in [("y", y[i], ry), ("grad_gate", dg[i], rdg), ("grad_up", du[i], rdu)] {
                let err = (got.to_f64() - want).abs();
                assert!(err <= tol(want), "{dt:?} n={n} element {i}: {what} = {} but exact {want} (g={}, u={}, dy={})",
                        got.to_f64(), g[i].to_f64(), u[i].to_f64(), dy[i].to_f64());
            }
        }
    }

    #[test]
    fn cpu_kernels_match_f64_reference() {
        // Sizes around a thread's least share, so that every boundary case runs.
        for n in [0, 1, 7, 1000, cpu::GRAIN, 2 * cpu::GRAIN + 3] {
            // f64: exp and ln round at every step of the reference (|g| < 12), far below f32's 2^-24.
            check::<f64>(BASTILE_F64, n, 2f64.powi(-44), 0.0);
            check::<f32>(BASTILE_F32, n, 2f64.powi(-24), 1e-40);
            check::<f16>(BASTILE_F16, n, 2f64.powi(-11), 2f64.powi(-24));
            check::<bf16>(BASTILE_BF16, n, 2f64.powi(-8), 1e-40);
        }
    }

    #[test]
    fn roundings_are_those_of_the_hf_expression() {
        // Inputs where every output of torch's bf16 autograd of F.silu(g) * u (the values asserted)
        // differs from the exact result rounded once (y -0.54296875, grad_gate 0.75390625,
        // grad_up -0.4296875).
        let (y, dg, du) = run(&[bf16::from_f32(0.75)], &[bf16::from_f32(-1.0625)], &[bf16::from_f32(-0.84375)]);
        assert_eq!((y[0].to_f32(), dg[0].to_f32(), du[0].to_f32()), (-0.5390625, 0.7578125, -0.427734375));
    }

    #[test]
    fn bad_dtype_code_is_an_error() {
        let p = SwigluForward { dtype: 9, n: 1, ..Default::default() };
        assert!(p.cpu().unwrap_err().contains("unknown dtype"));
    }
}
