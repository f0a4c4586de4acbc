//! Best-fit-decreasing packing of tokenized sequences into rows of a fixed capacity, for padding-free
//! training: `bastile.data` (python_shim) calls [`bastile_pack`] with the sequences' lengths and reads
//! back which tokens go to which row.
//!
//! Best fit decreasing: pieces are placed longest first, each into the open row whose free space is the
//! smallest that holds it, or into a new row. Rows with equal free space are interchangeable for every
//! later decision, so the rows' loads do not depend on which of them is taken. Pieces are packed in
//! shards of at most [`SHARD`] (shard k takes every S-th piece of the global longest-first order, so
//! every shard has the whole length distribution), the shards in parallel; the result depends on the
//! lengths alone, not on the number of threads.
use std::cmp::Reverse;

/// Pieces per shard: large enough that a shard's fill is the whole set's to within a fraction of a
/// percent, small enough that 1M sequences make 16 shards for the threads.
pub const SHARD: usize = 1 << 16;

/// The largest capacity: the free-space tables of a shard grow with it (40 MB at this one).
pub const MAX_CAPACITY: i64 = 1 << 20;

/// [`MAX_CAPACITY`], for `bastile.data`.
#[no_mangle]
pub extern "C" fn bastile_pack_max_capacity() -> i64 {
    MAX_CAPACITY
}

/// What becomes of a sequence longer than the capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overflow {
    /// Cut into pieces of the capacity (the last shorter), each packed as a sequence of its own.
    Split,
    /// Its first `capacity` tokens are kept.
    Truncate,
    /// Left out.
    Drop,
}

impl Overflow {
    fn of(code: i32) -> Option<Self> {
        [Self::Split, Self::Truncate, Self::Drop].get(usize::try_from(code).ok()?).copied()
    }
}

/// Tokens `[start, start + len)` of sequence `seq`, placed as one sequence in a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub seq: i64,
    pub start: i64,
    pub len: i64,
}

/// The pieces to place, in sequence order; empty sequences have none.
pub fn pieces(lengths: &[i64], capacity: i64, overflow: Overflow) -> Vec<Piece> {
    let mut out = Vec::with_capacity(lengths.len());
    for (seq, &len) in (0..).zip(lengths) {
        match overflow {
            _ if len <= capacity => out.extend((len > 0).then_some(Piece { seq, start: 0, len })),
            Overflow::Split => out.extend((0..len).step_by(capacity as usize).map(|start| Piece {
                seq,
                start,
                len: capacity.min(len - start),
            })),
            Overflow::Truncate => out.push(Piece { seq, start: 0, len: capacity }),
            Overflow::Drop => {}
        }
    }
    out
}

/// Max-tree over free spaces 1..=capacity: a leaf holds its space while some open row has it free, so
/// the leftmost leaf holding at least `len` is the best fit. The leaf of `capacity` always holds it: a
/// new row.
struct FreeSpaces {
    leaves: usize,
    tree: Vec<i64>,
}

impl FreeSpaces {
    fn new(capacity: i64) -> Self {
        let leaves = (capacity as usize).next_power_of_two();
        let mut spaces = Self { leaves, tree: vec![0; 2 * leaves] };
        spaces.set(capacity, capacity);
        spaces
    }

    fn set(&mut self, space: i64, value: i64) {
        let mut i = self.leaves + space as usize - 1;
        self.tree[i] = value;
        while i > 1 {
            i /= 2;
            self.tree[i] = self.tree[2 * i].max(self.tree[2 * i + 1]);
        }
    }

    fn best_fit(&self, len: i64) -> i64 {
        let mut i = 1;
        while i < self.leaves {
            i = if self.tree[2 * i] >= len { 2 * i } else { 2 * i + 1 };
        }
        self.tree[i]
    }
}

/// Rows (indices into `pieces`, longest first) of the pieces `order` lists, longest first.
fn best_fit_decreasing(pieces: &[Piece], order: impl Iterator<Item = usize>, capacity: i64) -> Vec<Vec<usize>> {
    let mut spaces = FreeSpaces::new(capacity);
    let mut rows_with: Vec<Vec<usize>> = vec![Vec::new(); capacity as usize]; // by free space
    let mut rows: Vec<Vec<usize>> = Vec::new();
    for p in order {
        let len = pieces[p].len;
        let space = spaces.best_fit(len);
        let row = if space == capacity {
            rows.push(Vec::new());
            rows.len() - 1
        } else {
            let open = &mut rows_with[space as usize];
            let row = open.pop().expect("a free space in the tree has a row");
            if open.is_empty() {
                spaces.set(space, 0);
            }
            row
        };
        rows[row].push(p);
        let left = space - len;
        if left > 0 {
            rows_with[left as usize].push(row);
            spaces.set(left, left);
        }
    }
    rows
}

/// The rows of `pieces` (indices into it, each row's pieces longest first), packed into `capacity`
/// with up to `threads` threads. Every piece must be 1..=capacity long.
pub fn pack(pieces: &[Piece], capacity: i64, threads: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_unstable_by_key(|&p| (Reverse(pieces[p].len), p));
    let shards = pieces.len().div_ceil(SHARD).max(1);
    let shard = |k: usize| best_fit_decreasing(pieces, order.iter().copied().skip(k).step_by(shards), capacity);
    let workers = threads.clamp(1, shards);
    let mut packed: Vec<Vec<Vec<usize>>> = vec![Vec::new(); shards];
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| scope.spawn(move || (w..shards).step_by(workers).map(|k| (k, shard(k))).collect::<Vec<_>>()))
            .collect();
        for handle in handles {
            for (k, rows) in handle.join().expect("a packing thread panicked") {
                packed[k] = rows;
            }
        }
    });
    packed.into_iter().flatten().collect()
}

/// C entry point: packs the `n` sequences of `lengths` into rows of `capacity` (1..=MAX_CAPACITY) tokens on up to `threads`
/// threads (`overflow`: 0 split, 1 truncate, 2 drop). Writes the pieces row by row into `pieces_out`
/// ([max_pieces, 3]: sequence, start, length) and the rows' first pieces into `row_starts` ([rows + 1]
/// used of max_pieces + 1); returns the number of rows. -1: bad arguments; -2: `max_pieces` is not the
/// number of pieces; -3: a panic (a bug), caught so that it never unwinds into the caller.
///
/// # Safety
/// `lengths` holds `n` values; `pieces_out` room for 3 * max_pieces, `row_starts` for max_pieces + 1.
#[no_mangle]
pub unsafe extern "C" fn bastile_pack(
    lengths: *const i64,
    n: i64,
    capacity: i64,
    overflow: i32,
    threads: i32,
    max_pieces: i64,
    pieces_out: *mut i64,
    row_starts: *mut i64,
) -> i64 {
    let (Some(overflow), Ok(n), Ok(max_pieces)) = (Overflow::of(overflow), usize::try_from(n), usize::try_from(max_pieces))
    else {
        return -1;
    };
    if !(1..=MAX_CAPACITY).contains(&capacity) || (n > 0 && lengths.is_null()) {
        return -1;
    }
    let lengths = if n == 0 { &[][..] } else { std::slice::from_raw_parts(lengths, n) };
    if lengths.iter().any(|&len| len < 0) {
        return -1;
    }
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let pieces = pieces(lengths, capacity, overflow);
        if pieces.len() != max_pieces {
            return -2;
        }
        let rows = pack(&pieces, capacity, threads.max(1) as usize);
        let out = std::slice::from_raw_parts_mut(pieces_out, 3 * max_pieces);
        let starts = std::slice::from_raw_parts_mut(row_starts, max_pieces + 1);
        let mut at = 0;
        for (r, row) in rows.iter().enumerate() {
            starts[r] = at as i64;
            for &p in row {
                let Piece { seq, start, len } = pieces[p];
                out[3 * at..3 * at + 3].copy_from_slice(&[seq, start, len]);
                at += 1;
            }
        }
        starts[rows.len()] = at as i64;
        rows.len() as i64
    }));
    run.unwrap_or(-3)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loads(pieces: &[Piece], rows: &[Vec<usize>]) -> Vec<i64> {
        let mut loads: Vec<i64> = rows.iter().map(|r| r.iter().map(|&p| pieces[p].len).sum()).collect();
        loads.sort_unstable();
        loads
    }

    /// Best fit decreasing by exhaustive search over the open rows: the loads the tree must give.
    fn reference_loads(pieces: &[Piece], capacity: i64) -> Vec<i64> {
        let mut lens: Vec<i64> = pieces.iter().map(|p| p.len).collect();
        lens.sort_unstable_by_key(|&l| Reverse(l));
        let mut loads: Vec<i64> = Vec::new();
        for len in lens {
            match loads.iter_mut().filter(|l| **l + len <= capacity).max_by_key(|l| **l) {
                Some(l) => *l += len,
                None => loads.push(len),
            }
        }
        loads.sort_unstable();
        loads
    }

    fn lengths(n: usize, max: i64, seed: u64) -> Vec<i64> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) % (max as u64 + 1)) as i64
            })
            .collect()
    }

    #[test]
    fn pieces_by_overflow() {
        let split = pieces(&[10, 0, 4], 4, Overflow::Split);
        assert_eq!(split.iter().map(|p| (p.seq, p.start, p.len)).collect::<Vec<_>>(),
                   [(0, 0, 4), (0, 4, 4), (0, 8, 2), (2, 0, 4)]);
        assert_eq!(pieces(&[10, 3], 4, Overflow::Truncate), [Piece { seq: 0, start: 0, len: 4 }, Piece { seq: 1, start: 0, len: 3 }]);
        assert_eq!(pieces(&[10, 3], 4, Overflow::Drop), [Piece { seq: 1, start: 0, len: 3 }]);
    }

    #[test]
    fn same_loads_as_exhaustive_best_fit() {
        for (seed, capacity) in [(1, 16), (2, 100), (3, 7), (4, 4096)] {
            let pieces = pieces(&lengths(500, capacity, seed), capacity, Overflow::Split);
            let rows = pack(&pieces, capacity, 2);
            assert_eq!(loads(&pieces, &rows), reference_loads(&pieces, capacity), "seed {seed}");
        }
    }

    #[test]
    fn every_piece_once_and_no_row_over_capacity_in_shards() {
        let capacity = 300;
        let pieces = pieces(&lengths(3 * SHARD + 17, 2 * capacity, 9), capacity, Overflow::Split);
        let rows = pack(&pieces, capacity, 3);
        let mut seen = vec![0u8; pieces.len()];
        for row in &rows {
            assert!(!row.is_empty() && row.iter().map(|&p| pieces[p].len).sum::<i64>() <= capacity);
            row.iter().for_each(|&p| seen[p] += 1);
        }
        assert!(seen.iter().all(|&s| s == 1));
        assert_eq!(rows, pack(&pieces, capacity, 1), "the threads change nothing");
    }
}
