"""Padding-free packed batches: tokenized sequences packed best fit decreasing into rows of a fixed
capacity by the library (src/packing.rs, on torch's number of threads), rows for a `DataLoader`, a
collate function that flattens a batch as HF's `DataCollatorWithFlattening` does, and a background
prefetch into pinned memory.

    rows = bastile.data.PackedDataset(dataset, capacity=4096)          # or a list of token-id lists
    loader = DataLoader(rows, batch_size=2, shuffle=True, collate_fn=bastile.data.collate, num_workers=2)
    for batch in bastile.data.prefetch(loader):
        model(**{k: v.to("cuda", non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}).loss

A batch is one row of its sequences back to back: `input_ids`, `position_ids` (restarting at each
sequence), `labels` (the tokens, or the given labels, with -100 at each sequence's first position so that
no sequence predicts the next one's first token), and the varlen attention arguments `cu_seq_lens_q/k`
and `max_length_q/k`. A sequence longer than the capacity is split into pieces of the capacity, each a
sequence of its own (overflow="split"), cut to the capacity ("truncate", as TRL's "bfd"), or left out
("drop").
"""
import ctypes
import itertools
import queue
import threading
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from ._library import LIB

OVERFLOW = ("split", "truncate", "drop")  # the codes bastile_pack takes, in order

LIB.bastile_pack.restype = LIB.bastile_pack_max_capacity.restype = ctypes.c_int64
LIB.bastile_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
MAX_CAPACITY = LIB.bastile_pack_max_capacity()  # a row's tokens at most: the packer's tables grow with it


def pack(lengths: Sequence[int], capacity: int, overflow: str = "split") -> tuple:
    """Best-fit-decreasing packing of sequences of these lengths into rows of `capacity` tokens:
    (pieces, row_starts), pieces [P, 3] int64 rows of (sequence, first token, length) row after row, row
    r being pieces[row_starts[r]:row_starts[r + 1]]. Deterministic: the same lengths give the same rows
    whatever the number of threads."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"bastile.data.pack: lengths must be one-dimensional, got shape {lengths.shape}")
    if not 0 < capacity <= MAX_CAPACITY:
        raise ValueError(f"bastile.data.pack: capacity must be in 1..{MAX_CAPACITY}, got {capacity}")
    if overflow not in OVERFLOW:
        raise ValueError(f"bastile.data.pack: overflow must be one of {OVERFLOW}, got {overflow!r}")
    if (lengths < 0).any():
        raise ValueError("bastile.data.pack: lengths must not be negative")
    fits = (lengths > 0) & (lengths <= capacity)
    count = {"split": -(-lengths // capacity).sum(), "truncate": (lengths > 0).sum(), "drop": fits.sum()}[overflow]
    pieces = np.empty((int(count), 3), dtype=np.int64)
    row_starts = np.empty(int(count) + 1, dtype=np.int64)
    rows = LIB.bastile_pack(lengths.ctypes.data, len(lengths), capacity, OVERFLOW.index(overflow),
                            torch.get_num_threads(), count, pieces.ctypes.data, row_starts.ctypes.data)
    if rows < 0:
        raise RuntimeError(f"bastile.data.pack: the library refused the packing (code {rows}); this is a bug")
    return pieces, row_starts[:rows + 1]


def _flat(sequences, column: str) -> tuple:
    """(values, offsets) of a list of token lists or of a datasets.Dataset's list column."""
    if hasattr(sequences, "with_format"):  # a datasets.Dataset, read as Arrow (its row order included)
        import pyarrow as pa
        array = sequences.with_format("arrow")[column]
        if isinstance(array, pa.ChunkedArray):
            array = array.chunk(0) if array.num_chunks == 1 else array.combine_chunks()
        offsets = array.offsets.to_numpy().astype(np.int64)
        return array.values.to_numpy(zero_copy_only=False), offsets
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    values = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(offsets[-1]))
    return values, offsets


class PackedDataset(torch.utils.data.Dataset):
    """The rows of `sequences` (a list of token-id lists, or a datasets.Dataset with a list column
    `column`) packed into `capacity` tokens; optional per-token `labels` (a list of lists of the same
    lengths, or the name of a second column, e.g. -100 on prompts). An item is a row: its `input_ids`,
    `labels` and `seq_lens` (its sequences' lengths), which `collate` turns into a batch. Rows are cut
    from the source when read, so the dataset holds no second copy of the tokens."""

    def __init__(self, sequences, capacity: int, overflow: str = "split", column: str = "input_ids",
                 labels=None):
        self.values, self.offsets = _flat(sequences, column)
        self.labels = None
        if isinstance(labels, str) and not hasattr(sequences, "with_format"):
            raise ValueError(f"bastile.data.PackedDataset: labels={labels!r} names a column, but the sequences "
                             "are a list: pass the labels as a list of lists")
        if labels is not None:
            self.labels, label_offsets = _flat(sequences if isinstance(labels, str) else labels,
                                               labels if isinstance(labels, str) else column)
            if not np.array_equal(label_offsets, self.offsets):
                raise ValueError("bastile.data.PackedDataset: labels must have the lengths of the sequences")
        self.capacity = capacity
        self.pieces, self.row_starts = pack(np.diff(self.offsets), capacity, overflow)

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def fill(self) -> float:
        """Tokens placed over the rows' room."""
        return float(self.pieces[:, 2].sum()) / max(1, len(self) * self.capacity)

    def _cut(self, values, pieces) -> torch.Tensor:
        starts = self.offsets[pieces[:, 0]] + pieces[:, 1]
        return torch.from_numpy(np.concatenate([values[s:s + n] for s, n in zip(starts, pieces[:, 2])]))

    def __getitem__(self, row: int) -> dict:
        if not -len(self) <= row < len(self):
            raise IndexError(f"bastile.data.PackedDataset: row {row} of {len(self)}")
        row %= len(self)
        pieces = self.pieces[self.row_starts[row]:self.row_starts[row + 1]]
        ids = self._cut(self.values, pieces).long()
        return {"input_ids": ids, "labels": ids if self.labels is None else self._cut(self.labels, pieces).long(),
                "seq_lens": torch.from_numpy(pieces[:, 2].copy())}


def collate(rows: Sequence[dict]) -> dict:
    """One batch of rows (PackedDataset items): their sequences back to back in one row [1, tokens], with
    position ids restarting at each sequence, -100 at each sequence's first label, and the cumulative
    sequence lengths (int32) and longest sequence the varlen attention kernels take."""
    ids = torch.cat([r["input_ids"] for r in rows])
    lens = torch.cat([r["seq_lens"] for r in rows])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    first = cu[:-1].long()
    positions = torch.arange(len(ids)) - torch.repeat_interleave(first, lens)
    labels = torch.cat([r["labels"] for r in rows]).clone()
    labels[first] = -100
    longest = int(lens.max()) if len(lens) else 0
    return {"input_ids": ids[None], "labels": labels[None], "position_ids": positions[None],
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def prefetch(batches: Iterable[dict], depth: int = 2, pin_memory: Optional[bool] = None) -> Iterator[dict]:
    """The batches of `batches`, each made `depth` ahead by a background thread, their tensors in pinned
    memory (pin_memory=None: when CUDA is available) so that `.to("cuda", non_blocking=True)` overlaps.
    The thread starts with the iteration and ends with it (also when the loop stops early)."""
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    ready: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()
    done = object()

    def offer(item) -> bool:  # False once the consumer has stopped
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce():
        try:
            for batch in batches:
                if pin:
                    batch = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}
                if not offer(batch):
                    return
            offer(done)
        except BaseException as e:  # raised again in the consumer
            offer(e)

    worker = threading.Thread(target=produce, daemon=True, name="bastile-prefetch")
    worker.start()
    try:
        while True:
            item = ready.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        worker.join()
