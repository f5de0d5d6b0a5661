"""The OTLP/HTTP receiver against a real HTTP client (requests), with the shared fixtures as bodies."""

from __future__ import annotations

import gzip
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

from support import poll

from otelgpu.receiver.config import HttpReceiverConfig
from otelgpu.receiver.http_server import HttpReceiver
from otelgpu.telemetry import by_label, total

from .helpers import DCGM1, KSM, VLLM, Exploding, drain_points, refusals_counted, spoil_dcgm

PB, JSON = "application/x-protobuf", "application/json"


def post(receiver: HttpReceiver, body: bytes, content_type: str = PB, gzipped: bool = False,
         path: str = "/v1/metrics") -> requests.Response:
    headers = {"Content-Type": content_type}
    if gzipped:
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    return requests.post(f"http://127.0.0.1:{receiver.port}{path}", data=body, headers=headers, timeout=5)


def status_of(response: requests.Response) -> status_pb2.Status:
    if response.headers["Content-Type"] == JSON:
        return json_format.Parse(response.content, status_pb2.Status())
    return status_pb2.Status.FromString(response.content)


@pytest.mark.parametrize(("name", "consumed"), [(DCGM1, 36), (KSM, 88), (VLLM, 2)])
@pytest.mark.parametrize("gzipped", [False, True])
def test_protobuf_fixture_is_accepted(http_receiver, make_ingest, otel_request, metrics, name, consumed, gzipped):
    ingest = make_ingest()
    response = post(http_receiver(ingest), otel_request(name).SerializeToString(), gzipped=gzipped)
    assert response.status_code == 200
    assert response.headers["Content-Type"] == PB
    assert ExportMetricsServiceResponse.FromString(response.content) == ExportMetricsServiceResponse()
    assert drain_points(ingest) == consumed
    assert by_label(metrics.requests)[("http", "ok")] == 1


@pytest.mark.parametrize("gzipped", [False, True])
def test_json_fixture_is_accepted(http_receiver, make_ingest, otel_json, gzipped):
    ingest = make_ingest()
    response = post(http_receiver(ingest), otel_json(DCGM1).encode(), JSON + "; charset=utf-8", gzipped)
    assert response.status_code == 200
    assert response.headers["Content-Type"] == JSON
    assert response.json() == {}
    assert drain_points(ingest) == 36


def test_rejected_points_give_partial_success_in_json(http_receiver, make_ingest, otel_request, metrics):
    ingest = make_ingest()
    request = otel_request(DCGM1)
    spoil_dcgm(request)
    response = post(http_receiver(ingest), json_format.MessageToJson(request).encode(), JSON)
    assert response.status_code == 200
    partial = response.json()["partialSuccess"]
    assert int(partial["rejectedDataPoints"]) == 2
    assert "missing label UUID" in partial["errorMessage"] and "value outside [0, 1]" in partial["errorMessage"]
    assert drain_points(ingest) == 34
    assert by_label(metrics.requests)[("http", "partial")] == 1
    assert by_label(metrics.receiver_refused_points) == {("otlp", "http"): 2}
    assert by_label(metrics.receiver_accepted_points)[("otlp", "http")] == 34 + total(metrics.points_ignored)


def test_full_queue_is_503_with_retry_after(http_receiver, make_ingest, otel_request, metrics):
    receiver = http_receiver(make_ingest(queue_size=1, retry_after_s=2.5))
    body = otel_request(DCGM1).SerializeToString()
    assert post(receiver, body).status_code == 200  # fills the queue; nothing drains it
    response = post(receiver, body)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "3"  # whole seconds, rounded up
    assert status_of(response).code == 14  # UNAVAILABLE
    assert by_label(metrics.requests)[("http", "unavailable")] == 1


def test_a_refused_request_is_let_go_once_answered(http_receiver, make_ingest, otel_request):
    """As over gRPC: no refusal waits for the cyclic collector with the request it refused."""
    receiver = http_receiver(make_ingest(queue_size=1))
    body = otel_request(DCGM1).SerializeToString()
    assert post(receiver, body).status_code == 200  # fills the queue; nothing drains it
    with refusals_counted() as alive:
        for _ in range(5):
            assert post(receiver, body).status_code == 503
        assert poll(lambda: alive() == 0), f"{alive()} refusals wait for the cyclic collector"


@pytest.mark.parametrize(("body", "content_type", "gzipped"), [
    (b"not a protobuf", PB, False),
    (b"{not json", JSON, False),
    (b'{"resourceMetrics": 3}', JSON, False),
    (b"\xff\xfe", JSON, True),
    (b"", "text/plain", False),
])
def test_undecodable_body_is_400(http_receiver, make_ingest, metrics, body, content_type, gzipped):
    response = post(http_receiver(make_ingest()), body, content_type, gzipped)
    assert response.status_code == 400
    assert status_of(response).code == 3  # INVALID_ARGUMENT
    assert by_label(metrics.requests)[("http", "invalid")] == 1


def test_bad_gzip_is_400(http_receiver, make_ingest, otel_request):
    receiver = http_receiver(make_ingest())
    zipped = gzip.compress(otel_request(DCGM1).SerializeToString())
    for body in (b"plainly not gzip", zipped[: len(zipped) // 2], zipped[: len(zipped) // 3]):
        headers = {"Content-Type": PB, "Content-Encoding": "gzip"}
        response = requests.post(f"http://127.0.0.1:{receiver.port}/v1/metrics", data=body, headers=headers, timeout=5)
        # A gzip body is first judged by the size its last four bytes declare: a cut one may declare
        # more than the limit (413). Either answer tells the sender never to retry.
        declared = int.from_bytes(body[-4:], "little") if body[:2] == b"\x1f\x8b" else 0
        assert response.status_code == (413 if declared > receiver.max_body_bytes else 400)


def test_oversize_body_is_413_plain_and_inflated(http_receiver, make_ingest, otel_request, metrics):
    body = otel_request(DCGM1).SerializeToString()
    receiver = http_receiver(make_ingest(), max_body_bytes=len(body) - 1)
    assert post(receiver, body).status_code == 413
    assert post(receiver, b"\0" * (50 * 1024 * 1024), gzipped=True).status_code == 413  # even compressed
    # compresses to well under the limit but inflates past it: refused on its declared size alone
    roomy = http_receiver(make_ingest(), max_body_bytes=2**20)
    bomb = post(roomy, b"\0" * (50 * 1024 * 1024), gzipped=True)
    assert bomb.status_code == 413 and "declared size" in bomb.text
    liar = gzip.compress(b"\0" * (50 * 1024 * 1024))[:-4] + (10).to_bytes(4, "little")  # declares 10 bytes
    headers = {"Content-Type": PB, "Content-Encoding": "gzip"}
    cut = requests.post(f"http://127.0.0.1:{roomy.port}/v1/metrics", data=liar, headers=headers, timeout=30)
    assert cut.status_code == 413 and "declared size" not in cut.text  # inflated only up to the limit
    assert by_label(metrics.requests)[("http", "invalid")] == 4
    exact = http_receiver(make_ingest(), max_body_bytes=len(body))
    assert post(exact, body, gzipped=True).status_code == 200


def test_other_paths_and_methods(http_receiver, make_ingest):
    receiver = http_receiver(make_ingest())
    assert post(receiver, b"", path="/v1/traces").status_code == 404
    assert requests.get(f"http://127.0.0.1:{receiver.port}/", timeout=5).status_code == 404
    response = requests.get(f"http://127.0.0.1:{receiver.port}/v1/metrics", timeout=5)
    assert response.status_code == 405 and response.headers["Allow"] == "POST"
    assert requests.put(f"http://127.0.0.1:{receiver.port}/v1/metrics", data=b"x", timeout=5).status_code == 405


def test_consumer_bug_is_500_and_the_server_keeps_serving(http_receiver, otel_request, metrics):
    receiver = http_receiver(Exploding())
    body = otel_request(VLLM).SerializeToString()
    assert [post(receiver, body).status_code for _ in range(2)] == [500, 500]
    assert by_label(metrics.requests)[("http", "error")] == 2


def test_twelve_concurrent_clients_all_succeed(http_receiver, make_ingest, otel_json, metrics):
    ingest = make_ingest()
    receiver = http_receiver(ingest)
    body = otel_json(KSM).encode()
    with ThreadPoolExecutor(max_workers=12) as pool:
        codes = list(pool.map(lambda _: post(receiver, body, JSON, gzipped=True).status_code, range(12)))
    assert codes == [200] * 12
    assert drain_points(ingest) == 12 * 88
    assert by_label(metrics.requests)[("http", "ok")] == 12


def test_lifecycle_and_shutdown_twice(make_ingest, metrics, otel_request):
    config = HttpReceiverConfig(endpoint="127.0.0.1:0")
    receiver = HttpReceiver(config, make_ingest(), metrics, max_body_bytes=1024 * 1024)
    receiver.start()
    assert post(receiver, otel_request(VLLM).SerializeToString()).status_code == 200
    receiver.shutdown()
    receiver.shutdown()
    with pytest.raises(requests.ConnectionError):
        post(receiver, b"")
    never_started = HttpReceiver(config, make_ingest(), metrics, max_body_bytes=1024)
    never_started.shutdown()
    never_started.shutdown()


def test_json_error_body_is_json(http_receiver, make_ingest):
    response = post(http_receiver(make_ingest()), b"[]", JSON)
    assert response.status_code == 400
    assert set(json.loads(response.content)) >= {"code", "message"}


def test_client_hanging_up_mid_body_does_not_hurt_the_server(http_receiver, make_ingest, otel_request):
    receiver = http_receiver(make_ingest())
    with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as conn:
        conn.sendall(b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 1000\r\n\r\n0123456789")
    assert post(receiver, otel_request(VLLM).SerializeToString()).status_code == 200
