"""Exceptions that several `common` modules raise: a leaf module, importing none of them."""
from __future__ import annotations


class ProtocolError(ValueError):
    """A frame or message that breaks the protocol.

    `code` is a short stable category for counters ("too_large", "not_msgpack", "not_a_map",
    "version", "type", "keys", "field", "framing"); the message says what exactly.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
