"""The router's transport security settings: TLS (optionally mutual) and a bearer token.

Role: one typed value that the CLI builds from files (``--tls-cert``, ``--tls-key``,
``--tls-client-ca``, ``--auth-token-file`` or ``$PDSERVE_AUTH_TOKEN``) and that
``start_server`` turns into gRPC server credentials and interceptors. Files are read once, when
the value is made, so a missing or unreadable file fails ``pdserve serve`` before Ray starts.

- TLS: the server presents ``tls_cert`` (PEM chain) with ``tls_key``.
- mTLS: with ``tls_client_ca`` set, every client must present a certificate that CA signed; the
  handshake fails otherwise (no RPC is ever dispatched).
- Token: with ``auth_token`` set, every RPC but grpc.health.v1 must carry
  ``authorization: Bearer <token>`` (``router/auth.py``). Without TLS the token crosses the
  network in clear text: use both, except on loopback.

The OpenAI-compatible HTTP API (``router.openai_api``) uses the same settings: the same
certificate (``ssl_context``), client CA and bearer token.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from router.pem import read_pem

AUTH_TOKEN_ENV = "PDSERVE_AUTH_TOKEN"


def read_token(path: str | os.PathLike) -> str:
    """A token file's token: its content without surrounding whitespace (editors add a newline)."""
    try:
        token = Path(path).read_text(encoding="ascii").strip()
    except UnicodeDecodeError as exc:   # a header no client could send: refused here, not 401 forever
        raise ValueError(f"auth token file {path}: not ASCII (byte {exc.start}); a bearer token is "
                         "sent in an HTTP header and gRPC metadata, which carry ASCII only") from None
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    return token


def token_from(path: str | os.PathLike | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The token from ``path`` if given, else from ``$PDSERVE_AUTH_TOKEN``, else None."""
    if path:
        return read_token(path)
    return env.get(AUTH_TOKEN_ENV, "").strip() or None


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    tls_cert: bytes | None = None        # PEM certificate chain the server presents
    tls_key: bytes | None = None         # its PEM private key
    tls_client_ca: bytes | None = None   # PEM CA bundle: set, clients must present a cert it signed
    auth_token: str | None = None        # set: RPCs need "authorization: Bearer <token>"

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("client certificates (--tls-client-ca) need TLS (--tls-cert, --tls-key)")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("the auth token is empty")
        if self.auth_token is not None and not (self.auth_token.isascii() and self.auth_token.isprintable()):
            raise ValueError("the auth token must be printable ASCII (it is sent in an HTTP header and gRPC "
                             "metadata)")

    @classmethod
    def from_files(cls, tls_cert=None, tls_key=None, tls_client_ca=None, auth_token_file=None,
                   env: Mapping[str, str] = os.environ) -> ServerSecurity:
        return cls(read_pem(tls_cert or None), read_pem(tls_key or None), read_pem(tls_client_ca or None),
                   token_from(auth_token_file, env))

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def mutual_tls(self) -> bool:
        return self.tls_client_ca is not None

    def credentials(self) -> grpc.ServerCredentials | None:
        """Server credentials for ``add_secure_port``; None means a plaintext port."""
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)], root_certificates=self.tls_client_ca,
                                           require_client_auth=self.mutual_tls)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The same certificate, key and client CA for the HTTP API (uvicorn); None: plaintext.
        ``load_cert_chain`` reads files only: the PEMs go through a private temporary directory
        that is gone once they are loaded."""
        if not self.tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        with tempfile.TemporaryDirectory(prefix="pdserve-tls-") as tmp:   # mode 0700
            cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            cert.write_bytes(self.tls_cert)
            key.write_bytes(self.tls_key)
            context.load_cert_chain(cert, key)
        if self.mutual_tls:
            context.load_verify_locations(cadata=self.tls_client_ca.decode())
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        if self.auth_token is None:
            return []
        from router.auth import BearerTokenAuth

        return [BearerTokenAuth(self.auth_token)]

    def describe(self) -> str:
        """For the log line: what protects the port (never the secrets)."""
        parts = ["mTLS" if self.mutual_tls else "TLS" if self.tls else "plaintext"]
        if self.auth_token is not None:
            parts.append("bearer token")
        return " + ".join(parts)
