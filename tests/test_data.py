"""bastile.data: the packer (src/packing.rs through bastile_pack) against its contract and TRL's packing,
the collate function against HF's DataCollatorWithFlattening, rows from datasets.Dataset columns, a
DataLoader with two forked workers, the prefetch thread, and a packed batch through a patched model."""
import copy
import threading

import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening

import bastile
from bastile import data
from test_families import COMMON, mini

SHARD = 1 << 16  # src/packing.rs: pieces per shard


def random_lengths(n, high, seed):
    return np.random.default_rng(seed).integers(0, high, n)


def lognormal_lengths(n, seed=0):
    """The issue's SFT lengths: median about 245 tokens, mean about 370, capped at 4095."""
    rng = np.random.default_rng(seed)
    return np.minimum(np.round(rng.lognormal(np.log(245), 0.9, n)).astype(np.int64) + 1, 4095)


def placed(pieces, lengths, capacity, overflow):
    """Checks each sequence's pieces against what `overflow` keeps of it."""
    by_seq = {}
    for seq, start, n in pieces.tolist():
        by_seq.setdefault(seq, []).append((start, n))
    for seq, length in enumerate(lengths.tolist()):
        got = sorted(by_seq.get(seq, []))
        if length == 0 or (overflow == "drop" and length > capacity):
            assert not got, (seq, length, got)
        elif overflow == "truncate":
            assert got == [(0, min(length, capacity))], (seq, length, got)
        else:  # split, or drop of one that fits: consecutive pieces covering it once
            assert [s for s, _ in got] == list(range(0, length, capacity)), (seq, length, got)
            assert sum(n for _, n in got) == length and all(n <= capacity for _, n in got)


@pytest.mark.parametrize("overflow", data.OVERFLOW)
@pytest.mark.parametrize("n,high,capacity,seed", [(1, 5, 4, 0), (300, 40, 16, 1), (3000, 900, 512, 2),
                                                  (SHARD + 5000, 300, 256, 3)])
def test_pack_places_every_piece_once_within_capacity(n, high, capacity, seed, overflow):
    lengths = random_lengths(n, high, seed)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        pieces, row_starts = data.pack(lengths, capacity, overflow)
        placed(pieces, lengths, capacity, overflow)
        loads = np.add.reduceat(pieces[:, 2], row_starts[:-1]) if len(pieces) else np.zeros(0)
        assert row_starts[0] == 0 and row_starts[-1] == len(pieces) and (np.diff(row_starts) > 0).all()
        assert (loads <= capacity).all()
        torch.set_num_threads(1)  # the threads change nothing
        again, again_starts = data.pack(lengths, capacity, overflow)
        assert np.array_equal(again, pieces) and np.array_equal(again_starts, row_starts)
    finally:  # the process's count, for the tests after this one (the order of their CPU sums)
        torch.set_num_threads(threads)


def test_pack_fills_rows_at_least_as_trl_does():
    datasets = pytest.importorskip("datasets")
    from trl import pack_dataset
    lengths, capacity = lognormal_lengths(20000), 4096
    rows = datasets.Dataset.from_dict({"input_ids": [[1] * int(n) for n in lengths]})
    trl_rows = len(pack_dataset(rows, capacity, strategy="bfd"))
    _, row_starts = data.pack(lengths, capacity, "truncate")
    assert len(row_starts) - 1 <= trl_rows, (len(row_starts) - 1, trl_rows)


def test_pack_rejects_bad_input():
    for args, what in [(([3, -1], 4), "negative"), (([3], 0), "capacity"), (([3], 1 << 21), "capacity"),
                       (([3], 4, "wrap"), "overflow"),
                       (([[3]], 4), "one-dimensional")]:
        with pytest.raises(ValueError, match=f"bastile.data.pack: .*{what}"):
            data.pack(*args)


def sequences(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, COMMON["vocab_size"], int(k)).tolist() for k in rng.integers(1, 60, n)]


def test_collate_equals_hf_flattening():
    """A batch of packed rows is what HF's DataCollatorWithFlattening makes of the rows' sequences."""
    seqs = sequences()
    rows = data.PackedDataset(seqs, capacity=64, overflow="split")
    hf = DataCollatorWithFlattening(return_position_ids=True, return_flash_attn_kwargs=True)
    for batch_rows in ([0, 1], [2], list(range(3, len(rows)))):
        items = [rows[r] for r in batch_rows]
        got = data.collate(items)
        pieces = [p for r in batch_rows for p in rows.pieces[rows.row_starts[r]:rows.row_starts[r + 1]].tolist()]
        expected = hf([{"input_ids": seqs[s][start:start + n]} for s, start, n in pieces])
        for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
            assert torch.equal(got[key], torch.as_tensor(expected[key]).to(got[key].dtype)), key
        assert got["max_length_q"] == got["max_length_k"] == int(expected["max_length_q"])


def test_dataset_columns_and_labels():
    """A datasets.Dataset (shuffled: rows read through its indices) gives the rows of the same lists; a
    labels column is cut as the tokens are."""
    datasets = pytest.importorskip("datasets")
    seqs = sequences(seed=1)
    labels = [[-100] * (len(s) // 2) + s[len(s) // 2:] for s in seqs]
    ds = datasets.Dataset.from_dict({"input_ids": seqs, "labels": labels}).shuffle(seed=3)
    rows = data.PackedDataset(ds, capacity=50, labels="labels")
    expected = data.PackedDataset(ds["input_ids"], capacity=50, labels=ds["labels"])
    assert len(rows) == len(expected)
    for a, b in zip(rows, expected):
        assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="labels must have the lengths"):
        data.PackedDataset(seqs, capacity=50, labels=[s[:-1] for s in seqs])
    with pytest.raises(ValueError, match="names a column, but the sequences are a list"):
        data.PackedDataset(seqs, capacity=50, labels="labels")


def test_dataloader_with_two_forked_workers():
    rows = data.PackedDataset(sequences(200, seed=2), capacity=128)
    one = list(torch.utils.data.DataLoader(rows, batch_size=3, collate_fn=data.collate))
    two = list(torch.utils.data.DataLoader(rows, batch_size=3, collate_fn=data.collate, num_workers=2,
                                           multiprocessing_context="fork"))
    assert len(one) == len(two) == -(-len(rows) // 3)
    for a, b in zip(one, two):
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
    tokens = sorted(torch.cat([b["input_ids"][0] for b in one]).tolist())
    assert tokens == sorted(t for s in sequences(200, seed=2) for t in s)


def test_prefetch_yields_the_batches_raises_their_errors_and_stops_with_the_loop():
    batches = [{"x": torch.full((3,), i), "n": i} for i in range(7)]
    got = list(data.prefetch(iter(batches), depth=2))
    assert [b["n"] for b in got] == list(range(7)) and all(torch.equal(a["x"], b["x"]) for a, b in zip(got, batches))

    def failing():
        yield batches[0]
        raise KeyError("source")
    with pytest.raises(KeyError, match="source"):
        list(data.prefetch(failing()))

    before = threading.active_count()
    for b in data.prefetch(iter(batches), depth=1):
        break
    assert threading.active_count() == before  # the producer ended with the loop


def test_packed_batch_trains_as_its_sequences_alone():
    """A loader batch through a patched model: the loss and gradients of its sequences run one by one,
    each sequence's loss weighted by its number of targets."""
    seqs = sequences(12, seed=4)
    rows = data.PackedDataset(seqs, capacity=96)
    batch = data.collate([rows[r] for r in range(len(rows))])
    ref = mini("qwen3", "cpu", torch.float32)
    model = copy.deepcopy(ref)
    bastile.apply(model=model)
    loss = model(**batch).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    bastile.reset()
    counts = [len(s) - 1 for s in seqs]
    expected = sum(ref(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss * n
                   for s, n in zip(seqs, counts) if n) / sum(counts)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    for g, e in zip(grads, torch.autograd.grad(expected, list(ref.parameters()))):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
