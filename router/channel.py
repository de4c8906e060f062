"""How a client reaches the router: plaintext or TLS (optionally with a client certificate for
mTLS), plus the bearer token sent as call metadata on every RPC.

Role: ``ClientSecurity.of(...)`` takes what a user has (PEM file paths or PEM bytes, a token)
and ``open_channel`` makes a sync or ``grpc.aio`` channel from it; the clients in
``router/client.py`` pass ``metadata()`` with each call. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

from router.pem import PemSource, read_ca, read_pem

@dataclass(frozen=True, slots=True)
class ClientSecurity:
    tls: bool = False                      # TLS even without a CA of our own (system roots)
    root_certificates: bytes | None = None # PEM CA that signed the server's certificate
    cert_chain: bytes | None = None        # client certificate (mTLS)
    private_key: bytes | None = None
    auth_token: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its key (tls_cert and tls_key)")

    @classmethod
    def of(cls, *, tls: bool = False, tls_ca: PemSource | None = None, tls_cert: PemSource | None = None,
           tls_key: PemSource | None = None, auth_token: str | None = None) -> ClientSecurity:
        """Any certificate or key implies TLS."""
        ca, cert, key = read_ca(tls_ca, "tls_ca"), read_pem(tls_cert), read_pem(tls_key)
        secure = tls or any(x is not None for x in (ca, cert, key))
        return cls(secure, ca, cert, key, auth_token or None)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.cert_chain)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        if self.auth_token is None:
            return None
        return (("authorization", f"Bearer {self.auth_token}"),)


def open_channel(address: str, security: ClientSecurity, options: Sequence[tuple[str, Any]] = (),
                 *, use_aio: bool = False):
    """A ``grpc.Channel`` (or ``grpc.aio.Channel``) to ``address`` with ``security``'s transport."""
    module = aio if use_aio else grpc
    credentials = security.credentials()
    if credentials is None:
        return module.insecure_channel(address, options=list(options))
    return module.secure_channel(address, credentials, options=list(options))
