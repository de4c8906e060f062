"""PEM material from where a user has it: a file path, or the PEM bytes themselves. One rule for
the router's own TLS settings (``router.security``) and its clients' (``router.channel``).
Torch-free."""

from __future__ import annotations

import os
from pathlib import Path

PemSource = str | os.PathLike | bytes   # a file path, or the PEM bytes themselves


def read_pem(source: PemSource | None) -> bytes | None:
    """The PEM bytes of ``source``; None stays None (the setting is not used)."""
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()
