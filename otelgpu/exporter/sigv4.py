"""SigV4 signing of remote-write requests with botocore, for Amazon Managed Service for
Prometheus. Imported only when `exporter.remote_write.sigv4` is set: botocore costs some 8 MiB."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Mapping, Optional

from botocore.auth import SIGV4_TIMESTAMP, SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import ReadOnlyCredentials
from botocore.exceptions import BotoCoreError, ClientError
from botocore.session import Session

from otelgpu.errors import ConfigError

CREDENTIAL_CHAIN = ("environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), shared config and credentials "
                    "files (AWS_PROFILE), web identity (AWS_ROLE_ARN + AWS_WEB_IDENTITY_TOKEN_FILE, as IRSA sets), "
                    "container credentials (ECS, EKS Pod Identity), EC2 instance metadata")


def sign(request_headers: Mapping[str, str], url: str, body: bytes, credentials: ReadOnlyCredentials,
         region: str, service: str, now: Optional[datetime] = None, method: str = "POST") -> dict[str, str]:
    """The headers with SigV4's added (X-Amz-Date, X-Amz-Security-Token with session credentials,
    Authorization), signed by botocore over the exact body at `now` (UTC; default: the clock).

    These are SigV4Auth.add_auth's own steps, two of them botocore internals, except that the time
    comes from `now` through the request context, where every step reads it, rather than from
    botocore's clock. The AWS test-suite vectors in the tests hold them to the published values."""
    request = AWSRequest(method=method, url=url, data=body, headers=dict(request_headers))
    auth = SigV4Auth(credentials, service, region)
    when = datetime.now(timezone.utc) if now is None else now
    when = when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)
    request.context["timestamp"] = when.strftime(SIGV4_TIMESTAMP)
    auth._modify_request_before_signing(request)  # X-Amz-Date from the context, the session token
    canonical = auth.canonical_request(request)
    auth._inject_signature_to_request(request, auth.signature(auth.string_to_sign(request, canonical), request))
    return dict(request.headers.items())


class Signer:
    """Signs with the credentials of the standard AWS chain, refreshed as they near expiry."""

    CredentialsUnavailable = (BotoCoreError, ClientError, OSError)

    def __init__(self, region: str, service: str, where: str = "exporter.remote_write.sigv4") -> None:
        """`where`: what asked for signing, in errors."""
        self.region, self.service = region, service
        try:
            self._credentials = Session().get_credentials()
        except BotoCoreError as exc:
            raise ConfigError([f"{where}: AWS credentials unusable: {exc}"]) from exc
        if self._credentials is None:
            raise ConfigError([f"{where}: no AWS credentials found; tried {CREDENTIAL_CHAIN}"])

    def headers(self, headers: Mapping[str, str], url: str, body: bytes) -> dict[str, str]:
        """`headers` with SigV4's added; raises one of CredentialsUnavailable when the credentials
        cannot be refreshed now."""
        frozen = self._credentials.get_frozen_credentials()  # refreshes what is about to expire
        return sign(headers, url, body, frozen, self.region, self.service)
