"""Atomic, verified, resumable checkpoints that say exactly which batches (and samples) they contain.

    <out_dir>/checkpoints/                          0700: the service user's only (files 0600)
        step-00000120/          a complete checkpoint (only ever appears by rename)
            state.pt            weights (trainable only), optimizer, schedule, RNG, step
            samples.npz         per epoch: the sample ids trained and the batch seq each was trained in
            meta.json           step, epoch, have (batch seqs, as ranges), sample accounting, config
                                hash, plan (the target server's data plan `have` counts batches of)
            manifest.json       written last: every other file's size and sha256, the checkpoint's
                                facts (step, epoch, have, samples per epoch) and its own digest
        step-00000117.bad-state.pt-checksum/   failed verification: moved aside, kept, never resumed
        .tmp-step-00000120-<pid>/   being written; swept on start
        .old-step-00000120-<pid>/   the copy a same-step save replaces, until the new one is in place
        .del-step-00000090-<pid>/   being removed (past train.keep_checkpoints)
    <out_dir>/trainer.lock      held (flock) by the one trainer using out_dir

A checkpoint is evidence, not trust: nothing of it is loaded before `verify_checkpoint` checked
every file against the manifest and the facts against each other, and the trainer resumes from
the newest checkpoint that verifies, moving each one that does not aside (`move_aside`). The
manifest's digests are no signature (anyone who can write the folder can reseal it), so state.pt
is only ever loaded with torch's weights-only unpickler (`_load_state`): a pickle that names
anything beyond tensors and plain values fails `state.pt-unsafe` and runs nothing.

Only the service's own user (and root) may control what is read: out_dir, checkpoints/, each
checkpoint folder and file theirs and not writable by group or others, every folder above them
theirs or sticky (`common.trust.state_path_problem`, ssh's StrictModes rule; `service.allowed_uids`,
who may talk to the sockets, does not extend to it). Anything else raises `Untrusted` naming the
path, its owner and its mode, before anything in out_dir is written (`check_run_folder`).

Every save is write-new-then-rename, and so is every removal (a folder leaves the names a resume
considers before its files go): a `kill -9` at any moment leaves the previous complete checkpoint
or the new one, the same-step re-save included (`_put_in_place`). One trainer at a time:
`lock_out_dir` comes before anything in out_dir is read or swept, so a second trainer (another
config, another endpoint) never sweeps the first one's checkpoint in progress.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from common.cluster import accounting as cluster_accounting
from common.cluster import count_by_host, epoch_ranges
from common.faults import fault_error, fault_point
from common.protocol import ProtocolError, check_plan
from common.seqset import SeqSet
from common.trust import Untrusted, state_path_problem, trusted_uids

# torch is imported only where state.pt is written or unpickled: verifying and inspecting checkpoints
# (`dfpipe inspect`, the tests' exactly-once audits) then starts in a fraction of torch's ~1.5 s import.
if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PREFIX = "step-"
CHECKPOINT_NAME = re.compile(r"step-\d{8}")
BAD_MARK = ".bad-"
FINISHED = "end of training"   # the `reason` in the meta of the checkpoint a trainer writes when its epochs are done

LOCK_NAME = "trainer.lock"
FORMAT = 2                      # 2: with samples.npz and a manifest; checkpoints before it had neither
MANIFEST = "manifest.json"
STATE, SAMPLES, META = "state.pt", "samples.npz", "meta.json"
PIECE_BYTES = 64 << 20          # a file's digest is over the sha256 of each such piece (see _PieceHash)
OVERLAP_BYTES = 1 << 20         # writes this large are hashed in a second thread while they are written
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))   # pieces hashed at once, writing and verifying

# The kill points inside a save, in the order a save passes them (DFPIPE_FAULT=<point>, test-only:
# common/faults.py). Between files, before and after the manifest, after each rename and inside
# each removal; `displaced` and `removing_old` only on a same-step re-save.
SAVE_FAULT_POINTS = ("checkpoint.after.state.pt", "checkpoint.after.samples.npz", "checkpoint.after.meta.json",
                     "checkpoint.before_rename", "checkpoint.displaced", "checkpoint.after_rename",
                     "checkpoint.removing_old", "checkpoint.removing_rotated")


class OutDirInUse(RuntimeError):
    """Another live process holds out_dir's lock."""


class CheckpointInvalid(Exception):
    """A checkpoint failed verification. `check` names the check (it becomes the moved-aside
    folder's suffix, e.g. `state.pt-checksum`), `detail` what was found."""

    def __init__(self, path: str, check: str, detail: str) -> None:
        super().__init__(f"{path}: {check}: {detail}")
        self.path, self.check, self.detail = path, check, detail


class NoCheckpointVerifies(Exception):
    """There were checkpoints and none of them verifies: resuming from nothing would throw the run's
    progress away, so the trainer stops and says what to do."""


def check_run_folder(out_dir: str, create: bool = False) -> None:
    """Untrusted unless out_dir and its checkpoints/ (when there) pass `state_path_problem` for this
    user and root; a missing out_dir passes (nothing in it is read), or with `create` is made, each
    missing folder 0755 (the umask may only take more away) once the folder it goes into has passed
    the same rule (sticky allowed there): nothing is created under a folder that fails."""
    trusted = trusted_uids()
    if not create and not os.path.lexists(out_dir):
        return   # nothing there to read: the caller finds no checkpoint
    if create and not os.path.lexists(out_dir):
        missing, parent = [], os.path.abspath(out_dir)
        while not os.path.lexists(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        if problem := state_path_problem(parent, trusted, sticky_ok=True):
            raise Untrusted(f"train.out_dir {out_dir}: {problem}")
        for folder in reversed(missing):
            with contextlib.suppress(FileExistsError):   # made meanwhile: the check below says whose it is
                os.mkdir(folder, 0o755)
    for path in (out_dir, checkpoint_root(out_dir)):
        if (path == out_dir or os.path.lexists(path)) and (problem := state_path_problem(path, trusted)):
            raise Untrusted(f"train.out_dir {out_dir}: {problem}")


def lock_out_dir(out_dir: str) -> int:
    """Take out_dir's trainer lock (flock on out_dir/trainer.lock) or raise OutDirInUse naming the
    holder; Untrusted (`check_run_folder`, out_dir created when missing) before anything is
    written. Returns the fd: the lock lasts as long as it is open, i.e. until the process ends,
    however it ends (the kernel drops a dead process's flock, so a stale file never blocks)."""
    check_run_folder(out_dir, create=True)
    path = os.path.join(out_dir, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise OutDirInUse(f"{out_dir} is in use by another trainer (pid {holder}, holding {path}); "
                          "one trainer per train.out_dir: stop it first or use another out_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def fsync_path(path: str) -> None:
    """fsync a file or a folder by path (a folder: so a rename into it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def _private_root(out_dir: str) -> str:
    """The checkpoints folder, 0700 (a folder an older version made 0755 is tightened)."""
    root = checkpoint_root(out_dir)
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.stat(root)
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(root, 0o700)
    return root


# The exactly-once audit as every place shows it (status, inspect, the demo summary, top).
AUDIT_KEYS = ("samples_trained", "samples_duplicated", "epoch_samples",
              "documents_trained", "documents_duplicated", "epoch_documents")


def trained_pairs(trained: np.ndarray) -> np.ndarray:
    """[n, 2] (sample id, document id), one row per document an epoch trained. A checkpoint written
    before documents were counted holds sample ids alone: their document ids read as -1 (unknown)."""
    trained = np.asarray(trained, dtype=np.int64)
    if trained.ndim == 2:
        return trained
    return np.stack([trained, np.full_like(trained, -1)], axis=1)


def sample_stats(trained_samples: dict[int, np.ndarray], epoch: int, epoch_samples: int,
                 epoch_documents: int = 0) -> dict[str, int]:
    """Exactly-once accounting for one epoch, of samples (source rows) and of documents (what the
    target computes: a template that re-renders earlier turns, or a split, makes several of one
    row). A document trained more than once is duplicated, and so is its sample; a sample's several
    documents trained once each are not. Documents of unknown id (-1, see `trained_pairs`) count
    as trained, never as duplicated."""
    pairs = trained_pairs(trained_samples.get(epoch, np.zeros((0, 2), dtype=np.int64)))
    known = pairs[pairs[:, 1] >= 0]
    docs, counts = np.unique(known[:, 1], return_counts=True)
    twice = docs[counts > 1]
    return {"samples_trained": len(np.unique(pairs[:, 0])),
            "samples_duplicated": len(np.unique(known[np.isin(known[:, 1], twice), 0])),
            "epoch_samples": epoch_samples,
            "documents_trained": len(docs) + int((pairs[:, 1] < 0).sum()),
            "documents_duplicated": len(twice),
            "epoch_documents": epoch_documents}


def epoch_stats(trained_samples: dict[int, np.ndarray]) -> dict[str, dict[str, int]]:
    """The same accounting for every epoch the run has trained from, so a run of many epochs (and
    restarts) can be audited from its last checkpoint alone. String keys: it goes into JSON."""
    return {str(e): {k: v for k, v in sample_stats(trained_samples, e, 0).items() if not k.startswith("epoch_")}
            for e in sorted(trained_samples)}


# ---- digests ---------------------------------------------------------------------------------------
class _PieceHash:
    """sha256 over the sha256 digests of a byte stream's PIECE_BYTES pieces: the same digest whether
    it is computed in order while the file is written or piece by piece in parallel while it is
    verified (a plain sha256 of a 20 GB file is one core for 13 s)."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._piece = hashlib.sha256()
        self._filled = 0
        self.size = 0

    def update(self, data: memoryview, pool: ThreadPoolExecutor | None = None) -> None:
        """Hash `data`, the stream's next bytes; with `pool`, the whole pieces inside it on its threads."""
        at = 0
        if self._filled:   # the piece begun by earlier bytes, first
            at = min(PIECE_BYTES - self._filled, len(data))
            self._add(data[:at])
        whole = range(at, len(data) - PIECE_BYTES + 1, PIECE_BYTES)
        if pool is not None and len(whole) > 1:
            self._pieces += pool.map(lambda start: hashlib.sha256(data[start:start + PIECE_BYTES]).digest(), whole)
            at = whole[-1] + PIECE_BYTES
        while at < len(data):
            take = min(PIECE_BYTES - self._filled, len(data) - at)
            self._add(data[at:at + take])
            at += take
        self.size += len(data)

    def _add(self, data: memoryview) -> None:
        """Bytes of the current piece (no more than it lacks)."""
        self._piece.update(data)
        self._filled += len(data)
        if self._filled == PIECE_BYTES:
            self._pieces.append(self._piece.digest())
            self._piece, self._filled = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        pieces = self._pieces + ([self._piece.digest()] if self._filled else [])
        return hashlib.sha256(b"".join(pieces)).hexdigest()


def bytes_digest(data: bytes) -> str:
    h = _PieceHash()
    h.update(memoryview(data))
    return h.hexdigest()


def file_digest(path: str, size: int, threads: int = HASH_THREADS) -> str:
    """_PieceHash of the first `size` bytes of a file, its pieces read and hashed on `threads`
    threads (hashlib and pread let go of the GIL)."""
    def piece(i: int) -> bytes:
        h = hashlib.sha256()
        buf = bytearray(min(8 << 20, PIECE_BYTES))
        start, stop = i * PIECE_BYTES, min(size, (i + 1) * PIECE_BYTES)
        with open(path, "rb", buffering=0) as f:
            while start < stop:
                n = os.preadv(f.fileno(), [memoryview(buf)[:min(len(buf), stop - start)]], start)
                if n == 0:
                    raise OSError(errno.EIO, f"{path}: ends at {start} bytes, {size} expected")
                h.update(memoryview(buf)[:n])
                start += n
        return h.digest()

    count = -(-size // PIECE_BYTES)
    if count <= 1:
        return hashlib.sha256(b"".join(piece(i) for i in range(count))).hexdigest()
    with ThreadPoolExecutor(min(threads, count), thread_name_prefix="checkpoint-verify") as pool:
        return hashlib.sha256(b"".join(pool.map(piece, range(count)))).hexdigest()


class _HashedFile:
    """A new checkpoint file (0600), digested from the very bytes written (no second read). A large
    write is hashed on the `beside` thread while this one writes it, its whole pieces in parallel
    on `pieces`' threads (hashlib and the write let go of the GIL)."""

    def __init__(self, path: str, beside: ThreadPoolExecutor, pieces: ThreadPoolExecutor) -> None:
        self.name = path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._f = os.fdopen(fd, "wb")
        self._beside, self._pieces = beside, pieces
        self.hash = _PieceHash()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) < OVERLAP_BYTES:
            self.hash.update(view)
            self._f.write(view)
            return len(view)
        hashing = self._beside.submit(self.hash.update, view, self._pieces)
        try:
            self._f.write(view)
        finally:
            hashing.result()    # `view` may be a writer's buffer, valid only during this call
        return len(view)

    def flush(self) -> None:
        self._f.flush()

    def finish(self) -> dict[str, Any]:
        """Durable on disk; its manifest entry."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"size": self.hash.size, "sha256": self.hash.hexdigest()}

    def close(self) -> None:
        self._f.close()


def _write_error(error: BaseException) -> OSError | None:
    """The OSError a failed write raised inside `error`'s chain of exceptions, if any."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _save_state(state: dict[str, Any], f: Any) -> None:
    """torch.save into an open file; a failed write (a full disk) raises OSError, as any other write:
    torch's zip writer lets the write's OSError (ENOSPC) out of the record it was writing, then
    closing the archive raises RuntimeError("unexpected pos ...") over it, which becomes an OSError
    here. A RuntimeError with no failed write under it (a bug, a device error while copying a
    tensor out) stays what it is."""
    import torch

    try:
        torch.save(state, f)
    except RuntimeError as e:
        failed = _write_error(e)
        if failed is None:
            raise
        raise OSError(failed.errno, f"writing {getattr(f, 'name', 'state.pt')}: {failed.strerror or failed}") from e


# ---- saving ----------------------------------------------------------------------------------------
Writer = Callable[[IO[bytes]], None]


def _manifest_bytes(facts: dict[str, Any], files: dict[str, dict[str, Any]]) -> bytes:
    body = {**facts, "format": FORMAT, "piece_bytes": PIECE_BYTES, "files": files}
    return json.dumps({**body, "digest": _json_digest(body)}, indent=1, sort_keys=True).encode()


def _json_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save_checkpoint(out_dir: str, step: int, files: dict[str, Writer], facts: dict[str, Any], keep: int) -> str:
    """Write `files` (name -> what writes it, in order) and then the manifest (`facts`, each file's
    size and digest) into a new folder, durable, and put it in place as step-<step>; keep the
    `keep` newest. OSError when a write fails (its folder removed: a full disk does not fill up
    further with every retry)."""
    root = _private_root(out_dir)
    name = f"{PREFIX}{step:08d}"
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.mkdir(tmp, 0o700)
        fault_error("checkpoint.write")
        entries = {}
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as beside, \
                ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="checkpoint-piece") as pieces:
            for fname, fill in files.items():
                with contextlib.closing(_HashedFile(os.path.join(tmp, fname), beside, pieces)) as f:
                    fill(f)
                    entries[fname] = f.finish()
                fault_point(f"checkpoint.after.{fname}")
            with contextlib.closing(_HashedFile(os.path.join(tmp, MANIFEST), beside, pieces)) as manifest:
                manifest.write(_manifest_bytes(facts, entries))
                manifest.finish()
        fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fault_point("checkpoint.before_rename")
    final = os.path.join(root, name)
    _put_in_place(tmp, final)
    try:
        for old in list_checkpoints(out_dir)[:-keep]:
            _discard(old, "checkpoint.removing_rotated")
    except OSError as e:    # the new checkpoint is in place: a leftover old one costs only disk
        log.warning("could not remove checkpoints past train.keep_checkpoints=%d: %s", keep, e)
    return final


def _put_in_place(tmp: str, final: str) -> None:
    """Rename the complete folder `tmp` to `final`. A same-step re-save (e.g. SIGTERM right after a
    periodic save) first renames the old copy aside: at every moment one of the two is whole
    under a name the start-up sweep restores (`sweep_partial`)."""
    if not os.path.exists(final):
        os.rename(tmp, final)
        fsync_path(os.path.dirname(final))
        fault_point("checkpoint.after_rename")
        return
    old = os.path.join(os.path.dirname(final), f".old-{os.path.basename(final)}-{os.getpid()}")
    os.rename(final, old)
    fault_point("checkpoint.displaced")
    try:
        os.rename(tmp, final)
    except OSError:
        os.rename(old, final)
        raise
    fsync_path(os.path.dirname(final))
    fault_point("checkpoint.after_rename")
    _discard(old, "checkpoint.removing_old")


def _discard(path: str, point: str) -> None:
    """Remove a checkpoint folder: out of the names a resume considers first (one rename), then its files."""
    base = os.path.basename(path)
    if not base.startswith("."):
        hidden = os.path.join(os.path.dirname(path), f".del-{base}-{os.getpid()}")
        os.rename(path, hidden)
        path = hidden
    fault_point(point)
    shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(out_dir: str) -> list[str]:
    """The checkpoint folders (step-NNNNNNNN), oldest first; verified or not (`verify_checkpoint`)."""
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if CHECKPOINT_NAME.fullmatch(n) and os.path.isdir(os.path.join(root, n)))
    return [os.path.join(root, n) for n in names]


def list_moved_aside(out_dir: str) -> list[str]:
    """Checkpoints that failed verification and were moved aside (step-NNNNNNNN.bad-<check>)."""
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in sorted(os.listdir(root))
            if n.startswith(PREFIX) and BAD_MARK in n and os.path.isdir(os.path.join(root, n))]


def sweep_partial(out_dir: str) -> int:
    """What a killed save or removal left (rank 0, at start, holding the out_dir lock): folders
    being written or removed go; a same-step copy that was renamed aside comes back if its
    replacement never got into place. Returns how many were swept or restored."""
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return 0
    done = 0
    for n in sorted(os.listdir(root)):
        path = os.path.join(root, n)
        if n.startswith((".tmp-", ".del-")):
            shutil.rmtree(path, ignore_errors=True)
            done += 1
        elif n.startswith(".old-") and CHECKPOINT_NAME.fullmatch(name := n[len(".old-"):].rsplit("-", 1)[0]):
            final = os.path.join(root, name)
            if os.path.exists(final):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, final)
                log.warning("restored %s: a kill interrupted its same-step re-save", final)
            done += 1
    return done


def move_aside(path: str, check: str) -> str:
    """Rename a checkpoint that failed `check` to <name>.bad-<check> (never delete it: it may be
    the only copy of the run's progress someone can repair); its new path."""
    base = f"{path}{BAD_MARK}{re.sub(r'[^A-Za-z0-9._-]', '_', check)}"
    target, n = base, 1
    while os.path.exists(target):
        n += 1
        target = f"{base}-{n}"
    os.rename(path, target)
    fsync_path(os.path.dirname(path))
    return target


# ---- verification ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Verified:
    """A checkpoint that passed `verify_checkpoint`, with what was read to check it."""
    path: str
    meta: dict[str, Any]
    samples: dict[int, np.ndarray]        # sample ids trained, per epoch
    sample_seqs: dict[int, np.ndarray]    # the batch seq of each (-1: resumed from a checkpoint before seqs)
    unattributed: SeqSet                  # the seqs of those -1 samples
    legacy: bool = False                  # no manifest (written before checkpoints had one): consistency only
    state: dict[str, Any] | None = None   # legacy only: state.pt, loaded to check it


def _trusted_file(path: str, name: str) -> str:
    """The checkpoint file path/name; Untrusted when it is there and not this user's or root's, is
    writable by group or others, or is a link (`state_path_problem`). A missing one is for the
    caller to report (a failed check, `<name>-missing`)."""
    file = os.path.join(path, name)
    if os.path.lexists(file) and (problem := state_path_problem(file, trusted_uids(), is_file=True)):
        raise Untrusted(f"checkpoint {path}: {problem}")
    return file


# ---- legacy numpy fields, rebuilt without numpy's unpickling ------------------------------------
# Checkpoints before manifests kept their sample ids as numpy integer arrays. numpy's own
# unpickling (`_reconstruct`, `ndarray.__setstate__`) trusts the pickle: an array of dtype=object
# over a bytes buffer makes numpy read the file's bytes as object pointers (a segfault, or worse).
# So no numpy callable is ever on the weights-only allowlist: these stand-ins take numpy's names,
# check what the pickle asks for (a plain numeric dtype, a buffer of exactly the array's size) and
# build the array with np.frombuffer, which never interprets bytes as pointers.
_LEGACY_DTYPE = re.compile(r"[iu][1248]|f[248]|b1")   # the numeric dtypes an array of ids or values has


class _LegacyDtype:
    """Stands in for `numpy.dtype(code, align, copy)` and its BUILD state; `dtype` once checked."""

    def __init__(self, code: Any = None, align: Any = False, copy: Any = True) -> None:
        if not isinstance(code, str) or not _LEGACY_DTYPE.fullmatch(code):
            raise ValueError(f"numpy dtype {code!r}: a checkpoint's arrays hold plain numbers only")
        self.code, self.dtype = code, np.dtype(code)

    def __setstate__(self, state: Any) -> None:
        # (version, byte order, subarray, names, fields, elsize, alignment, flags): a plain number has
        # no subarray, names or fields (a structured dtype, perhaps with object fields, has them), and
        # no flags (63 would tell numpy that its items are object pointers)
        if not (isinstance(state, tuple) and len(state) >= 5 and state[1] in ("<", ">", "|", "=")
                and state[2] is None and state[3] is None and state[4] is None
                and (len(state) < 8 or state[7] == 0)):
            raise ValueError(f"numpy dtype {self.code!r} with state {state!r:.80}: not a plain number")
        self.dtype = np.dtype(self.code).newbyteorder(state[1]) if state[1] in "<>" else np.dtype(self.code)


class _LegacyNdarrayType:
    """Stands in for the `numpy.ndarray` class a pickled array names; never built."""


class _LegacyArray:
    """Stands in for `numpy.core.multiarray._reconstruct(ndarray, ...)`; BUILD gives it the array."""

    def __init__(self) -> None:
        self.array: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) in (4, 5)):
            raise ValueError("numpy array state: not numpy's (version, shape, dtype, fortran, data)")
        shape, dtype, fortran, data = state[-4:]
        if not (isinstance(dtype, _LegacyDtype) and isinstance(data, bytes) and isinstance(shape, tuple)
                and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError("numpy array state: a plain-number array over a bytes buffer only")
        size = math.prod(shape)
        if size * dtype.dtype.itemsize != len(data):
            raise ValueError(f"numpy array of shape {shape} {dtype.dtype}: {len(data)} bytes of data")
        self.array = np.frombuffer(data, dtype=dtype.dtype).reshape(shape, order="F" if fortran else "C").copy()


def _reconstruct(subtype: Any, shape: Any, code: Any) -> _LegacyArray:
    if subtype is not _LegacyNdarrayType:
        raise ValueError(f"numpy _reconstruct of {subtype!r}: only plain arrays")
    return _LegacyArray()


def _safe_globals() -> list[Any]:
    """What the weights-only load of state.pt may build besides tensors and plain values: the
    stand-ins above, under the numpy names a pre-manifest checkpoint's integer arrays carry
    (`_legacy_arrays` turns them into numpy arrays). No numpy callable itself."""
    return [(_reconstruct, "numpy._core.multiarray._reconstruct"),
            (_reconstruct, "numpy.core.multiarray._reconstruct"),   # numpy 1's name, in older pickles
            (_LegacyNdarrayType, "numpy.ndarray"), (_LegacyDtype, "numpy.dtype"), _LegacyArray, _LegacyDtype]


def _legacy_arrays(value: Any) -> Any:
    """`value` with each stand-in array replaced by its numpy array (dicts and lists in place, so an
    OrderedDict stays one); ValueError for one left unbuilt (a pickle that never gave it its state)
    or a stand-in dtype outside an array."""
    if isinstance(value, _LegacyArray):
        if value.array is None:
            raise ValueError("a numpy array without its data")
        return value.array
    if isinstance(value, _LegacyDtype) or value is _LegacyNdarrayType:
        raise ValueError("a numpy dtype or class outside an array")
    if isinstance(value, dict):
        for k, v in value.items():
            value[k] = _legacy_arrays(v)
    elif type(value) is list:
        value[:] = [_legacy_arrays(v) for v in value]
    elif type(value) is tuple:
        return tuple(_legacy_arrays(v) for v in value)
    return value


def _load_state(path: str, mmap: bool = False) -> dict[str, Any]:
    """state.pt of the checkpoint `path`, loaded without running anything it holds: a pickle that
    names any callable or class beyond tensors, plain values and `_safe_globals` fails
    `state.pt-unsafe` (those names read from its opcodes, never called), and the load itself is
    torch's weights-only unpickler. A file that does not load fails `state.pt-unreadable`."""
    import torch

    file = _trusted_file(path, STATE)
    allowed = _safe_globals()
    try:
        with torch.serialization.safe_globals(allowed):
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
            if unsafe:
                raise CheckpointInvalid(path, f"{STATE}-unsafe", f"its pickle calls or builds {', '.join(unsafe[:4])}: "
                                        "a checkpoint holds tensors and plain values only; not loaded, nothing in "
                                        "it was run")
            state = _legacy_arrays(torch.load(file, map_location="cpu", weights_only=True, mmap=mmap))
    except CheckpointInvalid:
        raise
    except FileNotFoundError:
        raise CheckpointInvalid(path, f"{STATE}-missing", "not on disk") from None
    except Exception as e:   # a torn zip, a torn pickle: whatever loading a damaged file raises
        raise CheckpointInvalid(path, f"{STATE}-unreadable", f"{type(e).__name__}: {str(e)[:300]}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointInvalid(path, f"{STATE}-unreadable", "no weights in it (no `model`)")
    return state


def _read(path: str, name: str) -> bytes:
    try:
        with open(_trusted_file(path, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointInvalid(path, f"{name}-missing", "not on disk") from None
    except OSError as e:
        raise CheckpointInvalid(path, f"{name}-unreadable", str(e)) from None


def _json(path: str, name: str, data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise CheckpointInvalid(path, f"{name}-unreadable", f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointInvalid(path, f"{name}-unreadable", "not a JSON object")
    return obj


def _seqset_of(seqs: np.ndarray) -> SeqSet:
    """The set of the seqs in `seqs`, built run by run."""
    u = np.unique(seqs)
    if not len(u):
        return SeqSet()
    breaks = np.flatnonzero(np.diff(u) != 1)
    starts = u[np.concatenate(([0], breaks + 1))]
    stops = u[np.concatenate((breaks, [len(u) - 1]))] + 1
    return SeqSet.from_ranges(zip(starts.tolist(), stops.tolist()))


def check_samples(path: str, have: SeqSet, samples: dict[int, np.ndarray], seqs: dict[int, np.ndarray],
                  unattributed: SeqSet, epoch_sizes: list[int] | None) -> None:
    """`have` agrees with the sample ids beside it: the batch seqs they were trained in (and the
    seqs of samples resumed from a checkpoint that did not record them) are exactly `have`, and
    each seq lies in the epoch its samples are counted under."""
    def disagree(detail: str) -> CheckpointInvalid:
        return CheckpointInvalid(path, "samples-disagree", detail)

    if set(samples) != set(seqs):
        raise disagree(f"sample ids for epochs {sorted(samples)}, batch seqs for {sorted(seqs)}")
    ranges = epoch_ranges(epoch_sizes) if epoch_sizes else []
    trained = SeqSet()
    for e in sorted(samples):
        if len(samples[e]) != len(seqs[e]):
            raise disagree(f"epoch {e}: {len(samples[e])} sample ids, {len(seqs[e])} batch seqs")
        s = seqs[e][seqs[e] >= 0]
        if e < len(ranges) and len(s) and not (ranges[e].start <= s.min() and s.max() < ranges[e].stop):
            raise disagree(f"epoch {e}: batch seqs outside its range [{ranges[e].start}, {ranges[e].stop})")
        trained.update(_seqset_of(s))
    if any(bool((seqs[e] < 0).any()) for e in seqs) != bool(unattributed):
        raise disagree("samples without a batch seq and the seqs recorded for them do not go together")
    trained.update(unattributed)
    if trained != have:
        only_have, only_samples = have.copy(), trained.copy()
        only_have.difference_update(trained)
        only_samples.difference_update(have)
        raise disagree(f"have holds {len(have)} batches, the trained samples were of {len(trained)}: "
                       f"{len(only_have)} in have only {only_have.to_wire()[:3]}, {len(only_samples)} in the "
                       f"samples only {only_samples.to_wire()[:3]}")


def check_accounting(path: str, meta: dict[str, Any], samples: dict[int, np.ndarray]) -> None:
    """meta.json's audit is what the sample ids give: the current epoch's counts (`sample_stats`)
    and each epoch's (`epochs`). Only the counts a meta.json holds are compared (older ones hold
    fewer); `epoch_samples` and `epoch_documents` are the plan's sizes, which no sample id says."""
    def disagree(detail: str) -> CheckpointInvalid:
        return CheckpointInvalid(path, "meta.json-disagrees", detail)

    for k, v in sample_stats(samples, meta.get("epoch", 0), 0).items():
        if k in meta and not k.startswith("epoch_") and meta[k] != v:
            raise disagree(f"{k}: meta.json {meta[k]!r}, the sample ids give {v}")
    if "epochs" in meta:
        given = epoch_stats(samples)
        told = meta["epochs"] if isinstance(meta["epochs"], dict) else {}
        if set(told) != set(given) or any(not isinstance(told[e], dict)
                                          or any(given[e].get(k) != n for k, n in told[e].items()) for e in told):
            raise disagree("epochs: the per-epoch counts are not what the sample ids give")


def _load_samples(path: str, data: bytes) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray], SeqSet]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        samples = {int(k[4:]): v.astype(np.int64) for k, v in arrays.items() if k.startswith("ids_")}
        seqs = {int(k[5:]): v.astype(np.int64) for k, v in arrays.items() if k.startswith("seqs_")}
        runs = arrays.get("unattributed", np.zeros((0, 2), np.int64))
        return samples, seqs, SeqSet.from_wire([[int(a), int(b)] for a, b in runs.reshape(-1, 2)])
    except (ValueError, OSError, KeyError, ProtocolError, zipfile.BadZipFile) as e:
        raise CheckpointInvalid(path, "samples.npz-unreadable", str(e)) from None


def _samples_bytes(samples: dict[int, np.ndarray], seqs: dict[int, np.ndarray], unattributed: SeqSet) -> bytes:
    arrays = {f"ids_{e}": np.asarray(v, np.int64) for e, v in samples.items()}
    arrays.update({f"seqs_{e}": np.asarray(v, np.int64) for e, v in seqs.items()})
    arrays["unattributed"] = np.asarray(unattributed.to_wire(), np.int64).reshape(-1, 2)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _have(path: str, wire: Any, where: str) -> SeqSet:
    try:
        return SeqSet.from_wire(wire, max_ranges=1 << 62)
    except ProtocolError as e:
        raise CheckpointInvalid(path, f"{where}-unreadable", f"have: {e}") from None


def verify_checkpoint(path: str) -> Verified:
    """Every check a checkpoint must pass before anything in it is believed; CheckpointInvalid
    naming the first that fails. Reads every file once (state.pt's pieces in parallel), unpickles
    nothing: the manifest's own digest, each file's size, the small files' digests and the facts
    (meta.json's step, epoch and have are the manifest's, `check_samples`, `check_accounting`),
    then state.pt's digest. One without a manifest is from before manifests: `_verify_legacy`."""
    if not os.path.isdir(path):
        raise CheckpointInvalid(path, "folder-missing", "no such checkpoint folder")
    if problem := state_path_problem(path, trusted_uids()):
        raise Untrusted(f"checkpoint {path}: {problem}")
    if not os.path.lexists(os.path.join(path, MANIFEST)):
        return _verify_legacy(path)
    manifest = _json(path, MANIFEST, _read(path, MANIFEST))
    body = {k: v for k, v in manifest.items() if k != "digest"}
    if manifest.get("digest") != _json_digest(body):
        raise CheckpointInvalid(path, f"{MANIFEST}-checksum", "its digest does not match its content")
    named = os.path.basename(os.path.normpath(path))
    if CHECKPOINT_NAME.fullmatch(named) and int(named[len(PREFIX):]) != manifest.get("step"):
        raise CheckpointInvalid(path, f"{MANIFEST}-disagrees",
                                f"step {manifest.get('step')!r} in a folder named {named}")
    files = manifest.get("files")
    if (manifest.get("format") != FORMAT or not isinstance(files, dict) or not {STATE, SAMPLES, META} <= set(files)
            or not all("/" not in n and isinstance(e, dict) and type(e.get("size")) is int
                       and isinstance(e.get("sha256"), str) for n, e in files.items())):
        raise CheckpointInvalid(path, f"{MANIFEST}-unreadable", f"format {manifest.get('format')}, files "
                                f"{sorted(files) if isinstance(files, dict) else files!r:.80}")
    for name, entry in files.items():
        try:
            size = os.stat(_trusted_file(path, name)).st_size
        except FileNotFoundError:
            raise CheckpointInvalid(path, f"{name}-missing", "listed in the manifest, not on disk") from None
        if size != entry["size"]:
            raise CheckpointInvalid(path, f"{name}-size", f"{size} bytes, the manifest says {entry['size']}")
    small = {}
    for name in [n for n in files if n != STATE]:
        small[name] = _read(path, name)
        if bytes_digest(small[name]) != files[name]["sha256"]:
            raise CheckpointInvalid(path, f"{name}-checksum", "its content is not what was written")
    meta = _json(path, META, small[META])
    for k in ("step", "epoch", "have"):
        if meta.get(k) != manifest.get(k):
            raise CheckpointInvalid(path, "meta.json-disagrees", f"{k}: meta.json {meta.get(k)!r:.60}, "
                                    f"manifest {manifest.get(k)!r:.60}")
    have = _have(path, meta["have"], META)
    samples, seqs, unattributed = _load_samples(path, small[SAMPLES])
    counts = {str(e): len(v) for e, v in samples.items()}
    if counts != manifest.get("samples"):
        raise CheckpointInvalid(path, "samples-disagree", f"samples per epoch {counts}, the manifest says "
                                f"{manifest.get('samples')}")
    check_samples(path, have, samples, seqs, unattributed, meta.get("epoch_sizes"))
    check_accounting(path, meta, samples)
    state_size = files[STATE]["size"]
    try:
        digest = file_digest(os.path.join(path, STATE), state_size)
    except OSError as e:
        raise CheckpointInvalid(path, f"{STATE}-unreadable", str(e)) from None
    if digest != files[STATE]["sha256"]:
        raise CheckpointInvalid(path, f"{STATE}-checksum", "its content is not what was written")
    return Verified(path, meta, samples, seqs, unattributed)


def _verify_legacy(path: str) -> Verified:
    """A checkpoint from before manifests (no manifest.json, no samples.npz): accepted after a
    consistency check, since its bytes cannot be checked: meta.json parses, state.pt loads
    (weights only: `_load_state`), their steps agree, and the sample accounting in meta.json (per
    epoch, and the batch total in `cluster`) is what the sample ids in state.pt and its `have` give."""
    if os.path.lexists(os.path.join(path, SAMPLES)):
        raise CheckpointInvalid(path, f"{MANIFEST}-missing", "a checkpoint with samples.npz has a manifest")
    meta = _json(path, META, _read(path, META))
    if meta.get("format") == FORMAT:
        raise CheckpointInvalid(path, f"{MANIFEST}-missing", "meta.json says it was written with one")
    state = _load_state(path)
    try:
        samples = {int(e): np.asarray(v, dtype=np.int64) for e, v in state["trained_samples"].items()}
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointInvalid(path, f"{STATE}-unreadable", f"trained_samples: {type(e).__name__}: {e}") from None
    have = _have(path, meta.get("have"), META)
    if state.get("step") != meta.get("step"):
        raise CheckpointInvalid(path, "meta.json-disagrees",
                                f"step: meta.json {meta.get('step')!r}, state.pt {state.get('step')!r}")
    check_accounting(path, meta, samples)
    total = (meta.get("cluster") or {}).get("total", {}).get("batches_trained")
    if total is not None and total != len(have):   # its `have` has no batch seqs beside it to check against
        raise CheckpointInvalid(path, "meta.json-disagrees", f"have holds {len(have)} batches, cluster.total "
                                f"says {total}")
    seqs = {e: np.full(len(v), -1, np.int64) for e, v in samples.items()}
    return Verified(path, meta, samples, seqs, have.copy(), legacy=True, state=state)


# ---- the trainer's state -------------------------------------------------------------------------
@dataclasses.dataclass
class TrainerState:
    """What a checkpoint holds, written (`save`) and read (`load`) here only. The trainer builds
    one from itself to save, and restores from the one `load` gives: its accounting at start-up
    (before it says HELLO), the weights, RNG and optimizer once the drafter is built
    (`restore_weights`, and `optimizer` to optim.build_adamw)."""

    step: int
    epoch: int
    have: SeqSet                                  # batch seqs whose effect is in the weights (every host's)
    trained_samples: dict[int, np.ndarray]        # per epoch, (sample id, document id) per document trained
    sample_seqs: dict[int, np.ndarray] | None = None   # the batch seq of each of those (None: all -1)
    unattributed: SeqSet = dataclasses.field(default_factory=SeqSet)   # the seqs of the -1 ones
    skipped_steps: int = 0
    plan: dict[str, Any] = dataclasses.field(default_factory=dict)   # the data plan of `have` ({}: not recorded)
    epoch_sizes: list[int] | None = None          # batches of every planned epoch (None: not recorded)
    config_hash: str = ""                         # of the drafter config section
    model: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)   # the trainable weights
    optimizer: dict[str, Any] | None = None       # torch AdamW state_dict
    rng: torch.Tensor | None = None               # torch's CPU generator state
    drafter_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    split_fc: bool = False
    target_precision: str = ""                    # what the target ran in (fp8-block, bf16, ...; "": not recorded)

    def save(self, out_dir: str, keep: int, reason: str, epoch_samples: int, num_hosts: int = 1,
             epoch_documents: int = 0) -> tuple[str, dict]:
        """Write it atomically, with its manifest (save_checkpoint); its path and meta. OSError
        when the write fails."""
        state = {"model": self.model, "optimizer": self.optimizer, "step": self.step,
                 "drafter_config": self.drafter_config, "split_fc": self.split_fc, "rng": {"torch": self.rng}}
        seqs = self.sample_seqs if self.sample_seqs is not None else \
            {e: np.full(len(v), -1, np.int64) for e, v in self.trained_samples.items()}
        sizes = self.epoch_sizes or []
        have = self.have.to_wire()
        meta = {"format": FORMAT, "step": self.step, "epoch": self.epoch, "have": have, "reason": reason,
                "plan": self.plan, "config_hash": self.config_hash, "skipped_steps": self.skipped_steps,
                "target_precision": self.target_precision,
                "time": time.time(), **sample_stats(self.trained_samples, self.epoch, epoch_samples, epoch_documents),
                "epochs": epoch_stats(self.trained_samples), "epoch_sizes": sizes,
                "cluster": cluster_accounting(count_by_host(self.have, sizes, num_hosts), sizes)}
        facts = {"step": self.step, "epoch": self.epoch, "have": have,
                 "samples": {str(e): len(v) for e, v in self.trained_samples.items()}}
        files: dict[str, Writer] = {
            STATE: lambda f: _save_state(state, f),
            SAMPLES: lambda f: f.write(_samples_bytes(self.trained_samples, seqs, self.unattributed)),
            META: lambda f: f.write(json.dumps(meta, indent=1, sort_keys=True).encode()),
        }
        return save_checkpoint(out_dir, self.step, files, facts, keep), meta

    @classmethod
    def load(cls, path: str) -> "TrainerState":
        """Verify the checkpoint (verify_checkpoint), then load it (weights only, `_load_state`).
        CheckpointInvalid when it fails, Untrusted when another user controls it; nothing of it is
        loaded before its digest is checked."""
        v = verify_checkpoint(path)
        meta, state = v.meta, v.state
        if state is None:
            # mapped, not read: the verification just brought its pages into the page cache
            state = _load_state(path, mmap=True)
            if state.get("step") != meta["step"]:
                raise CheckpointInvalid(path, f"{STATE}-disagrees", f"step {state.get('step')!r}, "
                                        f"meta.json and the manifest say {meta['step']}")
        plan = {}
        if meta.get("plan"):
            try:
                plan = check_plan(meta["plan"], "meta.json plan")
            except ProtocolError as e:
                raise CheckpointInvalid(path, "meta.json-plan",
                                        f"{e}; the checkpoint's data plan is unreadable") from None
        return cls(step=meta["step"], epoch=meta["epoch"], have=SeqSet.from_wire(meta["have"], max_ranges=1 << 62),
                   trained_samples=v.samples, sample_seqs=v.sample_seqs, unattributed=v.unattributed,
                   skipped_steps=meta.get("skipped_steps", 0), plan=plan, epoch_sizes=meta.get("epoch_sizes"),
                   config_hash=meta.get("config_hash", ""), model=state["model"], optimizer=state.get("optimizer"),
                   rng=state.get("rng", {}).get("torch"), drafter_config=state.get("drafter_config", {}),
                   split_fc=state.get("split_fc", False), target_precision=meta.get("target_precision", ""))

    def check_fits(self, model: torch.nn.Module, path: str) -> None:
        """ConfigError (exit status 2, one line) unless the checkpoint's weights are the shapes of
        `model`'s: a resume under another drafter depth or width (drafter.num_layers,
        intermediate_size, heads...) would fail deep in load_state_dict or the optimizer."""
        # what a checkpoint holds: the trainable weights (the frozen target head is the target's)
        mine = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
        theirs = {name: tuple(t.shape) for name, t in self.model.items()}
        differ = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))
        if not differ:
            return
        from common.config import ConfigError

        def shape(weights: dict[str, tuple[int, ...]]) -> str:
            layers = {int(m[1]) for n in weights if (m := re.search(r"layers\.(\d+)\.", n))}
            width = next((s[-1] for n, s in sorted(weights.items()) if n.endswith("norm.weight")), "?")
            return f"{len(layers)} layers, width {width}"

        where = differ[0]
        raise ConfigError(
            f"drafter: the checkpoint {path} holds a drafter of {shape(theirs)}, this config builds one of "
            f"{shape(mine)} ({where}: {theirs.get(where, 'absent')} in the checkpoint, {mine.get(where, 'absent')} "
            f"here): keep its drafter settings to resume it, or train the new shape in another train.out_dir or "
            f"afresh (`dfpipe demo --fresh`, or move {os.path.dirname(path)} away)")

    def restore_weights(self, model: torch.nn.Module) -> None:
        """The checkpoint's trainable weights into `model` (its frozen target head stays), and its RNG."""
        result = model.load_state_dict(self.model, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"checkpoint has unknown weights {result.unexpected_keys[:4]}")
        if self.rng is not None:
            import torch

            torch.set_rng_state(self.rng)


def load_newest(out_dir: str, on_invalid: Callable[[CheckpointInvalid], None]) -> tuple[str, TrainerState] | None:
    """The newest checkpoint under out_dir that verifies, loaded; `on_invalid` is told of each newer
    one that does not (the trainer moves it aside, `dfpipe export` says it skips it). None: none verifies.
    Untrusted when another user controls out_dir, checkpoints/ or a checkpoint (`check_run_folder`)."""
    check_run_folder(out_dir)
    for path in reversed(list_checkpoints(out_dir)):
        try:
            return path, TrainerState.load(path)
        except CheckpointInvalid as e:
            on_invalid(e)
    return None


def resume_checkpoint(out_dir: str) -> tuple[str, TrainerState] | None:
    """What the trainer resumes (rank 0, holding the out_dir lock): the newest checkpoint that
    verifies. Each newer one that fails is logged with the check it failed and moved aside
    (`move_aside`). None: there is no checkpoint (a fresh start). NoCheckpointVerifies: there were
    checkpoints, now or moved aside on an earlier start, and none verifies; starting over from
    nothing would throw the run away, so that is left to the operator."""
    def set_aside(e: CheckpointInvalid) -> None:
        try:
            where = move_aside(e.path, e.check)
        except OSError as err:   # it is never trusted either way; the next start checks it again
            where = f"(not moved: {err})"
        log.error("checkpoint %s failed verification (%s: %s): moved aside to %s, never resumed; trying the one "
                  "before it", e.path, e.check, e.detail, where)

    found = load_newest(out_dir, set_aside)
    if found is not None:
        path, state = found
        if not os.path.exists(os.path.join(path, MANIFEST)):
            log.warning("%s has no manifest (written before checkpoints were checksummed): resumed after a "
                        "consistency check (its step, sample accounting and have agree), its bytes unchecked; "
                        "its next checkpoint has one", path)
        return found
    bad = list_moved_aside(out_dir)
    if not bad:
        return None
    root = checkpoint_root(out_dir)
    raise NoCheckpointVerifies(
        f"no checkpoint under {root} verifies ({', '.join(os.path.basename(b) for b in bad)}: each moved aside, "
        f"the check it failed in its name and in the log). Nothing was deleted. Put a good copy of a checkpoint "
        f"folder back as {root}/step-NNNNNNNN (from a backup, or a repaired one) and start the trainer again; "
        f"or, to train from scratch, move {root} away (mv {root} {root}.failed)")


def read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, META), encoding="utf-8") as f:
        return json.load(f)


def plan_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two data plans, one "setting: old -> new" per changed component."""
    keys = [k for k in sorted(set(old) | set(new)) if k != "id"]
    changed = [f"{k}: {old.get(k, '(absent)')} -> {new.get(k, '(absent)')}" for k in keys if old.get(k) != new.get(k)]
    return changed or [f"plan id: {old.get('id')} -> {new.get('id')}"]


def inspect(path: str) -> dict[str, Any]:
    """What `dfpipe inspect` prints of one checkpoint: `verified` (ok, or the check it fails), the
    meta, and, of one that verifies, the exactly-once audit of the current epoch and of every epoch
    (`epochs`) computed from its sample ids (meta.json's copies agree with them, or it fails
    `meta.json-disagrees`), and each host's shard (`cluster`). Of one that fails, the audit is not
    shown: nothing in it is believed. Untrusted when another user controls it."""
    v: Verified | None = None
    try:
        v = verify_checkpoint(path)
        meta: dict[str, Any] | None = v.meta
        verdict = "ok (no manifest: consistency checked, bytes not)" if v.legacy else "ok"
    except CheckpointInvalid as e:
        verdict = f"failed: {e.check}: {e.detail}"
        try:
            meta = read_meta(path)
        except (OSError, ValueError):
            meta = None
    out: dict[str, Any] = {"path": os.path.abspath(path), "verified": verdict}
    if not isinstance(meta, dict):
        return out
    out.update({k: meta[k] for k in ("step", "epoch", "cluster", "config_hash", "skipped_steps", "time") if k in meta})
    if v is not None:   # the plan's sizes from meta.json (no sample id says them), every count from the ids
        stats = sample_stats(v.samples, meta.get("epoch", 0), meta.get("epoch_samples", 0),
                             meta.get("epoch_documents", 0))
        out.update({k: n for k, n in stats.items() if not k.startswith("epoch_") or k in meta})
        out["epochs"] = epoch_stats(v.samples)
    try:
        out["batches"] = len(SeqSet.from_wire(meta.get("have"), max_ranges=1 << 62))
    except ProtocolError:
        out["batches"] = None
    # the data plan its batches are of (None: written before plans were fingerprinted)
    out.update({"have": meta.get("have"), "plan": meta.get("plan")})
    return out


def inspect_run(out_dir: str) -> dict[str, Any]:
    """`dfpipe inspect` of a run folder: every checkpoint verified, newest first (`checkpoints`:
    name, step, verified), then the moved-aside ones; the rest is `inspect` of the newest that
    verifies (no `verified` key when none does). Untrusted when another user controls the run."""
    check_run_folder(out_dir)
    reports = [inspect(p) for p in reversed(list_checkpoints(out_dir))]
    newest = next((r for r in reports if r["verified"].startswith("ok")), None)
    out: dict[str, Any] = dict(newest) if newest else {}
    out["checkpoints"] = [{"name": os.path.basename(r["path"]), "step": r.get("step"), "verified": r["verified"]}
                          for r in reports]
    out["checkpoints"] += [{"name": os.path.basename(p), "verified": "moved aside: failed "
                            + os.path.basename(p).split(BAD_MARK, 1)[1]} for p in list_moved_aside(out_dir)]
    return out


def latest_checkpoint(out_dir: str) -> str | None:
    """The newest checkpoint folder of a run that verifies; None when none does."""
    return inspect_run(out_dir).get("path")

