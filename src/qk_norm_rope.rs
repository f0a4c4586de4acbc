//! Fused per-head RMSNorm of q and k followed by rotary embedding (Qwen3 attention's `q_norm`,
//! `k_norm` and `apply_rotary_pos_emb`): CUDA launchers for `cuda/qk_norm_rope.cu` and the CPU
//! kernels (the reference the GPU is tested against). Per row (one token, one head) of D elements:
//! `n = to_N(w * to_X(x * rsqrt(mean(x^2) + eps)))` with N = promote(x, w) and statistics in f32
//! (f64 for f64 input), then `out = to_R(to_R(n * cos) + to_R(rotate_half(n) * sin))` with
//! R = promote(N, cos), `rotate_half(v) = cat(-v[D/2:], v[:D/2])`.
use crate::cpu::{promote, Element};
use crate::driver::{self, fatbins, Dir, Kernel, Launch, Result};
use crate::ffi::guard;
use crate::geometry;
use crate::params::{BastileDType, QkNormRopeBackward, QkNormRopeForward, QkNormRopeShape, RowGeometry};
use half::{bf16, f16};
use rayon::prelude::*;
use std::ffi::c_void;

crate::params::bridged!(QkNormRopeForward, QkNormRopeBackward);

/// Entries of `src/torch/qk_norm_rope.cpp` (`bastile::rs::qk_norm_rope::*`).
#[cxx::bridge(namespace = "bastile::rs::qk_norm_rope")]
mod bridge {
    #[namespace = ""]
    unsafe extern "C++" {
        include!("qk_norm_rope.h");
        type QkNormRopeForward = crate::params::QkNormRopeForward;
        type QkNormRopeBackward = crate::params::QkNormRopeBackward;
    }

    extern "Rust" {
        #[cxx_name = "forward_cuda"]
        fn ffi_forward_cuda(p: &mut QkNormRopeForward, device: i32, stream: usize) -> Result<()>;
        #[cxx_name = "backward_plan"]
        fn ffi_backward_plan(p: &mut QkNormRopeBackward, device: i32) -> Result<i64>;
        #[cxx_name = "backward_cuda"]
        fn ffi_backward_cuda(p: &QkNormRopeBackward, device: i32, stream: usize) -> Result<()>;
        #[cxx_name = "forward_cpu"]
        fn ffi_forward_cpu(p: &QkNormRopeForward) -> Result<()>;
        #[cxx_name = "backward_cpu"]
        fn ffi_backward_cpu(p: &QkNormRopeBackward) -> Result<()>;
    }
}

fn ffi_forward_cuda(p: &mut QkNormRopeForward, device: i32, stream: usize) -> Result<()> {
    guard(|| forward_cuda(p, device, stream))
}
fn ffi_backward_plan(p: &mut QkNormRopeBackward, device: i32) -> Result<i64> {
    guard(|| backward_plan(p, device))
}
fn ffi_backward_cuda(p: &QkNormRopeBackward, device: i32, stream: usize) -> Result<()> {
    guard(|| backward_cuda(p, device, stream))
}
fn ffi_forward_cpu(p: &QkNormRopeForward) -> Result<()> {
    guard(|| forward_cpu(p))
}
fn ffi_backward_cpu(p: &QkNormRopeBackward) -> Result<()> {
    guard(|| backward_cpu(p))
}

/// Element types of x (q and k), the weights and cos/sin.
type DTypes = (BastileDType, BastileDType, BastileDType);

fn dtypes(x: i32, w: i32, c: i32) -> Result<DTypes> {
    Ok((BastileDType::from_raw(x)?, BastileDType::from_raw(w)?, BastileDType::from_raw(c)?))
}

fn cuda_dtypes(x: i32, w: i32, c: i32) -> Result<DTypes> {
    let d = dtypes(x, w, c)?;
    BastileDType::check_cuda("qk_norm_rope", &[d.0, d.1, d.2])?;
    Ok(d)
}

/// Threads of a block: enough rows per block for small heads, and room in `__launch_bounds__(256)`.
const BLOCK: i32 = 128;

/// The vec variant when every tensor allows V-element vectors (V = 16 bytes of x) at every row
/// start and each half row is at most 32 vectors; otherwise a warp per row, element by element.
/// `tensors`: (pointer, dtype, element strides of the row starts).
fn cuda_geometry(head_dim: i64, x: BastileDType, tensors: &[(*const c_void, BastileDType, &[i64])]) -> RowGeometry {
    let v = 16 / x.size() as i64;
    let half = head_dim / 2;
    let aligned = tensors
        .iter()
        .all(|&(ptr, dt, strides)| geometry::aligned(ptr, v as usize * dt.size()) && strides.iter().all(|s| s % v == 0));
    if aligned && half % v == 0 && half / v <= 32 {
        let group = ((half / v) as u32).next_power_of_two() as i32;
        RowGeometry { vec: v as i32, per_thread: 1, group, block: BLOCK }
    } else {
        RowGeometry { vec: 1, per_thread: 0, group: 32, block: BLOCK }
    }
}

fn variant(geo: &RowGeometry) -> &'static str {
    if geo.vec > 1 {
        "vec"
    } else {
        "scalar"
    }
}

fn name(dir: Dir, (x, w, c): DTypes, geo: &RowGeometry) -> String {
    format!("qk_norm_rope_{}_{}_{}_{}_{}", dir.tag(), x.tag(), w.tag(), c.tag(), variant(geo))
}

/// The kernel of a direction, dtypes and variant, loaded once per device; its cache key holds
/// everything its name depends on (the block size is fixed per variant).
fn kernel(dev: &driver::Device, dir: Dir, d: DTypes, geo: &RowGeometry) -> Result<Kernel> {
    let (x, w, c) = d;
    let key = (dir == Dir::Bwd) as u64 | (x as u64) << 4 | (w as u64) << 8 | (c as u64) << 12 | (geo.vec as u64) << 16;
    dev.kernel(fatbins::QK_NORM_ROPE, key, geo.block as u32, || name(dir, d, geo))
}

fn tokens(s: &QkNormRopeShape) -> i64 {
    s.batch * s.seq
}

/// The kernels index rows and tokens in 32 bits (element offsets are 64-bit).
fn check_rows(s: &QkNormRopeShape) -> Result<()> {
    if tokens(s) * (s.q_heads + s.k_heads) >= 1 << 31 {
        return Err("bastile.qk_norm_rope: more than 2^31 (token, head) rows are not supported".into());
    }
    if s.head_dim % 2 != 0 || s.head_dim <= 0 {
        return Err(format!("bastile.qk_norm_rope: head_dim must be even and positive, got {}", s.head_dim));
    }
    Ok(())
}

fn row_tensors(p: &QkNormRopeForward, x: BastileDType, w: BastileDType, c: BastileDType) -> Vec<(*const c_void, BastileDType, Vec<i64>)> {
    let s = &p.shape;
    let out = promote(promote(x, w), c);
    vec![
        (p.q, x, s.q_stride.to_vec()),
        (p.k, x, s.k_stride.to_vec()),
        (p.q_weight, w, vec![]),
        (p.k_weight, w, vec![]),
        (p.cos, c, s.cos_stride.to_vec()),
        (p.sin, c, s.sin_stride.to_vec()),
        (p.q_out, out, vec![s.head_dim]),
        (p.k_out, out, vec![s.head_dim]),
    ]
}

fn geometry_of(head_dim: i64, x: BastileDType, tensors: &[(*const c_void, BastileDType, Vec<i64>)]) -> RowGeometry {
    let views: Vec<_> = tensors.iter().map(|(p, d, s)| (*p, *d, s.as_slice())).collect();
    cuda_geometry(head_dim, x, &views)
}

pub fn forward_cuda(p: &mut QkNormRopeForward, device: i32, stream: usize) -> Result<()> {
    let d = cuda_dtypes(p.x_dtype, p.w_dtype, p.c_dtype)?;
    check_rows(&p.shape)?;
    p.geo = geometry_of(p.shape.head_dim, d.0, &row_tensors(p, d.0, d.1, d.2));
    let dev = driver::device(device)?;
    let kernel = kernel(dev, Dir::Fwd, d, &p.geo)?;
    let rows = tokens(&p.shape) * (p.shape.q_heads + p.shape.k_heads);
    let grid = geometry::grid(p.geo.blocks_for(rows), dev.sm_count() as i64 * kernel.blocks_per_sm as i64) as u32;
    let cfg = Launch { grid: (grid, 1), block: (p.geo.block as u32, 1), shared: 0 };
    // SAFETY: the C++ layer checked shapes, strides, dtypes and devices of every pointer in `p`.
    unsafe { driver::launch(kernel, cfg, stream, p) }
}

/// Chooses the backward's geometry and returns how many f32 partial rows (per weight) of the
/// weight gradients the caller must allocate in `p.partial` (as [2, partials, head_dim]).
pub fn backward_plan(p: &mut QkNormRopeBackward, device: i32) -> Result<i64> {
    let d = cuda_dtypes(p.x_dtype, p.w_dtype, p.c_dtype)?;
    check_rows(&p.shape)?;
    let (x, w, c) = d;
    let s = &p.shape;
    let out = promote(promote(x, w), c);
    let tensors = vec![
        (p.q, x, s.q_stride.to_vec()),
        (p.k, x, s.k_stride.to_vec()),
        (p.q_weight, w, vec![]),
        (p.k_weight, w, vec![]),
        (p.cos, c, s.cos_stride.to_vec()),
        (p.sin, c, s.sin_stride.to_vec()),
        (p.grad_q, out, p.grad_q_stride.to_vec()),
        (p.grad_k, out, p.grad_k_stride.to_vec()),
        (p.grad_q_in as *const c_void, x, vec![s.head_dim]),
        (p.grad_k_in as *const c_void, x, vec![s.head_dim]),
    ];
    p.geo = geometry_of(s.head_dim, x, &tensors);
    let dev = driver::device(device)?;
    let kernel = kernel(dev, Dir::Bwd, d, &p.geo)?;
    // One resident wave: each block folds all its rows of one weight into one partial (per group
    // in the scalar variant).
    let rows = tokens(s) * s.q_heads.max(s.k_heads);
    let grid = p.geo.blocks_for(rows).min(dev.sm_count() as i64 * kernel.blocks_per_sm as i64);
    Ok(grid * partials_per_block(&p.geo))
}

fn partials_per_block(geo: &RowGeometry) -> i64 {
    if geo.vec > 1 {
        1
    } else {
        geo.rows_per_block()
    }
}

pub fn backward_cuda(p: &QkNormRopeBackward, device: i32, stream: usize) -> Result<()> {
    let d = cuda_dtypes(p.x_dtype, p.w_dtype, p.c_dtype)?;
    if p.geo.block == 0 || p.partials <= 0 || p.partial.is_null() {
        return Err("bastile.qk_norm_rope_backward: launched without a plan".into());
    }
    let dev = driver::device(device)?;
    let kernel = kernel(dev, Dir::Bwd, d, &p.geo)?;
    let grid = (p.partials / partials_per_block(&p.geo)) as u32;
    // The vec variant folds its groups' shares in shared memory: [groups][head_dim] f32.
    let shared = if p.geo.vec > 1 { (p.geo.rows_per_block() * p.shape.head_dim * 4) as u32 } else { 0 };
    let cfg = Launch { grid: (grid, 1), block: (p.geo.block as u32, 1), shared };
    let w = d.1;
    let reduce = dev.kernel(fatbins::QK_NORM_ROPE, 2 | (w as u64) << 8, 256, || format!("qk_norm_rope_bwd_reduce_{}", w.tag()))?;
    let reduce_cfg = Launch { grid: (geometry::ceil_div(p.shape.head_dim, 32) as u32, 2), block: (32, 8), shared: 0 };
    // SAFETY: the C++ layer checked every pointer in `p` and sized `partial` from the plan.
    unsafe {
        driver::launch(kernel, cfg, stream, p)?;
        driver::launch(reduce, reduce_cfg, stream, p)
    }
}

// ------------------------------------------------------------------------------------------ CPU

/// A tensor of a dtype known at run time: the CPU kernels are the reference, not the fast path, so
/// they dispatch per element instead of instantiating every combination of three dtypes.
#[derive(Clone, Copy)]
struct Typed {
    ptr: *mut c_void,
    dt: BastileDType,
}

// SAFETY: the CPU kernels write disjoint rows from different threads.
unsafe impl Send for Typed {}
unsafe impl Sync for Typed {}

impl Typed {
    fn new(ptr: *const c_void, dt: BastileDType) -> Self {
        Typed { ptr: ptr as *mut c_void, dt }
    }

    /// # Safety
    /// Element `i` must be in bounds.
    unsafe fn get(self, i: i64) -> f64 {
        use BastileDType::*;
        let i = i as isize;
        match self.dt {
            BASTILE_F32 => *self.ptr.cast::<f32>().offset(i) as f64,
            BASTILE_F16 => (*self.ptr.cast::<f16>().offset(i)).to_f64(),
            BASTILE_BF16 => (*self.ptr.cast::<bf16>().offset(i)).to_f64(),
            BASTILE_F64 => *self.ptr.cast::<f64>().offset(i),
        }
    }

    /// # Safety
    /// Element `i` must be in bounds and written by no other thread.
    unsafe fn set(self, i: i64, v: f64) {
        use BastileDType::*;
        let i = i as isize;
        match self.dt {
            BASTILE_F32 => *self.ptr.cast::<f32>().offset(i) = <f32 as Element>::from_f64(v),
            BASTILE_F16 => *self.ptr.cast::<f16>().offset(i) = <f16 as Element>::from_f64(v),
            BASTILE_BF16 => *self.ptr.cast::<bf16>().offset(i) = <bf16 as Element>::from_f64(v),
            BASTILE_F64 => *self.ptr.cast::<f64>().offset(i) = v,
        }
    }
}

/// `v` stored in `dt` and read back, as torch rounds an intermediate.
fn round(dt: BastileDType, v: f64) -> f64 {
    use BastileDType::*;
    match dt {
        BASTILE_F32 => <f32 as Element>::round(v),
        BASTILE_F16 => <f16 as Element>::round(v),
        BASTILE_BF16 => <bf16 as Element>::round(v),
        BASTILE_F64 => v,
    }
}

/// One tensor's rows: (batch, seq, head) element strides, head count, and where its row r
/// (token-major) starts.
struct Rows {
    heads: i64,
    stride: [i64; 3],
    seq: i64,
}

impl Rows {
    /// (batch, position, element offset) of row r.
    fn locate(&self, r: i64) -> (i64, i64, i64) {
        let (token, head) = (r / self.heads, r % self.heads);
        let (b, s) = (token / self.seq, token % self.seq);
        (b, s, b * self.stride[0] + s * self.stride[1] + head * self.stride[2])
    }
}

/// Statistics are stored in f64 for f64 input, f32 otherwise (as the GPU does).
fn stats(x: BastileDType) -> BastileDType {
    if x == BastileDType::BASTILE_F64 {
        x
    } else {
        BastileDType::BASTILE_F32
    }
}

pub fn forward_cpu(p: &QkNormRopeForward) -> Result<()> {
    let (xd, wd, cd) = dtypes(p.x_dtype, p.w_dtype, p.c_dtype)?;
    check_rows(&p.shape)?;
    let (nd, sd) = (promote(xd, wd), stats(xd));
    let rd = promote(nd, cd);
    let (s, eps) = (&p.shape.clone(), p.eps);
    let d = s.head_dim;
    let half = d / 2;
    let (cos, sin) = (Typed::new(p.cos, cd), Typed::new(p.sin, cd));
    let sides = [
        (p.q, p.q_weight, p.q_out, p.q_rstd, s.q_heads, s.q_stride),
        (p.k, p.k_weight, p.k_out, p.k_rstd, s.k_heads, s.k_stride),
    ];
    for (x, w, out, rstd, heads, stride) in sides {
        let (x, w, out, rstd) = (Typed::new(x, xd), Typed::new(w, wd), Typed::new(out, rd), Typed::new(rstd, sd));
        let rows = Rows { heads, stride, seq: s.seq };
        (0..tokens(s) * heads).into_par_iter().for_each(|r| {
            let (b, t, off) = rows.locate(r);
            let cs = |st: [i64; 2]| b * st[0] + t * st[1];
            let (co, so) = (cs(s.cos_stride), cs(s.sin_stride));
            // SAFETY: the C++ layer checked shapes and strides; row r of out and rstd is this task's.
            unsafe {
                let xs: Vec<f64> = (0..d).map(|j| x.get(off + j)).collect();
                let ss: f64 = xs.iter().map(|v| v * v).sum();
                let rs = round(sd, 1.0 / (ss / d as f64 + eps).sqrt());
                if !rstd.ptr.is_null() {
                    rstd.set(r, rs);
                }
                let n: Vec<f64> = (0..d).map(|j| round(nd, w.get(j) * round(xd, xs[j as usize] * rs))).collect();
                for j in 0..half {
                    let (lo, hi) = (n[j as usize], n[(j + half) as usize]);
                    let o_lo = round(rd, lo * cos.get(co + j)) + round(rd, -hi * sin.get(so + j));
                    let o_hi = round(rd, hi * cos.get(co + j + half)) + round(rd, lo * sin.get(so + j + half));
                    out.set(r * d + j, o_lo);
                    out.set(r * d + j + half, o_hi);
                }
            }
        });
    }
    Ok(())
}

pub fn backward_cpu(p: &QkNormRopeBackward) -> Result<()> {
    let (xd, wd, cd) = dtypes(p.x_dtype, p.w_dtype, p.c_dtype)?;
    check_rows(&p.shape)?;
    let (sd, gd) = (stats(xd), promote(promote(xd, wd), cd));
    let s = &p.shape.clone();
    let d = s.head_dim;
    let half = d / 2;
    let (cos, sin) = (Typed::new(p.cos, cd), Typed::new(p.sin, cd));
    let sides = [
        (p.grad_q, p.grad_q_stride, p.q, p.q_weight, p.q_rstd, p.grad_q_in, p.grad_q_weight, s.q_heads, s.q_stride),
        (p.grad_k, p.grad_k_stride, p.k, p.k_weight, p.k_rstd, p.grad_k_in, p.grad_k_weight, s.k_heads, s.k_stride),
    ];
    for (g, g_stride, x, w, rstd, gx, gw, heads, stride) in sides {
        let (g, x, w) = (Typed::new(g, gd), Typed::new(x, xd), Typed::new(w, wd));
        let (rstd, gx, gw) = (Typed::new(rstd, sd), Typed::new(gx, xd), Typed::new(gw, wd));
        let (xrows, grows) = (Rows { heads, stride, seq: s.seq }, Rows { heads, stride: g_stride, seq: s.seq });
        // SAFETY (all accesses below): the C++ layer checked shapes and strides; each chunk writes
        // only its own rows of grad_x.
        let ws: Vec<f64> = (0..d).map(|j| unsafe { w.get(j) }).collect();
        let rows = tokens(s) * heads;
        // Chunking depends on the shape alone, so the weight gradient's summation order (and
        // value) does not depend on the thread count.
        let chunk = (rows / 256).max(16);
        let partials: Vec<Vec<f64>> = (0..geometry::ceil_div(rows, chunk))
            .into_par_iter()
            .map(|c| {
                let mut dw = vec![0f64; d as usize];
                let mut gn = vec![0f64; d as usize];
                for r in c * chunk..((c + 1) * chunk).min(rows) {
                    let (b, t, off) = xrows.locate(r);
                    let goff = grows.locate(r).2;
                    let cs = |st: [i64; 2]| b * st[0] + t * st[1];
                    let (co, so) = (cs(s.cos_stride), cs(s.sin_stride));
                    unsafe {
                        for j in 0..half {
                            let (g_lo, g_hi) = (g.get(goff + j), g.get(goff + j + half));
                            gn[j as usize] = g_lo * cos.get(co + j) + g_hi * sin.get(so + j + half);
                            gn[(j + half) as usize] = g_hi * cos.get(co + j + half) - g_lo * sin.get(so + j);
                        }
                        let rs = rstd.get(r);
                        let xs: Vec<f64> = (0..d).map(|j| x.get(off + j)).collect();
                        let dot: f64 = (0..d as usize).map(|j| gn[j] * ws[j] * xs[j]).sum();
                        let c3 = rs * rs * rs * dot / d as f64;
                        for j in 0..d as usize {
                            gx.set(r * d + j as i64, rs * gn[j] * ws[j] - xs[j] * c3);
                            dw[j] += gn[j] * round(xd, xs[j] * rs);
                        }
                    }
                }
                dw
            })
            .collect();
        for j in 0..d as usize {
            // SAFETY: grad_w has head_dim elements.
            unsafe { gw.set(j as i64, partials.iter().map(|dw| dw[j]).sum()) };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{noise, rel_err_floor};
    use BastileDType::*;

    /// A buffer of `dt` elements (stored as raw bytes, 8 per element to fit any dtype).
    struct Buf {
        data: Vec<u64>,
        dt: BastileDType,
    }

    impl Buf {
        fn from(v: &[f64], dt: BastileDType) -> Buf {
            let b = Buf { data: vec![0; v.len()], dt };
            for (i, x) in v.iter().enumerate() {
                unsafe { b.typed().set(i as i64, *x) };
            }
            b
        }
        fn nan(n: usize, dt: BastileDType) -> Buf {
            Buf::from(&vec![f64::NAN; n], dt)
        }
        fn typed(&self) -> Typed {
            Typed::new(self.data.as_ptr().cast(), self.dt)
        }
        fn ptr(&self) -> *const c_void {
            self.data.as_ptr().cast()
        }
        fn mut_ptr(&mut self) -> *mut c_void {
            self.data.as_mut_ptr().cast()
        }
        fn values(&self) -> Vec<f64> {
            (0..self.data.len()).map(|i| unsafe { self.typed().get(i as i64) }).collect()
        }
    }

    struct Case {
        batch: usize,
        seq: usize,
        hq: usize,
        hk: usize,
        d: usize,
        /// cos/sin differ per batch row (packed sequences) instead of one [seq, d] table.
        per_batch_cos: bool,
    }

    /// The row's forward map as matrices, independent of the kernels' pairwise formulas: the
    /// rotation M (out = M n) and the normalisation's Jacobian J (dn = J dx).
    fn rotation(c: &[f64], s: &[f64]) -> Vec<Vec<f64>> {
        let d = c.len();
        let h = d / 2;
        let mut m = vec![vec![0.0; d]; d];
        for i in 0..d {
            m[i][i] = c[i];
            // rotate_half(n)[i] = -n[i + h] for i < h, n[i - h] otherwise.
            if i < h {
                m[i][i + h] = -s[i];
            } else {
                m[i][i - h] = s[i];
            }
        }
        m
    }

    fn matvec(m: &[Vec<f64>], v: &[f64]) -> Vec<f64> {
        m.iter().map(|row| row.iter().zip(v).map(|(a, b)| a * b).sum()).collect()
    }

    fn transpose(m: &[Vec<f64>]) -> Vec<Vec<f64>> {
        (0..m[0].len()).map(|j| m.iter().map(|row| row[j]).collect()).collect()
    }

    fn unit(d: BastileDType) -> f64 {
        match d {
            BASTILE_F64 => 2f64.powi(-50),
            BASTILE_F32 => 2f64.powi(-24),
            BASTILE_F16 => 2f64.powi(-11),
            BASTILE_BF16 => 2f64.powi(-8),
        }
    }

    /// Runs the CPU kernels on q and k living inside one fused [batch, seq, hq + 2 hk, d] buffer
    /// (strided, as HF's slices of a fused projection), and checks them against the matrices.
    fn check(case: &Case, (xd, wd, cd): DTypes) {
        let Case { batch, seq, hq, hk, d, per_batch_cos } = *case;
        let eps = 1e-6;
        let heads = hq + 2 * hk;
        let fused = Buf::from(&noise(batch * seq * heads * d, 1, 2.0), xd);
        let stride = [(seq * heads * d) as i64, (heads * d) as i64, d as i64];
        let (qw, kw) = (Buf::from(&noise(d, 2, 2.0), wd), Buf::from(&noise(d, 3, 2.0), wd));
        let cs_rows = if per_batch_cos { batch * seq } else { seq };
        let angle: Vec<f64> = noise(cs_rows * d, 4, 2.0).iter().map(|a| a * 3.0).collect();
        let cos = Buf::from(&angle.iter().map(|a| a.cos()).collect::<Vec<_>>(), cd);
        let sin = Buf::from(&angle.iter().map(|a| a.sin()).collect::<Vec<_>>(), cd);
        let cs_stride = [if per_batch_cos { (seq * d) as i64 } else { 0 }, d as i64];
        let out_dt = promote(promote(xd, wd), cd);
        let shape = QkNormRopeShape {
            batch: batch as i64,
            seq: seq as i64,
            q_heads: hq as i64,
            k_heads: hk as i64,
            head_dim: d as i64,
            q_stride: stride,
            k_stride: stride,
            cos_stride: cs_stride,
            sin_stride: cs_stride,
        };
        let (mut q_out, mut k_out) = (Buf::nan(batch * seq * hq * d, out_dt), Buf::nan(batch * seq * hk * d, out_dt));
        let (mut q_rstd, mut k_rstd) = (Buf::nan(batch * seq * hq, stats(xd)), Buf::nan(batch * seq * hk, stats(xd)));
        let k_ptr = unsafe { fused.typed().ptr.cast::<u8>().add(hq * d * xd.size()) };
        let p = QkNormRopeForward {
            q: fused.ptr(),
            k: k_ptr.cast(),
            q_weight: qw.ptr(),
            k_weight: kw.ptr(),
            cos: cos.ptr(),
            sin: sin.ptr(),
            q_out: q_out.mut_ptr(),
            k_out: k_out.mut_ptr(),
            q_rstd: q_rstd.mut_ptr(),
            k_rstd: k_rstd.mut_ptr(),
            shape,
            eps,
            x_dtype: xd as i32,
            w_dtype: wd as i32,
            c_dtype: cd as i32,
            ..Default::default()
        };
        forward_cpu(&p).unwrap();

        let gq_all = noise(batch * seq * hq * d * 2, 5, 2.0); // grad_q read through a transposed-like stride
        let gk = noise(batch * seq * hk * d, 6, 2.0);
        let (gq_buf, gk_buf) = (Buf::from(&gq_all, out_dt), Buf::from(&gk, out_dt));
        let (mut gq_in, mut gk_in) = (Buf::nan(batch * seq * hq * d, xd), Buf::nan(batch * seq * hk * d, xd));
        let (mut gqw, mut gkw) = (Buf::nan(d, wd), Buf::nan(d, wd));
        let b = QkNormRopeBackward {
            grad_q: gq_buf.ptr(),
            grad_k: gk_buf.ptr(),
            q: p.q,
            k: p.k,
            q_weight: p.q_weight,
            k_weight: p.k_weight,
            cos: p.cos,
            sin: p.sin,
            q_rstd: p.q_rstd,
            k_rstd: p.k_rstd,
            grad_q_in: gq_in.mut_ptr(),
            grad_k_in: gk_in.mut_ptr(),
            grad_q_weight: gqw.mut_ptr(),
            grad_k_weight: gkw.mut_ptr(),
            // grad_q: every other head slot of a [batch, seq, 2 hq, d] buffer.
            grad_q_stride: [(seq * 2 * hq * d) as i64, (2 * hq * d) as i64, (2 * d) as i64],
            grad_k_stride: [(seq * hk * d) as i64, (hk * d) as i64, d as i64],
            shape,
            x_dtype: xd as i32,
            w_dtype: wd as i32,
            c_dtype: cd as i32,
            ..Default::default()
        };
        backward_cpu(&b).unwrap();

        // Reference, row by row, in f64 on the same (rounded) inputs.
        let (xs, cosv, sinv) = (fused.values(), cos.values(), sin.values());
        let (gq_vals, gk_vals) = (gq_buf.values(), gk_buf.values());
        let tol = 6.0 * [xd, wd, cd, out_dt].iter().map(|&t| unit(t)).fold(0.0, f64::max);
        for (is_k, heads_n, w, out, rstd, gin, gw) in
            [(false, hq, &qw, &q_out, &q_rstd, &gq_in, &gqw), (true, hk, &kw, &k_out, &k_rstd, &gk_in, &gkw)]
        {
            let wv = w.values();
            let (outv, rstdv, ginv) = (out.values(), rstd.values(), gin.values());
            let mut gw_ref = vec![0.0; d];
            let (mut y_ref, mut gx_ref, mut scale) = (vec![], vec![], 0.0);
            for r in 0..batch * seq * heads_n {
                let (token, head) = (r / heads_n, r % heads_n);
                let (bi, si) = (token / seq, token % seq);
                let slot = if is_k { hq + head } else { head };
                let x = &xs[(token * heads + slot) * d..][..d];
                let cs_row = if per_batch_cos { bi * seq + si } else { si };
                let m = rotation(&cosv[cs_row * d..][..d], &sinv[cs_row * d..][..d]);
                let rs = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
                assert!((rstdv[r] - rs).abs() <= 2.0 * unit(stats(xd)) * rs, "rstd row {r}");
                let n: Vec<f64> = x.iter().zip(&wv).map(|(a, w)| a * rs * w).collect();
                y_ref.extend(matvec(&m, &n));
                let g: Vec<f64> = if is_k {
                    gk_vals[r * d..][..d].to_vec()
                } else {
                    gq_vals[(token * 2 * hq + 2 * head) * d..][..d].to_vec()
                };
                let gn = matvec(&transpose(&m), &g);
                for k in 0..d {
                    let mut acc = 0.0;
                    for i in 0..d {
                        let dn = wv[i] * (if i == k { rs } else { 0.0 } - x[i] * x[k] * rs.powi(3) / d as f64);
                        acc += gn[i] * dn;
                    }
                    gx_ref.push(acc);
                    gw_ref[k] += gn[k] * x[k] * rs;
                    scale += (rs * gn[k] * wv[k]).powi(2);
                }
            }
            let e_y = rel_err_floor(&outv, &y_ref, 0.0);
            let e_x = rel_err_floor(&ginv, &gx_ref, scale.sqrt());
            let e_w = rel_err_floor(&gw.values(), &gw_ref, 0.0);
            assert!(
                e_y < tol && e_x < tol && e_w < tol,
                "{xd:?}/{wd:?}/{cd:?} k={is_k} d={d}: out {e_y}, grad_x {e_x}, grad_w {e_w} (tol {tol})"
            );
        }
    }

    #[test]
    fn cpu_kernels_match_f64_matrices() {
        let cases = [
            Case { batch: 2, seq: 3, hq: 4, hk: 2, d: 8, per_batch_cos: false },
            Case { batch: 2, seq: 5, hq: 2, hk: 2, d: 64, per_batch_cos: true },
            Case { batch: 1, seq: 3, hq: 4, hk: 1, d: 128, per_batch_cos: false },
            Case { batch: 3, seq: 1, hq: 1, hk: 1, d: 2, per_batch_cos: true },
        ];
        let combos = [
            (BASTILE_F64, BASTILE_F64, BASTILE_F64),
            (BASTILE_F32, BASTILE_F32, BASTILE_F32),
            (BASTILE_BF16, BASTILE_BF16, BASTILE_BF16),
            (BASTILE_F16, BASTILE_F16, BASTILE_F16),
            (BASTILE_BF16, BASTILE_F32, BASTILE_BF16),
            (BASTILE_F16, BASTILE_BF16, BASTILE_F32),
        ];
        for case in &cases {
            for &dt in &combos {
                check(case, dt);
            }
        }
    }

    #[test]
    fn weight_gradient_sums_many_chunks() {
        check(&Case { batch: 4, seq: 300, hq: 3, hk: 2, d: 16, per_batch_cos: true }, (BASTILE_F32, BASTILE_F32, BASTILE_F32));
    }

    #[test]
    fn bad_dtype_codes_odd_head_dim_and_f64_on_cuda_are_errors() {
        let mut p = QkNormRopeForward { x_dtype: 9, ..Default::default() };
        assert!(forward_cpu(&p).unwrap_err().contains("unknown dtype"));
        p.x_dtype = BASTILE_F64 as i32;
        assert!(forward_cuda(&mut p, 0, 0).unwrap_err().contains("CPU only"));
        p.x_dtype = BASTILE_F32 as i32;
        p.shape.head_dim = 3;
        assert!(forward_cpu(&p).unwrap_err().contains("even"));
    }

    #[test]
    fn geometry_keeps_rotation_pairs_in_one_lane() {
        let aligned = 4096 as *const c_void;
        let strides: &[i64] = &[1 << 20, 3072, 128];
        let geo = |d: i64, x: BastileDType, ptr: *const c_void, st: &[i64]| cuda_geometry(d, x, &[(ptr, x, st)]);
        // bf16: 8-element vectors, one of each half per lane.
        assert_eq!((geo(128, BASTILE_BF16, aligned, strides).group, geo(128, BASTILE_BF16, aligned, strides).vec), (8, 8));
        assert_eq!(geo(64, BASTILE_BF16, aligned, strides).group, 4);
        assert_eq!(geo(256, BASTILE_BF16, aligned, strides).group, 16);
        assert_eq!(geo(192, BASTILE_BF16, aligned, strides).group, 16); // 12 lanes busy
        assert_eq!((geo(128, BASTILE_F32, aligned, strides).group, geo(128, BASTILE_F32, aligned, strides).vec), (16, 4));
        // Misaligned pointers or strides, odd half rows and long rows go element by element.
        for g in [
            geo(128, BASTILE_BF16, 4098 as *const c_void, strides),
            geo(128, BASTILE_BF16, aligned, &[1 << 20, 3073, 128]),
            geo(12, BASTILE_BF16, aligned, &[24]),
            geo(1024, BASTILE_BF16, aligned, &[1024]),
        ] {
            assert_eq!((g.vec, g.group, variant(&g)), (1, 32, "scalar"));
        }
    }

    #[test]
    fn kernel_names_match_cuda_symbols() {
        let g = cuda_geometry(128, BASTILE_BF16, &[]);
        assert_eq!(name(Dir::Fwd, (BASTILE_BF16, BASTILE_F32, BASTILE_BF16), &g), "qk_norm_rope_fwd_bf16_f32_bf16_vec");
        let g = cuda_geometry(6, BASTILE_F16, &[]);
        assert_eq!(name(Dir::Bwd, (BASTILE_F16, BASTILE_F16, BASTILE_F32), &g), "qk_norm_rope_bwd_f16_f16_f32_scalar");
    }
}
