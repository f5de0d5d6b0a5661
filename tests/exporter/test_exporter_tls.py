"""The exporters over real TLS and mutual TLS with bearer tokens (certificates made in the test):
the OTLP exporter to a gRPC server, remote write to an HTTPS server; the server verified against
the configured CA, the client certificate presented, the token read again when its file
changes; plaintext to anything but loopback refused unless asked for."""

from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import grpc
import pytest
from certs import Authority
from otlpsink import MetricsSink, serve_sink

from otelgpu.config import parse_config
from otelgpu.core.settings import ClientTLSConfig
from otelgpu.errors import ConfigError
from otelgpu.exporter.config import OtlpExporterConfig, RemoteWriteConfig
from otelgpu.exporter.otlp import OtlpSender
from otelgpu.exporter.remote_write import RemoteWriteSender
from otelgpu.exporter.store import CostStore
from otelgpu.telemetry import SelfMetrics


@pytest.fixture
def pki(tmp_path):
    ca = Authority(tmp_path / "pki")
    return ca, ca.issue("collector", file="server"), ca.issue("otelgpu", server=False, file="client")


def sink_credentials(ca: Authority, server, mutual: bool = True) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(server.key.read_bytes(), server.cert.read_bytes())],
                                       root_certificates=ca.cert.read_bytes() if mutual else None,
                                       require_client_auth=mutual)


def send_one(config: OtlpExporterConfig, store: CostStore) -> object:
    sender = OtlpSender(config, store.specs, SelfMetrics(), "c1")
    try:
        return sender.send(store.points())
    finally:
        sender.close()


def test_otlp_over_mutual_tls_with_a_rotating_bearer_token(pki, store, intervals, tmp_path) -> None:
    ca, server, client = pki
    token = tmp_path / "token"
    token.write_text("first-token\n")
    sink = MetricsSink()
    with serve_sink(sink, credentials=sink_credentials(ca, server)) as port:
        tls = ClientTLSConfig(insecure=False, ca_file=str(ca.cert), cert_file=str(client.cert), key_file=str(client.key))
        config = OtlpExporterConfig(endpoint=f"localhost:{port}", tls=tls, bearer_token_file=str(token), timeout_seconds=5)
        sender = OtlpSender(config, store.specs, SelfMetrics(), "c1")
        try:
            intervals.record(0)
            assert sender.send(store.points()).ok
            token.write_text("second-token\n")  # a projected token rotated
            intervals.record(1)
            assert sender.send(store.points()).ok
        finally:
            sender.close()
    assert [r.metadata["authorization"] for r in sink.received] == ["Bearer first-token", "Bearer second-token"]


def test_otlp_refuses_a_server_its_ca_did_not_sign_and_mtls_wants_its_certificate(pki, store, intervals) -> None:
    intervals.record(0)
    ca, server, client = pki
    stranger = Authority(ca.directory / "other", "someone else's CA")
    sink = MetricsSink()
    with serve_sink(sink, credentials=sink_credentials(ca, server)) as port:
        wrong_ca = ClientTLSConfig(insecure=False, ca_file=str(stranger.cert), cert_file=str(client.cert),
                                   key_file=str(client.key))
        no_client_cert = ClientTLSConfig(insecure=False, ca_file=str(ca.cert))
        for tls in (wrong_ca, no_client_cert):
            result = send_one(OtlpExporterConfig(endpoint=f"localhost:{port}", tls=tls, timeout_seconds=5), store)
            assert not result.ok and result.retryable and result.reason == "unavailable"
    assert sink.received == []


def test_otlp_server_name_override_reaches_a_server_by_another_name(pki, store, intervals) -> None:
    intervals.record(0)
    ca, _, client = pki
    elsewhere = ca.issue("collector.monitoring.svc", hosts=("collector.monitoring.svc",), file="svc")
    sink = MetricsSink()
    with serve_sink(sink, credentials=sink_credentials(ca, elsewhere, mutual=False)) as port:
        tls = ClientTLSConfig(insecure=False, ca_file=str(ca.cert))
        assert not send_one(OtlpExporterConfig(endpoint=f"localhost:{port}", tls=tls, timeout_seconds=5),
                            store).ok
        tls = ClientTLSConfig(insecure=False, ca_file=str(ca.cert), server_name_override="collector.monitoring.svc")
        assert send_one(OtlpExporterConfig(endpoint=f"localhost:{port}", tls=tls, timeout_seconds=5), store).ok
    assert len(sink.received) == 1


class HttpsReceiver:
    """An HTTPS server answering 204 to remote write, mutual TLS when given a client CA; it keeps
    each request's Authorization header and the client certificate's subject."""

    def __init__(self, server, client_ca=None) -> None:  # noqa: ANN001
        self.seen: list[tuple[str, str]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                peer = self.connection.getpeercert() or {}
                subject = dict(x[0] for x in peer.get("subject", ()))
                receiver.seen.append((self.headers.get("Authorization", ""), subject.get("commonName", "")))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args) -> None:  # noqa: ANN002
                pass

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(server.cert, server.key)
        if client_ca is not None:
            context.load_verify_locations(client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"https://localhost:{self.httpd.server_address[1]}/api/v1/write"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def https(pki) -> Iterator[HttpsReceiver]:
    ca, server, _ = pki
    receiver = HttpsReceiver(server, ca.cert)
    yield receiver
    receiver.stop()


def remote_write(config: RemoteWriteConfig, store: CostStore):  # noqa: ANN201
    sender = RemoteWriteSender(config, store.specs, "c1", SelfMetrics())
    try:
        return sender.send(store.points())
    finally:
        sender.close()


def test_remote_write_over_mutual_tls_with_a_bearer_token(pki, https, store, intervals, tmp_path) -> None:
    intervals.record(0)
    ca, _, client = pki
    token = tmp_path / "token"
    token.write_text("rw-token")
    tls = ClientTLSConfig(ca_file=str(ca.cert), cert_file=str(client.cert), key_file=str(client.key))
    assert remote_write(RemoteWriteConfig(url=https.url, tls=tls, bearer_token_file=str(token)), store).ok
    assert https.seen == [("Bearer rw-token", "otelgpu")]
    # The wrong CA, or no client certificate: a TLS failure, retried later; nothing arrives.
    stranger = Authority(ca.directory / "other", "someone else's CA")
    for bad in (ClientTLSConfig(ca_file=str(stranger.cert), cert_file=str(client.cert), key_file=str(client.key)),
                ClientTLSConfig(ca_file=str(ca.cert))):
        result = remote_write(RemoteWriteConfig(url=https.url, tls=bad), store)
        assert not result.ok and result.retryable and result.reason in ("tls", "connection")
    assert len(https.seen) == 1


def test_insecure_skip_verify_trusts_any_server_when_asked(pki, store, intervals) -> None:
    intervals.record(0)
    ca, _, _ = pki
    stranger = Authority(ca.directory / "other", "someone else's CA")
    receiver = HttpsReceiver(stranger.issue("self-signed-ish"))
    try:
        assert not remote_write(RemoteWriteConfig(url=receiver.url), store).ok  # the system's CAs
        skip = ClientTLSConfig(insecure_skip_verify=True)
        assert remote_write(RemoteWriteConfig(url=receiver.url, tls=skip), store).ok
    finally:
        receiver.stop()


@pytest.mark.parametrize(("exporter", "says"), [
    ({"otlp": {"endpoint": "collector.monitoring:4317", "tls": {"insecure": True}}}, None),
    ({"otlp": {"endpoint": "127.0.0.1:4319"}}, None),  # loopback: plaintext unless tls.insecure: false
    ({"otlp": {"endpoint": "[::1]:4319"}}, None),
    ({"otlp": {"endpoint": "http://collector:4317"}}, "plaintext to a host that is not loopback"),
    ({"otlp": {"endpoint": "collector:4317", "insecure": True}}, "insecure moved to tls.insecure"),
    ({"otlp": {"endpoint": "collector:4317", "tls": {"insecure_skip_verify": True}}}, "not available over gRPC"),
    ({"otlp": {"endpoint": "127.0.0.1:4317", "tls": {"ca_file": "/ca.pem"}}}, "need TLS"),
    ({"otlp": {"endpoint": "c:4317", "headers": {"Authorization": "x"}, "bearer_token_file": "/t"}}, "keep one"),
    ({"otlp": {"endpoint": "c:4317", "tls": {"cert_file": "/c.pem"}}}, "go together"),
    ({"remote_write": {"url": "http://prometheus:9090/api/v1/write"}}, "plaintext to a host that is not loopback"),
    ({"remote_write": {"url": "http://prometheus:9090/api/v1/write", "tls": {"insecure": True}}}, None),
    ({"remote_write": {"url": "http://localhost:9090/api/v1/write"}}, None),
    ({"remote_write": {"url": "https://x/api/v1/write", "ca_file": "/ca.pem"}}, "moved to tls.ca_file"),
    # Read as urllib3 reads it, the host is 192.0.2.2; urllib.parse would say 127.0.0.1.
    ({"remote_write": {"url": "http://192.0.2.2:9\\@127.0.0.1/api/v1/write"}}, "no user information or backslash"),
    ({"remote_write": {"url": "http://user:pw@127.0.0.1/api/v1/write"}}, "no user information"),
    ({"remote_write": {"url": "http://[::1]:9090/api/v1/write"}}, None),
    ({"remote_write": {"url": "http://localhost:9090/api/v1/write", "tls": {"insecure": False}}}, "plaintext, but"),
    # Cluster DNS resolves x.localhost through its search path (a Service in a namespace "localhost").
    ({"remote_write": {"url": "http://otel.localhost:9090/api/v1/write"}}, "not loopback"),
    ({"otlp": {"endpoint": "otel.localhost:4317"}}, None),  # TLS, then: allowed, and not plaintext
    ({"otlp": {"endpoint": "collector:4317", "tls": {"min_version": "1.3"}}}, "only 1.2 can be set"),
    ({"remote_write": {"url": "https://x/api/v1/write", "sigv4": {"region": "eu-west-1"},
                       "bearer_token_file": "/t"}}, "keep one"),
])
def test_plaintext_and_credentials_are_what_the_config_says(exporter: dict, says) -> None:  # noqa: ANN001
    if says is None:
        parse_config({"exporter": exporter})
    else:
        with pytest.raises(ConfigError, match=says):
            parse_config({"exporter": exporter})


def test_the_otlp_target_follows_the_endpoint_and_tls() -> None:
    assert OtlpExporterConfig(endpoint="127.0.0.1:4319").target == ("127.0.0.1:4319", False)
    assert OtlpExporterConfig(endpoint="localhost:4319", tls=ClientTLSConfig(insecure=False)).target == ("localhost:4319", True)
    assert OtlpExporterConfig(endpoint="collector:4317").target == ("collector:4317", True)
    assert OtlpExporterConfig(endpoint="https://collector:4317/").target == ("collector:4317", True)
    assert OtlpExporterConfig(endpoint="[::1]:4319").target == ("[::1]:4319", False)


def test_a_name_under_localhost_gets_tls() -> None:
    assert OtlpExporterConfig(endpoint="otel.localhost:4317").target == ("otel.localhost:4317", True)


def test_plaintext_to_loopback_never_goes_through_a_proxy(store, intervals, monkeypatch) -> None:
    """An http_proxy in the environment would carry loopback plaintext off the host: the OTLP
    exporter's plaintext channel does not use it (the proxy here counts who comes)."""
    import socket

    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen(8)
    proxy.settimeout(0.01)
    for name in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.getsockname()[1]}")
    intervals.record(0)
    sink = MetricsSink()
    try:
        with serve_sink(sink):
            assert send_one(OtlpExporterConfig(endpoint=sink.endpoint, timeout_seconds=5), store).ok
        assert len(sink.received) == 1
        with pytest.raises(TimeoutError):
            proxy.accept()  # nobody came to the proxy
    finally:
        proxy.close()
