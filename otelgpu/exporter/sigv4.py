"""SigV4 signing of remote-write requests with botocore, for Amazon Managed Service for
Prometheus. Imported only when `exporter.remote_write.sigv4` is set: botocore costs some 8 MiB."""

from __future__ import annotations

from typing import Mapping

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import ReadOnlyCredentials
from botocore.exceptions import BotoCoreError, ClientError
from botocore.session import Session

from otelgpu.errors import ConfigError

CREDENTIAL_CHAIN = ("environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), shared config and credentials "
                    "files (AWS_PROFILE), web identity (AWS_ROLE_ARN + AWS_WEB_IDENTITY_TOKEN_FILE, as IRSA sets), "
                    "container credentials (ECS, EKS Pod Identity), EC2 instance metadata")


def sign(request_headers: Mapping[str, str], url: str, body: bytes, credentials: ReadOnlyCredentials,
         region: str, service: str, method: str = "POST") -> dict[str, str]:
    """The headers with SigV4's added (X-Amz-Date, X-Amz-Security-Token with session credentials,
    Authorization), signed over the exact body now by botocore's SigV4Auth.add_auth. The AWS
    test-suite vectors in the tests hold it to the published values."""
    request = AWSRequest(method=method, url=url, data=body, headers=dict(request_headers))
    SigV4Auth(credentials, service, region).add_auth(request)
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
