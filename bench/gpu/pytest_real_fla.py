"""pytest plugin: run the GPU tests with flash-linear-attention really loaded, and prove it.

    python -m pytest -p bench.gpu.pytest_real_fla tests/test_target_packing.py -k "gpu or fla"

tests/conftest.py blocks FLA (`sys.modules.setdefault("fla", None)`) so CPU tests run
transformers' torch fallback. Because it uses setdefault, a real `fla` imported first stays:
`-p` plugins are imported before any conftest, so this module's import wins. Then both the packed
path (FLA varlen) and transformers' own forward (FLA chunk rule) run FLA's kernels, which the
plain GPU run of `test_packed_equals_per_document_on_gpu_in_bf16` does not (its runner falls back
to the torch Gated DeltaNet path there).

Every TargetRunner.load is recorded as (test, device, linear backend) and written as JSON to
$DFPIPE_BENCH_BACKENDS at the end of the session, so the caller can check which path ran.
"""
from __future__ import annotations

import json
import os
from typing import Any

try:
    import fla  # noqa: F401  (the point of this plugin: load it before conftest blocks it)
    FLA_VERSION: str | None = getattr(fla, "__version__", "unknown")
    FLA_ERROR = ""
except ImportError as e:
    FLA_VERSION, FLA_ERROR = None, f"{type(e).__name__}: {e}"

_loads: list[dict[str, str]] = []


def pytest_configure(config: Any) -> None:
    from target_server.target import TargetRunner

    original = TargetRunner.load.__func__

    def load(cls: type, *args: Any, **kwargs: Any) -> Any:
        runner = original(cls, *args, **kwargs)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        _loads.append({"test": test, "device": runner.device.type, "backend": runner.linear_backend})
        return runner

    TargetRunner.load = classmethod(load)


def pytest_report_header(config: Any) -> str:
    return f"bench.gpu.pytest_real_fla: fla {FLA_VERSION or 'NOT importable: ' + FLA_ERROR}"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("DFPIPE_BENCH_BACKENDS")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"fla_version": FLA_VERSION, "fla_error": FLA_ERROR, "loads": _loads}, f, indent=1)
