"""The SigV4 stand-in for AMP (tests/sigv4gate.py) accepts what botocore signs for `aps` and refuses
a request whose bytes, scope or time differ from what was signed."""

from __future__ import annotations

import hashlib

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from sigv4gate import SigV4Gate

KEY, SECRET = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
URL = "http://127.0.0.1:9090/workspaces/ws-1/api/v1/remote_write"
BODY = b"\x1f\x8b snappy-compressed WriteRequest bytes"


def signed(body: bytes = BODY, region: str = "us-east-1") -> dict[str, str]:
    request = AWSRequest(method="POST", url=URL, data=body, headers={
        "Content-Type": "application/x-protobuf", "Content-Encoding": "snappy",
        "X-Amz-Content-Sha256": hashlib.sha256(body).hexdigest()})
    SigV4Auth(Credentials(KEY, SECRET), "aps", region).add_auth(request)
    return {**dict(request.headers.items()), "Host": "127.0.0.1:9090"}


def problem(headers: dict[str, str], body: bytes = BODY) -> str:
    return SigV4Gate.problem(headers, "/workspaces/ws-1/api/v1/remote_write", body, KEY, SECRET, "us-east-1", "aps")


def test_a_request_botocore_signed_verifies() -> None:
    assert problem(signed()) == ""


def test_other_bytes_another_region_no_signature_or_a_wrong_secret_are_refused() -> None:
    assert "x-amz-content-sha256" in problem(signed(), body=BODY + b"!")
    headers = signed()
    del headers["X-Amz-Content-Sha256"]
    headers["Authorization"] = headers["Authorization"].replace("x-amz-content-sha256;", "")
    assert problem(headers, body=BODY + b"!") != ""
    assert "scope" in problem(signed(region="eu-west-1"))
    assert "malformed" in problem({k: v for k, v in signed().items() if k != "Authorization"})
    forged = signed()
    forged["Authorization"] = forged["Authorization"][:-64] + "0" * 64
    assert problem(forged) == "signature does not match the bytes that arrived"
