"""The deterministic packer: a pure function of (lengths, budget, seed, epoch), dense replayable seqs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from common.batch import PackedBatch, check_batch
from target_server import toy_corpus
from target_server.data import PreparedDataset, prepare_data
from target_server.packer import Packer, build_packed, hash_keys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _long_tailed(n: int, seed: int = 0, max_len: int = 3072) -> np.ndarray:
    """Lognormal lengths (median 600) clipped to [16, max_len]: many short chats, a long tail."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(600), 1.0, n), 16, max_len).astype(np.int64)


def _assert_valid_epoch(packer: Packer, batches: list[list[int]]) -> None:
    flat = [d for b in batches for d in b]
    assert sorted(flat) == list(range(len(packer)))  # every document exactly once
    assert all(b for b in batches)
    assert max(int(packer.lengths[b].sum()) for b in batches) <= packer.token_budget


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=400), budget=st.integers(300, 2000),
       seed=st.integers(0, 2**70), epoch=st.integers(0, 5), window=st.integers(1, 8))
def test_every_document_lands_exactly_once_within_the_token_budget(lengths, budget, seed, epoch, window):
    packer = Packer(np.array(lengths), budget, seed, window_batches=window)
    _assert_valid_epoch(packer, packer.epoch_batches(epoch))


def test_epochs_differ_in_order_and_in_batch_composition():
    packer = Packer(_long_tailed(3000), 4096, seed=0)
    e0, e1 = packer.epoch_batches(0), packer.epoch_batches(1)
    for batches in (e0, e1):
        _assert_valid_epoch(packer, batches)
    assert e0 != e1
    shared = {tuple(sorted(b)) for b in e0 if len(b) > 1} & {tuple(sorted(b)) for b in e1}
    assert len(shared) < len(e0) // 10


def _batch_mates(batches: list[list[int]]) -> set[tuple[int, int]]:
    return {(a, b) for batch in batches for a in batch for b in batch if a < b}


def test_small_dataset_in_one_window_still_gets_new_batch_mates_each_epoch():
    # One window holds the whole epoch here, so only the length-sort tie-breaking can vary batches
    # (an exact length sort keeps ~90% of the pairs together from one epoch to the next).
    packer = Packer(np.random.default_rng(1).integers(20, 270, 500), 4096, seed=0)
    assert packer.epoch_size(0) < packer.window_batches
    mates0, mates1 = _batch_mates(packer.epoch_batches(0)), _batch_mates(packer.epoch_batches(1))
    assert len(mates0 & mates1) < 0.3 * len(mates0)


def test_same_seed_and_epoch_give_identical_batches_in_fresh_instances_and_seeds_differ():
    lengths = _long_tailed(2000)
    a, b = Packer(lengths, 4096, seed=7), Packer(lengths.copy(), 4096, seed=7)
    for epoch in (0, 3):
        assert a.epoch_batches(epoch) == b.epoch_batches(epoch)
        assert a.fingerprint(epoch) == b.fingerprint(epoch)
    assert Packer(lengths, 4096, seed=8).epoch_batches(0) != a.epoch_batches(0)


def test_another_process_computes_the_same_batches():
    lengths = _long_tailed(2000)
    here = [Packer(lengths, 4096, seed=5).fingerprint(e) for e in (0, 2)]
    code = ("import json, sys, numpy as np; from target_server.packer import Packer; "
            "lengths = np.array(json.loads(sys.stdin.read())); p = Packer(lengths, 4096, seed=5); "
            "print(json.dumps([p.fingerprint(e) for e in (0, 2)]))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(lengths.tolist()), capture_output=True,
                         text=True, cwd=REPO, check=True, env={**os.environ, "PYTHONHASHSEED": "123"})
    assert json.loads(out.stdout) == here


def _splitmix64_reference(x: int) -> int:
    """splitmix64's finalizer in plain Python integers (independent of numpy)."""
    m = (1 << 64) - 1
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & m
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & m
    return x ^ (x >> 31)


def test_shuffle_keys_are_pinned_so_a_library_upgrade_cannot_renumber_seqs():
    # If these change, every existing checkpoint's "have" set names different documents.
    base = 0
    for part in (12, 3, 1):  # seed, epoch, stream
        base = _splitmix64_reference(base ^ part)
    golden = 0x9E3779B97F4A7C15
    want = [_splitmix64_reference((base + i * golden) & ((1 << 64) - 1)) for i in range(1, 6)]
    assert hash_keys(12, 3, 1, 5).tolist() == want
    assert hash_keys(0, 0, 1, 3).tolist() == [13830413928045401970, 6869446166584666695, 8084911050856847527]
    assert Packer(np.array([5, 3, 8, 2, 7, 1]), 10, seed=42).epoch_batches(1) == [[0, 5], [2, 3], [4, 1]]


def test_seqs_are_dense_across_epochs_and_locate_inverts_them():
    packer = Packer(_long_tailed(1500), 4096, seed=1)
    sizes = packer.epoch_sizes(4)
    assert all(n > 0 for n in sizes)
    seq = 0
    for epoch, n in enumerate(sizes):
        assert packer.seq_range(epoch) == (seq, seq + n)
        for index in (0, n // 2, n - 1):
            assert packer.locate(seq + index) == (epoch, index)
        seq += n
    assert packer.locate(seq) == (4, 0)  # past the planned epochs: the next epoch, packed on demand
    with pytest.raises(ValueError):
        packer.locate(-1)


def test_batch_of_a_seq_is_always_the_same_even_after_cache_eviction():
    packer = Packer(_long_tailed(800), 4096, seed=3, cache_epochs=1)
    expected = {e: packer.epoch_batches(e) for e in range(3)}
    for seq in [0, packer.seq_range(2)[0] + 1, 1, packer.seq_range(1)[1] - 1, packer.seq_range(2)[1] - 1]:
        epoch, index = packer.locate(seq)
        assert packer.batch(seq) == expected[epoch][index]
    fresh = Packer(_long_tailed(800), 4096, seed=3)
    seq = packer.seq_range(2)[0] + 4
    assert fresh.batch(seq) == packer.batch(seq)  # no history needed: seq -> batch is a function


def test_concurrent_callers_see_one_consistent_mapping():
    packer = Packer(_long_tailed(3000), 4096, seed=9, cache_epochs=1)
    reference = Packer(_long_tailed(3000), 4096, seed=9)
    seqs = list(range(0, reference.seq_range(3)[1], 7))
    results: dict[int, list[list[int]]] = {}

    def work(t: int) -> None:
        results[t] = [packer.batch(s) for s in (seqs if t % 2 else seqs[::-1])]
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = [reference.batch(s) for s in seqs]
    for t, got in results.items():
        assert got == (want if t % 2 else want[::-1])


def test_fill_ratio_on_a_long_tailed_mix_is_at_least_95_percent():
    packer = Packer(_long_tailed(20_000), 4096, seed=0)
    for epoch in (0, 1):
        assert packer.fill_ratio(epoch) >= 0.95


@pytest.mark.parametrize("budget", [32768, 65536])
def test_whole_long_documents_pack_into_32k_and_64k_budgets(budget):
    # regenerated thinking traces: lognormal around 12K tokens (1-32K), 64 of them exactly 32K
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(12_000), 0.5, 2_000), 1_000, 32_768).astype(np.int64)
    lengths[rng.choice(len(lengths), 64, replace=False)] = 32_768
    packer = Packer(lengths, budget, seed=0)
    for epoch in (0, 1):
        batches = packer.epoch_batches(epoch)
        assert sorted(d for b in batches for d in b) == list(range(len(lengths)))   # each whole, once
        assert max(int(lengths[b].sum()) for b in batches) <= budget
        assert packer.fill_ratio(epoch) >= 0.95
    full = [b for b in packer.epoch_batches(0) if 32_768 in lengths[b]]
    if budget == 32768:
        assert all(len(b) == 1 for b in full)           # a 32K-token document is a batch of its own
    else:
        assert sum(len(b) > 1 for b in full) > len(full) // 2   # in 64K it shares its batch


@pytest.mark.parametrize("lengths, budget, message", [
    (np.array([10, 5000, 20]), 4096, "document 1 has 5000 tokens > token_budget 4096"),
    (np.array([10, 0, 20]), 4096, "non-empty"),
    (np.array([], dtype=np.int64), 4096, "non-empty 1-d"),
    (np.array([1.5, 2.0]), 4096, "integers"),
    (np.array([10]), 0, "token_budget"),
])
def test_unpackable_input_is_rejected_in_the_constructor(lengths, budget, message):
    with pytest.raises(ValueError, match=message):
        Packer(lengths, budget, seed=0)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> PreparedDataset:
    folder = tmp_path_factory.mktemp("packer-data")
    src = folder / "chat.jsonl"
    toy_corpus.write_jsonl(toy_corpus.generate(120, seed=4), str(src))
    prepare_data(str(src), os.path.join(REPO, "configs", "demo", "tokenizer"), str(folder / "p"), max_len=256)
    return PreparedDataset.open(str(folder / "p"))


def test_packed_batches_pass_check_batch_and_hold_the_documents_tokens(dataset):
    packer = Packer(dataset.lengths, 1024, seed=0)
    for seq in range(*packer.seq_range(0)):
        docs = packer.batch(seq)
        arrays = build_packed(dataset, docs)
        batch = PackedBatch(hidden=torch.zeros(3, len(arrays["input_ids"]), 8),
                            **{k: torch.from_numpy(v) for k, v in arrays.items()})
        check_batch(batch, num_layers=3, hidden_size=8)
        assert batch.num_tokens <= 1024
        start = 0
        for i, doc in enumerate(docs):
            ids, mask, sid = dataset.sample(doc)
            end = start + len(ids)
            assert np.array_equal(arrays["input_ids"][start:end], ids)
            assert np.array_equal(arrays["loss_mask"][start:end], mask)
            assert arrays["position_ids"][start] == 0 and arrays["sample_ids"][i] == sid
            assert arrays["doc_ids"][i] == doc           # the document itself, unique in the epoch
            start = end


def test_build_packed_rejects_an_empty_document_list(dataset):
    with pytest.raises(ValueError, match="at least one document"):
        build_packed(dataset, [])
