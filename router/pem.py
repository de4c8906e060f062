"""PEM material from where a user has it: a file path, or the PEM bytes themselves. One rule for
the router's own TLS settings (``router.security``) and its clients' (``router.channel``); a CA
bundle is checked as it is read (``read_ca``), so a file that is none fails at once, not as a
handshake that never succeeds (UNAVAILABLE). Torch-free."""

from __future__ import annotations

import os
import re
import ssl
from pathlib import Path

from engine.errors import ConfigError

PemSource = str | os.PathLike | bytes   # a file path, or the PEM bytes themselves


def read_pem(source: PemSource | None) -> bytes | None:
    """The PEM bytes of ``source``; None stays None (the setting is not used)."""
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()


def read_ca(source: PemSource | None, field: str) -> bytes | None:
    """``read_pem``, refused (naming ``field`` and the file) unless it holds a PEM certificate."""
    pem = read_pem(source)
    if pem is None:
        return None
    try:
        ssl.create_default_context(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError) as exc:
        where = "bytes" if isinstance(source, bytes) else os.fspath(source)
        reason = re.sub(r" \(_ssl\.c:\d+\)$", "", getattr(exc, "reason", None) or str(exc))
        raise ConfigError.on(field, f"{where}: not a PEM certificate ({reason})") from None
    return pem
