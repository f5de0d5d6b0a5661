"""RemoteWriteSender against real local HTTP servers scripted to answer as a remote-write
receiver (and as AWS STS) would: what goes on the wire, how answers are classified, SigV4 against
the published AWS test suite, and IRSA credentials fetched through botocore's own chain."""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
import threading
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import cramjam
import pytest
from botocore.credentials import ReadOnlyCredentials
from sigv4ref import reference_sigv4
from support import eventually

from otelgpu.errors import ConfigError
from otelgpu.exporter.config import DeliveryConfig, RemoteWriteConfig, SigV4Config
from otelgpu.exporter.delivery import Delivery
from otelgpu.exporter.remote_write import MAX_LABELS, RemoteWriteSender, WriteRequest, retry_after
from otelgpu.exporter.sending import Progress
from otelgpu.exporter.sigv4 import sign
from otelgpu.exporter.store import Point, cost_metrics
from otelgpu.telemetry import SelfMetrics, by_label

SPECS = cost_metrics()
MS = 1_000_000
T = 1_700_000_000_000 * MS  # a whole second, in ns
MIN = 60_000 * MS
TEAM_A = (("k8s.namespace.name", "ml"), ("k8s.pod.name", "train-0"), ("team", "a"))


# -- a scripted HTTP server ----------------------------------------------------------------------

@dataclass
class Reply:
    status: int = 204
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    hang: bool = False  # answer nothing until the test ends
    drop: bool = False  # close the connection without an answer


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


class Scripted:
    """http.server on 127.0.0.1:0 in a thread: answers each POST with the next scripted Reply (204
    once they run out) and records every request."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = deque(replies)
        self.received: list[Received] = []
        self.release = threading.Event()  # ends the hanging answers
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/api/v1/write"

    def stop(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    def write_requests(self) -> list[Any]:
        return [WriteRequest.FromString(bytes(cramjam.snappy.decompress_raw(r.body))) for r in self.received]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with scripted._lock:
                    scripted.received.append(Received(self.path, dict(self.headers.items()), body))
                    reply = scripted.replies.popleft() if scripted.replies else Reply()
                if reply.hang:
                    scripted.release.wait(10)
                    return
                if reply.drop:
                    self.close_connection = True
                    return
                self.send_response(reply.status)
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def receiver() -> Iterator[Scripted]:
    server = Scripted()
    yield server
    server.stop()


def _config(url: str, **kw: Any) -> RemoteWriteConfig:
    return RemoteWriteConfig(url=url, **kw)


def _labels(ts: Any) -> list[tuple[str, str]]:
    return [(label.name, label.value) for label in ts.labels]


def _bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


# -- SigV4 ---------------------------------------------------------------------------------------

SUITE_CREDENTIALS = ReadOnlyCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", None)
SUITE_TIME = datetime(2015, 8, 30, 12, 36, tzinfo=timezone.utc)
SUITE_SCOPE = "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request"
STS_TOKEN = ("AQoDYXdzEPT//////////wEXAMPLEtc764bNrC9SAPBSM22wDOk4x4HIZ8j4FZTwdQWLWsKWHGBuFqwAeMicRXmxfpSPfIeoIYRqT"
             "flfKD8YUuwthAx7mSEI/qkPpKPi/kMcGdQrmGdeehM4IC1NtBmUpp2wUE8phUZampKsburEDy0KPkyQDYwT7WZ0wq5VSXDvp75YU9"
             "HFvlRd8Tx6q6fE8YQcHNVXAkiY9q6d+xo0rKwT38xVqr7ZD0u0iPPkUL64lIZbqBAz+scqKmlzm8FDrypNC9Yjc8fPOLn9FX9KSYvKT"
             "r4rvx3iSIlTJabIQwj2ICCR/oLxBA==")


# From the AWS Signature Version 4 test suite (aws-sig-v4-test-suite, 2015-08-30): request, and the
# published Authorization header.
@pytest.mark.parametrize("method, headers, body, token, signed, signature", [
    pytest.param("GET", {}, b"", None, "host;x-amz-date",
                 "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31", id="get-vanilla"),
    pytest.param("POST", {}, b"", None, "host;x-amz-date",
                 "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b", id="post-vanilla"),
    pytest.param("POST", {"Content-Type": "application/x-www-form-urlencoded"}, b"Param1=value1", None,
                 "content-type;host;x-amz-date",
                 "ff11897932ad3f4e8b18135d722051e5ac45fc38421b1da7b9d196a0fe09473a", id="post-x-www-form-urlencoded"),
    pytest.param("POST", {}, b"", STS_TOKEN, "host;x-amz-date;x-amz-security-token",
                 "85d96828115b5dc0cfc3bd16ad9e210dd772bbebba041836c64533a82be05ead", id="post-sts-header-before"),
])
def test_sigv4_matches_the_aws_test_suite(method, headers, body, token, signed, signature, monkeypatch) -> None:
    import botocore.auth

    # The suite's vectors are signed at its own time: the signer's clock is set to it.
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: SUITE_TIME.replace(tzinfo=None))
    credentials = SUITE_CREDENTIALS._replace(token=token)
    out = sign(headers, "https://example.amazonaws.com/", body, credentials, "us-east-1", "service", method=method)
    assert out["X-Amz-Date"] == "20150830T123600Z"
    assert out["Authorization"] == f"{SUITE_SCOPE}, SignedHeaders={signed}, Signature={signature}"
    assert out.get("X-Amz-Security-Token") == token
    assert {k: out[k] for k in headers} == headers  # the caller's headers are kept as they were


def test_sigv4_of_a_remote_write_request_to_amp() -> None:
    url = "https://aps-workspaces.eu-west-1.amazonaws.com/workspaces/ws-1234abcd/api/v1/remote_write"
    body = bytes(cramjam.snappy.compress_raw(b"\x0a\x10not a real request"))
    headers = {"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
               "X-Prometheus-Remote-Write-Version": "0.1.0", "User-Agent": "otelgpu/test"}
    credentials = ReadOnlyCredentials("ASIAEXAMPLE", "secretEXAMPLE", "session/token+EXAMPLE==")
    before = datetime.now(timezone.utc).replace(microsecond=0)
    out = sign(headers, url, body, credentials, "eu-west-1", "aps")
    signed_at = datetime.strptime(out["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    assert before <= signed_at <= datetime.now(timezone.utc)  # signed now, by the clock
    assert out["X-Amz-Security-Token"] == "session/token+EXAMPLE=="
    assert ("SignedHeaders=content-encoding;content-type;host;x-amz-date;x-amz-security-token;"
            "x-prometheus-remote-write-version,") in out["Authorization"]  # User-Agent is never signed
    signed = {k: v for k, v in out.items() if k not in ("Authorization", "User-Agent")}
    assert out["Authorization"] == reference_sigv4(
        signed, "aps-workspaces.eu-west-1.amazonaws.com", "/workspaces/ws-1234abcd/api/v1/remote_write", body,
        "ASIAEXAMPLE", "secretEXAMPLE", out["X-Amz-Date"], "eu-west-1", "aps")


def _clean_aws_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials anywhere: AWS_* cleared, empty config files, no instance metadata."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, var in (("config", "AWS_CONFIG_FILE"), ("credentials", "AWS_SHARED_CREDENTIALS_FILE")):
        (tmp_path / name).write_text("")
        monkeypatch.setenv(var, str(tmp_path / name))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _sts_reply(key: str, secret: str, token: str, valid: timedelta = timedelta(hours=1)) -> Reply:
    expires = (datetime.now(timezone.utc) + valid).strftime("%Y-%m-%dT%H:%M:%SZ")
    xml = f"""<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <AssumeRoleWithWebIdentityResult>
    <SubjectFromWebIdentityToken>system:serviceaccount:otelgpu:otelgpu</SubjectFromWebIdentityToken>
    <Audience>sts.amazonaws.com</Audience>
    <AssumedRoleUser>
      <Arn>arn:aws:sts::123456789012:assumed-role/otelgpu-amp/botocore-session-1</Arn>
      <AssumedRoleId>AROAEXAMPLE:botocore-session-1</AssumedRoleId>
    </AssumedRoleUser>
    <Credentials>
      <SessionToken>{token}</SessionToken>
      <SecretAccessKey>{secret}</SecretAccessKey>
      <Expiration>{expires}</Expiration>
      <AccessKeyId>{key}</AccessKeyId>
    </Credentials>
    <Provider>arn:aws:iam::123456789012:oidc-provider/oidc.eks.eu-west-1.amazonaws.com/id/EXAMPLE</Provider>
  </AssumeRoleWithWebIdentityResult>
  <ResponseMetadata><RequestId>c6104cbe-af31-11e0-8154-cbc7ccf896c7</RequestId></ResponseMetadata>
</AssumeRoleWithWebIdentityResponse>"""
    return Reply(200, {"Content-Type": "text/xml"}, xml.encode())


def test_irsa_web_identity_credentials_sign_the_request(monkeypatch, tmp_path, receiver) -> None:
    # The first credentials expire within botocore's 15 minute advisory window, so the second
    # request, re-reading them, gets fresh ones from STS: rotation without a restart.
    sts = Scripted(_sts_reply("ASIAFIRSTEXAMPLE", "firstSecret", "firstToken", timedelta(minutes=10)),
                   _sts_reply("ASIASTSEXAMPLE", "stsSecretEXAMPLE", "stsSessionTokenEXAMPLE"))
    try:
        _clean_aws_environment(monkeypatch, tmp_path)
        (tmp_path / "token").write_text("eyJhbGciOiJSUzI1NiJ9.projected-service-account-token")
        monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/otelgpu-amp")
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))
        monkeypatch.setenv("AWS_REGION", "eu-west-1")
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts.url.removesuffix("/api/v1/write"))
        sender = RemoteWriteSender(_config(receiver.url, sigv4=SigV4Config(region="eu-west-1")), SPECS, "c1")
        assert sender.send([Point("allocated", TEAM_A, T, T + MIN, 1.0)]).ok
        assert sender.send([Point("allocated", TEAM_A, T, T + 2 * MIN, 2.0)]).ok
        sender.close()
    finally:
        sts.stop()

    assert len(sts.received) == 2
    form = dict(urllib.parse.parse_qsl(sts.received[0].body.decode()))
    assert form["Action"] == "AssumeRoleWithWebIdentity"
    assert form["RoleArn"] == "arn:aws:iam::123456789012:role/otelgpu-amp"
    assert form["WebIdentityToken"] == "eyJhbGciOiJSUzI1NiJ9.projected-service-account-token"

    assert "Credential=ASIAFIRSTEXAMPLE/" in receiver.received[0].headers["Authorization"]
    assert receiver.received[0].headers["X-Amz-Security-Token"] == "firstToken"
    headers = receiver.received[1].headers
    auth, amz_date = headers["Authorization"], headers["X-Amz-Date"]
    assert auth.startswith(f"AWS4-HMAC-SHA256 Credential=ASIASTSEXAMPLE/{amz_date[:8]}/eu-west-1/aps/aws4_request, ")
    assert headers["X-Amz-Security-Token"] == "stsSessionTokenEXAMPLE"
    # Checked as a receiver would: the signature over the headers and body as they arrived.
    names = auth.split("SignedHeaders=")[1].split(",")[0].split(";")
    assert "x-amz-security-token" in names
    arrived = {k: v for k, v in headers.items() if k.lower() in names and k.lower() != "host"}
    assert auth == reference_sigv4(arrived, headers["Host"], "/api/v1/write", receiver.received[1].body,
                                    "ASIASTSEXAMPLE", "stsSecretEXAMPLE", amz_date, "eu-west-1", "aps")


def test_environment_credentials_sign_the_request(monkeypatch, tmp_path, receiver) -> None:
    _clean_aws_environment(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAENVEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envSecretEXAMPLE")
    sender = RemoteWriteSender(_config(receiver.url, sigv4=SigV4Config(region="us-east-2")), SPECS, "c1")
    assert sender.send([Point("allocated", TEAM_A, T, T + MIN, 1.0)]).ok
    headers = receiver.received[0].headers
    assert "Credential=AKIAENVEXAMPLE/" in headers["Authorization"] and "/us-east-2/aps/" in headers["Authorization"]
    assert "X-Amz-Security-Token" not in headers


def test_no_credentials_is_a_config_error_naming_the_chain(monkeypatch, tmp_path) -> None:
    _clean_aws_environment(monkeypatch, tmp_path)
    with pytest.raises(ConfigError) as info:
        RemoteWriteSender(_config("https://aps.example/api/v1/write", sigv4=SigV4Config(region="eu-west-1")),
                          SPECS, "c1")
    message = str(info.value)
    assert "exporter.remote_write.sigv4" in message
    for step in ("environment", "AWS_WEB_IDENTITY_TOKEN_FILE", "shared config", "instance metadata"):
        assert step in message


# -- the request ---------------------------------------------------------------------------------

def test_headers_labels_samples_and_stale_marker(receiver) -> None:
    config = _config(receiver.url, headers={"X-Scope-OrgID": "tenant-1"},
                     external_labels={"region": "eu-west-1", "team": "from-external"})
    points = [
        Point("allocated", TEAM_A, T, T + 2 * MIN, 3.0),
        Point("allocated", TEAM_A, T, T + MIN, 1.5),  # out of order in the snapshot: sent in time order
        Point("activity", TEAM_A, T + MIN, T + MIN, 0.5),
        Point("activity", TEAM_A, T + 2 * MIN, T + 2 * MIN, math.nan, ended=True),
        Point("idle", (("node", "n1"), ("unit", "")), T, T + 2 * MIN, 0.25),
    ]
    sender = RemoteWriteSender(config, SPECS, "prod-eu")
    assert sender.send(points).ok
    sender.close()

    (got,) = receiver.received
    assert got.path == "/api/v1/write"
    assert got.headers["Content-Encoding"] == "snappy"
    assert got.headers["Content-Type"] == "application/x-protobuf"
    assert got.headers["X-Prometheus-Remote-Write-Version"] == "0.1.0"
    assert got.headers["User-Agent"].startswith("otelgpu/")
    assert got.headers["X-Scope-OrgID"] == "tenant-1"
    assert "Authorization" not in got.headers

    (request,) = receiver.write_requests()
    series = {dict(_labels(ts))["__name__"]: ts for ts in request.timeseries}
    assert set(series) == {"gpu_cost_allocated_total", "gpu_activity_ratio", "gpu_cost_idle_total"}
    for ts in request.timeseries:
        names = [name for name, _ in _labels(ts)]
        assert names == sorted(names)
        assert all(value != "" for _, value in _labels(ts))
    assert _labels(series["gpu_cost_allocated_total"]) == [
        ("__name__", "gpu_cost_allocated_total"), ("cluster", "prod-eu"), ("k8s_namespace_name", "ml"),
        ("k8s_pod_name", "train-0"), ("region", "eu-west-1"), ("team", "a")]  # the series' own team wins
    assert dict(_labels(series["gpu_cost_idle_total"])).keys() == {"__name__", "cluster", "node", "region", "team"}

    allocated = series["gpu_cost_allocated_total"].samples
    assert [(s.timestamp, s.value) for s in allocated] == [((T + MIN) // MS, 1.5), ((T + 2 * MIN) // MS, 3.0)]
    activity = series["gpu_activity_ratio"].samples
    assert activity[0].value == 0.5
    assert _bits(activity[1].value) == 0x7FF0000000000002  # the stale marker, not just any NaN


def test_requests_split_by_samples_in_order(receiver) -> None:
    pods = [(("k8s.pod.name", f"p{i}"),) for i in range(3)]
    points = [Point("allocated", pods[0], T, T + k * MIN, float(k)) for k in range(1, 6)]  # 5 samples
    points += [Point("allocated", pods[1], T, T + MIN, 10.0), Point("allocated", pods[2], T, T + MIN, 20.0)]
    sender = RemoteWriteSender(_config(receiver.url, max_samples_per_request=3), SPECS, "c1")
    assert sender.send(points).ok

    requests = receiver.write_requests()
    sizes = [sum(len(ts.samples) for ts in r.timeseries) for r in requests]
    assert sizes == [3, 3, 1]
    sent = [(dict(_labels(ts))["k8s_pod_name"], s.timestamp, s.value)
            for r in requests for ts in r.timeseries for s in ts.samples]
    expected = [("p0", (T + k * MIN) // MS, float(k)) for k in range(1, 6)]
    expected += [("p1", (T + MIN) // MS, 10.0), ("p2", (T + MIN) // MS, 20.0)]
    assert sent == expected  # series order kept, a split series' earlier samples first


def test_first_failure_stops_the_send(receiver) -> None:
    receiver.replies.extend([Reply(204), Reply(500, body=b"storage down")])
    points = [Point("allocated", (("k8s.pod.name", f"p{i}"),), T, T + MIN, 1.0) for i in range(5)]
    sender = RemoteWriteSender(_config(receiver.url, max_samples_per_request=2), SPECS, "c1")
    result = sender.send(points)
    assert (result.ok, result.retryable, result.reason, result.detail) == (False, True, "http_500", "storage down")
    assert len(receiver.received) == 2  # the third request was never sent


def test_a_partly_failed_snapshot_resends_only_the_rest(receiver) -> None:
    # Prometheus refuses a sample older than a series' newest, even an identical one: what the
    # receiver accepted before the failure must not be sent again. The progress, a count of
    # samples in the encoding's fixed order, says where to resume.
    receiver.replies.extend([Reply(204), Reply(503)])
    pods = [(("k8s.pod.name", f"p{i}"),) for i in range(2)]
    points = [Point("allocated", pods[0], T, T + k * MIN, float(k)) for k in range(1, 4)]
    points += [Point("allocated", pods[1], T, T + MIN, 10.0)]
    sender = RemoteWriteSender(_config(receiver.url, max_samples_per_request=2), SPECS, "c1")
    progress = Progress()
    assert sender.send(points, progress).reason == "http_503"
    assert progress.done == 2  # the first request only
    # The same snapshot in another order, as a restarted process might hold it: same samples.
    assert sender.send(points[::-1], progress).ok and progress.done == 4
    assert sender.send(points, progress).ok  # all of it accepted: nothing left to send
    assert sender.send([Point("allocated", pods[0], T, T + 5 * MIN, 5.0)]).ok  # a new snapshot: all of it

    sent = [[(dict(_labels(ts))["k8s_pod_name"], s.value) for ts in r.timeseries for s in ts.samples]
            for r in receiver.write_requests()]
    assert sent == [[("p0", 1.0), ("p0", 2.0)], [("p0", 3.0), ("p1", 10.0)],  # the second failed
                    [("p0", 3.0), ("p1", 10.0)], [("p0", 5.0)]]


def test_each_request_is_written_as_it_is_sent_and_a_failure_to_write_one_keeps_the_rest(receiver,
                                                                                       monkeypatch) -> None:
    """Requests are written one at a time as they are sent: one that cannot be written (an encoding
    bug) stops the send after those already accepted, which the progress keeps."""
    from otelgpu.exporter import remote_write

    written, real = [], remote_write.write_series

    def write_series(*args):  # noqa: ANN002, ANN202
        written.append(len(receiver.received))  # requests the receiver had when this one was written
        if len(written) == 3:
            raise ValueError("no room")
        return real(*args)

    monkeypatch.setattr(remote_write, "write_series", write_series)
    points = [Point("allocated", (("k8s.pod.name", f"p{i}"),), T, T + MIN, 1.0) for i in range(5)]
    sender = RemoteWriteSender(_config(receiver.url, max_samples_per_request=2), SPECS, "c1")
    progress = Progress()
    result = sender.send(points, progress)
    assert (result.ok, result.retryable, result.reason, result.detail) == (False, False, "encode", "no room")
    assert written == [0, 1, 2] and progress.done == 4  # each written after the one before was sent


def test_nothing_to_send_sends_nothing(receiver) -> None:
    assert RemoteWriteSender(_config(receiver.url), SPECS, "c1").send([]).ok
    assert receiver.received == []


# -- answers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("reply, retryable, reason, detail, delay", [
    (Reply(429, {"Retry-After": "7"}), True, "http_429", "", 7.0),
    (Reply(500, body=b"internal"), True, "http_500", "internal", None),
    (Reply(503, {"Retry-After": "2"}, b"unavailable"), True, "http_503", "unavailable", 2.0),
    (Reply(400, body=b"out of order sample " + b"x" * 2000), False, "http_400",
     "out of order sample " + "x" * 480, None),  # the body, cut to 500 characters
    (Reply(403, body=b"forbidden"), False, "http_403", "forbidden", None),
], ids=["429", "500", "503", "400", "403"])
def test_answers_are_classified(receiver, reply, retryable, reason, detail, delay) -> None:
    receiver.replies.append(reply)
    result = RemoteWriteSender(_config(receiver.url), SPECS, "c1").send([Point("allocated", TEAM_A, T, T + MIN, 1.0)])
    assert (result.ok, result.retryable, result.reason, result.detail) == (False, retryable, reason, detail)
    assert result.retry_after == delay


def test_retry_after_as_an_http_date(receiver) -> None:
    later = datetime.now(timezone.utc) + timedelta(seconds=30)
    receiver.replies.append(Reply(429, {"Retry-After": format_datetime(later, usegmt=True)}))
    result = RemoteWriteSender(_config(receiver.url), SPECS, "c1").send([Point("allocated", TEAM_A, T, T + MIN, 1.0)])
    assert result.reason == "http_429" and result.retryable
    assert 25 <= result.retry_after <= 30
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date past: no wait
    assert retry_after("soon") is None and retry_after(None) is None


def test_connection_refused_is_retryable() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = RemoteWriteSender(_config(f"http://127.0.0.1:{port}/api/v1/write"), SPECS, "c1").send(
        [Point("allocated", TEAM_A, T, T + MIN, 1.0)])
    assert (result.ok, result.retryable, result.reason) == (False, True, "connection")


def test_connection_closed_without_an_answer_is_retryable(receiver) -> None:
    receiver.replies.append(Reply(drop=True))
    result = RemoteWriteSender(_config(receiver.url), SPECS, "c1").send([Point("allocated", TEAM_A, T, T + MIN, 1.0)])
    assert (result.ok, result.retryable, result.reason) == (False, True, "connection")


def test_a_receiver_that_hangs_times_out(receiver) -> None:
    receiver.replies.append(Reply(hang=True))
    sender = RemoteWriteSender(_config(receiver.url, timeout_seconds=0.3), SPECS, "c1")
    started = time.monotonic()
    result = sender.send([Point("allocated", TEAM_A, T, T + MIN, 1.0)])
    assert (result.ok, result.retryable, result.reason) == (False, True, "timeout")
    assert time.monotonic() - started < 2.0


# -- series AMP would refuse ---------------------------------------------------------------------

def test_series_over_70_labels_are_left_out_and_counted(receiver, caplog) -> None:
    wide = tuple((f"attr_{i:02d}", "v") for i in range(MAX_LABELS - 1))  # + __name__ + cluster = 71
    fits = tuple((f"attr_{i:02d}", "v") for i in range(MAX_LABELS - 2))  # exactly 70
    points = [Point("allocated", wide, T, T + MIN, 1.0), Point("allocated", fits, T, T + MIN, 2.0),
              Point("allocated", (("__secret", "x"),), T, T + MIN, 3.0), Point("allocated", TEAM_A, T, T + MIN, 4.0)]
    metrics = SelfMetrics()
    sender = RemoteWriteSender(_config(receiver.url), SPECS, "c1", metrics)
    with caplog.at_level(logging.ERROR, logger="otelgpu.exporter.remote_write"):
        assert sender.send(points).ok
        assert sender.send(points).ok

    assert sender.rejected_series == {"too_many_labels": 2, "invalid_label_name": 2}  # per send
    assert by_label(metrics.export_series_rejected) == {("remote_write", "too_many_labels"): 2,
                                              ("remote_write", "invalid_label_name"): 2}
    assert len([r for r in caplog.records if "too_many_labels" in r.getMessage()]) == 1  # logged once
    for request in receiver.write_requests():
        assert sorted(len(ts.labels) for ts in request.timeseries) == [5, MAX_LABELS]
        assert sorted(ts.samples[0].value for ts in request.timeseries) == [2.0, 4.0]


@pytest.mark.slow
def test_the_queue_never_merges_a_partly_accepted_snapshot(receiver) -> None:
    """The progress counts samples of one snapshot: merging newer snapshots into it while it waits
    for its retry would make the count point into other samples."""
    receiver.replies.extend([Reply(204), Reply(503, {"Retry-After": "3"})])
    pods = [(("k8s.pod.name", f"p{i}"),) for i in range(3)]
    metrics = SelfMetrics()
    sender = RemoteWriteSender(_config(receiver.url, max_samples_per_request=2), SPECS, "c1", metrics)
    delivery = Delivery(sender, DeliveryConfig(queue_size=2), metrics, interval_s=60)
    delivery.put([Point("allocated", pod, T, T + MIN, 1.0) for pod in pods])
    eventually(lambda: len(receiver.received) == 2, timeout=10)  # [p0, p1] accepted, [p2] not: waits 3 s
    for k in (2, 3, 4):  # the queue overflows while the first snapshot waits
        delivery.put([Point("allocated", pod, T, T + k * MIN, float(k)) for pod in pods])
    assert delivery.depth == 2 and by_label(metrics.export_snapshots_merged)["remote_write"] == 2
    assert delivery.wait_idle(20) and delivery.close() == 0

    sent = [[(dict(_labels(ts))["k8s_pod_name"], s.value) for ts in r.timeseries for s in ts.samples]
            for r in receiver.write_requests()]
    assert sent == [[("p0", 1.0), ("p1", 1.0)], [("p2", 1.0)], [("p2", 1.0)],  # the rest of the first
                    [("p0", 4.0), ("p1", 4.0)], [("p2", 4.0)]]  # the merged newer ones: the newest values
    assert by_label(metrics.exports)["remote_write"] == 2
