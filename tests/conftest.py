"""Test-wide guards: CPU tests run the real Qwen3.5 torch fallback and never reach the hub."""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator

# FLA / causal-conv1d make transformers pick kernels that cannot run without a GPU; blocking the
# import makes it fall back to the pure-torch implementation of the same architecture.
for _mod in ("fla", "causal_conv1d"):
    sys.modules.setdefault(_mod, None)  # type: ignore[arg-type]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# inductor's compiled CPU kernels in the user's cache folder rather than its default
# /tmp/torchinductor_<user>: the suite leaves nothing in /tmp, and every clone on the machine still
# reuses them (an empty cache costs the compile tests ~4x: two of them 121 CPU-s cold, 27 warm).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dfpipe", "torchinductor"))
# Several test processes (xdist workers, spawned services) share 2 cores: one intra-op thread each
# avoids oversubscription, which makes small torch ops ~100x slower. Children inherit the env.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch's structured trace log (for TORCH_TRACE files and tlparse) is always at DEBUG and does not
# propagate; pytest attaches its log capture to every non-propagating logger, so a failing test
# that compiled printed ~200 lines of `DEBUG torch.__trace` JSON. Those records are dropped unless
# a trace was asked for; warnings, errors and the project's own logs are reported as before.
if "TORCH_TRACE" not in os.environ:
    logging.getLogger("torch.__trace").addFilter(lambda record: False)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

import machine_speed  # noqa: E402


# What a run of the suite must not leave in /tmp or /dev/shm: its rings, the services' default
# endpoint folders, the folders tests make in /tmp itself (a sticky folder others can enter),
# torchrun's and inductor's folders (names are prefixes; only this user's count).
LEFTOVER_PREFIXES = {"/tmp": ("dfpt-", "dfpgb-", "dfpipe-", "dfst-", "dfsh", "dfz", "dfck", "dfh", "torchelastic_",
                             "torchinductor_"),
                     "/dev/shm": ("dfpt-", "dfpgb-", "dfpipe-")}
_before: dict[str, set[str]] = {}


def _ours(folder: str) -> set[str]:
    names = set()
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        with contextlib.suppress(OSError):
            if (name.startswith(LEFTOVER_PREFIXES[folder])
                    and os.lstat(os.path.join(folder, name)).st_uid == os.geteuid()):
                names.add(name)
    return names


@pytest.hookimpl(trylast=True)   # after pytest's own configure made the run's temporary folder
def pytest_configure(config: pytest.Config) -> None:
    """The machine's slowness, measured once per session: here in the first pytest process, before
    xdist starts its workers, which (like every subprocess of a test) inherit it through the env.

    Temporary files and default endpoints in this run's own folder, not /tmp: TMPDIR (tempfile in
    every test, service and torchrun agent: torchelastic_* folders) and XDG_RUNTIME_DIR (the default
    endpoints' folder, else /tmp/dfpipe-<uid>) point into pytest's base folder, which pytest keeps
    for the last runs' failures and then removes. Set here, in the first pytest process; its xdist
    workers and every subprocess inherit them."""
    machine_speed.slowness()
    if hasattr(config, "workerinput"):
        return
    base = config._tmp_path_factory.getbasetemp()   # type: ignore[attr-defined]  (pytest's tmp_path root)
    for var, name in (("TMPDIR", "tmp"), ("XDG_RUNTIME_DIR", "run")):
        folder = base / name
        folder.mkdir(mode=0o700, exist_ok=True)
        os.environ[var] = str(folder)
    tempfile.tempdir = None   # found again from TMPDIR
    # inductor keeps its precompiled C++ headers (~150 MB, ~10 CPU-s to build) in
    # $TMPDIR/torchinductor_<user> whatever TORCHINDUCTOR_CACHE_DIR says: that name, in this run's
    # folder, leads to the compiled-kernel cache that every run reuses.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    os.makedirs(os.environ["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)
    if not os.path.lexists(default_cache_dir()):
        os.symlink(os.environ["TORCHINDUCTOR_CACHE_DIR"], default_cache_dir())
    _before.update({folder: _ours(folder) for folder in LEFTOVER_PREFIXES})
    (base.parent / f"dfpipe-tests-{os.getpid()}").touch()   # this run is live (see pytest_sessionfinish)


def _other_live_runs(runs: "os.PathLike[str]") -> list[int]:
    """The pids of this user's other test runs that are still going (their marker, their process)."""
    pids = []
    for marker in glob.glob(os.path.join(runs, "dfpipe-tests-*")):
        pid = int(marker.rsplit("-", 1)[1])
        if pid != os.getpid():
            try:
                os.kill(pid, 0)   # a run of this same user: signalling it is allowed
                pids.append(pid)
            except ProcessLookupError:   # killed before it could remove its marker
                with contextlib.suppress(OSError):
                    os.unlink(marker)
    return pids


@pytest.hookimpl(trylast=True)   # after pytest's own, which tears down the last fixtures (their services)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that left something of its own in /tmp or /dev/shm fails, naming it."""
    e2e = sys.modules.get("e2e")   # its socket folders and rings, in this process (each xdist worker's own)
    if e2e is not None:
        e2e.remove_leftovers()
    if hasattr(session.config, "workerinput") or not _before:
        return
    runs = session.config._tmp_path_factory.getbasetemp().parent   # type: ignore[attr-defined]
    with contextlib.suppress(OSError):
        os.unlink(runs / f"dfpipe-tests-{os.getpid()}")
    left = sorted(os.path.join(folder, name) for folder in LEFTOVER_PREFIXES
                  for name in _ours(folder) - _before[folder])
    if not left:
        return
    writer = session.config.get_terminal_writer()
    writer.line()
    others = _other_live_runs(runs)
    if others:   # another run of this user's (a second clone) owns some of them, or all
        writer.line(f"not checked for leftovers: test runs {others} of this user still go; found {', '.join(left)}",
                    yellow=True)
    else:
        writer.line(f"the tests left behind: {', '.join(left)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The factor, beside --durations (`make test` runs with -q, which hides the header)."""
    terminalreporter.write_line(f"wall-clock limits x{machine_speed.slowness():.2f} (${machine_speed.ENV}: this "
                                "machine's time for a fixed CPU workload over the reference machine's)")


@pytest.fixture
def ring_name() -> Iterator[str]:
    """A ring name no other test (or xdist worker) uses; files of that name that the test left in
    /dev/shm (a killed producer's, a stranger's) are removed after it, whatever its outcome."""
    name = f"dfpt-{uuid.uuid4().hex[:10]}"
    yield name
    for path in glob.glob(f"/dev/shm/{name}.*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


@pytest.fixture
def shm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """/dev/shm when present (the real thing), else a temp dir; either way a private subfolder."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path_factory.getbasetemp())
    path = os.path.join(base, f"dfpt-{uuid.uuid4().hex[:10]}")
    os.makedirs(path, mode=0o700)
    yield path
    leftovers = os.listdir(path)
    for name in leftovers:
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


@pytest.fixture
def small_tmpfs() -> Iterator[Callable[[str, str], None]]:
    """mount(path, size): a real tmpfs of `size` (e.g. "64k") at `path`, a disk that really fills
    up; unmounted after the test. Skips (saying why) when not root or the mount is refused."""
    mounted: list[str] = []

    def mount(path: str, size: str) -> None:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs (a real full disk) needs root")
        os.makedirs(path, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", path], check=True)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny real-architecture targets (Qwen3.5 hybrid and Qwen3), built from configs."""
    from target_server.tiny import build_tiny_target
    root = tmp_path_factory.mktemp("tiny-targets")
    return {arch: build_tiny_target(str(root / arch), arch=arch) for arch in ("qwen3.5", "qwen3")}


@pytest.fixture(scope="session")
def cxx_compiler() -> str:
    """The C++ compiler torch.compile needs on the CPU (inductor builds its CPU kernels as C++;
    `g++`, or $CXX). Tests that compile on the CPU skip without one; under CI they fail."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        return get_cpp_compiler()
    except InvalidCxxCompiler:
        why = (f"torch.compile on the CPU needs a C++ compiler and {os.environ.get('CXX', 'g++')} is not there "
               "(Debian: apt-get install g++, or set CXX)")
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


# `make test` hands whole files to its two xdist workers (`--dist loadfile`): a module's fixtures
# (tiny targets, a trained toy target, a serving target) are built once, not once on each worker
# (-95 CPU-s, -40 s). The costliest files go first, each to the worker that is free (the longest-
# first rule): the many small files then even out the end, where one long file handed out last
# kept one worker busy for two minutes while the other sat idle. Costs: CPU-s of each file in a
# serial run (docs/benchmarks.md); every other file keeps its order.
COSTLIEST_FIRST = ("test_e2e_trainer.py", "test_tau_ci.py", "test_stranger.py",
                   "test_multihost.py", "test_e2e_restart.py", "test_demo.py", "test_e2e_checkpoint.py",
                   "test_soak.py")   # module file names, costliest first


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the same on every worker
    # pytest-timeout's limit of every test (its own mark, else `--timeout`, else pyproject's
    # `timeout`), written for the reference machine, scaled to this one: a mark put first is the
    # one pytest-timeout reads. 0 (no limit, e.g. `--timeout 0`) stays 0.
    given = config.getoption("timeout", None)
    default = float(config.getini("timeout") or 0) if given is None else float(given)
    for item in items:
        mark = item.get_closest_marker("timeout")
        limit = default if mark is None else float(mark.args[0] if mark.args else mark.kwargs.get("timeout", default))
        item.add_marker(pytest.mark.timeout(machine_speed.scaled(limit)), append=False)


def pytest_runtest_setup(item: pytest.Item) -> None:
    e2e = sys.modules.get("e2e")   # imported only by the tests that start services
    if e2e is not None:
        e2e.Service.started.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """A failing end-to-end test reports the last lines of every service it started: on the GPU
    host its temp folder does not come back, and a timeout alone does not say which side stalled."""
    outcome = yield
    report = outcome.get_result()
    e2e = sys.modules.get("e2e")
    if e2e is None or report.when != "call" or not report.failed:
        return
    for svc in e2e.Service.started:
        report.sections.append((f"{svc.role} log, pid {svc.pid} (last 80 lines)", svc.log(80)))
