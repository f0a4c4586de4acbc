//! Launch geometry of row-wise kernels (one normalisation / activation per row of a 2-D view).
use crate::kernels::Tag;
use crate::params::{BastileDType, RowGeometry};
use std::ffi::c_void;

/// Threads a register-cached forward row prefers: fewer threads holding more vectors each keep more
/// bytes in flight per SM, which is what a memory-bound row kernel needs. The backward, which holds two
/// rows of two tensors a thread, prefers [`CACHED_THREADS`] (see [`rows`]).
pub const PREFERRED_THREADS: i64 = 128;
/// Rows of at most this many vectors get a warp or less each in the forward, every thread holding
/// [`SHORT_ROW_PER_THREAD`] vectors: reductions are then shuffles alone, over few lanes (H100, bf16:
/// 8192x1024 forward 0.0165 ms against 0.0176 ms with 128 threads a row; at 65536x128, experimental
/// kernels of this layout in one process: 15.7 us with 4 lanes a row, 16.8 us with 8, and the previous
/// 16-lane kernel 17.1 us).
pub const WARP_ROW_UNITS: i64 = 4 * 32;
/// Vectors each thread of a short row holds.
pub const SHORT_ROW_PER_THREAD: i64 = 4;
/// Most threads a register-cached kernel runs per row (and per block): the kernels'
/// `__launch_bounds__(256)` lets the compiler give each thread room for its share of a row.
pub const CACHED_THREADS: i64 = 256;
/// Most vectors each thread keeps in registers; longer rows stream through twice.
pub const MAX_PER_THREAD: i64 = 8;
/// Blocks of fewer threads than this hold several rows, so that small rows still fill an SM.
pub const MIN_BLOCK: i64 = 128;

/// Picks how a row of `cols` elements of `elem_bytes` bytes each is spread over threads, as wide as
/// [`CACHED_THREADS`]: the backward's registers per thread then leave room for more resident blocks and
/// for the next row's loads (H100, bf16, the Gemma norm's fwd+bwd in GPU time, one call: 4096x5376
/// 88.1 us against 109.6 us with [`PREFERRED_THREADS`], which took eight vectors a thread; 4096x2560 47.3
/// against 48.8, 8192x2048 66.3 against 68.3; 8192x1152 and 8192x1024 within 0.5%; 16384x1152 1.7% slower).
/// `vectorizable`: the caller has checked that every tensor the kernel touches is aligned for
/// 16-byte accesses of the row's element type.
pub fn rows(cols: i64, elem_bytes: usize, vectorizable: bool) -> RowGeometry {
    rows_with(cols, elem_bytes, vectorizable, CACHED_THREADS)
}

/// As [`rows`], with a warp or less per row where the row is short enough (see [`WARP_ROW_UNITS`]).
pub fn rows_warp_first(cols: i64, elem_bytes: usize, vectorizable: bool) -> RowGeometry {
    let units = cols / (16 / elem_bytes as i64);
    let preferred = if units <= WARP_ROW_UNITS { ceil_div(units, SHORT_ROW_PER_THREAD).max(1) } else { PREFERRED_THREADS };
    rows_with(cols, elem_bytes, vectorizable, preferred)
}

/// `policy`'s geometry for rows of `x`'s dtype; vector access only if every tensor (pointer, dtype) and
/// row stride (in elements) allows the same number of elements per access.
pub fn for_tensors(
    policy: fn(i64, usize, bool) -> RowGeometry,
    cols: i64,
    x: BastileDType,
    tensors: &[(*const c_void, BastileDType)],
    strides: &[i64],
) -> RowGeometry {
    let vec = 16 / x.size();
    let ok = tensors.iter().all(|&(ptr, dt)| aligned(ptr, vec * dt.size())) && strides.iter().all(|s| s % vec as i64 == 0);
    policy(cols, x.size(), ok)
}

fn rows_with(cols: i64, elem_bytes: usize, vectorizable: bool, preferred: i64) -> RowGeometry {
    assert!(cols > 0, "a row must have at least one element");
    let vec = if vectorizable && cols % (16 / elem_bytes as i64) == 0 { 16 / elem_bytes as i64 } else { 1 };
    let units = cols / vec;
    let (per_thread, threads) = if vec > 1 && units <= CACHED_THREADS * MAX_PER_THREAD {
        let mut k = 1;
        while ceil_div(units, k) > preferred && k < MAX_PER_THREAD {
            k *= 2;
        }
        (k, ceil_div(units, k))
    } else {
        (0, units.min(1024))
    };
    let group = if threads <= 32 { (threads as u64).next_power_of_two() as i64 } else { ceil_div(threads, 32) * 32 };
    let rows_per_block = if group < MIN_BLOCK { MIN_BLOCK / group } else { 1 };
    RowGeometry {
        vec: vec as i32,
        per_thread: per_thread as i32,
        group: group as i32,
        block: (group * rows_per_block) as i32,
    }
}

impl RowGeometry {
    pub fn rows_per_block(&self) -> i64 {
        (self.block / self.group) as i64
    }

    /// The tags of a row kernel's layout: 16-byte vectors or single elements; the vectors a thread keeps
    /// in registers, or the row streamed twice.
    pub fn layout_tags(&self) -> [Tag; 2] {
        let access = if self.vec > 1 { Tag::Vec } else { Tag::Scalar };
        let residency = match self.per_thread {
            0 => Tag::Streamed,
            1 => Tag::Cached1,
            2 => Tag::Cached2,
            4 => Tag::Cached4,
            8 => Tag::Cached8,
            _ => unreachable!("no kernel for {self:?}"),
        };
        [access, residency]
    }

    /// The f32 partial rows of a column sum (a weight gradient) a backward block writes: register-cached
    /// blocks fold their rows' shares in shared memory (cuda/rows.cuh `store_partial`), streaming groups
    /// own a row each.
    pub fn partials_per_block(&self) -> i64 {
        if self.per_thread > 0 {
            1
        } else {
            self.rows_per_block()
        }
    }

    /// Dynamic shared memory a backward block of `cols`-wide rows folds its partials in.
    pub fn fold_bytes(&self, cols: i64) -> i64 {
        if self.per_thread > 0 && self.rows_per_block() > 1 {
            self.rows_per_block() * cols * 4
        } else {
            0
        }
    }

    /// Blocks needed to give every row a group once.
    pub fn blocks_for(&self, rows: i64) -> i64 {
        ceil_div(rows, self.rows_per_block()).max(1)
    }
}

/// Row backward blocks resident per SM at most, in their one wave: fewer partials to write and fold where
/// small blocks would fit 21 an SM (rms_norm, H100, bf16, fwd+bwd of 8192x1152 / 4096x2560 / 16384x1152 /
/// 8192x1024 in one call: 0.0546 / 0.0579 / 0.0879 / 0.0451 ms against 0.0549 / 0.0595 / 0.0895 / 0.0457
/// uncapped; a cap of 4 was slower, 0.0663 / 0.0617 / 0.1016 / 0.0626).
pub const BACKWARD_BLOCKS_PER_SM: u32 = 8;

/// Threads of a column fold's block (cuda/common.cuh `column_sum`): 32 columns by BASTILE_FOLD_ROWS rows.
pub const FOLD_BLOCK: (u32, u32) = (32, crate::params::BASTILE_FOLD_ROWS);

pub fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// Threads that share a row of `vectors` accesses in the kernels that give a row a power-of-two group of a
/// warp's lanes (attention_sink, expert_combine): one access each where the row allows, up to a warp.
pub fn lane_group(vectors: i64) -> i32 {
    (vectors.max(1) as u64).next_power_of_two().min(32) as i32
}

/// The launch of such a kernel over `rows` rows, `group` threads a row in blocks of `block`: a block per
/// block / group rows, at most 2^31 - 1 (the kernels stride past them).
pub fn lane_group_launch(rows: i64, group: i32, block: u32) -> crate::driver::LaunchConfig {
    let blocks = ceil_div(rows, (block as i32 / group) as i64).clamp(1, i32::MAX as i64);
    crate::driver::LaunchConfig { grid: (blocks as u32, 1), block: (block, 1), shared: 0 }
}

/// Blocks to launch for `blocks` row-group slots when `wave` blocks fit on the GPU at once. Many
/// slots per resident block: a plain grid, whose tail the block scheduler balances. Few: one
/// persistent wave, whose blocks stride over the rest.
pub fn grid(blocks: i64, wave: i64) -> i64 {
    if blocks >= 4 * wave {
        blocks.min(i32::MAX as i64)
    } else {
        blocks.min(wave)
    }
}

/// The pipeline of cuda/hopper.cuh's gemm_bf16_tn in a block of `shared` bytes: its stages (at most `max`; each
/// an A box and B's boxes, BASTILE_GEMM_TILE_M + BASTILE_GEMM_TILE_N rows of BASTILE_GEMM_TILE_K bf16) and the
/// dynamic shared memory they take with the 1 KiB that aligns them to the swizzle pattern; None where fewer than
/// two fit.
pub fn gemm_stages(shared: u32, max: u32) -> Option<(u32, u32)> {
    use crate::params::{BASTILE_GEMM_TILE_K, BASTILE_GEMM_TILE_M, BASTILE_GEMM_TILE_N};
    let stage_bytes = (BASTILE_GEMM_TILE_M + BASTILE_GEMM_TILE_N) * BASTILE_GEMM_TILE_K * 2;
    let stages = (shared.saturating_sub(1024) / stage_bytes).min(max);
    (stages >= 2).then_some((stages, stages * stage_bytes + 1024))
}

/// True when `ptr` may be accessed in `bytes`-wide vectors.
pub fn aligned(ptr: *const std::ffi::c_void, bytes: usize) -> bool {
    ptr.is_null() || (ptr as usize) % bytes == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_stages_fill_the_shared_memory_after_its_alignment() {
        // Hopper's 227 KiB a block: four 48 KiB stages and the 1 KiB of alignment; a block without room for two
        // has no pipeline.
        assert_eq!(gemm_stages(232_448, 8), Some((4, 4 * 49_152 + 1024)));
        assert_eq!(gemm_stages(232_448, 3), Some((3, 3 * 49_152 + 1024)));
        assert_eq!(gemm_stages(2 * 49_152 + 1023, 8), None);
    }

    fn covers(g: &RowGeometry, cols: i64) {
        let units = cols / g.vec as i64;
        if g.per_thread > 0 {
            assert!(g.group as i64 * g.per_thread as i64 >= units, "{g:?} misses part of {cols}");
            assert!(g.block as i64 <= CACHED_THREADS.max(MIN_BLOCK), "{g:?}");
        }
        assert_eq!(cols % g.vec as i64, 0);
        assert!(g.block <= 1024 && g.block % g.group == 0, "{g:?}");
        assert!(g.group < 32 && (g.group as u32).is_power_of_two() || g.group % 32 == 0, "{g:?}");
    }

    #[test]
    fn real_hidden_sizes_stay_in_registers() {
        for cols in [128, 1024, 2048, 2560, 3072, 4096, 5120, 8192, 16384] {
            let g = rows(cols, 2, true);
            covers(&g, cols);
            assert_eq!(g.vec, 8, "{cols}: {g:?}");
            assert!(g.per_thread > 0, "{cols}: {g:?}");
        }
        // (cols, element bytes) -> (vec, group, per_thread, block)
        for (cols, bytes, want) in [
            (128, 2, (8, 16, 1, 128)),     // Qwen3's per-head norms: 16 threads per row, 8 rows per block
            (4096, 2, (8, 256, 2, 256)),   // Llama-size rows: 256 threads holding two 16-byte vectors each
            (5376, 2, (8, 192, 4, 192)),   // Gemma-3-27B's: four vectors, not eight, over 168 threads
            (16384, 2, (8, 256, 8, 256)),
            (4096, 4, (4, 256, 4, 256)),   // f32 rows use 4-element vectors
        ] {
            let g = rows(cols, bytes, true);
            assert_eq!((g.vec, g.group, g.per_thread, g.block), want, "{cols} x {bytes} bytes");
        }
    }

    #[test]
    fn odd_unaligned_and_huge_rows_stream() {
        for (cols, bytes, vec_ok) in [(3, 2, true), (1000, 4, false), (1001, 2, true), (65536, 4, true), (1 << 20, 2, true)] {
            let g = rows(cols, bytes, vec_ok);
            covers(&g, cols);
            assert_eq!(g.per_thread, 0, "{cols}: {g:?}");
        }
        assert_eq!((rows(3, 2, true).vec, rows(1000, 2, false).vec), (1, 1));
        assert_eq!((rows(1 << 20, 2, true).vec, rows(1 << 20, 2, true).per_thread), (8, 0));
        // A 3-wide row: 4 threads per row, 32 rows per block.
        let g = rows(3, 2, true);
        assert_eq!((g.group, g.rows_per_block()), (4, 32));
    }

    #[test]
    fn forward_gives_short_rows_a_warp_or_less() {
        // cols -> (group, per_thread, block), two-byte elements
        for (cols, want) in [
            (1024, (32, 4, 128)),
            (2048, (128, 2, 128)),
            (128, (4, 4, 128)), // Qwen3's per-head norms: four lanes a row, 32 rows a block
            (800, (32, 4, 128)), // 100 vectors: 25 threads of four, rounded up to a warp
        ] {
            let g = rows_warp_first(cols, 2, true);
            assert_eq!((g.group, g.per_thread, g.block), want, "{cols}");
        }
        for cols in [8, 24, 64, 128, 256, 512, 800, 1000, 1024] {
            covers(&rows_warp_first(cols, 2, true), cols);
            covers(&rows_warp_first(cols, 4, true), cols);
        }
        assert_eq!(rows_warp_first(3, 2, true).vec, 1);
    }

    #[test]
    fn grid_is_one_wave_or_all_blocks() {
        assert_eq!(grid(100, 1056), 100);
        assert_eq!(grid(2048, 1056), 1056);
        assert_eq!(grid(16384, 1056), 16384);
        assert_eq!(grid(1 << 40, 1056), i32::MAX as i64);
    }

    #[test]
    fn blocks_cover_all_rows() {
        let g = rows(128, 2, true);
        assert_eq!(g.blocks_for(65536), 8192);
        assert_eq!(g.blocks_for(1), 1);
        assert_eq!(g.blocks_for(9), 2);
    }

    #[test]
    fn alignment() {
        assert!(aligned(64 as *const _, 16));
        assert!(!aligned(72 as *const _, 16));
        assert!(aligned(std::ptr::null(), 32));
    }
}
