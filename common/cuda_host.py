"""Page-lock (cudaHostRegister) a shared-memory mapping so device<->host copies run at DMA speed.

Without registration a copy between a GPU and the mapping goes through a pageable staging buffer
at a fraction of the DMA rate, and cannot overlap with compute. Both sides of a ring register
their own mapping. The driver limits one registration in practice, so a mapping is registered in
chunks of at most 64 GiB; chunk borders fall on slot borders, so no copy into or out of one slot
ever spans two registrations.

Modes: "off" never registers; "auto" registers when CUDA is available and otherwise (or on
failure, with a warning) carries on unregistered; "require" raises when it cannot register.
On a machine without CUDA nothing here touches CUDA: `torch.cuda.is_available()` is the only call.
"""
from __future__ import annotations

import ctypes
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

MAX_CHUNK = 64 << 30
PAGE = 4096
_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process (one per target GPU)
MODES = ("auto", "off", "require")


class CudaRegisterError(RuntimeError):
    """cuda_register="require" and the mapping could not be registered."""


def chunk_ranges(nbytes: int, borders: Sequence[int] = (), limit: int = MAX_CHUNK) -> list[tuple[int, int]]:
    """Split [0, nbytes) into (offset, length) pieces of at most `limit` bytes.

    Pieces end on one of `borders` (e.g. slot starts) whenever one fits; a stretch between two
    borders longer than `limit` is cut at page-aligned multiples of it.
    """
    if limit < PAGE or limit % PAGE:
        raise ValueError(f"chunk limit {limit} must be a positive multiple of {PAGE}")
    cuts = sorted({b for b in borders if 0 < b < nbytes} | {nbytes})
    pieces: list[tuple[int, int]] = []
    start = 0
    while start < nbytes:
        fitting = [c for c in cuts if start < c <= start + limit]
        end = fitting[-1] if fitting else start + limit
        pieces.append((start, end - start))
        start = end
    return pieces


def _clear_last_cuda_error() -> None:
    """Reset the runtime's last-error slot so a failed registration is not reported later by an
    unrelated torch kernel-launch check. torch does not bind cudaGetLastError, so call it in the
    libcudart this process already loaded (the same instance torch uses)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError as e:
        log.debug("could not clear the CUDA last error: %s", e)


@dataclass
class HostRegistration:
    """Registered pieces of one mapping; `unregister()` before the mapping is unmapped."""

    pointers: list[int] = field(default_factory=list)
    nbytes: int = 0

    def unregister(self) -> None:
        cudart = torch.cuda.cudart()
        failed = []
        for ptr in self.pointers:
            err = cudart.cudaHostUnregister(ptr)
            if int(err) != 0:
                failed.append((ptr, int(err)))
        self.pointers = []
        if failed:
            _clear_last_cuda_error()
            log.warning("cudaHostUnregister failed for %d chunk(s): %s", len(failed), failed)


def register_mapping(ptr: int, nbytes: int, mode: str, borders: Sequence[int] = (),
                     what: str = "mapping") -> HostRegistration | None:
    """Register [ptr, ptr+nbytes) according to `mode`; None when it stays unregistered."""
    if mode not in MODES:
        raise ValueError(f"cuda_register must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return None
    if not torch.cuda.is_available():
        if mode == "require":
            raise CudaRegisterError(f"cuda_register=require but CUDA is not available ({what})")
        return None
    if ptr % PAGE:
        raise ValueError(f"{what}: address {ptr:#x} is not page-aligned")
    cudart = torch.cuda.cudart()
    reg = HostRegistration(nbytes=nbytes)
    for offset, length in chunk_ranges(nbytes, borders):
        err = int(cudart.cudaHostRegister(ptr + offset, length, _HOST_REGISTER_PORTABLE))
        if err != 0:
            message = (f"cudaHostRegister of {what} failed at +{offset} ({length} bytes): "
                       f"{_error_string(cudart, err)} (cudaError {err})")
            reg.unregister()
            _clear_last_cuda_error()
            if mode == "require":
                raise CudaRegisterError(message)
            warnings.warn(message + "; continuing unregistered (slower pageable copies)", RuntimeWarning,
                          stacklevel=2)
            log.warning("%s; continuing unregistered", message)
            return None
        reg.pointers.append(ptr + offset)
    log.info("registered %s with CUDA: %d bytes in %d chunk(s)", what, nbytes, len(reg.pointers))
    return reg


def _error_string(cudart: object, err: int) -> str:
    try:
        return str(cudart.cudaGetErrorString(cudart.cudaError(err)))  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # torch's enum binds only `success`; some builds refuse other codes
        return "unknown error"
