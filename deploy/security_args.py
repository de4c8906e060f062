"""Command-line flags for the router's transport security, shared by ``pdserve serve`` (the
server side) and ``pdserve generate`` / ``chat`` / ``bench`` (the client side).

Server: ``--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]`` (the CA turns on mTLS) and
``--auth-token-file FILE`` (or ``$PDSERVE_AUTH_TOKEN``). Client: ``--tls-ca FILE`` (the CA that
signed the server's certificate), ``--tls-cert FILE --tls-key FILE`` (mTLS), ``--tls`` (TLS
with the system's CA roots) and the same token file / variable.
"""

from __future__ import annotations

import argparse
import ssl
from typing import Any

from router.security import AUTH_TOKEN_ENV, ServerSecurity, token_from

_TOKEN_HELP = f"file holding the bearer token (default: ${AUTH_TOKEN_ENV} if set)"


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (deploy/README.md: threat model)")
    g.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM certificate chain: serve gRPC over TLS")
    g.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None, metavar="FILE",
                   help="PEM CA bundle: require a client certificate it signed (mTLS)")
    g.add_argument("--auth-token-file", default=None, metavar="FILE",
                   help=_TOKEN_HELP + "; every RPC but health needs 'authorization: Bearer <token>'")


def server_security(args: argparse.Namespace) -> ServerSecurity | None:
    """The settings the flags ask for (files read now, so a bad path fails before Ray starts);
    None when there are none."""
    security = ServerSecurity.from_files(args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file)
    try:   # a certificate, key or CA that is no PEM, or a key that is not the certificate's: now, before Ray
        security.ssl_context()
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-cert / --tls-key / --tls-client-ca: not a PEM certificate, its key and a CA "
                         f"({exc.reason or exc})") from None
    return None if security == ServerSecurity() else security


def add_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's CA roots")
    g.add_argument("--tls-ca", default=None, metavar="FILE", help="PEM CA that signed the server's certificate (implies TLS)")
    g.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM client certificate (mTLS)")
    g.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--auth-token-file", default=None, metavar="FILE", help=_TOKEN_HELP)


def client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``PdserveClient`` / ``AsyncPdserveClient``."""
    return {"tls": args.tls, "tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key,
            "auth_token": token_from(args.auth_token_file)}


# What gRPC's connection failures say (its last error's words) -> what the client's flags should
# change, in the client's terms. gRPC says a plaintext client refused by a TLS server, and a TLS
# client without the certificate an mTLS server requires, as a bare "Socket closed".
_HINTS = (
    ("WRONG_VERSION_NUMBER", lambda tls, cert: "the server does not speak TLS: leave out --tls / --tls-ca"),
    ("CERTIFICATE_VERIFY_FAILED", lambda tls, cert: "the server's certificate is not signed by the CA the client "
                                                    "trusts (--tls-ca), or does not name this host"),
    ("Socket closed", lambda tls, cert: None if tls and cert else
        "the server closed the connection: it may require TLS (--tls-ca FILE)" if not tls else
        "the server closed the TLS connection: it may require a client certificate (--tls-cert, --tls-key)"),
    ("Connection refused", lambda tls, cert: "nothing listens there: is `pdserve serve` running at this --address?"),
)


def connection_hint(details: str | None, args: argparse.Namespace) -> str:
    """A hint for an UNAVAILABLE call's ``details`` under the client flags ``args`` ("" if none)."""
    tls, cert = bool(args.tls or args.tls_ca), bool(args.tls_cert)
    for words, hint in _HINTS:
        if words in (details or ""):
            said = hint(tls, cert)
            return f" ({said})" if said else ""
    return ""
