"""The slot payload checksum (common/checksum.py): what it catches, that it is the same on every
device and reduction shape, and what the services do with a slot whose payload bytes changed in
/dev/shm after it was published: never trained, handed back, computed again, trained once."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.batch import DOC_TENSORS, PAYLOAD_TENSORS, TOKEN_TENSORS
from common.checksum import (ChecksumMismatch, as_meta, check_payload, payload_checksums,
                             tensor_checksum)
from common.protocol import Ack, Announce, EpochEnd
from common.ring import ConsumerRing, SlotState
from common.seqset import SeqSet
from e2e import REPO, Service, assert_exactly_once, ctl, load, serving, wait_for, write_config, write_heldout
from test_target_server import ScriptedConsumer
from machine_speed import scaled

INT64 = 1 << 64


def reference(x: torch.Tensor) -> list[int]:
    """The definition, in Python integers: little-endian 64-bit words, zero-padded, sums mod 2^64."""
    data = x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    data += b"\0" * (-len(data) % 8)
    words = struct.unpack(f"<{len(data) // 8}q", data)
    s1 = sum(words) % INT64
    s2 = sum((i + 1) * w for i, w in enumerate(words)) % INT64
    return [s - INT64 if s >= INT64 // 2 else s for s in (s1, s2)]


def small_payload(seed: int = 0, tokens: int = 37, layers: int = 2, hidden: int = 12,
                  hidden_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A batch's tensors at a tiny size; odd lengths, so several tensors end in a padded word."""
    g = torch.Generator().manual_seed(seed)
    out = {"hidden": torch.randn((layers, tokens, hidden), generator=g).to(hidden_dtype)}
    for name, dtype in TOKEN_TENSORS.items():
        n = 5 if name in DOC_TENSORS else tokens
        out[name] = torch.randint(-(1 << 62) if dtype == torch.int64 else 0, 1 << 62 if dtype == torch.int64 else 100,
                                  (n,), generator=g, dtype=torch.int64).to(dtype)
    return out


# ---- the function --------------------------------------------------------------------------------

@pytest.mark.parametrize("row_words", [1, 3, 8, 1024])
def test_the_checksum_is_its_definition_whatever_the_reduction_shape(row_words: int) -> None:
    # int64 values near the limits make both sums wrap many times: torch's wrapping must agree
    # with arithmetic modulo 2^64
    for name, x in {**small_payload(), "float32": torch.randn(3, 41), "big": torch.arange(5000, dtype=torch.int64) * (
            (1 << 62) + 12345), "one_byte": torch.tensor([7], dtype=torch.uint8),
            "empty": torch.zeros(0, dtype=torch.int32)}.items():
        assert tensor_checksum(x, row_words).tolist() == reference(x), (name, row_words)


def test_every_single_flipped_bit_of_every_tensor_changes_its_checksum() -> None:
    payload = small_payload()
    clean = payload_checksums(payload)
    for i, (name, x) in enumerate(payload.items()):
        raw = x.reshape(-1).view(torch.uint8)
        want = clean[i].tolist()
        for byte in range(raw.numel()):
            for bit in range(8):
                raw[byte] ^= 1 << bit
                # payload_checksums stacks tensor_checksum per tensor: the flipped one's alone is
                # the same figure, without summing the untouched tensors again on every flip
                assert tensor_checksum(x).tolist() != want, (name, byte, bit)
                raw[byte] ^= 1 << bit
    assert torch.equal(payload_checksums(payload), clean), "every flip undone"


def test_swapped_words_and_scaled_values_change_the_checksum() -> None:
    x = torch.randn(8, 128).to(torch.bfloat16)   # 256 words
    clean = tensor_checksum(x).tolist()
    words = x.reshape(-1).view(torch.uint8).view(torch.int64)
    for a, b in [(0, 1), (0, 127), (5, 69), (30, 31)]:
        words[[a, b]] = words[[b, a]]
        assert tensor_checksum(x).tolist() != clean, (a, b)
        words[[a, b]] = words[[b, a]]
    assert tensor_checksum(x).tolist() == clean
    y = x.clone()
    y[1] *= 2                                     # "hidden states scaled"
    assert tensor_checksum(y).tolist() != clean


def test_a_mismatch_names_the_tensor_and_a_slot_without_checksums_is_malformed() -> None:
    payload = small_payload()
    meta = as_meta(PAYLOAD_TENSORS, payload_checksums(payload))
    check_payload(meta, PAYLOAD_TENSORS, payload_checksums(payload))
    payload["sample_ids"][2] += 1
    with pytest.raises(ChecksumMismatch, match="sample_ids") as e:
        check_payload(meta, PAYLOAD_TENSORS, payload_checksums(payload))
    assert "hidden" not in str(e.value)
    for bad in (None, {}, {**meta, "hidden": [1]}, {**meta, "hidden": ["1", 2]}):
        with pytest.raises(ValueError, match="no payload checksum"):
            check_payload(bad, PAYLOAD_TENSORS, payload_checksums(payload))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU-only host)")
def test_cuda_and_cpu_give_the_same_checksums() -> None:
    for seed, tokens in enumerate((37, 1000, 4099)):
        payload = small_payload(seed, tokens=tokens, layers=3, hidden=640)
        on_gpu = {k: v.cuda() for k, v in payload.items()}
        assert payload_checksums(on_gpu).cpu().tolist() == payload_checksums(payload).tolist()
        # a view whose bytes do not start 8-byte-aligned is handled (copied), not misread
        odd = torch.randint(0, 255, (1001,), dtype=torch.uint8)
        assert tensor_checksum(odd.cuda()[3:]).cpu().tolist() == reference(odd[3:])


def test_the_gpu_bench_runs_on_the_cpu(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "checksum_bench.py"), "--device", "cpu",
                          "--tokens", "96", "--layers", "2", "--hidden", "40", "--docs", "7", "--repeats", "2",
                          "--warmup", "1"], capture_output=True, text=True, timeout=scaled(120), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["payload_bytes"] == 2 * 96 * 40 * 2 + 96 * (4 + 1 + 4) + 7 * (4 + 8 + 8)   # doc_lens, sample_ids, doc_ids
    assert out["checksum_ms_producer"] > 0 and out["checksum_ms_consumer"] > 0 and out["cpu_equal"] is True


# ---- the services --------------------------------------------------------------------------------

def _full_ring(endpoint: str, slots: int):
    s = ctl(endpoint, "status")
    return s if s and s["ring"][0]["slots"]["READY"] == slots else None


def _flip(view, tensor: str, byte: int, mask: int) -> None:
    """XOR one byte of a READY slot's tensor in /dev/shm (the producer's copy; nobody re-publishes it)."""
    raw = view.tensors[tensor].reshape(-1).view(torch.uint8)
    raw[byte] ^= mask


@pytest.mark.timeout(600)
def test_the_server_frees_a_slot_handed_back_as_corrupt_and_computes_it_again(tmp_path: Path) -> None:
    """The server half alone, held-out batches included: an ACK with `corrupt` frees the slot
    without counting it delivered, and the batch comes again from a fresh publication; a corrupt
    ACK for another publication than the one announced frees nothing."""
    config = write_config(tmp_path, samples=40, data={"heldout_path": str(write_heldout(tmp_path, 10))},
                          train={"eval_batches": 1})
    endpoint = load(config)["service"]["target_endpoint"]
    server = Service("target-server", config, tmp_path)
    consumer = None
    try:
        total = sum(wait_for(lambda: serving(endpoint), 180, "target serving")["epoch_sizes"])
        consumer = ScriptedConsumer(endpoint, SeqSet(), job="handback", heldout=True)

        def corrupt_ack(a: Announce, pub_seq: int) -> None:
            consumer.chan.send(Ack(consumer_epoch=a.consumer_epoch, secret=consumer.secret, worker=a.worker,
                                   slot=a.slot, pub_seq=pub_seq, seq=a.seq, corrupt=True))

        handed_back: dict[bool, Announce] = {}     # heldout? -> the announcement handed back
        got: list[int] = []
        heldout: list[int] = []
        deadline = time.monotonic() + 300
        while not (consumer.ended and heldout) and time.monotonic() < deadline:
            msg = consumer.chan.recv(timeout_s=0.5)
            if isinstance(msg, EpochEnd):
                consumer.ended = True
            if not isinstance(msg, Announce):
                continue
            if msg.heldout not in handed_back:
                corrupt_ack(msg, msg.pub_seq + 1)   # not the publication announced: ignored
                corrupt_ack(msg, msg.pub_seq)
                handed_back[msg.heldout] = msg
                continue
            if any((a.worker, a.slot, a.pub_seq) == (msg.worker, msg.slot, msg.pub_seq) for a in handed_back.values()):
                raise AssertionError(f"a slot handed back as corrupt was announced again: {msg}")
            consumer._ack(msg)
            (heldout if msg.heldout else got).append(msg.seq)
        assert consumer.ended
        assert sorted(got) == list(range(total)), "every batch once, the handed-back one computed again"
        assert heldout == [0]
        status = ctl(endpoint, "status")
        assert status["batches"]["corrupt_payloads"] == 2 and status["batches"]["acked"] == total
        assert status["batches"]["corrupt_slots"] == 0 and status["heldout"]["acked"] == 1
        assert handed_back[False].seq in range(total) and status["pid"] == server.pid
    finally:
        if consumer is not None:
            consumer.close()
        server.stop()
    assert server.proc.returncode == 0, server.log()
    assert server.log(tail=10_000).count("fails its checksum") == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flipped_payload_bytes_in_ready_slots_are_never_trained_and_computed_again(tmp_path: Path) -> None:
    """Issue 21: bytes of READY slots flipped in /dev/shm (hidden states scaled, a sample id
    changed) before the trainer reads them. The trainer takes neither, the server computes both
    again, and every sample is trained exactly once; both services count them and exit 0."""
    config = write_config(tmp_path, samples=60)
    cfg = load(config)
    endpoint, slots = cfg["service"]["target_endpoint"], cfg["ring"]["slots"]
    target = Service("target-server", config, tmp_path)
    trainer = None
    try:
        wait_for(lambda: serving(endpoint), 180, "target serving")
        status = wait_for(lambda: _full_ring(endpoint, slots), 180, "every slot READY before a trainer connects")
        total = sum(status["epoch_sizes"])
        ring = ConsumerRing.attach(status["ring"][0]["path"], cuda_register="off")
        try:
            ready = [i for i in ring.slots() if i.state is SlotState.READY]
            views = [ring.read(i.index, i.pub_seq) for i in ready[:2]]
            hidden = views[0].tensors["hidden"]
            # the top byte of one element's word: its exponent, so that value is scaled
            _flip(views[0], "hidden", hidden.element_size() * (hidden.numel() // 2) + hidden.element_size() - 1, 0x01)
            _flip(views[1], "sample_ids", 0, 0x01)
            flipped = sorted(v.meta["seq"] for v in views)
            del views, hidden   # before the unmap
        finally:
            ring.close()
        trainer = Service("trainer", config, tmp_path)
        assert trainer.wait(600) == 0, trainer.log()
        info = assert_exactly_once(config)
        final = ctl(endpoint, "status")
        assert final["batches"]["corrupt_payloads"] == 2, final["batches"]
        assert final["batches"]["acked"] == total and info["batches"] == total
        log = trainer.log(tail=10_000)
        lines = [ln for ln in log.splitlines() if "payload checksum mismatch" in ln]
        assert len(lines) == 2, log
        assert sorted(int(ln.split(" seq ")[1].split()[0]) for ln in lines) == flipped
        assert "in hidden" in lines[0] + lines[1] and "in sample_ids" in lines[0] + lines[1]
        assert "(2 corrupt payload(s) so far)" in log      # feed.corrupt_payloads
        assert "exported drafter" in log
    finally:
        if trainer is not None:
            trainer.stop()
        target.stop()
    assert target.proc.returncode == 0, target.log()
