//! A mixture of experts' router after its logits: the top-k experts of each token and their weights, and the
//! logits' gradient (the formulas are in `include/expert_route.h`): the launches of `cuda/expert_route.cu` and
//! the CPU kernels, the reference the GPU is tested against. The CPU picks by sorting each row in the same order
//! and computes in f64, each result rounded once.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, Result};
use crate::geometry;
use crate::kernels::{self, Kernels, Launch, Plan, Tag};
use crate::params::{BastileDType, ExpertRouteBackward, ExpertRouteForward, EXPERT_ROUTE_BLOCK};
use std::cmp::Ordering;

/// One launch over `tokens` rows, a warp each.
fn plan<P: Kernels>(dev: &Device, p: P, dir: Tag, dtype: i32, weights_dtype: i32, tokens: i64) -> Result<Plan> {
    let (dt, wt) = (BastileDType::from_raw(dtype)?, BastileDType::from_raw(weights_dtype)?);
    let kernel = kernels::kernel::<P>(dev, &[dir, dt.tag(), wt.tag()], EXPERT_ROUTE_BLOCK)?;
    Ok(Plan::single(kernel, geometry::lane_group_launch(tokens, 32, EXPERT_ROUTE_BLOCK), p))
}

impl Launch for ExpertRouteForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        plan(dev, *self, Tag::Fwd, self.dtype, self.weights_dtype, self.tokens)
    }

    fn cpu(&self) -> Result<()> {
        let (dt, wt) = (BastileDType::from_raw(self.dtype)?, BastileDType::from_raw(self.weights_dtype)?);
        // SAFETY: the C++ layer checked every pointer of the block against its tensor's shape and dtype.
        crate::with_dtypes!(dt, wt, |T, W, _Y| unsafe { forward_cpu::<T, W>(self) })
    }
}

impl Launch for ExpertRouteBackward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        plan(dev, *self, Tag::Bwd, self.dtype, self.weights_dtype, self.tokens)
    }

    fn cpu(&self) -> Result<()> {
        let (dt, wt) = (BastileDType::from_raw(self.dtype)?, BastileDType::from_raw(self.weights_dtype)?);
        // SAFETY: as in the forward.
        crate::with_dtypes!(dt, wt, |T, W, _Y| unsafe { backward_cpu::<T, W>(self) })
    }
}

/// The picking order of (logit, index): larger logits first, NaN above everything, then the lower index.
fn picked_before(a: (f64, usize), b: (f64, usize)) -> Ordering {
    match (a.0.is_nan(), b.0.is_nan()) {
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        _ => b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal).then(a.1.cmp(&b.1)),
    }
}

/// The row's exponentials e^(v - m) with m its largest logit (NaN where a logit is), each row's in turn.
fn exps(row: &[f64]) -> Vec<f64> {
    let top = row.iter().copied().zip(0..).min_by(|&a, &b| picked_before(a, b)).map_or(0.0, |(v, _)| v);
    row.iter().map(|v| (v - top).exp()).collect()
}

/// Rows a CPU task takes at least.
fn grain(experts: usize) -> usize {
    (cpu::GRAIN / experts.max(1)).max(1)
}

unsafe fn forward_cpu<T: Element, W: Element>(p: &ExpertRouteForward) -> Result<()> {
    let (tokens, experts, k, renorm) = (p.tokens as usize, p.experts as usize, p.k as usize, p.renorm != 0);
    let logits = cpu::slice::<T>(p.logits, tokens * experts);
    let weights = Disjoint::new(cpu::slice_mut::<W>(p.weights, tokens * k));
    let chosen = Disjoint::new(cpu::slice_mut::<i64>(p.chosen.cast(), tokens * k));
    cpu::parallel_for(tokens, grain(experts), |range| {
        for t in range {
            let row: Vec<f64> = logits[t * experts..(t + 1) * experts].iter().map(|v| v.to_f64()).collect();
            let mut order: Vec<(f64, usize)> = row.iter().copied().zip(0..).collect();
            order.sort_by(|&a, &b| picked_before(a, b));
            let e = exps(&row);
            let picked = &order[..k];
            let sum: f64 = if renorm { picked.iter().map(|&(_, j)| e[j]).sum() } else { e.iter().sum() };
            // SAFETY: the ranges of parallel_for do not overlap.
            let (w, c) = (weights.part(t * k..(t + 1) * k), chosen.part(t * k..(t + 1) * k));
            for (s, &(_, j)) in picked.iter().enumerate() {
                (w[s], c[s]) = (W::from_f64(e[j] / sum), j as i64);
            }
        }
    });
    Ok(())
}

unsafe fn backward_cpu<T: Element, W: Element>(p: &ExpertRouteBackward) -> Result<()> {
    let (tokens, experts, k, renorm) = (p.tokens as usize, p.experts as usize, p.k as usize, p.renorm != 0);
    let chosen = cpu::slice::<i64>(p.chosen.cast(), tokens * k);
    cpu::check_indices("expert_route", "chosen", chosen, experts, false)?;
    let logits = cpu::slice::<T>(p.logits, tokens * experts);
    let grad = cpu::slice::<W>(p.grad, tokens * k);
    let out = Disjoint::new(cpu::slice_mut::<T>(p.grad_logits, tokens * experts));
    cpu::parallel_for(tokens, grain(experts), |range| {
        for t in range {
            let row: Vec<f64> = logits[t * experts..(t + 1) * experts].iter().map(|v| v.to_f64()).collect();
            let (pick, g) = (&chosen[t * k..(t + 1) * k], &grad[t * k..(t + 1) * k]);
            let e = exps(&row);
            let sum: f64 = if renorm { pick.iter().map(|&j| e[j as usize]).sum() } else { e.iter().sum() };
            let dot: f64 = pick.iter().zip(g).map(|(&j, g)| g.to_f64() * e[j as usize] / sum).sum();
            let (mut chose, mut times) = (vec![0.0; experts], vec![0.0; experts]);
            for (&j, g) in pick.iter().zip(g) {
                chose[j as usize] += g.to_f64();
                times[j as usize] += 1.0;
            }
            // SAFETY: the ranges of parallel_for do not overlap.
            for (j, o) in out.part(t * experts..(t + 1) * experts).iter_mut().enumerate() {
                let pj = e[j] / sum;
                let v = if !renorm {
                    pj * (chose[j] - dot)
                } else if times[j] > 0.0 {
                    pj * (chose[j] - times[j] * dot)
                } else {
                    0.0
                };
                *o = T::from_f64(v);
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::BastileDType::*;
    use crate::testing::{cast, noise};

    fn route<T: Element, W: Element>(logits: &[T], experts: usize, k: usize, renorm: bool) -> (Vec<W>, Vec<i64>) {
        let tokens = logits.len() / experts;
        let (mut weights, mut chosen) = (vec![W::from_f64(f64::NAN); tokens * k], vec![-1i64; tokens * k]);
        ExpertRouteForward { logits: logits.as_ptr().cast(), weights: weights.as_mut_ptr().cast(), chosen: chosen.as_mut_ptr(),
            tokens: tokens as i64, experts: experts as i64, k: k as i64, dtype: T::DTYPE as i32,
            weights_dtype: W::DTYPE as i32, renorm: renorm as i32 }.cpu().unwrap();
        (weights, chosen)
    }

    fn grad_of<T: Element, W: Element>(logits: &[T], chosen: &[i64], grad: &[W], experts: usize, renorm: bool)
        -> Result<Vec<T>> {
        let k = grad.len() / (logits.len() / experts);
        let mut out = vec![T::from_f64(f64::NAN); logits.len()];
        ExpertRouteBackward { grad: grad.as_ptr().cast(), logits: logits.as_ptr().cast(), chosen: chosen.as_ptr(),
            grad_logits: out.as_mut_ptr().cast(), tokens: (logits.len() / experts) as i64, experts: experts as i64,
            k: k as i64, dtype: T::DTYPE as i32, weights_dtype: W::DTYPE as i32, renorm: renorm as i32 }.cpu()?;
        Ok(out)
    }

    #[test]
    fn picks_the_largest_ties_to_the_lower_index_and_nan_first() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 0.0, -0.0, f32::NAN, 1.0];
        let (_, chosen) = route::<f32, f32>(&logits[..6], 6, 4, true);
        assert_eq!(chosen, [1, 3, 0, 4]);
        let (_, chosen) = route::<f32, f32>(&[-0.0, 0.0, -1.0], 3, 2, true);
        assert_eq!(chosen, [0, 1]); // -0 and +0 tie
        let (weights, chosen) = route::<f32, f32>(&logits, 8, 2, true);
        assert_eq!(chosen, [6, 1]);
        assert!(weights.iter().all(|w| w.is_nan()));
    }

    /// The weights against the softmax written out, over all experts or the chosen.
    fn weights_are_the_softmax<T: Element, W: Element>(unit: f64) {
        let (tokens, experts, k) = (5usize, 7usize, 3usize);
        let logits: Vec<T> = cast(&noise(tokens * experts, 1, 4.0));
        for renorm in [false, true] {
            let (weights, chosen) = route::<T, W>(&logits, experts, k, renorm);
            for t in 0..tokens {
                let row: Vec<f64> = logits[t * experts..(t + 1) * experts].iter().map(|v| v.to_f64()).collect();
                let mut sorted = row.clone();
                sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
                let total: f64 = if renorm { sorted[..k].iter().map(|v| v.exp()).sum() } else { row.iter().map(|v| v.exp()).sum() };
                for s in 0..k {
                    let j = chosen[t * k + s] as usize;
                    assert_eq!(row[j], sorted[s]);
                    let want = row[j].exp() / total;
                    let got = weights[t * k + s].to_f64();
                    assert!((got - want).abs() <= unit * want, "{got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn weights_are_the_softmax_of_all_or_of_the_chosen() {
        weights_are_the_softmax::<f64, f64>(1e-14);
        weights_are_the_softmax::<f32, f32>(2f64.powi(-24));
        weights_are_the_softmax::<half::bf16, half::bf16>(2f64.powi(-8));
        weights_are_the_softmax::<half::bf16, f32>(2f64.powi(-24));
        weights_are_the_softmax::<f32, half::f16>(2f64.powi(-11));
    }

    /// d loss / d x[i] by central differences in f64.
    fn central_difference(loss: impl Fn(&[f64]) -> f64, x: &[f64], i: usize) -> f64 {
        let (mut up, mut down) = (x.to_vec(), x.to_vec());
        up[i] += 1e-6;
        down[i] -= 1e-6;
        (loss(&up) - loss(&down)) / 2e-6
    }

    /// The gradient against central differences of the forward's weights in f64 (the choice held fixed).
    #[test]
    fn gradient_matches_finite_differences() {
        let (tokens, experts, k) = (3usize, 6usize, 3usize);
        let logits = noise(tokens * experts, 2, 2.0);
        let grad = noise(tokens * k, 3, 1.0);
        for renorm in [false, true] {
            let (_, chosen) = route::<f64, f64>(&logits, experts, k, renorm);
            let got = grad_of::<f64, f64>(&logits, &chosen, &grad, experts, renorm).unwrap();
            let loss = |x: &[f64]| -> f64 {
                (0..tokens).map(|t| {
                    let row = &x[t * experts..(t + 1) * experts];
                    let e: Vec<f64> = row.iter().map(|v| v.exp()).collect();
                    let pick = &chosen[t * k..(t + 1) * k];
                    let sum: f64 = if renorm { pick.iter().map(|&j| e[j as usize]).sum() } else { e.iter().sum() };
                    pick.iter().zip(&grad[t * k..]).map(|(&j, g)| g * e[j as usize] / sum).sum::<f64>()
                }).sum()
            };
            for i in 0..logits.len() {
                let want = central_difference(&loss, &logits, i);
                assert!((got[i] - want).abs() < 1e-8, "renorm {renorm}, logit {i}: {} vs {want}", got[i]);
            }
        }
    }

    /// A slot repeated (which the forward never gives) adds its gradient as autograd would: the same as the
    /// gradient of the weights' sum over the two slots, written out.
    #[test]
    fn repeated_slots_are_summed() {
        let logits = noise(4, 5, 1.0);
        for renorm in [false, true] {
            let once = grad_of::<f64, f64>(&logits, &[2, 0], &[0.75, -0.5], 4, renorm).unwrap();
            let twice = grad_of::<f64, f64>(&logits, &[2, 0, 2], &[0.5, -0.5, 0.25], 4, renorm).unwrap();
            if !renorm {
                for (a, b) in once.iter().zip(&twice) {
                    assert!((a - b).abs() < 1e-15, "{a} vs {b}");
                }
            }
            // with renorm the sum counts expert 2 twice: its finite differences
            let loss = |x: &[f64]| {
                let e: Vec<f64> = x.iter().map(|v| v.exp()).collect();
                let sum = if renorm { 2.0 * e[2] + e[0] } else { e.iter().sum() };
                (0.5 * e[2] - 0.5 * e[0] + 0.25 * e[2]) / sum
            };
            for i in 0..4 {
                let want = central_difference(&loss, &logits, i);
                assert!((twice[i] - want).abs() < 1e-8, "renorm {renorm}: {} vs {want}", twice[i]);
            }
        }
    }

    #[test]
    fn a_chosen_expert_outside_the_experts_is_an_error() {
        let err = grad_of::<f32, f32>(&[0.0; 4], &[1, 4], &[1.0, 1.0], 4, true).unwrap_err();
        assert_eq!(err, "bastile.expert_route: chosen holds 4, outside 0..4");
    }

    #[test]
    fn every_launch_has_a_kernel() {
        for dt in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
            for wt in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
                ExpertRouteForward::find(&[Tag::Fwd, dt.tag(), wt.tag()]).unwrap();
                ExpertRouteBackward::find(&[Tag::Bwd, dt.tag(), wt.tag()]).unwrap();
            }
        }
    }
}
