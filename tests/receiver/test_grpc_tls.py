"""The OTLP/gRPC receiver with real TLS, mutual TLS and bearer tokens (certificates made here, in
the test): raw gRPC clients and the SDK's OTLP exporter, with and without client certificates,
with the wrong CA, an expired certificate, no token and a wrong one; certificates and tokens
rotated while it runs."""

from __future__ import annotations


import grpc
import pytest
from certs import Authority, rotate_through_a_half_done_rotation, served_serial
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.sdk.metrics.export import MetricExportResult
from support import poll

from otelgpu.core.settings import ServerAuthConfig, ServerTLSConfig
from otelgpu.errors import ConfigError
from otelgpu.telemetry import by_label

from .helpers import DCGM1, drain_points
from .test_grpc_server import sdk_data


@pytest.fixture
def pki(tmp_path):
    ca = Authority(tmp_path / "pki")
    return ca, ca.issue("otelgpu", file="server"), ca.issue("collector", server=False, file="client")


def export(port: int, request, credentials: grpc.ChannelCredentials | None = None,
           metadata: tuple = (), override: str | None = None):
    options = [("grpc.ssl_target_name_override", override)] if override else []
    channel = (grpc.secure_channel(f"localhost:{port}", credentials, options=options) if credentials
               else grpc.insecure_channel(f"localhost:{port}"))
    with channel:
        return metrics_service_pb2_grpc.MetricsServiceStub(channel).Export(request, metadata=metadata, timeout=5)


def creds(ca_cert, client=None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(ca_cert.read_bytes(), client.key.read_bytes() if client else None,
                                        client.cert.read_bytes() if client else None)


def code_of(call) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as failed:
        call()
    return failed.value.code()


def test_tls_serves_clients_that_trust_its_ca_only(grpc_receiver, make_ingest, otel_request, metrics, pki) -> None:
    ca, server, _ = pki
    ingest = make_ingest()
    receiver = grpc_receiver(ingest, tls=ServerTLSConfig(cert_file=str(server.cert), key_file=str(server.key)))
    request = otel_request(DCGM1)
    assert export(receiver.port, request, creds(ca.cert)) == ExportMetricsServiceResponse()
    assert drain_points(ingest) == 36
    stranger = Authority(ca.directory / "other", "someone else's CA")
    assert code_of(lambda: export(receiver.port, request, creds(stranger.cert))) is grpc.StatusCode.UNAVAILABLE
    assert code_of(lambda: export(receiver.port, request)) is grpc.StatusCode.UNAVAILABLE  # plaintext
    assert drain_points(ingest) == 0 and by_label(metrics.requests)[("grpc", "ok")] == 1


def test_mutual_tls_wants_a_client_certificate_of_its_ca(grpc_receiver, make_ingest, otel_request, metrics, pki) -> None:
    ca, server, client = pki
    ingest = make_ingest()
    receiver = grpc_receiver(ingest, tls=ServerTLSConfig(cert_file=str(server.cert), key_file=str(server.key),
                                                         client_ca_file=str(ca.cert)))
    request = otel_request(DCGM1)
    assert export(receiver.port, request, creds(ca.cert, client)) == ExportMetricsServiceResponse()
    stranger = Authority(ca.directory / "other", "someone else's CA")
    expired = ca.issue("old collector", server=False, expired=True)
    for refused in (creds(ca.cert), creds(ca.cert, stranger.issue("intruder", server=False)), creds(ca.cert, expired)):
        assert code_of(lambda: export(receiver.port, request, refused)) is grpc.StatusCode.UNAVAILABLE
    assert drain_points(ingest) == 36 and by_label(metrics.requests)[("grpc", "ok")] == 1


def test_an_expired_server_certificate_is_refused_by_clients(grpc_receiver, make_ingest, otel_request, pki) -> None:
    ca, _, _ = pki
    old = ca.issue("otelgpu", expired=True, file="expired-server")
    receiver = grpc_receiver(make_ingest(), tls=ServerTLSConfig(cert_file=str(old.cert), key_file=str(old.key)))
    assert code_of(lambda: export(receiver.port, otel_request(DCGM1), creds(ca.cert))) is grpc.StatusCode.UNAVAILABLE


def test_the_sdk_exporter_over_mutual_tls_with_a_bearer_token(grpc_receiver, make_ingest, metrics, pki, tmp_path) -> None:
    ca, server, client = pki
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-token\n")
    ingest = make_ingest()
    receiver = grpc_receiver(ingest, tls=ServerTLSConfig(cert_file=str(server.cert), key_file=str(server.key),
                                                         client_ca_file=str(ca.cert)),
                             auth=ServerAuthConfig(bearer_token_file=str(tokens)))

    def sdk(token: str | None) -> MetricExportResult:
        exporter = OTLPMetricExporter(endpoint=f"https://localhost:{receiver.port}", credentials=creds(ca.cert, client),
                                      headers={"authorization": f"Bearer {token}"} if token else None, timeout=2)
        try:
            return exporter.export(sdk_data(0.5))
        finally:
            exporter.shutdown()

    assert sdk("s3cret-token") == MetricExportResult.SUCCESS
    assert sdk(None) == MetricExportResult.FAILURE and sdk("guess") == MetricExportResult.FAILURE
    assert by_label(metrics.requests)[("grpc", "ok")] == 1 and by_label(metrics.requests)[("grpc", "unauthenticated")] == 2
    assert drain_points(ingest) == 1


def test_bearer_tokens_are_read_again_when_the_file_changes(grpc_receiver, make_ingest, otel_request, metrics,
                                                            tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("first\n")
    receiver = grpc_receiver(make_ingest(), auth=ServerAuthConfig(bearer_token_file=str(tokens)))
    request = otel_request(DCGM1)

    def with_token(token: str) -> grpc.StatusCode:
        try:
            export(receiver.port, request, metadata=(("authorization", f"Bearer {token}"),))
            return grpc.StatusCode.OK
        except grpc.RpcError as failed:
            return failed.code()

    assert with_token("first") is grpc.StatusCode.OK
    assert code_of(lambda: export(receiver.port, request)) is grpc.StatusCode.UNAUTHENTICATED
    tokens.write_text("# rotation: both for now\nfirst\nsecond\n")
    assert with_token("second") is grpc.StatusCode.OK and with_token("first") is grpc.StatusCode.OK
    tokens.write_text("second\n")
    assert with_token("first") is grpc.StatusCode.UNAUTHENTICATED and with_token("second") is grpc.StatusCode.OK
    assert by_label(metrics.requests)[("grpc", "unauthenticated")] == 2



def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(
        grpc_receiver, make_ingest, otel_request, metrics, pki) -> None:
    ca, server, _ = pki
    receiver = grpc_receiver(make_ingest(), tls=ServerTLSConfig(cert_file=str(server.cert), key_file=str(server.key),
                                                                reload_interval=0))
    first = served_serial(receiver.port, ca.cert, alpn=("h2",))
    assert first == ca.serial_of(server.cert.read_bytes())
    # A half-done rotation (a new certificate with the old key) is kept out and counted; then the new one serves.
    rotate_through_a_half_done_rotation(ca, server, lambda: served_serial(receiver.port, ca.cert, alpn=("h2",)),
                                        lambda: by_label(metrics.tls_reload_errors)["receiver.grpc"], poll)
    assert export(receiver.port, otel_request(DCGM1), creds(ca.cert)) == ExportMetricsServiceResponse()


def test_unusable_certificate_files_stop_the_start_with_their_setting(make_ingest, metrics, pki, tmp_path) -> None:
    from otelgpu.receiver.config import GrpcReceiverConfig
    from otelgpu.receiver.grpc_server import GrpcReceiver

    ca, server, _ = pki
    for tls, says in ((ServerTLSConfig(cert_file=str(tmp_path / "missing.crt"), key_file=str(server.key)), "missing.crt"),
                      (ServerTLSConfig(cert_file=str(server.cert), key_file=str(ca.cert)), "key_file")):
        receiver = GrpcReceiver(GrpcReceiverConfig(endpoint="127.0.0.1:0", tls=tls), make_ingest(), metrics)
        with pytest.raises(ConfigError, match=says):
            receiver.start()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    receiver = GrpcReceiver(GrpcReceiverConfig(endpoint="127.0.0.1:0", auth=ServerAuthConfig(bearer_token_file=str(empty))),
                            make_ingest(), metrics)
    with pytest.raises(ConfigError, match="holds no token"):
        receiver.start()


def test_token_files_comments_and_revocation(tmp_path) -> None:
    from otelgpu.tls import BearerTokens

    path = tmp_path / "tokens"
    path.write_text("  # the old one below was revoked on 2026-05-01\nnew-token\n")
    tokens = BearerTokens(ServerAuthConfig(bearer_token_file=str(path)), "receiver.grpc")
    assert tokens.check("Bearer new-token")
    assert not tokens.check("Bearer # the old one below was revoked on 2026-05-01")  # an indented comment
    path.write_text("")  # emptied on purpose: every token revoked
    assert not tokens.check("Bearer new-token")
    path.write_text("newer\n")
    assert tokens.check("Bearer newer")
    path.unlink()  # gone for a moment (a Secret being replaced): what was read stays
    assert tokens.check("Bearer newer")
