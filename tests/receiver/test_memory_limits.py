"""The receivers' memory limiter against real clients: requests refused "retry later" before they
are decoded when the process is at its soft limit or the bytes in flight would pass the budget;
every refusal counted once by outcome and once by reason; a request bigger than the whole budget
still taken when nothing else is in flight; and nothing the senders retry is lost."""

from __future__ import annotations

import gzip
import socket
import threading

import grpc
import pytest
import requests
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from support import eventually

from otelgpu.config import parse_config
from otelgpu.core.settings import MemoryLimiterConfig
from otelgpu.errors import RetryableError
from otelgpu.memory import BYTES_IN_FLIGHT, MEMORY_LIMIT, MemoryLimiter, cost, limiter_of, resident_bytes
from otelgpu.receiver.grpc_server import SERVICE
from otelgpu.telemetry import by_label, total

from .helpers import DCGM1, KSM, drain_points
from .test_http_limits import Gate

MiB = 1 << 20


def export_raw(port: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 * MiB)])
    return channel, channel.unary_unary(f"/{SERVICE}/Export", request_serializer=None, response_deserializer=None)


def refusals(metrics, transport: str) -> dict[str, float]:
    return {reason: n for (t, reason), n in by_label(metrics.receiver_connections_refused).items() if t == transport}


def test_the_budget_admits_until_full_and_one_request_larger_than_it_when_alone():
    memory = MemoryLimiter(None, None, max_inflight_bytes=100)
    a = memory.admit(60)
    with pytest.raises(RetryableError) as caught:
        memory.admit(50)
    assert caught.value.reason == BYTES_IN_FLIGHT and memory.inflight == 60
    b = memory.admit(40)
    a.release()
    a.release()  # once only
    assert memory.inflight == 40
    b.release()
    huge = memory.admit(500)  # nothing else in flight: taken alone, and it may grow alone
    huge.grow(100)
    with pytest.raises(RetryableError):
        memory.admit(0)
    memory.hold(1)  # a decoded batch queued meanwhile
    with pytest.raises(RetryableError):
        huge.grow(1)  # no longer alone
    assert memory.inflight == 601
    huge.release()
    memory.unhold(1)
    assert memory.inflight == 0


def test_the_soft_limit_is_the_resident_size_and_above_it_requests_go_one_at_a_time():
    rss = resident_bytes()
    over = MemoryLimiter(soft_bytes=rss // 2, hard_bytes=rss * 4, max_inflight_bytes=1 << 40)
    alone = over.admit(1)  # nothing in flight: refusing could not bring the state down
    for attempt in (over.admit, lambda n: over.check()):
        with pytest.raises(RetryableError) as caught:
            attempt(1)
        assert caught.value.reason == MEMORY_LIMIT
    alone.release()
    over.admit(1).release()
    under = MemoryLimiter(soft_bytes=rss * 2, hard_bytes=rss * 4, max_inflight_bytes=1 << 40)
    tickets = [under.admit(1) for _ in range(3)]  # below it, side by side
    assert under.inflight == 3
    for t in tickets:
        t.release()


def test_limits_default_to_shares_of_the_container_and_can_be_set(monkeypatch):
    from otelgpu import memory

    monkeypatch.setattr(memory, "container_memory", lambda: 1000 * MiB)
    default = limiter_of(MemoryLimiterConfig())
    assert (default.hard_bytes, default.soft_bytes, default.max_inflight_bytes) == (800 * MiB, 600 * MiB, 200 * MiB)
    set_ = limiter_of(MemoryLimiterConfig(limit_mib=512, spike_limit_mib=128, max_inflight_mib=64))
    assert (set_.hard_bytes, set_.soft_bytes, set_.max_inflight_bytes) == (512 * MiB, 384 * MiB, 64 * MiB)
    assert limiter_of(MemoryLimiterConfig(enabled=False)).soft_bytes is None
    with pytest.raises(Exception, match="spike_limit_mib must be below limit_mib"):
        parse_config({"receiver": {"memory_limiter": {"limit_mib": 256, "spike_limit_mib": 256}}})


def test_grpc_at_the_soft_limit_refuses_before_decoding_then_recovers(grpc_receiver, make_ingest, otel_request,
                                                                      metrics):
    memory = MemoryLimiter(soft_bytes=1, hard_bytes=1 << 50, max_inflight_bytes=1 << 40, retry_after_s=3)
    ingest = make_ingest(memory=memory)
    channel, export = export_raw(grpc_receiver(ingest, memory=memory).port)
    body = otel_request(DCGM1).SerializeToString()
    export(body, timeout=10)  # alone: taken; its decoded batch waits in the queue, in flight
    assert ingest.depth == 1 and memory.inflight > 0
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as caught:
            export(body, timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        info = error_details_pb2.RetryInfo()
        assert rpc_status.from_call(caught.value).details[0].Unpack(info)
        assert info.retry_delay.ToTimedelta().total_seconds() == 3
    assert total(metrics.points_received) == 36 and ingest.depth == 1  # nothing more decoded
    assert refusals(metrics, "grpc") == {MEMORY_LIMIT: 3}
    assert by_label(metrics.requests) == {("grpc", "ok"): 1, ("grpc", "unavailable"): 3}
    assert drain_points(ingest) == 36 and memory.inflight == 0  # the pipeline took the batch
    export(body, timeout=10)  # alone again: taken, one at a time
    memory.soft_bytes = 1 << 50  # memory freed: taken side by side again
    export(body, timeout=10)
    assert drain_points(ingest) == 72 and memory.inflight == 0
    channel.close()


def test_grpc_requests_beyond_the_budget_are_refused_and_all_are_taken_on_retry(grpc_receiver, make_ingest,
                                                                               otel_request, metrics):
    body = otel_request(KSM).SerializeToString()
    memory = MemoryLimiter(None, None, max_inflight_bytes=cost(len(body)) * 2)  # two at a time
    gate = Gate(make_ingest(memory=memory))
    channel, export = export_raw(grpc_receiver(gate, memory=memory).port)
    gate.opened.set()
    export(body, timeout=10)  # alone: whatever its size; the receiver learns what a request takes
    first = drain_points(gate.inner)  # taken by the pipeline: its bytes given back
    gate.opened.clear()
    gate.entered = 0
    calls = [export.future(body, timeout=30) for _ in range(2)]
    eventually(lambda: gate.entered == 2)  # both decoding (held by the gate): the budget is spent
    with pytest.raises(grpc.RpcError) as caught:
        export(body, timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "in flight" in caught.value.details()
    gate.opened.set()
    for call in calls:
        call.result()
    export(body, timeout=10)  # the refused one, resent
    assert refusals(metrics, "grpc") == {BYTES_IN_FLIGHT: 1}
    assert by_label(metrics.requests) == {("grpc", "ok"): 4, ("grpc", "unavailable"): 1}
    points = first + drain_points(gate.inner)
    assert first > 0 and points == 4 * first == total(metrics.points_received)
    assert memory.inflight == 0  # queued batches gave their bytes back when taken out
    channel.close()


def test_a_queued_batch_keeps_its_bytes_until_the_pipeline_takes_it(grpc_receiver, make_ingest, otel_request):
    memory = MemoryLimiter(None, None, max_inflight_bytes=1 << 40)
    ingest = make_ingest(memory=memory)
    channel, export = export_raw(grpc_receiver(ingest, memory=memory).port)
    export(otel_request(DCGM1).SerializeToString(), timeout=10)
    held = memory.inflight
    assert held > 0
    batch = ingest.get(timeout=0)
    assert batch is not None and batch.nbytes == held and memory.inflight == 0
    channel.close()


def post_raw(port: int, head: bytes, body: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_http_refuses_from_the_content_length_before_the_body_is_read(http_receiver, make_ingest, otel_request,
                                                                      metrics):
    body = otel_request(KSM).SerializeToString()
    memory = MemoryLimiter(None, None, max_inflight_bytes=cost(len(body)) + 10)
    gate = Gate(make_ingest(memory=memory))
    receiver = http_receiver(gate, memory=memory)
    url = f"http://127.0.0.1:{receiver.port}/v1/metrics"
    headers = {"Content-Type": "application/x-protobuf"}
    first = threading.Thread(target=lambda: requests.post(url, data=body, headers=headers, timeout=30))
    first.start()
    eventually(lambda: gate.entered == 1)
    # the headers alone: refused with no byte of the body sent
    head = (f"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    answer = post_raw(receiver.port, head, b"")
    assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer
    # a chunked body, refused as its chunks pass the budget, answered 503 once it ends
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 4096]), body[i:i + 4096]) for i in range(0, len(body), 4096))
    head = (b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    answer = post_raw(receiver.port, head, chunks + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After" in answer
    gate.opened.set()
    first.join()
    taken = drain_points(gate.inner)  # the pipeline takes the first batch: its bytes are given back
    # with room again, the same chunked request is taken whole
    answer = post_raw(receiver.port, head, chunks + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert refusals(metrics, "http") == {BYTES_IN_FLIGHT: 2}
    assert by_label(metrics.requests) == {("http", "ok"): 2, ("http", "unavailable"): 2}
    assert taken + drain_points(gate.inner) == total(metrics.points_received) > 0
    assert memory.inflight == 0


def test_http_reserves_a_gzip_bodys_declared_size_before_inflating_it(http_receiver, make_ingest, otel_request,
                                                                      metrics):
    raw = otel_request(KSM).SerializeToString()
    body = gzip.compress(raw)
    memory = MemoryLimiter(None, None, max_inflight_bytes=cost(len(body), len(raw)) - 1)
    receiver = http_receiver(make_ingest(memory=memory), memory=memory)
    holder = memory.admit(1)  # something else in flight: the body alone would fit, inflated it does not
    url = f"http://127.0.0.1:{receiver.port}/v1/metrics"
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
    response = requests.post(url, data=body, headers=headers, timeout=10)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert total(metrics.points_received) == 0
    holder.release()
    assert requests.post(url, data=body, headers=headers, timeout=10).status_code == 200
    assert refusals(metrics, "http") == {BYTES_IN_FLIGHT: 1}
    assert by_label(metrics.requests) == {("http", "ok"): 1, ("http", "unavailable"): 1}


def test_every_unavailable_answer_is_counted_once_under_a_flood(grpc_receiver, make_ingest, otel_request, metrics):
    """Far more concurrent Exports than the receiver admits, a full queue and a spent budget at
    once: each UNAVAILABLE a sender got is counted, once by outcome and once by reason."""
    body = otel_request(KSM).SerializeToString()
    memory = MemoryLimiter(None, None, max_inflight_bytes=cost(len(body)) * 6)
    gate = Gate(make_ingest(queue_size=4, memory=memory))
    channel, export = export_raw(grpc_receiver(gate, memory=memory, max_concurrent_requests=10,
                                               max_queued_requests=2).port)
    calls = [export.future(body, timeout=60) for _ in range(300)]
    eventually(lambda: sum(c.done() for c in calls) >= 300 - 12)  # all but those admitted are answered
    gate.opened.set()
    codes = [c.exception().code() if c.exception() else grpc.StatusCode.OK for c in calls]
    unavailable = codes.count(grpc.StatusCode.UNAVAILABLE)
    assert unavailable >= 300 - 12 and set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
    assert by_label(metrics.requests)[("grpc", "unavailable")] == unavailable
    assert sum(refusals(metrics, "grpc").values()) == unavailable
    assert by_label(metrics.requests)[("grpc", "ok")] == codes.count(grpc.StatusCode.OK)
    channel.close()
