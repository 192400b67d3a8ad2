"""Test-wide guards: CPU tests run the real Qwen3.5 torch fallback and never reach the hub."""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import subprocess
import sys
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


def pytest_configure(config: pytest.Config) -> None:
    """The machine's slowness, measured once per session: here in the first pytest process, before
    xdist starts its workers, which (like every subprocess of a test) inherit it through the env."""
    machine_speed.slowness()


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


# The suite's longest test (minutes: two drafter trainings through the services). In collection
# order it came among the last, and ran alone while the other xdist worker sat idle. Started first,
# it runs beside the rest: `--dist load` hands each worker its first chunk and the rest on demand,
# so the other worker takes the remaining tests meanwhile. Every other test keeps its order (moving
# all the slow ones to the front made two long chunks that the workers could not share).
LONGEST_FIRST = ("test_tau_ci.py",)   # module file names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)   # stable: the same on every worker
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
