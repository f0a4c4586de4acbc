"""Packing speed and fill on the CPU: TRL's pack_dataset(strategy="bfd") against bastile.data on the same
lengths (the issue's SFT distribution: log-normal, median about 245 tokens, mean about 370, capped at 4095)
and capacity.

    python benches/bench_packing.py                   # 1M sequences, capacity 4096
    python benches/bench_packing.py --n 100000 --threads 1

Timed: TRL's pack_dataset (assignment and the packed Arrow table); Bastile's pack() alone (the rows'
assignment, in the library); PackedDataset(dataset) (the column read as flat arrays, then pack(): what a
training run waits for before its first batch; rows are cut when the loader reads them); and cutting
every row once (what the loader's reads add up to over an epoch). Fill: tokens over rows x capacity.
"""
import argparse
import time

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset
from trl import pack_dataset

from bastile import data


def lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(np.round(rng.lognormal(np.log(245), 0.9, n)).astype(np.int64) + 1, 4095)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lens = lengths(args.n)
    tokens = int(lens.sum())
    offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
    values = np.arange(tokens, dtype=np.int64) % 151936
    ds = Dataset(pa.table({"input_ids": pa.LargeListArray.from_arrays(offsets, values)}))
    print(f"{args.n:,} sequences, {tokens:,} tokens (median {np.median(lens):.0f}, mean {lens.mean():.0f}), "
          f"capacity {args.capacity}, {args.threads} threads")

    packed, trl_s = timed(lambda: pack_dataset(ds, args.capacity, strategy="bfd"))
    trl_fill = tokens / (len(packed) * args.capacity)
    (_, row_starts), pack_s = timed(lambda: data.pack(lens, args.capacity, "truncate"))
    rows, dataset_s = timed(lambda: data.PackedDataset(ds, args.capacity, overflow="truncate"))
    _, read_s = timed(lambda: [rows[r] for r in range(len(rows))])
    print("\n| | seconds | rows | fill | vs TRL |\n|---|---|---|---|---|")
    print(f"| TRL pack_dataset(strategy='bfd') | {trl_s:.2f} | {len(packed):,} | {trl_fill:.4f} | 1.0x |")
    print(f"| bastile.data.pack | {pack_s:.3f} | {len(row_starts) - 1:,} | {rows.fill():.4f} | {trl_s / pack_s:.0f}x |")
    print(f"| bastile.data.PackedDataset(dataset) | {dataset_s:.3f} | {len(rows):,} | {rows.fill():.4f} | "
          f"{trl_s / dataset_s:.0f}x |")
    print(f"| cutting every row once (PackedDataset[i]) | {read_s:.2f} | | | |")


if __name__ == "__main__":
    main()
