//! What the experts' grouped GEMMs (`expert_swiglu`, `expert_linear`) share on the host: the offsets checked for
//! the CPU kernels and a row's products there, which path a call may take, the fallback's launch, and the Hopper
//! launch of cuda/expert_tiles.cuh's walk over gemm_bf16_tn.
use crate::cpu::Element;
use crate::driver::{Device, Kernel, LaunchConfig, Result};
use crate::kernels::{self, Kernels, Tag};
use crate::params::{
    BastileDType, BastileTensorMap, ExpertGemm, BASTILE_GEMM_THREADS, BASTILE_GEMM_TILE_K, BASTILE_GEMM_TILE_M, BASTILE_GEMM_TILE_N,
};

/// Whether a grouped GEMM's Hopper kernel may take a call, before its op's own shape conditions: operands that the
/// C++ layer found to fit, on a CUDA device of compute capability 9.0, at most `max` experts.
pub fn hopper(fits: i32, device: i32, experts: i32, max: u32) -> bool {
    fits != 0
        && device >= 0
        && experts as u32 <= max
        && crate::driver::device(device).is_ok_and(|d| d.capability() == (9, 0))
}

/// The fallback kernel of op `P` for `dtype` and its launch: a thread an element of `elements`, `block` threads a
/// block, at most 32 blocks an SM (the kernel strides over the rest).
pub fn rows<P: Kernels>(dev: &Device, dtype: BastileDType, elements: i64, block: u32) -> Result<(Kernel, LaunchConfig)> {
    let kernel = kernels::kernel::<P>(dev, &[Tag::Rows, dtype.tag()], block)?;
    let grid = crate::geometry::ceil_div(elements, block as i64).clamp(1, 32 * dev.sm_count() as i64) as u32;
    Ok((kernel, LaunchConfig { grid: (grid, 1), block: (block, 1), shared: 0 }))
}

/// Whether the Hopper kernels' tail stage takes a low-rank product of `rank` (0: none): rows of 16-byte multiples,
/// at most a stage's k.
pub fn tail_fits(rank: i64) -> bool {
    rank == 0 || (rank % 8 == 0 && rank <= BASTILE_GEMM_TILE_K as i64)
}

/// Op `P`'s Hopper GEMM kernel `variant`, which takes bf16 on compute capability 9.0 only.
pub fn gemm_kernel<P: Kernels>(op: &str, dev: &Device, dtype: BastileDType, variant: Tag) -> Result<Kernel> {
    if dev.capability() != (9, 0) || dtype != BastileDType::BASTILE_BF16 {
        return Err(format!("bastile.{op}: the GEMM kernel takes bf16 on compute capability 9.0"));
    }
    kernels::kernel_sharing::<P>(dev, &[Tag::Gemm, Tag::Bf16, variant], BASTILE_GEMM_THREADS, 1)
}

/// Each expert's end, checked: non-decreasing within 0..pairs, the last at pairs (every row has an expert).
///
/// # Safety
/// `offsets` must point to `experts` int32.
pub unsafe fn ends(op: &str, offsets: *const i32, experts: i32, pairs: i64) -> Result<Vec<usize>> {
    let raw = crate::cpu::slice::<i32>(offsets.cast(), experts as usize);
    let mut last = 0i64;
    for (e, &end) in raw.iter().enumerate() {
        let end = end as i64;
        if end < last || end > pairs {
            return Err(format!("bastile.{op}: offsets[{e}] = {end} must lie in {last}..={pairs} (non-decreasing, within the pairs)"));
        }
        last = end;
    }
    if last != pairs {
        return Err(format!("bastile.{op}: the last offset is {last}, but x has {pairs} rows"));
    }
    Ok(raw.iter().map(|&e| e as usize).collect())
}

/// The CPU kernels' products of one row `x` with its expert's weight rows ([out.len(), x.len()]), plus those of
/// its low-rank row `lora_x` with the expert's lora_weight rows ([out.len(), lora_x.len()]; both empty without):
/// each summed in f64 and rounded once.
pub fn row_products<T: Element>(x: &[T], weight: &[T], lora_x: &[T], lora_weight: &[T], out: &mut [T]) {
    let (k, rank) = (x.len(), lora_x.len());
    for (c, o) in out.iter_mut().enumerate() {
        *o = T::from_f64(dot(x, &weight[c * k..][..k]) + dot(lora_x, &lora_weight[c * rank..][..rank]));
    }
}

/// The rows `rows` of a low-rank operand `width` wide, or nothing without one (`width` 0).
///
/// # Safety
/// Where `width` > 0, `ptr` must point to `rows * width` elements of T.
pub unsafe fn low_rank<'a, T: Element>(ptr: *const std::ffi::c_void, rows: usize, width: usize) -> &'a [T] {
    if width == 0 {
        return &[];
    }
    crate::cpu::slice::<T>(ptr, rows * width)
}

/// The f64 sum of the products of a and b.
pub fn dot<T: Element>(a: &[T], b: &[T]) -> f64 {
    a.iter().zip(b).map(|(a, b)| a.to_f64() * b.to_f64()).sum()
}

/// How a grouped GEMM's weight is stored, as its TMA map reads it: the experts' weights stacked as `rows` rows.
pub enum Weight {
    /// Rows of the product's k (gemm_bf16_tn's Major::K): [experts * out, k].
    K { rows: i64 },
    /// Rows of out, `cols` (Major::N): [experts * k, out].
    N { rows: i64, cols: i64 },
}

/// One product's operands: rows of x `k` wide ([pairs, k]) and the experts' weights as `layout` stores them.
pub struct Operands {
    pub x: *const std::ffi::c_void,
    pub weight: *const std::ffi::c_void,
    pub k: i64,
    pub layout: Weight,
}

impl Operands {
    /// The TMA maps of x and the weight. Box rows of 128 bytes (64 bf16), the span of the 128-byte swizzle, which
    /// is also a stage's k (columns past k read as TMA's zeros): x, a stage's k by the tile's rows; K-major, a
    /// stage's k by half the tile's rows of B; N-major, 64 of out's columns by a stage's k rows, four boxes a tile.
    fn maps(&self, pairs: i64) -> Result<(BastileTensorMap, BastileTensorMap)> {
        let k = BASTILE_GEMM_TILE_K;
        let x = crate::driver::tensor_map_bf16(self.x, pairs, self.k, k, BASTILE_GEMM_TILE_M)?;
        let weight = match self.layout {
            Weight::K { rows } => crate::driver::tensor_map_bf16(self.weight, rows, self.k, k, BASTILE_GEMM_TILE_N / 2)?,
            Weight::N { rows, cols } => crate::driver::tensor_map_bf16(self.weight, rows, cols, k, k)?,
        };
        Ok((x, weight))
    }

    fn rows(&self) -> i64 {
        match self.layout {
            Weight::K { rows } | Weight::N { rows, .. } => rows,
        }
    }
}

/// A grouped GEMM's launch: `main`'s product plus `tail`'s (gemm_bf16_tn's TailProduct, in main's layout), tiles of
/// BASTILE_GEMM_TILE_M rows of one expert by `col_tiles` column tiles an expert.
pub struct Gemm {
    pub main: Operands,
    pub tail: Option<Operands>,
    pub pairs: i64,
    pub experts: i32,
    pub col_tiles: i64,
}

impl Gemm {
    /// `kernel` (gemm_bf16_tn's) with as many stages as its shared memory holds, up to `max_stages`; a block an SM
    /// up to the tiles' bound (each expert's row tiles rounded up). Returns what the op's block takes (its TMA maps,
    /// the tail's zeros without one) and the launch.
    pub fn launch(&self, op: &str, dev: &Device, kernel: &Kernel, max_stages: u32) -> Result<(ExpertGemm, LaunchConfig)> {
        // The walk's tile indices and TMA's row coordinates are 32-bit.
        let tiles = (crate::geometry::ceil_div(self.pairs, BASTILE_GEMM_TILE_M as i64) + self.experts as i64) * self.col_tiles;
        let rows = self.main.rows().max(self.tail.as_ref().map_or(0, Operands::rows));
        if tiles > i32::MAX as i64 || rows > i32::MAX as i64 || self.pairs > i32::MAX as i64 {
            return Err(format!("bastile.{op}: {} pairs of {} experts are more than 32-bit tile indices reach", self.pairs, self.experts));
        }
        let (x_map, weight_map) = self.main.maps(self.pairs)?;
        let (lora_x_map, lora_weight_map) = match &self.tail {
            Some(tail) => tail.maps(self.pairs)?,
            None => Default::default(),
        };
        let (stages, shared) = crate::geometry::gemm_stages(kernel.shared, max_stages)
            .ok_or_else(|| format!("bastile.{op}: {} bytes of shared memory hold no GEMM pipeline", kernel.shared))?;
        let grid = tiles.clamp(1, dev.sm_count() as i64) as u32;
        let cfg = LaunchConfig { grid: (grid, 1), block: (BASTILE_GEMM_THREADS, 1), shared };
        let gemm = ExpertGemm { stages: stages as i32, col_tiles: self.col_tiles as i32, x_map, weight_map, lora_x_map, lora_weight_map };
        Ok((gemm, cfg))
    }
}
