//! A mixture of experts' router after its logits, softmax or sigmoid: the top-k experts of each token and their
//! weights, and the logits' gradient (the formulas are in `include/expert_route.h`): the launches of `cuda/expert_route.cu` and
//! the CPU kernels, the reference the GPU is tested against. The CPU picks by sorting each row in the same order
//! and computes in f64, each result rounded once.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, Result};
use crate::geometry;
use crate::kernels::{self, Kernels, Launch, Plan, Tag};
use crate::params::{BastileDType, ExpertRouteBackward, ExpertRouteForward, ExpertRouteSigmoidBackward,
                    ExpertRouteSigmoidForward, EXPERT_ROUTE_BLOCK};
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

impl Launch for ExpertRouteSigmoidForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        plan(dev, *self, Tag::SigmoidFwd, self.dtype, self.weights_dtype, self.tokens)
    }

    fn cpu(&self) -> Result<()> {
        let (dt, wt) = (BastileDType::from_raw(self.dtype)?, BastileDType::from_raw(self.weights_dtype)?);
        // SAFETY: as ExpertRouteForward's.
        crate::with_dtypes!(dt, wt, |T, W, _Y| unsafe { sigmoid_forward_cpu::<T, W>(self) })
    }
}

impl Launch for ExpertRouteSigmoidBackward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        plan(dev, *self, Tag::SigmoidBwd, self.dtype, self.weights_dtype, self.tokens)
    }

    fn cpu(&self) -> Result<()> {
        let (dt, wt) = (BastileDType::from_raw(self.dtype)?, BastileDType::from_raw(self.weights_dtype)?);
        // SAFETY: as ExpertRouteForward's.
        crate::with_dtypes!(dt, wt, |T, W, _Y| unsafe { sigmoid_backward_cpu::<T, W>(self) })
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

/// The renormalised weights' denominator: the chosen's sum of exponentials, clamped below at norm_min times the
/// total (their probabilities' sum at norm_min); None where it is not clamped.
fn clamped(picked: f64, total: f64, norm_min: f64) -> Option<f64> {
    (norm_min > 0.0 && picked < norm_min * total).then(|| norm_min * total)
}

unsafe fn forward_cpu<T: Element, W: Element>(p: &ExpertRouteForward) -> Result<()> {
    let (tokens, experts, k, renorm) = (p.tokens as usize, p.experts as usize, p.k as usize, p.renorm != 0);
    let wide = T::DTYPE == BastileDType::BASTILE_F64;
    let logits = cpu::slice::<T>(p.logits, tokens * experts);
    let bias = (!p.bias.is_null()).then(|| cpu::slice::<f32>(p.bias.cast(), experts));
    let norm_min = p.norm_min as f64;
    let weights = Disjoint::new(cpu::slice_mut::<W>(p.weights, tokens * k));
    let chosen = Disjoint::new(cpu::slice_mut::<i64>(p.chosen.cast(), tokens * k));
    cpu::parallel_for(tokens, grain(experts), |range| {
        for t in range {
            let row: Vec<f64> = logits[t * experts..(t + 1) * experts].iter().map(|v| v.to_f64()).collect();
            let e = exps(&row);
            let total: f64 = e.iter().sum();
            // by the logits, or by the softmax (in HF's float32) plus the bias
            let mut order: Vec<(f64, usize)> = match bias {
                None => row.iter().copied().zip(0..).collect(),
                Some(b) if wide => e.iter().zip(b).map(|(e, &b)| e / total + b as f64).zip(0..).collect(),
                Some(b) => e.iter().zip(b).map(|(e, &b)| ((e / total) as f32 + b) as f64).zip(0..).collect(),
            };
            order.sort_by(|&a, &b| picked_before(a, b));
            let picked = &order[..k];
            let picked_sum: f64 = picked.iter().map(|&(_, j)| e[j]).sum();
            let sum = if !renorm { total } else { clamped(picked_sum, total, norm_min).unwrap_or(picked_sum) };
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
    let (tokens, experts, k, renorm, norm_min) =
        (p.tokens as usize, p.experts as usize, p.k as usize, p.renorm != 0, p.norm_min as f64);
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
            let total: f64 = e.iter().sum();
            let picked_sum: f64 = pick.iter().map(|&j| e[j as usize]).sum();
            // where the forward clamped, the weights are the softmax over all divided by norm_min
            let clamp = if renorm { clamped(picked_sum, total, norm_min) } else { None };
            let (renorm, sum, scale) = match clamp {
                Some(_) => (false, total, 1.0 / norm_min),
                None if renorm => (true, picked_sum, 1.0),
                None => (false, total, 1.0),
            };
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
                    pj * (chose[j] - dot) * scale
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

/// The sigmoid router's scores of a row, rounded to T as HF's sigmoid rounds them.
fn scores<T: Element>(row: &[T]) -> Vec<f64> {
    row.iter().map(|v| T::round(1.0 / (1.0 + (-v.to_f64()).exp()))).collect()
}

unsafe fn sigmoid_forward_cpu<T: Element, W: Element>(p: &ExpertRouteSigmoidForward) -> Result<()> {
    let (tokens, experts, k, renorm) = (p.tokens as usize, p.experts as usize, p.k as usize, p.renorm != 0);
    let (eps, scale, groups, group_k) = (p.eps as f64, p.scale as f64, p.groups as usize, p.group_k as usize);
    let (wide, round_choice) = (T::DTYPE == BastileDType::BASTILE_F64, p.round_choice != 0);
    let logits = cpu::slice::<T>(p.logits, tokens * experts);
    let bias = (!p.bias.is_null()).then(|| cpu::slice::<f32>(p.bias.cast(), experts));
    let weights = Disjoint::new(cpu::slice_mut::<W>(p.weights, tokens * k));
    let chosen = Disjoint::new(cpu::slice_mut::<i64>(p.chosen.cast(), tokens * k));
    cpu::parallel_for(tokens, grain(experts), |range| {
        for t in range {
            let s = scores(&logits[t * experts..(t + 1) * experts]);
            // the choice adds the f32 bias in the promoted type, as HF's `scores + bias`
            let plus = |s: f64, b: f32| match (wide, round_choice) {
                (true, _) => s + b as f64,
                (false, true) => T::round(s + b as f64),
                (false, false) => (s as f32 + b) as f64,
            };
            let mut order: Vec<(f64, usize)> = match bias {
                Some(b) => s.iter().zip(b).map(|(&s, &b)| plus(s, b)).zip(0..).collect(),
                None => s.iter().copied().zip(0..).collect(),
            };
            if group_k < groups {
                // each group's two largest choice values summed; the others' experts choose as -inf
                let size = experts / groups;
                let mut best: Vec<(f64, usize)> = order.chunks(size).zip(0..).map(|(members, g)| {
                    let mut values: Vec<(f64, usize)> = members.to_vec();
                    values.sort_by(|&a, &b| picked_before(a, b));
                    let (a, b) = (values[0].0, values[1].0);
                    (if wide { a + b } else { (a as f32 + b as f32) as f64 }, g)
                }).collect();
                best.sort_by(|&a, &b| picked_before(a, b));
                let allowed: Vec<usize> = best[..group_k].iter().map(|&(_, g)| g).collect();
                for (c, j) in order.iter_mut() {
                    if !allowed.contains(&(*j / size)) {
                        *c = f64::NEG_INFINITY;
                    }
                }
            }
            order.sort_by(|&a, &b| picked_before(a, b));
            let picked = &order[..k];
            let denominator = if renorm { picked.iter().map(|&(_, j)| s[j]).sum::<f64>() + eps } else { 1.0 };
            // SAFETY: the ranges of parallel_for do not overlap.
            let (w, c) = (weights.part(t * k..(t + 1) * k), chosen.part(t * k..(t + 1) * k));
            for (slot, &(_, j)) in picked.iter().enumerate() {
                (w[slot], c[slot]) = (W::from_f64(s[j] / denominator * scale), j as i64);
            }
        }
    });
    Ok(())
}

unsafe fn sigmoid_backward_cpu<T: Element, W: Element>(p: &ExpertRouteSigmoidBackward) -> Result<()> {
    let (tokens, experts, k, renorm) = (p.tokens as usize, p.experts as usize, p.k as usize, p.renorm != 0);
    let (eps, scale) = (p.eps as f64, p.scale as f64);
    let chosen = cpu::slice::<i64>(p.chosen.cast(), tokens * k);
    cpu::check_indices("expert_route_sigmoid", "chosen", chosen, experts, false)?;
    let logits = cpu::slice::<T>(p.logits, tokens * experts);
    let grad = cpu::slice::<W>(p.grad, tokens * k);
    let out = Disjoint::new(cpu::slice_mut::<T>(p.grad_logits, tokens * experts));
    cpu::parallel_for(tokens, grain(experts), |range| {
        for t in range {
            let s = scores(&logits[t * experts..(t + 1) * experts]);
            let (pick, g) = (&chosen[t * k..(t + 1) * k], &grad[t * k..(t + 1) * k]);
            let denominator = if renorm { pick.iter().map(|&j| s[j as usize]).sum::<f64>() + eps } else { 1.0 };
            let dot = if renorm {
                pick.iter().zip(g).map(|(&j, g)| g.to_f64() * s[j as usize]).sum::<f64>() / denominator
            } else {
                0.0
            };
            let (mut chose, mut times) = (vec![0.0; experts], vec![0.0; experts]);
            for (&j, g) in pick.iter().zip(g) {
                chose[j as usize] += g.to_f64();
                times[j as usize] += 1.0;
            }
            // SAFETY: the ranges of parallel_for do not overlap.
            for (j, o) in out.part(t * experts..(t + 1) * experts).iter_mut().enumerate() {
                let v = s[j] * (1.0 - s[j]) * scale * (chose[j] - times[j] * dot) / denominator;
                *o = T::from_f64(if times[j] > 0.0 { v } else { 0.0 });
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
        ExpertRouteForward { logits: logits.as_ptr().cast(), bias: std::ptr::null(), weights: weights.as_mut_ptr().cast(),
            chosen: chosen.as_mut_ptr(), tokens: tokens as i64, experts: experts as i64, k: k as i64, norm_min: 0.0,
            dtype: T::DTYPE as i32,
            weights_dtype: W::DTYPE as i32, renorm: renorm as i32 }.cpu().unwrap();
        (weights, chosen)
    }

    fn grad_of<T: Element, W: Element>(logits: &[T], chosen: &[i64], grad: &[W], experts: usize, renorm: bool)
        -> Result<Vec<T>> {
        let k = grad.len() / (logits.len() / experts);
        let mut out = vec![T::from_f64(f64::NAN); logits.len()];
        ExpertRouteBackward { grad: grad.as_ptr().cast(), logits: logits.as_ptr().cast(), chosen: chosen.as_ptr(),
            grad_logits: out.as_mut_ptr().cast(), tokens: (logits.len() / experts) as i64, experts: experts as i64,
            k: k as i64, norm_min: 0.0, dtype: T::DTYPE as i32, weights_dtype: W::DTYPE as i32, renorm: renorm as i32 }
            .cpu()?;
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

    fn sigmoid_route(logits: &[f64], bias: Option<&[f32]>, experts: usize, k: usize, renorm: bool)
        -> (Vec<f64>, Vec<i64>) {
        let tokens = logits.len() / experts;
        let (mut weights, mut chosen) = (vec![f64::NAN; tokens * k], vec![-1i64; tokens * k]);
        ExpertRouteSigmoidForward { logits: logits.as_ptr().cast(), bias: bias.map_or(std::ptr::null(), |b| b.as_ptr()),
            weights: weights.as_mut_ptr().cast(), chosen: chosen.as_mut_ptr(), tokens: tokens as i64,
            experts: experts as i64, k: k as i64, groups: 1, group_k: 1, eps: 1e-6, scale: 2.5, dtype: BASTILE_F64 as i32,
            weights_dtype: BASTILE_F64 as i32, renorm: renorm as i32, round_choice: 0 }.cpu().unwrap();
        (weights, chosen)
    }

    /// The sigmoid router: the choice by score plus bias, the weights the scores (over their sum plus eps), scaled.
    #[test]
    fn sigmoid_router_picks_by_score_plus_bias() {
        let logits = [0.5, 2.0, -1.0, 1.0];
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        let (weights, chosen) = sigmoid_route(&logits, None, 4, 2, false);
        assert_eq!(chosen, [1, 3]);
        assert!((weights[0] - 2.5 * sigmoid(2.0)).abs() < 1e-15);
        let bias = [0.0f32, 0.0, 2.0, 0.0];
        let (weights, chosen) = sigmoid_route(&logits, Some(&bias), 4, 2, true);
        assert_eq!(chosen, [2, 1]);
        let sum = sigmoid(-1.0) + sigmoid(2.0) + 1e-6;
        assert!((weights[0] - sigmoid(-1.0) / sum * 2.5).abs() < 1e-12, "{weights:?}"); // eps is f32
    }

    /// GLM-4.5's group-limited choice: 2 groups of 3, the group whose two largest choice values sum highest.
    #[test]
    fn sigmoid_router_chooses_within_the_best_groups() {
        // group 0's two largest logits 3.0 and -3.0; group 1's 1.0 and 0.9: group 1 wins though 3.0 is the largest
        let logits = [3.0, -3.0, -4.0, 1.0, 0.9, -5.0];
        let mut weights = [f64::NAN; 2];
        let mut chosen = [-1i64; 2];
        let mut run = |groups, group_k| {
            ExpertRouteSigmoidForward { logits: logits.as_ptr().cast(), bias: std::ptr::null(),
                weights: weights.as_mut_ptr().cast(), chosen: chosen.as_mut_ptr(), tokens: 1, experts: 6, k: 2, groups,
                group_k, eps: 0.0, scale: 1.0, dtype: BASTILE_F64 as i32, weights_dtype: BASTILE_F64 as i32, renorm: 0,
                round_choice: 0 }
                .cpu().unwrap();
            chosen
        };
        assert_eq!(run(2, 1), [3, 4]);
        assert_eq!(run(2, 2), [0, 3]);
        assert_eq!(run(1, 1), [0, 3]);
    }

    #[test]
    fn sigmoid_gradient_matches_finite_differences() {
        let (tokens, experts, k) = (3usize, 6usize, 3usize);
        let logits = noise(tokens * experts, 4, 2.0);
        let grad = noise(tokens * k, 5, 1.0);
        for renorm in [false, true] {
            let (_, chosen) = sigmoid_route(&logits, None, experts, k, renorm);
            let mut got = vec![f64::NAN; logits.len()];
            ExpertRouteSigmoidBackward { grad: grad.as_ptr().cast(), logits: logits.as_ptr().cast(), chosen: chosen.as_ptr(),
                grad_logits: got.as_mut_ptr().cast(), tokens: tokens as i64, experts: experts as i64, k: k as i64,
                eps: 1e-6, scale: 2.5, dtype: BASTILE_F64 as i32, weights_dtype: BASTILE_F64 as i32,
                renorm: renorm as i32 }.cpu().unwrap();
            let loss = |x: &[f64]| -> f64 {
                (0..tokens).map(|t| {
                    let s: Vec<f64> = x[t * experts..(t + 1) * experts].iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
                    let pick = &chosen[t * k..(t + 1) * k];
                    let denominator = if renorm { pick.iter().map(|&j| s[j as usize]).sum::<f64>() + 1e-6 } else { 1.0 };
                    pick.iter().zip(&grad[t * k..]).map(|(&j, g)| g * s[j as usize] / denominator * 2.5).sum::<f64>()
                }).sum()
            };
            for i in 0..logits.len() {
                let want = central_difference(&loss, &logits, i);
                assert!((got[i] - want).abs() < 1e-8, "renorm {renorm}, logit {i}: {} vs {want}", got[i]);
            }
        }
    }

    #[test]
    fn every_launch_has_a_kernel() {
        for dt in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
            for wt in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
                ExpertRouteForward::find(&[Tag::Fwd, dt.tag(), wt.tag()]).unwrap();
                ExpertRouteBackward::find(&[Tag::Bwd, dt.tag(), wt.tag()]).unwrap();
                ExpertRouteSigmoidForward::find(&[Tag::SigmoidFwd, dt.tag(), wt.tag()]).unwrap();
                ExpertRouteSigmoidBackward::find(&[Tag::SigmoidBwd, dt.tag(), wt.tag()]).unwrap();
            }
        }
    }
}
