"""AWS Signature Version 4 written out step by step from AWS's documentation, for tests that check
what otelgpu signs (with botocore) against an independent computation."""

from __future__ import annotations

import hashlib
import hmac


def reference_sigv4(headers: dict[str, str], host: str, path: str, body: bytes, key: str, secret: str,
                     amz_date: str, region: str, service: str) -> str:
    """The Authorization header of a POST without a query string (a shape the AWS test suite lacks)."""
    canonical = {k.lower(): " ".join(v.split()) for k, v in headers.items()} | {"host": host}
    names = sorted(canonical)
    request = "\n".join(["POST", path, "", *(f"{n}:{canonical[n]}" for n in names), "", ";".join(names),
                         hashlib.sha256(body).hexdigest()])
    scope = f"{amz_date[:8]}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(request.encode()).hexdigest()])
    k = ("AWS4" + secret).encode()
    for part in (amz_date[:8], region, service, "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    return f"AWS4-HMAC-SHA256 Credential={key}/{scope}, SignedHeaders={';'.join(names)}, Signature={signature}"
