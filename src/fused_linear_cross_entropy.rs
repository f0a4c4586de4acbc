//! Fused linear cross-entropy: the per-chunk pass over logits (`cuda/fused_linear_cross_entropy.cu`
//! and its CPU twin here, the reference the GPU is tested against). For each row of a chunk:
//! `loss = lse(s) - s[target] + z_loss * lse(s)^2` with `s = softcap(logit_scale * logit) / temperature`,
//! `softcap(x) = softcap * tanh(x / softcap)` (or x), and, in place of the logits, `d(loss)/d(logit) =
//! (scale * ((1 + 2 z_loss lse) p - onehot(target)) - g_H p (log p + H)) * ds/dlogit` with `p = softmax(s)`,
//! `scale = 1 / count` for reduction "mean", 1 for "sum", the row's upstream gradient for "none" (the
//! backward's recomputation), and `g_H` the upstream gradient of the row's entropy H (0 by default). With
//! label smoothing eps, the loss is `lse - (1 - eps) s[target] - eps mean(s) + ...` and the one-hot is
//! `(1 - eps) onehot + eps / vocab`.
//! On request (`stats`), the row's entropy H, log(sum p^2), mean of s and whether the target is s's first
//! maximum: what TRL's per-token heads report. Ignored rows (target == ignore_index) get loss, stats and
//! gradient 0. The GEMMs around the pass are ATen's, or on Hopper the logits GEMM is our own
//! ([`CrossEntropyGemm`]); the driver of both heads (`src/torch/fused_head.cpp`) runs the chunks of rows
//! that [`HeadPlan`] decides here.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, LaunchConfig, Result};
use crate::elementwise::{vector_width, Elementwise};
use crate::geometry;
use crate::kernels::{self, Decide, Launch, Plan, Tag};
use crate::params::{
    BastileDType, CrossEntropyChunk, CrossEntropyGemm, GradScale, HeadPlan, FLCE_BLOCK, FLCE_BLOCKS_PER_SM, FLCE_CACHED, FLCE_CACHED_SOFTCAP,
    FLCE_CACHED_SOFTCAP_STATS, FLCE_CACHED_STATS, FLCE_GEMM_MAX_STAGES, FLCE_GEMM_ROW_BLOCK, FLCE_GEMM_SCALE,
    FLCE_SCALE_BLOCK, FLCE_SCALE_UNROLL, BASTILE_GEMM_THREADS, BASTILE_GEMM_TILE_K, BASTILE_GEMM_TILE_M, BASTILE_GEMM_TILE_N,
};

/// Logits of one chunk stay within this many bytes. 256 MiB is 768 rows of Qwen3's vocabulary in
/// bf16. Every chunk's weight-gradient GEMM reads and writes the whole [vocab, hidden] sum, so its
/// arithmetic intensity is proportional to the chunk's rows divided by the sum's element size: an f32
/// sum gets twice the bytes (1664 bf16 rows of Qwen3's vocabulary), which keeps that GEMM
/// compute-bound on an H100. The chunk comes on top of a model's activations at the end of its
/// forward, so it sets the peak of a training step: 768 MiB gave Qwen3-0.6B (seq 4096, batch 2) a
/// peak 1 GiB above Liger Kernel's. An f32 sum cast to the weight's dtype at the end needs the sum and
/// the cast copy at once, so chunks up to the copy's size raise no peak the cast does not reach: the
/// budget grows to it (BENCHMARKS.md: chunk sizes).
const CHUNK_BYTES: i64 = 256 << 20;
const CHUNK_BYTES_F32_SUM: i64 = 512 << 20;
/// Chunks of this many rows or more are a multiple of it (whole GEMM tiles).
const CHUNK_ALIGN: i64 = 128;

/// Rows of each chunk of `rows` rows whose logits (or exps) take `row_bytes` each: within `budget` bytes
/// when it is positive (the op's `chunk_bytes`), else the default budget. The Hopper path's other chunk
/// buffers (partial sums, the f32 product, the scaled hidden: [`gemm_partial_bytes`] + 6 * cols bytes a
/// row, under 4% of its exps) are not counted: fewer rows would mean one more pass over the f32 weight-gradient sum,
/// which costs more (H100, 8192 x 4096: 1.3 ms). `f32_sum`: the weight gradient is summed in
/// f32; `cast_bytes`: the size of that sum's final cast copy (0 when none).
fn chunk_rows(rows: i64, row_bytes: i64, f32_sum: bool, cast_bytes: i64, budget: i64) -> i64 {
    let budget = if budget > 0 { budget } else { (if f32_sum { CHUNK_BYTES_F32_SUM } else { CHUNK_BYTES }).max(cast_bytes) };
    let mut n = (budget / row_bytes).max(1);
    if n >= CHUNK_ALIGN {
        n = n / CHUNK_ALIGN * CHUNK_ALIGN;
    }
    n.min(rows.max(1))
}

/// Columns of the Hopper path's exps rows: whole 16-byte vectors, so that each pair the epilogue stores
/// is in the row.
fn gemm_ld(vocab: i64) -> i64 {
    geometry::ceil_div(vocab, 8) * 8
}

/// Bytes of a row's partial sums on the Hopper path: {max, sum} per column tile.
fn gemm_partial_bytes(vocab: i64) -> i64 {
    geometry::ceil_div(vocab, BASTILE_GEMM_TILE_N as i64) * 8
}

/// Rows of each chunk on the Hopper path without gradients: no exps are written, so the budget (as in
/// [`chunk_rows`]) holds only the partial sums. (Capping the chunk's hidden at 32 MiB, to keep it in L2, was
/// within noise on an H100: 8192 x 4096, one forward, 14.66 ms as one chunk, 14.58 ms as two.)
fn gemm_forward_rows(rows: i64, vocab: i64, budget: i64) -> i64 {
    chunk_rows(rows, gemm_partial_bytes(vocab), false, 0, budget)
}

/// Whether `BASTILE_CROSS_ENTROPY_GEMM=cublas` turns the Hopper path off (the earlier path: cuBLAS logits
/// and a pass over them), read once, at the first fused head's call on CUDA: a process runs one path.
fn cublas_only() -> bool {
    static CUBLAS: std::sync::LazyLock<bool> =
        std::sync::LazyLock::new(|| std::env::var("BASTILE_CROSS_ENTROPY_GEMM").is_ok_and(|v| v == "cublas"));
    *CUBLAS
}

/// Whether the Hopper path runs on `device` for hidden size `cols` (what it computes is the caller's
/// `gemm_fits`): compute capability 9.0, whole 16-byte rows for TMA, and not turned off ([`cublas_only`]).
fn gemm_supported(device: i32, cols: i64) -> bool {
    cols > 0 && cols % 8 == 0 && !cublas_only() && crate::driver::device(device).is_ok_and(|d| d.capability() == (9, 0))
}

impl Decide for HeadPlan {
    fn decide(&mut self) -> Result<()> {
        let gemm = self.gemm_fits != 0 && self.device >= 0 && gemm_supported(self.device, self.cols);
        self.gemm = gemm.into();
        self.ld = if gemm { gemm_ld(self.vocab) } else { self.vocab };
        self.step = if gemm && self.grad == 0 {
            gemm_forward_rows(self.rows, self.vocab, self.chunk_bytes)
        } else {
            chunk_rows(self.rows, self.ld * self.element_bytes, self.f32_sum != 0, self.cast_bytes, self.chunk_bytes)
        };
        self.buffer_rows = self.step.min(self.rows);
        Ok(())
    }
}

/// Threads of a block: sized so that short rows do not leave most threads idle.
fn block_size(vectors: i64) -> i64 {
    (geometry::ceil_div(geometry::ceil_div(vectors, FLCE_CACHED as i64), 32) * 32).clamp(32, FLCE_BLOCK as i64)
}

/// Vectors per thread to park in shared memory: what the registers do not hold of a row, up to the
/// `room` bytes a block may take.
fn shared_vecs(vectors: i64, block: i64, cached: i64, vector_bytes: i64, room: u32) -> i64 {
    let rest = geometry::ceil_div((vectors - cached * block).max(0), block);
    rest.min(room as i64 / (block * vector_bytes))
}

fn tags(dtype: BastileDType, vectorized: bool, softcap: bool, stats: bool) -> Vec<Tag> {
    let mut tags = vec![Tag::Rows, dtype.tag(), if vectorized { Tag::Vec } else { Tag::Scalar }];
    tags.extend(softcap.then_some(Tag::Softcap));
    tags.extend(stats.then_some(Tag::Stats));
    tags
}

/// Vectors per thread the kernel keeps in registers.
fn cached(softcap: bool, stats: bool) -> i64 {
    (match (softcap, stats) {
        (false, false) => FLCE_CACHED,
        (true, false) => FLCE_CACHED_SOFTCAP,
        (false, true) => FLCE_CACHED_STATS,
        (true, true) => FLCE_CACHED_SOFTCAP_STATS,
    }) as i64
}

impl CrossEntropyChunk {
    /// The stats kernels: the row's statistics are asked for, or the entropy's gradient or label smoothing
    /// needs them.
    fn stats(&self) -> bool {
        !self.stats.is_null() || !self.entropy_scale.is_null() || self.label_smoothing > 0.0
    }
}

impl Launch for CrossEntropyChunk {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let dtype = BastileDType::from_raw(self.dtype)?;
        let mut p = *self;
        let vec = 16 / dtype.size() as i64;
        let vectorized = geometry::aligned(p.logits, 16) && p.vocab % vec == 0 && p.ld % vec == 0;
        p.vec = if vectorized { vec as i32 } else { 1 };
        let (softcap, stats) = (p.softcap > 0.0, p.stats());
        let vectors = p.vocab / p.vec as i64;
        let block = block_size(vectors);
        let tags = tags(dtype, vectorized, softcap, stats);
        let kernel = kernels::kernel_sharing::<Self>(dev, &tags, block as u32, FLCE_BLOCKS_PER_SM)?;
        let vector_bytes = p.vec as i64 * dtype.size() as i64;
        p.shared_vecs = shared_vecs(vectors, block, cached(softcap, stats), vector_bytes, kernel.shared) as i32;
        let rows = u32::try_from(p.rows).map_err(|_| "bastile.fused_linear_cross_entropy: too many rows in one chunk")?;
        let shared = (p.shared_vecs as i64 * block * vector_bytes) as u32;
        Ok(Plan::single(kernel, LaunchConfig { grid: (rows, 1), block: (block as u32, 1), shared }, p))
    }

    fn cpu(&self) -> Result<()> {
        chunk_cpu(self)
    }
}

/// The backward's scaling of a gradient by the loss's upstream gradient (a device f32 scalar). ATen's
/// `grad * grad_loss` with a 0-dim CUDA factor takes its generic, unvectorised loop (H100: ~1 TB/s).
const SCALE: Elementwise = Elementwise { block: FLCE_SCALE_BLOCK, unroll: FLCE_SCALE_UNROLL };

impl Launch for GradScale {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let dtype = BastileDType::from_raw(self.dtype)?;
        SCALE.plan(dev, *self, Tag::Scale, dtype, vector_width(dtype, &[self.src, self.dst]), self.n)
    }

    /// The C++ layer scales CPU tensors with ATen.
    fn cpu(&self) -> Result<()> {
        Err("bastile.fused_linear_cross_entropy: the gradient scaling kernel runs on CUDA only".into())
    }
}

/// Scratch of the Hopper path, bytes from its start: partial sums, target logits, references, row sums,
/// repair flags.
fn gemm_scratch(p: &CrossEntropyGemm) -> ([i64; 5], i64) {
    let row_tiles = geometry::ceil_div(p.rows, BASTILE_GEMM_TILE_M as i64);
    let sizes = [p.rows * gemm_partial_bytes(p.vocab), p.rows * 4, p.rows * 4, p.rows * 4, (row_tiles + 1) * 4];
    let mut at = [0; 5];
    let mut end = 0;
    for (a, size) in at.iter_mut().zip(sizes) {
        *a = end;
        end += geometry::ceil_div(size, 256) * 256;
    }
    (at, end)
}

impl Launch for CrossEntropyGemm {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let mut p = *self;
        let rows = u32::try_from(p.rows).map_err(|_| "bastile.fused_linear_cross_entropy: too many rows in one chunk")?;
        let row_kernel = |tag: &[Tag]| kernels::kernel::<Self>(dev, tag, FLCE_GEMM_ROW_BLOCK);
        if p.stage == FLCE_GEMM_SCALE as i32 {
            let k = row_kernel(&[Tag::Rescale, Tag::Bf16])?;
            return Ok(Plan::single(k, LaunchConfig { grid: (rows, 1), block: (FLCE_GEMM_ROW_BLOCK, 1), shared: 0 }, p));
        }
        if dev.capability() != (9, 0) {
            return Err("bastile.fused_linear_cross_entropy: the GEMM path needs compute capability 9.0".into());
        }
        let (m, n, k) = (BASTILE_GEMM_TILE_M, BASTILE_GEMM_TILE_N, BASTILE_GEMM_TILE_K);
        p.hidden_map = crate::driver::tensor_map_bf16(p.hidden, p.rows, p.cols, k, m)?;
        p.weight_map = crate::driver::tensor_map_bf16(p.weight, p.vocab, p.cols, k, n / 2)?;
        let tags: &[Tag] = if p.softcap > 0.0 { &[Tag::Gemm, Tag::Bf16, Tag::Softcap] } else { &[Tag::Gemm, Tag::Bf16] };
        let gemm = kernels::kernel_sharing::<Self>(dev, tags, BASTILE_GEMM_THREADS, 1)?;
        let (stages, shared) = geometry::gemm_stages(gemm.shared, FLCE_GEMM_MAX_STAGES).ok_or_else(|| {
            format!("bastile.fused_linear_cross_entropy: {} bytes of shared memory hold no GEMM pipeline", gemm.shared)
        })?;
        p.stages = stages as i32;
        let tiles = geometry::ceil_div(p.rows, m as i64) * geometry::ceil_div(p.vocab, n as i64);
        let gemm_cfg = LaunchConfig {
            grid: (tiles.min(dev.sm_count() as i64) as u32, 1),
            block: (BASTILE_GEMM_THREADS, 1),
            shared,
        };
        let warps = FLCE_GEMM_ROW_BLOCK / 32;
        let rows_cfg = LaunchConfig { grid: (rows.div_ceil(warps), 1), block: (FLCE_GEMM_ROW_BLOCK, 1), shared: 0 };
        let (target, check, finish) = (row_kernel(&[Tag::Target, Tag::Bf16])?, row_kernel(&[Tag::Check])?, row_kernel(&[Tag::Finish, Tag::Bf16])?);
        let (at, bytes) = gemm_scratch(&p);
        Ok(Plan::new(bytes, move |memory, stream| {
            let m = memory.cast::<u8>();
            // SAFETY: the scratch holds `bytes` bytes, laid out by gemm_scratch.
            unsafe {
                p.partial = m.add(at[0] as usize).cast();
                p.target_logit = m.add(at[1] as usize).cast();
                p.reference = m.add(at[2] as usize).cast();
                p.row_sum = m.add(at[3] as usize).cast();
                p.tile_flags = m.add(at[4] as usize).cast();
            }
            let mut again = p;
            again.repair = 1;
            // SAFETY: every kernel takes this block; the C++ layer checked its tensors, Rust set its scratch.
            unsafe {
                crate::driver::launch(target, rows_cfg, stream, &p)?;
                crate::driver::launch(gemm, gemm_cfg, stream, &p)?;
                crate::driver::launch(check, rows_cfg, stream, &p)?;
                crate::driver::launch(gemm, gemm_cfg, stream, &again)?;
                crate::driver::launch(finish, rows_cfg, stream, &p)
            }
        }))
    }

    fn cpu(&self) -> Result<()> {
        Err("bastile.fused_linear_cross_entropy: the GEMM path runs on CUDA only".into())
    }
}

pub fn chunk_cpu(p: &CrossEntropyChunk) -> Result<()> {
    let dt = BastileDType::from_raw(p.dtype)?;
    // The loss comes out in promote(dtype, f32): f32, or f64 for f64 input.
    // SAFETY: the C++ layer checked shapes and dtypes of every pointer in `p`.
    crate::with_dtypes!(dt, BastileDType::BASTILE_F32, |T, _F, L| unsafe { chunk_cpu_typed::<T, L>(p) })
}

/// The scaled logit s = softcap(logit_scale * z) / temperature of a logit z, and ds/dz.
#[derive(Clone, Copy)]
struct Scaled {
    logit_scale: f64,
    temperature: f64,
    softcap: f64,
}

impl Scaled {
    fn of(&self, z: f64) -> (f64, f64) {
        let x = self.logit_scale * z;
        if self.softcap > 0.0 {
            let t = (x / self.softcap).tanh();
            (self.softcap * t / self.temperature, self.logit_scale * (1.0 - t * t) / self.temperature)
        } else {
            (x / self.temperature, self.logit_scale / self.temperature)
        }
    }
}

/// Loss of one row in f64, and its stats (entropy, log sum p^2, mean of s, target is the first
/// maximum); `row` is overwritten with the gradient when `grad`, for the loss's upstream gradient `scale`
/// and the entropy's `entropy_scale`.
fn row_cpu<T: Element>(row: &mut [T], target: usize, f: Scaled, z_loss: f64, eps: f64, scale: f64,
                       entropy_scale: f64, grad: bool) -> (f64, [f64; 4]) {
    let s: Vec<f64> = row.iter().map(|z| f.of(z.to_f64()).0).collect();
    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + s.iter().map(|&v| (v - max).exp()).sum::<f64>().ln();
    let mean = s.iter().sum::<f64>() / s.len() as f64;
    let loss = lse - (1.0 - eps) * s[target] - eps * mean + z_loss * lse * lse;
    let entropy = lse - s.iter().map(|&v| (v - lse).exp() * v).sum::<f64>();
    let stats = [
        entropy,
        s.iter().map(|&v| (2.0 * (v - lse)).exp()).sum::<f64>().ln(),
        mean,
        (s[target] >= max && s[..target].iter().all(|&v| v < s[target])) as u8 as f64,
    ];
    if grad {
        let (coef, smooth) = (scale * (1.0 + 2.0 * z_loss * lse), scale * eps / s.len() as f64);
        for (j, z) in row.iter_mut().enumerate() {
            let (sj, slope) = f.of(z.to_f64());
            let log_p = sj - lse;
            let onehot = if j == target { scale * (1.0 - eps) } else { 0.0 };
            let d = log_p.exp() * (coef - entropy_scale * (log_p + entropy)) - onehot - smooth;
            *z = T::from_f64(d * slope);
        }
    }
    (loss, stats)
}

unsafe fn chunk_cpu_typed<T: Element, L: Element>(p: &CrossEntropyChunk) -> Result<()> {
    let (rows, vocab, ld) = (p.rows as usize, p.vocab as usize, p.ld as usize);
    if rows == 0 {
        return Ok(());
    }
    let targets = cpu::slice::<i64>(p.target.cast(), rows);
    // On the CPU the check is free, so a bad target is an error rather than an ignored row.
    if let Some(&t) = targets.iter().find(|&&t| t != p.ignore_index && !(0..p.vocab).contains(&t)) {
        return Err(format!(
            "bastile.fused_linear_cross_entropy: target {t} is outside [0, {vocab}) and is not ignore_index ({})",
            p.ignore_index
        ));
    }
    let scale = if p.count.is_null() {
        1.0
    } else {
        match *p.count {
            c if c > 0 => 1.0 / c as f64,
            _ => 0.0,
        }
    };
    let row_scale = (!p.row_scale.is_null()).then(|| cpu::slice::<L>(p.row_scale.cast(), rows));
    let entropy_scale = (!p.entropy_scale.is_null()).then(|| cpu::slice::<L>(p.entropy_scale.cast(), rows));
    let logits = Disjoint::new(cpu::slice_mut::<T>(p.logits, (rows - 1) * ld + vocab));
    let loss = Disjoint::new(cpu::slice_mut::<L>(p.loss, rows));
    let stats = (!p.stats.is_null()).then(|| Disjoint::new(cpu::slice_mut::<L>(p.stats, rows * 4)));
    let (grad, ignore, z_loss, eps) = (p.grad != 0, p.ignore_index, p.z_loss, p.label_smoothing);
    let f = Scaled { logit_scale: p.logit_scale, temperature: p.temperature, softcap: p.softcap };
    cpu::parallel_for(rows, cpu::GRAIN.div_ceil(vocab.max(1)), |range| {
        // SAFETY: the ranges of parallel_for do not overlap, nor do the rows' first `vocab` elements.
        for ((i, l), &t) in range.clone().zip(loss.part(range.clone())).zip(&targets[range]) {
            let row = logits.part(i * ld..i * ld + vocab);
            let (value, row_stats) = if t == ignore {
                if grad {
                    row.fill(T::from_f64(0.0));
                }
                (0.0, [0.0; 4])
            } else {
                let scale = row_scale.map_or(scale, |r| scale * r[i].to_f64());
                let entropy_scale = entropy_scale.map_or(0.0, |r| r[i].to_f64());
                row_cpu(row, t as usize, f, z_loss, eps, scale, entropy_scale, grad)
            };
            *l = L::from_f64(value);
            if let Some(stats) = &stats {
                for (o, v) in stats.part(i * 4..i * 4 + 4).iter_mut().zip(row_stats) {
                    *o = L::from_f64(v);
                }
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Kernels;
    use crate::testing::noise;
    use half::bf16;
    use std::ffi::c_void;
    use BastileDType::*;

    /// Loss of one row from its definition, with no shared code: the log of a plain sum of exps, and with
    /// label smoothing eps the cross-entropy against (1 - eps) onehot + eps / vocab.
    fn reference_loss(z: &[f64], t: usize, softcap: f64, z_loss: f64, eps: f64) -> f64 {
        let s: Vec<f64> = z.iter().map(|&v| if softcap > 0.0 { softcap * (v / softcap).tanh() } else { v }).collect();
        let lse = s.iter().map(|v| v.exp()).sum::<f64>().ln();
        let uniform = s.iter().map(|v| lse - v).sum::<f64>() / s.len() as f64;
        (1.0 - eps) * (lse - s[t]) + eps * uniform + z_loss * lse * lse
    }

    /// The gradient by central differences of the reference loss.
    fn reference_grad(z: &[f64], t: usize, softcap: f64, z_loss: f64, eps: f64) -> Vec<f64> {
        let h = 1e-6;
        (0..z.len())
            .map(|j| {
                let (mut a, mut b) = (z.to_vec(), z.to_vec());
                a[j] += h;
                b[j] -= h;
                (reference_loss(&a, t, softcap, z_loss, eps) - reference_loss(&b, t, softcap, z_loss, eps)) / (2.0 * h)
            })
            .collect()
    }

    struct Case {
        rows: usize,
        vocab: usize,
        ld: usize,
        softcap: f64,
        z_loss: f64,
        eps: f64,
        count: Option<i64>,
    }

    impl Case {
        /// The chunk's block over these buffers, ignore_index -100, no scale or temperature, no count.
        fn chunk(&self, logits: *mut c_void, target: &[i64], loss: *mut c_void, dtype: BastileDType, grad: bool) -> CrossEntropyChunk {
            CrossEntropyChunk {
                logits,
                target: target.as_ptr(),
                loss,
                rows: self.rows as i64,
                vocab: self.vocab as i64,
                ld: self.ld as i64,
                ignore_index: -100,
                logit_scale: 1.0,
                temperature: 1.0,
                softcap: self.softcap,
                z_loss: self.z_loss,
                label_smoothing: self.eps,
                dtype: dtype as i32,
                grad: grad as i32,
                vec: 1,
                ..Default::default()
            }
        }
    }

    fn run<T: Element, L: Element>(dtype: BastileDType, c: &Case, targets: &[i64], grad: bool) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let z = noise(c.rows * c.ld, 7, 4.0);
        let mut logits: Vec<T> = z.iter().map(|&v| T::from_f64(v)).collect();
        let inputs: Vec<f64> = logits.iter().map(|v| v.to_f64()).collect();
        let mut loss = vec![L::from_f64(f64::NAN); c.rows];
        let count = c.count.unwrap_or(0);
        let mut p = c.chunk(logits.as_mut_ptr().cast(), targets, loss.as_mut_ptr().cast(), dtype, grad);
        if c.count.is_some() {
            p.count = &count;
        }
        chunk_cpu(&p).unwrap();
        (inputs, loss.iter().map(|v| v.to_f64()).collect(), logits.iter().map(|v| v.to_f64()).collect())
    }

    fn check<T: Element, L: Element>(dtype: BastileDType, c: Case, tol: f64) {
        let targets: Vec<i64> = (0..c.rows).map(|r| if r % 3 == 1 { -100 } else { ((r * 7919) % c.vocab) as i64 }).collect();
        let (z, loss, grad) = run::<T, L>(dtype, &c, &targets, true);
        let scale = match c.count {
            None => 1.0,
            Some(n) if n > 0 => 1.0 / n as f64,
            Some(_) => 0.0,
        };
        for (r, &t) in targets.iter().enumerate() {
            let zr = &z[r * c.ld..][..c.vocab];
            let gr = &grad[r * c.ld..][..c.vocab];
            if t < 0 {
                assert_eq!(loss[r], 0.0);
                assert!(gr.iter().all(|&g| g == 0.0), "ignored row {r} has a gradient");
                continue;
            }
            let want = reference_loss(zr, t as usize, c.softcap, c.z_loss, c.eps);
            assert!((loss[r] - want).abs() <= tol * want.abs().max(1.0), "{dtype:?} row {r}: loss {} vs {want}", loss[r]);
            let want_g = reference_grad(zr, t as usize, c.softcap, c.z_loss, c.eps);
            let err = gr.iter().zip(&want_g).map(|(a, b)| (a - scale * b).abs()).fold(0.0, f64::max);
            // The finite difference itself is good to ~1e-9.
            assert!(err <= (tol + 1e-8) * scale, "{dtype:?} row {r}: gradient off by {err}");
        }
        // Padding between rows (ld > vocab) is left alone.
        for r in 0..c.rows {
            for j in c.vocab..c.ld {
                assert_eq!(grad[r * c.ld + j], z[r * c.ld + j]);
            }
        }
        // Without `grad` the logits stay and the loss is the same.
        let (_, loss2, kept) = run::<T, L>(dtype, &c, &targets, false);
        assert_eq!(loss, loss2);
        assert_eq!(kept, z);
    }

    #[test]
    fn cpu_pass_matches_f64_reference() {
        for (softcap, z_loss, eps) in [(0.0, 0.0, 0.0), (30.0, 0.0, 0.1), (0.0, 1e-2, 0.0), (5.0, 1e-3, 0.3)] {
            for (rows, vocab, ld) in [(1, 1, 1), (5, 3, 3), (9, 1000, 1000), (4, 37, 40)] {
                for count in [None, Some(3), Some(0)] {
                    let c = Case { rows, vocab, ld, softcap, z_loss, eps, count };
                    check::<f64, f64>(BASTILE_F64, c, 1e-12);
                    let c = Case { rows, vocab, ld, softcap, z_loss, eps, count };
                    // f32 storage of loss and gradient.
                    check::<f32, f32>(BASTILE_F32, c, 2e-7);
                }
            }
        }
    }

    #[test]
    fn row_scale_multiplies_each_rows_gradient() {
        let (rows, vocab) = (3, 16);
        let targets = [2i64, 5, 11];
        let scales = [2.0f32, -0.5, 0.0];
        let z = noise(rows * vocab, 3, 4.0);
        let grads = |row_scale: Option<&[f32]>| {
            let mut logits: Vec<f32> = z.iter().map(|&v| v as f32).collect();
            let mut loss = vec![0f32; rows];
            let p = CrossEntropyChunk {
                logits: logits.as_mut_ptr().cast(),
                target: targets.as_ptr(),
                loss: loss.as_mut_ptr().cast(),
                row_scale: row_scale.map_or(std::ptr::null(), |r| r.as_ptr().cast()),
                rows: rows as i64,
                vocab: vocab as i64,
                ld: vocab as i64,
                ignore_index: -100,
                logit_scale: 1.0,
                temperature: 1.0,
                dtype: BastileDType::BASTILE_F32 as i32,
                grad: 1,
                vec: 1,
                ..Default::default()
            };
            chunk_cpu(&p).unwrap();
            (loss, logits)
        };
        let (loss1, unit) = grads(None);
        let (loss, scaled) = grads(Some(&scales));
        assert_eq!(loss, loss1, "the losses do not depend on the scale");
        for (i, (a, b)) in scaled.iter().zip(&unit).enumerate() {
            assert_eq!(*a, scales[i / vocab] * b, "element {i}");
        }
    }

    #[test]
    fn bf16_gradient_is_the_rounded_f64_value() {
        let c = Case { rows: 3, vocab: 64, ld: 64, softcap: 0.0, z_loss: 0.0, eps: 0.0, count: Some(2) };
        check::<bf16, f32>(BASTILE_BF16, c, 2f64.powi(-8));
    }

    #[test]
    fn out_of_range_targets_are_errors_on_cpu() {
        let c = Case { rows: 2, vocab: 8, ld: 8, softcap: 0.0, z_loss: 0.0, eps: 0.0, count: None };
        for bad in [8, -1, -101] {
            let z = noise(16, 1, 4.0);
            let mut loss = [0f64; 2];
            let targets = [0, bad];
            let mut logits = z.clone();
            let p = c.chunk(logits.as_mut_ptr().cast(), &targets, loss.as_mut_ptr().cast(), BASTILE_F64, true);
            let err = chunk_cpu(&p).unwrap_err();
            assert!(err.contains(&format!("target {bad} is outside [0, 8)")), "{err}");
            assert_eq!(logits, z, "nothing is written before the check");
        }
    }

    #[test]
    fn every_launch_has_a_kernel() {
        for dtype in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
            for vectorized in [true, false] {
                for softcap in [true, false] {
                    for stats in [true, false] {
                        CrossEntropyChunk::find(&tags(dtype, vectorized, softcap, stats)).unwrap();
                    }
                }
            }
        }
        let i = CrossEntropyChunk::find(&tags(BASTILE_F32, false, true, false)).unwrap();
        assert_eq!(CrossEntropyChunk::KERNELS[i].1, "fused_linear_cross_entropy_rows_f32_scalar_softcap");
        let i = CrossEntropyChunk::find(&tags(BASTILE_BF16, true, false, true)).unwrap();
        assert_eq!(CrossEntropyChunk::KERNELS[i].1, "fused_linear_cross_entropy_rows_bf16_vec_stats");
    }

    /// What TRL's heads compute for one row, from the definitions: the scaled logits, their softmax p,
    /// log p of the target, the entropy -sum p log p, log sum p^2, the mean and argmax's first maximum.
    fn reference_stats(z: &[f64], t: usize, f: Scaled) -> (f64, [f64; 4]) {
        let s: Vec<f64> = z.iter().map(|&v| {
            let x = f.logit_scale * v;
            (if f.softcap > 0.0 { f.softcap * (x / f.softcap).tanh() } else { x }) / f.temperature
        }).collect();
        let total: f64 = s.iter().map(|v| v.exp()).sum();
        let p: Vec<f64> = s.iter().map(|v| v.exp() / total).collect();
        let first_max = (0..s.len()).fold(0, |b, j| if s[j] > s[b] { j } else { b });
        (p[t].ln(), [
            -p.iter().map(|q| q * q.ln()).sum::<f64>(),
            p.iter().map(|q| q * q).sum::<f64>().ln(),
            s.iter().sum::<f64>() / s.len() as f64,
            (first_max == t) as u8 as f64,
        ])
    }

    /// Stats, scaled logits and the entropy's gradient against the definitions (the gradient of
    /// g_lp * log p_t + g_H * H by central differences), ignored rows zero throughout.
    #[test]
    fn stats_and_entropy_gradient_match_the_definitions() {
        let (rows, vocab) = (6, 50);
        let mut z = noise(rows * vocab, 11, 3.0);
        // Row 4: a tie of the target (17) with an earlier maximum (3), so argmax is not the target; row 5:
        // the target is the maximum, tied by a later element.
        z[4 * vocab + 3] = 9.0;
        z[4 * vocab + 17] = 9.0;
        z[5 * vocab + 8] = 9.0;
        z[5 * vocab + 30] = 9.0;
        let targets = [3i64, -100, 49, 0, 17, 8];
        let (g_lp, g_h) = ([0.7f64, 5.0, -1.3, 0.2, 1.0, -0.4], [0.5f64, 2.0, 0.0, -2.5, 1.5, 0.3]);
        for f in [
            Scaled { logit_scale: 1.0, temperature: 1.0, softcap: 0.0 },
            Scaled { logit_scale: 0.5, temperature: 0.7, softcap: 0.0 },
            Scaled { logit_scale: 2.0, temperature: 1.3, softcap: 4.0 },
        ] {
            let mut logits = z.clone();
            let (mut loss, mut stats) = (vec![f64::NAN; rows], vec![f64::NAN; rows * 4]);
            // The loss is -log p_t, so its upstream gradient is -g_lp.
            let row_scale: Vec<f64> = g_lp.iter().map(|g| -g).collect();
            let p = CrossEntropyChunk {
                logits: logits.as_mut_ptr().cast(),
                target: targets.as_ptr(),
                loss: loss.as_mut_ptr().cast(),
                row_scale: row_scale.as_ptr().cast(),
                stats: stats.as_mut_ptr().cast(),
                entropy_scale: g_h.as_ptr().cast(),
                rows: rows as i64,
                vocab: vocab as i64,
                ld: vocab as i64,
                ignore_index: -100,
                logit_scale: f.logit_scale,
                temperature: f.temperature,
                softcap: f.softcap,
                dtype: BASTILE_F64 as i32,
                grad: 1,
                vec: 1,
                ..Default::default()
            };
            chunk_cpu(&p).unwrap();
            for (r, &t) in targets.iter().enumerate() {
                let zr = &z[r * vocab..][..vocab];
                let (got_stats, grad) = (&stats[r * 4..][..4], &logits[r * vocab..][..vocab]);
                if t < 0 {
                    assert_eq!((loss[r], got_stats, grad.iter().all(|&g| g == 0.0)), (0.0, &[0.0; 4][..], true));
                    continue;
                }
                let (log_p, want) = reference_stats(zr, t as usize, f);
                assert!((loss[r] + log_p).abs() < 1e-12, "row {r}: loss {} vs {}", loss[r], -log_p);
                for k in 0..4 {
                    assert!((got_stats[k] - want[k]).abs() < 1e-12, "row {r} stat {k}: {} vs {}", got_stats[k], want[k]);
                }
                let objective = |v: &[f64]| {
                    let (lp, st) = reference_stats(v, t as usize, f);
                    g_lp[r] * lp + g_h[r] * st[0]
                };
                for j in 0..vocab {
                    let (mut a, mut b) = (zr.to_vec(), zr.to_vec());
                    a[j] += 1e-6;
                    b[j] -= 1e-6;
                    let want = (objective(&a) - objective(&b)) / 2e-6;
                    assert!((grad[j] - want).abs() < 1e-7, "row {r} logit {j}: gradient {} vs {want}", grad[j]);
                }
            }
            assert_eq!(stats[4 * 4 + 3], 0.0, "a target tied with an earlier maximum is not argmax");
            assert_eq!(stats[5 * 4 + 3], 1.0, "a target tied with a later maximum is argmax");
        }
    }

    /// Qwen3's vocabulary in bf16 (303,872 bytes a row): 256 MiB for a bf16 weight-gradient sum, 512 MiB
    /// for an f32 one, or the f32 sum's cast copy where larger (hidden 4096: 1.16 GiB, 4096 rows).
    #[test]
    fn chunk_rows_follow_the_budget() {
        let vocab = 151936;
        assert_eq!(chunk_rows(8192, vocab * 2, false, 0, 0), 768);
        assert_eq!(chunk_rows(8192, vocab * 2, true, vocab * 1024 * 2, 0), 1664);
        assert_eq!(chunk_rows(8192, vocab * 2, true, vocab * 4096 * 2, 0), 4096);
        assert_eq!(chunk_rows(100, vocab * 2, true, 0, 0), 100);
        assert_eq!(chunk_rows(0, vocab * 2, true, 0, 0), 1);
        // The Hopper path's forward alone: only partial sums, 4752 bytes a row of Qwen3's vocabulary.
        assert_eq!(gemm_forward_rows(100_000, vocab, 0), 56448);
        assert_eq!(gemm_forward_rows(8192, vocab, 0), 8192);
        // An explicit budget: rows below the alignment stay as they are, at least one.
        assert_eq!(chunk_rows(50, 300 * 4, true, 0, 16 * 300 * 4), 16);
        assert_eq!(chunk_rows(50, 300 * 4, true, 0, 1), 1);
        assert_eq!(chunk_rows(100_000, 1000 * 2, false, 0, 1000 * 2 * 300), 256);
    }

    /// On the CPU (and off Hopper) the cuBLAS path, its chunks sized by the logits' bytes; the plan sizes
    /// the Hopper path's buffers by the rows a chunk takes.
    #[test]
    fn head_plan_off_hopper() {
        let vocab = 151936;
        let mut p = HeadPlan { rows: 8192, cols: 1024, vocab, element_bytes: 2, device: -1, grad: 1, gemm_fits: 1, ..Default::default() };
        p.decide().unwrap();
        assert_eq!((p.gemm, p.ld, p.step, p.buffer_rows), (0, vocab, 768, 768));
        let mut p = HeadPlan { rows: 100, f32_sum: 1, cast_bytes: vocab * 4096 * 2, ..p };
        p.decide().unwrap();
        assert_eq!((p.gemm, p.step, p.buffer_rows), (0, 100, 100));
        let mut p = HeadPlan { rows: 50, cols: 300, vocab: 1000, element_bytes: 4, chunk_bytes: 16 * 4000, ..p };
        p.decide().unwrap();
        assert_eq!((p.ld, p.step), (1000, 16));
    }

    #[test]
    fn blocks_fit_the_row() {
        assert_eq!(block_size(151936 / 8), 512);
        assert_eq!(block_size(1), 32);
        assert_eq!(block_size(4 * 100), 128);
    }

    /// What pass 1 parks in shared memory: the rest of the row past the registers, up to the room.
    #[test]
    fn shared_cache_takes_the_rest_of_the_row_up_to_the_room() {
        let h100_room = 233_472 / 2 - 1024 - 256;
        // Qwen3's vocabulary in bf16: 18992 vectors, 2048 in registers, 14 x 512 in shared memory.
        assert_eq!(shared_vecs(18992, 512, 4, 16, h100_room), 14);
        // A 32000-entry vocabulary: the 1952 vectors past the registers, 4 per thread.
        assert_eq!(shared_vecs(4000, 512, 4, 16, h100_room), 4);
        assert_eq!(shared_vecs(400, 128, 4, 16, h100_room), 0);
        assert_eq!(shared_vecs(18992, 512, 2, 16, 0), 0);
    }
}
