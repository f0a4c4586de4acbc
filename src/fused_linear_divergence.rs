//! The student-teacher divergence over a chunk of logits (the formulas are in
//! `include/fused_linear_divergence.h`): the launches of `cuda/fused_linear_divergence.cu`, the CPU kernels
//! (f64 math, the reference the GPU is tested against), and the chunking of a call.
use crate::cpu::{self, Element};
use crate::driver::{Device, LaunchConfig, Result};
use crate::geometry;
use crate::kernels::{self, Decide, Launch, Plan, Tag};
use crate::params::{BastileDType, DivergenceChunk, DivergencePlan, DIVERGENCE_BLOCK};
use half::{bf16, f16};

/// The buffers of a chunk's logits (both models', f32) and of a group's gradient by default: TRL's function
/// keeps two f32 tiles of 4,096 x 32,768 (1 GiB), the same.
const CHUNK_BYTES: i64 = 1 << 30;
/// Chunks of this many rows or more are a multiple of it (whole GEMM tiles).
const CHUNK_ALIGN: i64 = 128;

/// Rows of `row_bytes` each that fit `budget`: at least one, whole tiles from CHUNK_ALIGN up.
fn fit(budget: i64, row_bytes: i64) -> i64 {
    let n = (budget / row_bytes.max(1)).max(1);
    if n >= CHUNK_ALIGN { n / CHUNK_ALIGN * CHUNK_ALIGN } else { n }
}

impl Decide for DivergencePlan {
    /// With a gradient buffer of its own, half the budget goes to a chunk's logits and what is left to a
    /// group's gradient rows, so that the f32 weight-gradient sum is read and written once a group rather
    /// than once a chunk.
    fn decide(&mut self) -> Result<()> {
        let budget = if self.chunk_bytes > 0 { self.chunk_bytes } else { CHUNK_BYTES };
        let rows = self.rows.max(1);
        if self.grad_bytes == 0 {
            self.step = fit(budget, self.logit_bytes).min(rows);
            self.group = self.step;
            return Ok(());
        }
        self.step = fit(budget / 2, self.logit_bytes).min(rows);
        let left = budget - self.step * self.logit_bytes;
        let chunks = (left / self.grad_bytes.max(1) / self.step).max(1);
        self.group = (chunks * self.step).min(geometry::ceil_div(rows, self.step) * self.step);
        Ok(())
    }
}

/// The kernel's tag for beta: forward KL, reverse KL or the JSD between.
fn mode(beta: f64) -> Tag {
    if beta == 0.0 {
        Tag::Fkl
    } else if beta == 1.0 {
        Tag::Rkl
    } else {
        Tag::Jsd
    }
}

impl Launch for DivergenceChunk {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        if BastileDType::from_raw(self.dtype)? != BastileDType::BASTILE_F32 {
            return Err("bastile.fused_linear_divergence: the CUDA kernels take float32 logits".into());
        }
        let grad = BastileDType::from_raw(self.grad_dtype)?;
        if grad == BastileDType::BASTILE_F64 {
            return Err("bastile.fused_linear_divergence: float64 is supported on CPU only".into());
        }
        let vec = self.vocab % 4 == 0
            && self.ld % 4 == 0
            && [self.student, self.teacher, self.grad.cast_const()].iter().all(|&p| geometry::aligned(p, 16));
        let tags = [mode(self.beta), grad.tag(), if vec { Tag::Vec } else { Tag::Scalar }];
        let vectors = if vec { self.vocab / 4 } else { self.vocab };
        // Short rows leave no thread idle; a multiple of 32 (the kernel reduces over whole warps).
        let block = (geometry::ceil_div(vectors, 32) * 32).clamp(32, DIVERGENCE_BLOCK as i64) as u32;
        let kernel = kernels::kernel::<Self>(dev, &tags, block)?;
        let blocks = self.rows.clamp(1, i32::MAX as i64) as u32;
        Ok(Plan::single(kernel, LaunchConfig { grid: (blocks, 1), block: (block, 1), shared: 0 }, *self))
    }

    fn cpu(&self) -> Result<()> {
        use BastileDType::*;
        // SAFETY: the C++ layer checked every pointer of the block against its tensor's shape and dtype.
        unsafe {
            match (BastileDType::from_raw(self.dtype)?, BastileDType::from_raw(self.grad_dtype)?) {
                (BASTILE_F64, BASTILE_F64) => chunk_cpu::<f64, f64>(self),
                (BASTILE_F32, BASTILE_F32) => chunk_cpu::<f32, f32>(self),
                (BASTILE_F32, BASTILE_F16) => chunk_cpu::<f32, f16>(self),
                (BASTILE_F32, BASTILE_BF16) => chunk_cpu::<f32, bf16>(self),
                (l, g) => return Err(format!("bastile.fused_linear_divergence: no CPU kernel for {l:?} logits with a {g:?} gradient")),
            }
        }
        Ok(())
    }
}

/// z = softcap(scale * x) / temperature, and dz/dx.
#[derive(Clone, Copy)]
struct Logit {
    scale: f64,
    softcap: f64,
    temperature: f64,
}

impl Logit {
    fn of(&self, x: f64) -> (f64, f64) {
        let y = self.scale * x;
        if self.softcap > 0.0 {
            let t = (y / self.softcap).tanh();
            (self.softcap * t / self.temperature, self.scale * (1.0 - t * t) / self.temperature)
        } else {
            (y / self.temperature, self.scale / self.temperature)
        }
    }
}

fn log_softmax(z: &[f64]) -> Vec<f64> {
    let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    z.iter().map(|v| v - lse).collect()
}

/// torch.logaddexp.
fn logaddexp(a: f64, b: f64) -> f64 {
    if a.is_infinite() && a == b {
        a
    } else {
        a.max(b) + (-(a - b).abs()).exp().ln_1p()
    }
}

/// One row: (D, H(p_s), dD/ds) from the logits s and t, in f64.
fn row(s: &[f64], t: &[f64], student: Logit, teacher: Logit, beta: f64) -> (f64, f64, Vec<f64>) {
    let zs: Vec<(f64, f64)> = s.iter().map(|&x| student.of(x)).collect();
    let ls = log_softmax(&zs.iter().map(|z| z.0).collect::<Vec<_>>());
    let lt = log_softmax(&t.iter().map(|&x| teacher.of(x).0).collect::<Vec<_>>());
    let entropy = -ls.iter().map(|l| l.exp() * l).sum::<f64>();
    let kl = |p: &[f64], q: &[f64]| p.iter().zip(q).map(|(p, q)| if p.exp() > 0.0 { p.exp() * (p - q) } else { 0.0 }).sum::<f64>();
    let (d, dz): (f64, Vec<f64>) = if beta == 0.0 {
        (kl(&lt, &ls), ls.iter().zip(&lt).map(|(a, b)| a.exp() - b.exp()).collect())
    } else if beta == 1.0 {
        let d = kl(&ls, &lt);
        (d, ls.iter().zip(&lt).map(|(a, b)| a.exp() * (a - b - d)).collect())
    } else {
        let lm: Vec<f64> = ls.iter().zip(&lt).map(|(a, b)| logaddexp(a + (1.0 - beta).ln(), b + beta.ln())).collect();
        let ks = kl(&ls, &lm);
        (beta * kl(&lt, &lm) + (1.0 - beta) * ks,
         ls.iter().zip(&lm).map(|(a, m)| (1.0 - beta) * a.exp() * (a - m - ks)).collect())
    };
    (d, entropy, dz.iter().zip(&zs).map(|(g, z)| g * z.1).collect())
}

unsafe fn chunk_cpu<L: Element, G: Element>(p: &DivergenceChunk) {
    let (rows, vocab, ld) = (p.rows as usize, p.vocab as usize, p.ld as usize);
    let student = Logit { scale: p.student_scale, softcap: p.student_softcap, temperature: p.temperature };
    let teacher = Logit { scale: p.teacher_scale, softcap: p.teacher_softcap, temperature: p.temperature };
    // Raw pointers: the gradient may be the student's logits, read here before they are overwritten.
    let (s, t, g) = (p.student as *const L as usize, p.teacher as *const L as usize, p.grad as *mut G as usize);
    let (div, ent) = (p.divergence as *mut L as usize, p.entropy as *mut L as usize);
    let mask = (!p.mask.is_null()).then(|| cpu::slice::<u8>(p.mask.cast(), rows));
    let beta = p.beta;
    cpu::parallel_for(rows, (cpu::GRAIN / vocab.max(1)).max(1), |r| {
        // SAFETY: each row's elements are read and written by the one task that takes the row.
        for i in r {
            let read = |base: usize| (0..vocab).map(|j| (*(base as *const L).add(i * ld + j)).to_f64()).collect::<Vec<_>>();
            let counted = mask.map_or(true, |m| m[i] != 0);
            let (d, h, dz) = if counted {
                row(&read(s), &read(t), student, teacher, beta)
            } else {
                (0.0, 0.0, vec![0.0; vocab])
            };
            *(div as *mut L).add(i) = L::from_f64(d);
            *(ent as *mut L).add(i) = L::from_f64(h);
            if g != 0 {
                for (j, v) in dz.iter().enumerate() {
                    *(g as *mut G).add(i * ld + j) = G::from_f64(*v);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::noise;

    fn block(s: &[f32], t: &[f32], grad: *mut f32, div: &mut [f32], ent: &mut [f32], mask: Option<&[u8]>, vocab: i64,
             beta: f64) -> DivergenceChunk {
        DivergenceChunk {
            student: s.as_ptr().cast(), teacher: t.as_ptr().cast(), mask: mask.map_or(std::ptr::null(), |m| m.as_ptr()),
            grad: grad.cast(), divergence: div.as_mut_ptr().cast(), entropy: ent.as_mut_ptr().cast(),
            rows: div.len() as i64, vocab, ld: vocab, beta, temperature: 1.5, student_scale: 0.8, student_softcap: 4.0,
            teacher_scale: 1.2, teacher_softcap: 0.0, dtype: BastileDType::BASTILE_F32 as i32,
            grad_dtype: BastileDType::BASTILE_F32 as i32,
        }
    }

    fn plan(rows: i64, vocab: i64, grad_bytes: i64, chunk_bytes: i64) -> DivergencePlan {
        let mut p = DivergencePlan { rows, vocab, logit_bytes: vocab * 8, grad_bytes: vocab * grad_bytes, chunk_bytes,
                                     step: 0, group: 0 };
        p.decide().unwrap();
        p
    }

    /// Groups are whole chunks within what is left of the budget, no more than the rows need; without a
    /// gradient buffer of its own a group is one chunk.
    #[test]
    fn groups_are_whole_chunks_within_the_budget() {
        let p = plan(8192, 151_936, 2, 0);
        assert_eq!((p.step, p.group), (384, 1920));
        assert!(p.step * p.logit_bytes + p.group * p.grad_bytes <= CHUNK_BYTES);
        let p = plan(37, 300, 2, 80 * 300);
        assert_eq!((p.step, p.group), (5, 20));
        let p = plan(37, 300, 2, 1 << 30);
        assert_eq!((p.step, p.group), (37, 37));
        let p = plan(1000, 300, 2, 300 * 64);
        assert_eq!((p.step, p.group), (4, 16));
        let p = plan(8192, 151_936, 0, 0);
        assert_eq!((p.step, p.group), (768, 768));
        let p = plan(0, 10, 2, 0);
        assert_eq!((p.step, p.group), (1, 1));
        let p = plan(100, 1 << 28, 2, 0);  // a row over the budget: one row at a time
        assert_eq!((p.step, p.group), (1, 1));
    }

    /// The divergence's gradient against central differences of the kernel's own divergence, for each beta;
    /// masked rows give nothing.
    #[test]
    fn gradient_is_the_divergences_derivative() {
        let (rows, vocab) = (3usize, 11i64);
        let s: Vec<f32> = noise(rows * vocab as usize, 1, 3.0).iter().map(|&v| v as f32).collect();
        let t: Vec<f32> = noise(rows * vocab as usize, 2, 3.0).iter().map(|&v| v as f32).collect();
        let mask = [1u8, 0, 1];
        for beta in [0.0, 0.3, 1.0] {
            let (mut div, mut ent, mut g) = (vec![f32::NAN; rows], vec![f32::NAN; rows], vec![f32::NAN; s.len()]);
            block(&s, &t, g.as_mut_ptr(), &mut div, &mut ent, Some(&mask), vocab, beta).cpu().unwrap();
            assert_eq!((div[1], ent[1]), (0.0, 0.0));
            assert!(g[vocab as usize..2 * vocab as usize].iter().all(|&v| v == 0.0));
            let f = |s: &[f32]| {
                let (mut d, mut e) = (vec![0f32; rows], vec![0f32; rows]);
                block(s, &t, std::ptr::null_mut(), &mut d, &mut e, None, vocab, beta).cpu().unwrap();
                d[0] as f64 + d[2] as f64
            };
            for j in [0usize, 5, 2 * vocab as usize + 7] {
                let h = 1e-2f32;
                let (mut up, mut down) = (s.clone(), s.clone());
                up[j] += h;
                down[j] -= h;
                let numeric = (f(&up) - f(&down)) / (2.0 * h as f64);
                assert!((numeric - g[j] as f64).abs() < 2e-3, "beta {beta} element {j}: {numeric} vs {}", g[j]);
            }
        }
    }
}
