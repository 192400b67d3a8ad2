"""state.pt files crafted to crash numpy's unpickling, refused as damaged checkpoints.

numpy's own unpickling trusts the pickle: an array of dtype=object over a bytes buffer makes it read
the file's bytes as object pointers (the trainer and `dfpipe inspect` died with SIGSEGV, and the
checkpoint was never moved aside, so every restart died the same way). The weights-only load admits
no numpy callable (drafter_trainer/checkpoint.py `_safe_globals`): such a state.pt fails
`state.pt-unreadable`, is moved aside, and the checkpoint before it resumes. Each load runs in a
subprocess, so a crash fails the test instead of killing the suite."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common.seqset import SeqSet
from drafter_trainer.checkpoint import TrainerState, sample_stats

REPO = Path(__file__).resolve().parents[1]


class _Dtype:
    """Pickles as numpy.dtype(code, False, True), with the BUILD state `state` as numpy's own reduce
    gives it, or none (numpy's dtype as the code alone makes it)."""

    def __init__(self, code: str, state: tuple | None = None) -> None:
        self.code, self.state = code, state

    def __reduce__(self) -> tuple:
        if self.state is None:
            return np.dtype, (self.code, False, True)
        return np.dtype, (self.code, False, True), self.state


class _Array:
    """Pickles as numpy's _reconstruct(ndarray, ...) with BUILD state (1, shape, dtype, False, data)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, data: bytes) -> None:
        self.shape, self.dtype, self.data = shape, dtype, data

    def __reduce__(self) -> tuple:
        from numpy._core.multiarray import _reconstruct
        return _reconstruct, (np.ndarray, (0,), b"b"), (1, self.shape, self.dtype, False, self.data)


def _object_over_bytes() -> _Array:
    """dtype=object, its flags saying it holds no objects, over 8 bytes of 0x41: numpy's unpickling
    takes the bytes as the array's items, and reading one dereferences 0x4141414141414141."""
    return _Array((1,), _Dtype("O8", (3, "|", None, None, None, -1, -1, 0)), b"\x41" * 8)


def _int_flagged_as_objects() -> _Array:
    """An int64 dtype whose flags say its items are object pointers."""
    return _Array((1,), _Dtype("i8", (3, "<", None, None, None, -1, -1, 63)), b"\x41" * 8)


def _structured_with_object_field() -> _Array:
    """A structured dtype whose field `a` is an object: the same pointers, one level down."""
    fields = {"a": (np.dtype(object), 0), "b": (np.dtype(np.int64), 8)}
    return _Array((1,), _Dtype("V16", (3, "|", None, ("a", "b"), fields, 16, 8, 27)), b"\x41" * 16)


PAYLOADS = {"object-dtype": _object_over_bytes, "int-flagged-as-objects": _int_flagged_as_objects,
            "structured-object-field": _structured_with_object_field}


def _legacy_checkpoint(run: Path, step: int, trained: Any) -> str:
    """A pre-manifest checkpoint (state.pt holding `trained` as its sample ids, meta.json)."""
    path = run / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True, mode=0o755)
    buf = io.BytesIO()
    torch.save({"model": {}, "step": step, "trained_samples": {0: trained}}, buf)
    (path / "state.pt").write_bytes(buf.getvalue())
    (path / "meta.json").write_text(json.dumps({"step": step, "epoch": 0, "have": [[0, 1]]}))
    return str(path)


def _good_checkpoint(run: Path) -> str:
    """A checkpoint of step 2 that verifies (with a manifest)."""
    state = TrainerState(step=2, epoch=0, have=SeqSet(range(2)), trained_samples={0: np.array([[0, 0], [1, 1]])},
                         sample_seqs={0: np.arange(2)}, model={"w": torch.zeros(2)})
    return state.save(str(run), keep=5, reason="test", epoch_samples=2, epoch_documents=2)[0]


def _in_subprocess(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_a_state_pt_with_a_crafted_numpy_array_is_moved_aside_and_the_one_before_resumes(
        tmp_path: Path, payload: str) -> None:
    run = tmp_path / "run"
    good = _good_checkpoint(run)
    bad = _legacy_checkpoint(run, 3, PAYLOADS[payload]())
    inspected = _in_subprocess(f"import sys; from dfpipe.cli import main; sys.exit(main(['inspect', {bad!r}]))", run)
    assert inspected.returncode == 1, (inspected.returncode, inspected.stderr[-2000:])   # not -11 (SIGSEGV)
    verdicts = [line for line in inspected.stdout.splitlines() if "verified" in line]
    assert len(verdicts) == 1 and "failed: state.pt-unreadable: ValueError: numpy dtype" in verdicts[0], \
        inspected.stdout
    assert "Traceback" not in inspected.stderr, inspected.stderr
    resumed = _in_subprocess(
        "import sys; from drafter_trainer.checkpoint import resume_checkpoint, list_moved_aside; "
        f"path, state = resume_checkpoint({str(run)!r}); print(path, state.step); "
        f"print(*list_moved_aside({str(run)!r}))", run)
    assert resumed.returncode == 0, (resumed.returncode, resumed.stderr[-2000:])
    where, moved = resumed.stdout.splitlines()
    assert where == f"{good} 2"
    assert os.path.basename(moved) == "step-00000003.bad-state.pt-unreadable"
    assert not os.path.exists(bad)


def test_a_pre_manifest_checkpoint_s_integer_arrays_still_load(tmp_path: Path) -> None:
    """What the stand-ins exist for: the sample ids of a checkpoint written before manifests, numpy
    int64 arrays, come back as the same arrays (the numpy classes themselves are never admitted)."""
    ids = np.array([[0, 0], [1, 1], [2, 2]], dtype=np.int64)
    path = _legacy_checkpoint(tmp_path / "run", 3, ids)
    meta = json.loads(Path(path, "meta.json").read_text())
    meta.update(have=[[0, 0]], **sample_stats({0: ids}, 0, 3))
    Path(path, "meta.json").write_text(json.dumps(meta))
    from drafter_trainer.checkpoint import _load_state
    loaded = _load_state(path)["trained_samples"][0]
    assert isinstance(loaded, np.ndarray) and loaded.dtype == np.int64 and loaded.tolist() == ids.tolist()
