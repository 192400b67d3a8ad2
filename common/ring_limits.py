"""The shared-memory ring's own limits, without the ring (common/ring.py imports torch): the config
checks its ring settings against the very numbers the ring refuses beyond."""
from __future__ import annotations

MAX_SLOTS = 4096                 # slots per ring (per target worker)
MAX_SLOT_SIZE = 1 << 40          # bytes of one slot's tensors (1 TiB)
