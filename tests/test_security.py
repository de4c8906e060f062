"""The router's transport security over a real cluster (tiny random Llama, real Ray actors):
TLS serves, mTLS refuses a client without a certificate (or with one from another CA) and
serves one with, a wrong or missing bearer token gets UNAUTHENTICATED, the right one is served,
and grpc.health.v1 stays open. The OpenAI-compatible HTTP port under the same settings, driven
by the official ``openai`` client over ``httpx``: HTTPS with the router's certificate, mTLS
with the same client CA, the same bearer token (401), ``/health`` open. Certificates are made
here with ``cryptography``.

One cluster for the module; each test restarts only its gRPC server with the settings under
test (the workers take seconds to start, a server milliseconds). Every test ends with the
cluster-wide leak check.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx2
import openai
import psutil
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.auth import AuthResult, BearerTokenAuth
from router.client import AsyncPdserveClient, PdserveClient
from router.openai_api.server import openai_server
from router.security import ServerSecurity, read_token, token_from
from router.server import start_server
from tests.conftest import cluster_leaks
from tests.test_cluster_e2e import start_cluster

TOKEN = "s3cret-token-for-tests"
PROMPT = {"token_ids": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": True}


# ---------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, *, ca: bool = False,
           sans: list[x509.GeneralName] | None = None) -> tuple[Pem, x509.Name, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    issuer_name, issuer_key = issuer or (_name(subject), key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    pem = Pem(cert.public_bytes(serialization.Encoding.PEM),
              key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()))
    return pem, _name(subject), key


@dataclass(frozen=True)
class Pki:
    ca: Pem
    server: Pem
    client: Pem
    rogue_client: Pem   # signed by another CA


@pytest.fixture(scope="module")
def pki() -> Pki:
    ca, ca_name, ca_key = _issue("pdserve test CA", None, ca=True)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server, _, _ = _issue("localhost", (ca_name, ca_key), sans=sans)
    client, _, _ = _issue("pdserve test client", (ca_name, ca_key))
    _, other_name, other_key = _issue("another CA", None, ca=True)
    rogue, _, _ = _issue("rogue client", (other_name, other_key))
    return Pki(ca, server, client, rogue)


# ---------------------------------------------------------------- cluster


@pytest.fixture(scope="module")
def cluster(ray_session):
    cluster = start_cluster("disaggregated")
    yield cluster
    cluster.stop()


def serve_with(cluster, security: ServerSecurity | None) -> str:
    """Replace the cluster's gRPC server with one under ``security``; returns its address."""
    c = cluster.cluster

    async def restart():
        await c.server.stop(grace=None)
        c.server, c.port = await start_server(c.servicer, "127.0.0.1", 0, security)

    cluster.run(restart())
    return f"127.0.0.1:{c.port}"


def served(client: PdserveClient) -> bool:
    return len(client.generate_text(**PROMPT).token_ids) == 3


def rpc_error(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


# ---------------------------------------------------------------- TLS, mTLS


def test_tls_serves_and_refuses_plaintext(cluster, pki):
    addr = serve_with(cluster, ServerSecurity(pki.server.cert, pki.server.key))
    with PdserveClient(addr, tls_ca=pki.ca.cert, timeout_s=30) as client:
        assert served(client)
        assert client.server_info().max_model_len > 0
    with PdserveClient(f"localhost:{addr.rsplit(':', 1)[1]}", tls_ca=pki.ca.cert, timeout_s=30) as client:
        assert served(client)  # the certificate names localhost too
    with PdserveClient(addr, timeout_s=10) as plaintext:
        assert rpc_error(lambda: plaintext.generate_text(**PROMPT)) == grpc.StatusCode.UNAVAILABLE
    assert cluster_leaks(cluster) == {}


def test_tls_client_refuses_a_server_its_ca_did_not_sign(cluster, pki):
    addr = serve_with(cluster, ServerSecurity(pki.server.cert, pki.server.key))
    with PdserveClient(addr, tls_ca=pki.rogue_client.cert, timeout_s=10) as client:
        assert rpc_error(lambda: client.generate_text(**PROMPT)) == grpc.StatusCode.UNAVAILABLE
    assert cluster_leaks(cluster) == {}


def test_mtls_requires_a_client_certificate_from_the_ca(cluster, pki, tmp_path):
    addr = serve_with(cluster, ServerSecurity(pki.server.cert, pki.server.key, tls_client_ca=pki.ca.cert))
    with PdserveClient(addr, tls_ca=pki.ca.cert, timeout_s=10) as no_cert:
        assert rpc_error(lambda: no_cert.generate_text(**PROMPT)) == grpc.StatusCode.UNAVAILABLE
    with PdserveClient(addr, tls_ca=pki.ca.cert, tls_cert=pki.rogue_client.cert, tls_key=pki.rogue_client.key,
                       timeout_s=10) as rogue:
        assert rpc_error(lambda: rogue.generate_text(**PROMPT)) == grpc.StatusCode.UNAVAILABLE
    # The client takes file paths as well as PEM bytes.
    for name, data in (("ca.pem", pki.ca.cert), ("client.pem", pki.client.cert), ("client.key", pki.client.key)):
        (tmp_path / name).write_bytes(data)
    with PdserveClient(addr, tls_ca=tmp_path / "ca.pem", tls_cert=str(tmp_path / "client.pem"),
                       tls_key=tmp_path / "client.key", timeout_s=30) as client:
        assert served(client)
    assert cluster_leaks(cluster) == {}


# ---------------------------------------------------------------- bearer token


def test_wrong_or_missing_token_is_unauthenticated_right_token_is_served(cluster):
    addr = serve_with(cluster, ServerSecurity(auth_token=TOKEN))
    for token in (None, "wrong-token", TOKEN + "x", TOKEN[:-1]):
        with PdserveClient(addr, auth_token=token, timeout_s=10) as client:
            assert rpc_error(lambda: client.generate_text(**PROMPT)) == grpc.StatusCode.UNAUTHENTICATED
            assert rpc_error(client.server_info) == grpc.StatusCode.UNAUTHENTICATED
    with PdserveClient(addr, auth_token=TOKEN, timeout_s=30) as client:
        assert served(client) and client.server_info().max_model_len > 0
    assert cluster_leaks(cluster) == {}


def test_health_is_open_without_a_token(cluster):
    addr = serve_with(cluster, ServerSecurity(auth_token=TOKEN))
    with grpc.insecure_channel(addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pdserve.v1.Pdserve"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert cluster_leaks(cluster) == {}


def test_mtls_and_token_together(cluster, pki):
    addr = serve_with(cluster, ServerSecurity(pki.server.cert, pki.server.key, pki.ca.cert, auth_token=TOKEN))
    tls = {"tls_ca": pki.ca.cert, "tls_cert": pki.client.cert, "tls_key": pki.client.key}
    with PdserveClient(addr, timeout_s=10, **tls) as no_token:
        assert rpc_error(lambda: no_token.generate_text(**PROMPT)) == grpc.StatusCode.UNAUTHENTICATED
    with PdserveClient(addr, auth_token=TOKEN, timeout_s=30, **tls) as client:
        assert served(client)

    async def aio_client():
        async with AsyncPdserveClient(addr, auth_token=TOKEN, timeout_s=30, **tls) as client:
            return (await client.generate_text(**PROMPT)).token_ids, (await client.server_info()).max_model_len

    token_ids, max_model_len = asyncio.run(aio_client())
    assert len(token_ids) == 3 and max_model_len > 0
    assert cluster_leaks(cluster) == {}


# ---------------------------------------------------------------- the HTTP API, same settings


@contextlib.contextmanager
def http_with(cluster, security: ServerSecurity) -> Iterator[int]:
    """An OpenAI-compatible HTTP server on the cluster's request path under ``security``, as
    ``pdserve serve`` builds it from the same flags; yields its port."""
    c = cluster.cluster
    server = openai_server(c.servicer.core, c.health, "tiny", 4096, "127.0.0.1", 0, security)
    port = cluster.run(server.start())
    try:
        yield port
    finally:
        cluster.run(server.stop())


def tls_context(tmp_path, ca: bytes | None, client: Pem | None = None) -> ssl.SSLContext:
    """What an HTTPS client trusts (``ca``; None: the system's roots) and presents (``client``)."""
    context = ssl.create_default_context(cadata=ca.decode() if ca else None)
    if client is not None:
        (tmp_path / "c.pem").write_bytes(client.cert)
        (tmp_path / "c.key").write_bytes(client.key)
        context.load_cert_chain(tmp_path / "c.pem", tmp_path / "c.key")
    return context


def http_client(url: str, verify: ssl.SSLContext | bool = True, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=30,
                         http_client=openai.DefaultHttpxClient(verify=verify))   # as in the README


def completes(client: openai.OpenAI) -> bool:
    done = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, extra_body={"ignore_eos": True})
    return done.usage.completion_tokens == 3


def test_http_tls_serves_https_and_refuses_plaintext_and_unknown_cas(cluster, pki, tmp_path):
    with http_with(cluster, ServerSecurity(pki.server.cert, pki.server.key)) as port:
        trusting = tls_context(tmp_path, pki.ca.cert)
        assert completes(http_client(f"https://127.0.0.1:{port}/v1", trusting))
        assert completes(http_client(f"https://localhost:{port}/v1", trusting))   # its certificate names both
        with pytest.raises(openai.APIConnectionError):   # plaintext to a TLS port: no HTTP answer
            http_client(f"http://127.0.0.1:{port}/v1").models.list()
        with pytest.raises(openai.APIConnectionError):   # a client that does not trust our CA
            http_client(f"https://127.0.0.1:{port}/v1", tls_context(tmp_path, pki.rogue_client.cert)).models.list()
    assert cluster_leaks(cluster) == {}


def test_http_mtls_and_token_as_on_the_grpc_port(cluster, pki, tmp_path):
    security = ServerSecurity(pki.server.cert, pki.server.key, pki.ca.cert, auth_token=TOKEN)
    with http_with(cluster, security) as port:
        url = f"https://127.0.0.1:{port}/v1"
        for presented in (None, pki.rogue_client):   # no client certificate, or one another CA signed
            with pytest.raises(openai.APIConnectionError):
                http_client(url, tls_context(tmp_path, pki.ca.cert, presented), api_key=TOKEN).models.list()
        with_cert = tls_context(tmp_path, pki.ca.cert, pki.client)
        with pytest.raises(openai.AuthenticationError):   # the certificate alone is not enough
            http_client(url, with_cert, api_key="wrong-token").models.list()
        assert completes(http_client(url, with_cert, api_key=TOKEN))
        health = httpx2.get(f"https://127.0.0.1:{port}/health", verify=with_cert, timeout=30)
        assert health.status_code == 200   # open without a token, as grpc.health.v1
    assert cluster_leaks(cluster) == {}


def test_http_tls_setup_failure_leaves_no_socket(cluster, pki):
    """A certificate that does not load fails the start before a socket is bound."""
    bad = ServerSecurity(pki.server.cert, pki.rogue_client.key)   # a key that is not the certificate's
    server = openai_server(cluster.cluster.servicer.core, cluster.cluster.health, "tiny", 4096, "127.0.0.1", 0, bad)
    listening = set(_listening())
    with pytest.raises(ssl.SSLError):
        cluster.run(server.start())
    assert server.port is None and set(_listening()) == listening


def _listening() -> list[tuple]:
    return [c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]


# ---------------------------------------------------------------- without a cluster


def test_token_check_is_exact():
    auth = BearerTokenAuth(TOKEN)
    method = "/pdserve.v1.Pdserve/Generate"
    assert auth.check(method, (("authorization", f"Bearer {TOKEN}"),)) is AuthResult.GRANTED
    assert auth.check(method, (("authorization", f"bearer  {TOKEN} "),)) is AuthResult.GRANTED
    assert auth.check(method, (("authorization", TOKEN),)) is AuthResult.MISSING  # no scheme
    assert auth.check(method, (("authorization", f"Basic {TOKEN}"),)) is AuthResult.MISSING
    assert auth.check(method, ()) is AuthResult.MISSING
    assert auth.check(method, (("authorization", "Bearer nope"),)) is AuthResult.WRONG
    assert auth.check("/grpc.health.v1.Health/Check", ()) is AuthResult.OPEN
    assert auth.check("/grpc.health.v1.HealthX/Check", ()) is AuthResult.MISSING


def test_security_settings_from_files_and_env(tmp_path, pki):
    (tmp_path / "token").write_text(f"  {TOKEN}\n")
    assert read_token(tmp_path / "token") == TOKEN
    assert token_from(None, {"PDSERVE_AUTH_TOKEN": TOKEN}) == TOKEN
    assert token_from(None, {}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token(tmp_path / "empty")
    # no client could send these (an HTTP header, gRPC metadata: ASCII): refused at start-up, not 401 forever
    (tmp_path / "accented").write_text("s\u00e9same\n")
    with pytest.raises(ValueError, match="accented: not ASCII"):
        read_token(tmp_path / "accented")
    for token in ("s\u00e9same", "tab\there"):
        with pytest.raises(ValueError, match="printable ASCII"):
            ServerSecurity(auth_token=token)
    with pytest.raises(ValueError, match="key"):
        ServerSecurity(tls_cert=pki.server.cert)
    with pytest.raises(ValueError, match="need TLS"):
        ServerSecurity(tls_client_ca=pki.ca.cert)
    assert ServerSecurity().describe() == "plaintext"
    assert ServerSecurity(pki.server.cert, pki.server.key, pki.ca.cert, TOKEN).describe() == "mTLS + bearer token"


def test_cli_flags_reach_the_server_and_client_settings(tmp_path, pki, monkeypatch):
    from deploy.cli import _parser, cluster_config
    from deploy.security_args import client_kwargs

    files = {"cert.pem": pki.server.cert, "key.pem": pki.server.key, "ca.pem": pki.ca.cert, "token": TOKEN.encode()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    monkeypatch.delenv("PDSERVE_AUTH_TOKEN", raising=False)
    args = _parser().parse_args(["serve", "--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem"),
                                 "--tls-client-ca", str(tmp_path / "ca.pem"), "--auth-token-file", str(tmp_path / "token"),
                                 "--host", "0.0.0.0", "--metrics-host", "10.1.2.3"])
    cfg = cluster_config(args)
    assert cfg.security == ServerSecurity(pki.server.cert, pki.server.key, pki.ca.cert, TOKEN)
    assert (cfg.host, cfg.metrics_host) == ("0.0.0.0", "10.1.2.3")
    default = cluster_config(_parser().parse_args(["serve"]))
    assert default.security is None and default.metrics_host == "127.0.0.1"
    monkeypatch.setenv("PDSERVE_AUTH_TOKEN", "from-env")
    assert cluster_config(_parser().parse_args(["serve"])).security == ServerSecurity(auth_token="from-env")

    gen = _parser().parse_args(["generate", "hi", "--tls-ca", "ca.pem", "--auth-token-file", str(tmp_path / "token")])
    assert client_kwargs(gen) == {"tls": False, "tls_ca": "ca.pem", "tls_cert": None, "tls_key": None, "auth_token": TOKEN}


def test_security_modules_do_not_load_torch():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, router.security, router.auth, router.channel, router.client; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], check=True, timeout=60)


@pytest.mark.parametrize("server, flags, hint", [
    ("tls", [], "it may require TLS (--tls-ca FILE)"),
    ("plaintext", ["--tls-ca", "ca.pem"], "the server does not speak TLS: leave out --tls / --tls-ca"),
    ("tls", ["--tls-ca", "other-ca.pem"], "the server's certificate is not signed by the CA the client trusts"),
    ("mtls", ["--tls-ca", "ca.pem"], "it may require a client certificate (--tls-cert, --tls-key)"),
    ("none", [], "nothing listens there: is `pdserve serve` running at this --address?"),
])
def test_a_connection_refused_for_its_security_says_which_flag_to_change(pki, tmp_path, capsys, monkeypatch,
                                                                         server, flags, hint):
    """gRPC says a plaintext client at a TLS server, or a TLS client without the certificate an
    mTLS server requires, as a bare "Socket closed": `pdserve generate` (and bench) add what to change."""
    from concurrent.futures import ThreadPoolExecutor

    from deploy.cli import main

    for name, data in {"ca.pem": pki.ca.cert, "other-ca.pem": _issue("a third CA", None, ca=True)[0].cert}.items():
        (tmp_path / name).write_bytes(data)
    monkeypatch.chdir(tmp_path)
    creds = {"tls": grpc.ssl_server_credentials([(pki.server.key, pki.server.cert)]),
             "mtls": grpc.ssl_server_credentials([(pki.server.key, pki.server.cert)], root_certificates=pki.ca.cert,
                                                 require_client_auth=True)}.get(server)
    bare = grpc.server(ThreadPoolExecutor(1))
    port = bare.add_secure_port("127.0.0.1:0", creds) if creds else bare.add_insecure_port("127.0.0.1:0")
    if server == "none":
        port = 1
    else:
        bare.start()
    try:
        with pytest.raises(SystemExit):
            main(["generate", "hi", "--address", f"127.0.0.1:{port}", *flags])
    finally:
        bare.stop(None)
    err = capsys.readouterr().err
    assert "pdserve: UNAVAILABLE: " in err and hint in err, err
