"""common/exits.py: which errors are a disk that refuses writes (exit 4), the line that says so, and
what a final status becomes under compose. The deployments' use of the set: tests/test_deploy.py."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from common.exits import (EXIT_CONFIG, EXIT_DISK_FULL, EXIT_FAILED, EXIT_OK, EXIT_UNTRUSTED, FINAL_AS_SUCCESS,
                          FINAL_EXITS, WHY, as_supervised, cannot_write, disk_error)


def test_every_status_has_a_why_and_only_0_and_1_are_left_to_a_restart() -> None:
    assert set(WHY) == set(range(9))
    assert FINAL_EXITS == set(WHY) - {EXIT_OK, EXIT_FAILED}
    assert EXIT_UNTRUSTED == 8 and EXIT_DISK_FULL == 4


def test_a_full_disk_is_found_under_torch_s_runtime_error_and_a_denied_path_only_inside_out_dir(tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("unexpected pos 64 vs 0") from e   # what torch.save raises over it
    except RuntimeError as wrapped:
        assert disk_error(wrapped, out) is full
    denied_inside = PermissionError(errno.EACCES, "Permission denied", f"{out}/trainer.lock")
    denied_elsewhere = PermissionError(errno.EACCES, "Permission denied", "/models/target/config.json")
    assert disk_error(denied_inside, out) is denied_inside
    assert disk_error(denied_elsewhere, out) is None, "not ours to call a disk problem: a crash (exit 1)"
    assert disk_error(FileNotFoundError(errno.ENOENT, "No such file", f"{out}/x"), out) is None
    assert disk_error(ValueError("no"), out) is None


@pytest.mark.parametrize("code, path, fix", [
    (errno.ENOSPC, None, "Free space there (`df -h {out}`), or set train.out_dir to a disk with room, and start it again"),
    (errno.ENOSPC, "/cache/inductor/x", "Free space there (`df -h /cache/inductor/x`), and start it again"),
    (errno.EROFS, "{out}/tensorboard", "Make it writable (it is mounted read-only), or set train.out_dir"),
    (errno.EACCES, "{out}/trainer.lock", f"Make it writable by this service's user (uid {os.geteuid()})"),
])
def test_the_line_names_the_path_and_the_fix(tmp_path: Path, code: int, path: str | None, fix: str) -> None:
    out = str(tmp_path / "run")
    error = OSError(code, os.strerror(code), path.format(out=out) if path else None)
    line = cannot_write(error, out)
    shown = path.format(out=out) if path else out
    assert line.startswith(f"cannot write {shown}: {os.strerror(code)} [errno {code}]. "), line
    assert fix.format(out=out) in line and "\n" not in line, line


def test_a_final_status_ends_with_0_under_compose_only_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert as_supervised(EXIT_UNTRUSTED, "dfpipe target-server", {}) == EXIT_UNTRUSTED
    assert capsys.readouterr().err == ""
    assert as_supervised(EXIT_FAILED, "dfpipe target-server", {FINAL_AS_SUCCESS: "1"}) == EXIT_FAILED, "restarted"
    assert as_supervised(EXIT_CONFIG, "dfpipe target-server", {FINAL_AS_SUCCESS: "1"}) == EXIT_OK
    err = capsys.readouterr().err
    assert err.startswith(f"dfpipe target-server: exit status 2 ({WHY[EXIT_CONFIG]}; restarting would not help")
