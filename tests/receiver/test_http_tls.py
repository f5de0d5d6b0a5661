"""The OTLP/HTTP receiver with real TLS, mutual TLS and bearer tokens (certificates made here, in
the test), against requests, http.client and raw ssl sockets: clients with and without client
certificates, of another CA, expired, trusting the wrong CA; no token, a wrong one, a rotated
token file; certificates rotated on disk (a half-done rotation kept out); an IPv6 endpoint; a client
that never says hello."""

from __future__ import annotations

import socket

import pytest
import requests
from certs import Authority, rotate_through_a_half_done_rotation, served_serial
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from support import eventually, poll

from otelgpu.core.settings import ServerAuthConfig, ServerTLSConfig
from otelgpu.errors import ConfigError
from otelgpu.receiver.config import HttpReceiverConfig
from otelgpu.receiver.http_server import HttpReceiver
from otelgpu.telemetry import by_label

from .helpers import DCGM1, VLLM, drain_points

PB = "application/x-protobuf"
# What a TLS client sees when the server refuses it during (or right after) the handshake.
REFUSED = (requests.exceptions.SSLError, requests.exceptions.ConnectionError)


@pytest.fixture
def pki(tmp_path):
    ca = Authority(tmp_path / "pki")
    return ca, ca.issue("otelgpu", file="server"), ca.issue("collector", server=False, file="client")


def tls_config(server, ca=None, **kw) -> ServerTLSConfig:
    return ServerTLSConfig(cert_file=str(server.cert), key_file=str(server.key),
                           client_ca_file=str(ca.cert) if ca else None, **kw)


def post(port: int, body: bytes, verify, cert=None, token: str | None = None, host: str = "localhost"):
    headers = {"Content-Type": PB}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return requests.post(f"https://{host}:{port}/v1/metrics", data=body, headers=headers, timeout=10,
                         verify=str(verify), cert=(str(cert.cert), str(cert.key)) if cert else None)



def test_tls_serves_clients_that_trust_its_ca_only(http_receiver, make_ingest, otel_request, metrics, pki):
    ca, server, _ = pki
    ingest = make_ingest()
    receiver = http_receiver(ingest, tls=tls_config(server))
    body = otel_request(DCGM1).SerializeToString()
    response = post(receiver.port, body, ca.cert)
    assert response.status_code == 200 and ExportMetricsServiceResponse.FromString(response.content) == \
        ExportMetricsServiceResponse()
    assert drain_points(ingest) == 36
    stranger = Authority(ca.directory / "other", "someone else's CA")
    with pytest.raises(requests.exceptions.SSLError):  # the client trusts another CA
        post(receiver.port, body, stranger.cert)
    with pytest.raises(requests.exceptions.ConnectionError):  # plaintext to a TLS port
        requests.post(f"http://localhost:{receiver.port}/v1/metrics", data=body, headers={"Content-Type": PB},
                      timeout=10)
    # keep-alive over TLS: one connection, several requests
    with requests.Session() as session:
        for _ in range(3):
            r = session.post(f"https://localhost:{receiver.port}/v1/metrics", data=body,
                             headers={"Content-Type": PB}, verify=str(ca.cert), timeout=10)
            assert r.status_code == 200
    assert drain_points(ingest) == 3 * 36 and by_label(metrics.requests)[("http", "ok")] == 4


def test_mutual_tls_wants_a_client_certificate_of_its_ca(http_receiver, make_ingest, otel_request, metrics, pki):
    ca, server, client = pki
    ingest = make_ingest()
    receiver = http_receiver(ingest, tls=tls_config(server, ca))
    body = otel_request(DCGM1).SerializeToString()
    assert post(receiver.port, body, ca.cert, client).status_code == 200
    stranger = Authority(ca.directory / "other", "someone else's CA")
    expired = ca.issue("old collector", server=False, expired=True)
    for refused in (None, stranger.issue("intruder", server=False), expired):
        with pytest.raises(REFUSED):
            post(receiver.port, body, ca.cert, refused)
    with pytest.raises(requests.exceptions.SSLError):  # a good client certificate, but the wrong CA to trust
        post(receiver.port, body, stranger.cert, client)
    assert drain_points(ingest) == 36 and by_label(metrics.requests)[("http", "ok")] == 1


def test_an_expired_server_certificate_is_refused_by_clients(http_receiver, make_ingest, otel_request, pki):
    ca, _, _ = pki
    old = ca.issue("otelgpu", expired=True, file="expired-server")
    receiver = http_receiver(make_ingest(), tls=tls_config(old))
    with pytest.raises(requests.exceptions.SSLError):
        post(receiver.port, otel_request(VLLM).SerializeToString(), ca.cert)


def test_bearer_tokens_over_mutual_tls(http_receiver, make_ingest, otel_request, metrics, pki, tmp_path):
    ca, server, client = pki
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-token\n")
    ingest = make_ingest()
    receiver = http_receiver(ingest, tls=tls_config(server, ca), auth=ServerAuthConfig(bearer_token_file=str(tokens)))
    body = otel_request(DCGM1).SerializeToString()
    assert post(receiver.port, body, ca.cert, client, token="s3cret-token").status_code == 200
    for token in (None, "guess", ""):
        response = post(receiver.port, body, ca.cert, client, token=token)
        assert response.status_code == 401 and response.headers["WWW-Authenticate"].startswith("Bearer")
        assert response.headers["Content-Type"] == PB
        assert status_pb2.Status.FromString(response.content).code == 16  # UNAUTHENTICATED
    assert by_label(metrics.requests)[("http", "ok")] == 1 and by_label(metrics.requests)[("http", "unauthenticated")] == 3
    assert drain_points(ingest) == 36  # refused before the body was read: nothing consumed


def test_bearer_tokens_are_read_again_when_the_file_changes(http_receiver, make_ingest, otel_request, metrics,
                                                            tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("first\n")
    receiver = http_receiver(make_ingest(), auth=ServerAuthConfig(bearer_token_file=str(tokens)))
    body = otel_request(VLLM).SerializeToString()

    def with_token(token: str | None) -> int:
        headers = {"Content-Type": PB, **({"Authorization": f"Bearer {token}"} if token else {})}
        return requests.post(f"http://127.0.0.1:{receiver.port}/v1/metrics", data=body, headers=headers,
                             timeout=10).status_code

    assert with_token("first") == 200 and with_token(None) == 401
    tokens.write_text("# rotation: both for now\nfirst\nsecond\n")
    assert with_token("second") == 200 and with_token("first") == 200
    tokens.write_text("second\n")
    assert with_token("first") == 401 and with_token("second") == 200
    assert by_label(metrics.requests)[("http", "unauthenticated")] == 2


def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(
        http_receiver, make_ingest, otel_request, metrics, pki):
    ca, server, _ = pki
    receiver = http_receiver(make_ingest(), tls=tls_config(server, reload_interval=0))
    first = served_serial(receiver.port, ca.cert)
    assert first == ca.serial_of(server.cert.read_bytes())
    kept = requests.Session()  # a connection opened before the rotation keeps its certificate
    assert kept.post(f"https://localhost:{receiver.port}/v1/metrics", data=otel_request(VLLM).SerializeToString(),
                     headers={"Content-Type": PB}, verify=str(ca.cert), timeout=10).status_code == 200
    # A half-done rotation (a new certificate with the old key) is kept out and counted; then the new one serves.
    rotate_through_a_half_done_rotation(ca, server, lambda: served_serial(receiver.port, ca.cert),
                                        lambda: by_label(metrics.tls_reload_errors)["receiver.http"], poll)
    assert post(receiver.port, otel_request(DCGM1).SerializeToString(), ca.cert).status_code == 200
    assert kept.post(f"https://localhost:{receiver.port}/v1/metrics", data=otel_request(VLLM).SerializeToString(),
                     headers={"Content-Type": PB}, verify=str(ca.cert), timeout=10).status_code == 200
    kept.close()


def test_an_ipv6_endpoint_over_tls(make_ingest, otel_request, metrics, pki):
    ca, server, _ = pki
    ingest = make_ingest()
    receiver = HttpReceiver(HttpReceiverConfig(endpoint="[::1]:0", tls=tls_config(server)), ingest, metrics, 1 << 20)
    receiver.start()
    try:
        response = post(receiver.port, otel_request(DCGM1).SerializeToString(), ca.cert, host="[::1]")
        assert response.status_code == 200 and drain_points(ingest) == 36
        with pytest.raises(OSError):  # IPv6 only: nothing on 127.0.0.1
            socket.create_connection(("127.0.0.1", receiver.port), timeout=5).close()
    finally:
        receiver.shutdown()


def test_a_client_that_never_says_hello_is_closed_at_the_deadline_while_others_are_served(
        http_receiver, make_ingest, otel_request, metrics, pki):
    ca, server, _ = pki
    receiver = http_receiver(make_ingest(), tls=tls_config(server), idle_timeout_seconds=0.5)
    silent = socket.create_connection(("127.0.0.1", receiver.port), timeout=10)  # TCP only, no ClientHello
    assert post(receiver.port, otel_request(VLLM).SerializeToString(), ca.cert).status_code == 200
    assert silent.recv(1) == b""  # closed by the server, at the header deadline
    eventually(lambda: by_label(metrics.receiver_connections_refused)[("http", "idle_timeout")] >= 1)
    silent.close()


def test_unusable_certificate_files_stop_the_start_with_their_setting(make_ingest, metrics, pki, tmp_path):
    ca, server, _ = pki
    for tls, says in ((ServerTLSConfig(cert_file=str(tmp_path / "missing.crt"), key_file=str(server.key)), "missing.crt"),
                      (ServerTLSConfig(cert_file=str(server.cert), key_file=str(ca.cert)), "key_file")):
        receiver = HttpReceiver(HttpReceiverConfig(endpoint="127.0.0.1:0", tls=tls), make_ingest(), metrics, 1 << 20)
        with pytest.raises(ConfigError, match=says):
            receiver.start()


def test_tokens_in_plaintext_beyond_the_loopback_are_said_at_start(make_ingest, metrics, tmp_path, caplog):
    token = tmp_path / "token"
    token.write_text("t\n")
    for endpoint, warned in (("127.0.0.1:0", False), ("0.0.0.0:0", True)):
        caplog.clear()
        receiver = HttpReceiver(HttpReceiverConfig(endpoint=endpoint, auth=ServerAuthConfig(bearer_token_file=str(token))),
                                make_ingest(), metrics, 1 << 20)
        receiver.start()
        try:
            assert ("bearer tokens accepted in plaintext" in caplog.text) is warned
        finally:
            receiver.shutdown()
