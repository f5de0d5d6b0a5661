"""A Prometheus HTTP API client for the report: instant queries, vector and matrix results, over
plain HTTP(S) or signed with SigV4 for Amazon Managed Service for Prometheus (service `aps`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional

from otelgpu.errors import OtelgpuError

Labels = dict[str, str]
MAX_POINTS = 11_000  # points per series Prometheus returns from a range query


class QueryError(OtelgpuError):
    """The server refused a query or could not be reached; the message says which and why."""


class PromClient:
    """`url`: the server's base (`http://prometheus:9090`, or AMP's
    `https://aps-workspaces.REGION.amazonaws.com/workspaces/WS`), queried at `/api/v1/query`."""

    def __init__(self, url: str, sigv4_region: Optional[str] = None, headers: Optional[dict[str, str]] = None,
                 timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s
        self._signer = None
        if sigv4_region:
            from otelgpu.exporter.sigv4 import Signer

            self._signer = Signer(sigv4_region, "aps", where="report --sigv4-region")

    def vector(self, promql: str, at: float) -> list[tuple[Labels, float]]:
        """An instant query returning an instant vector: (labels, value) per series."""
        data = self._query(promql, at)
        if data["resultType"] != "vector":
            raise QueryError(f"expected an instant vector from {promql!r}, got a {data['resultType']}")
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def matrix(self, promql: str, at: float) -> list[tuple[Labels, list[tuple[float, float]]]]:
        """An instant query of a range selector: each series' raw samples, (time, value)."""
        data = self._query(promql, at)
        if data["resultType"] != "matrix":
            raise QueryError(f"expected a range vector from {promql!r}, got a {data['resultType']}")
        return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in data["result"]]

    def range_matrix(self, promql: str, start: float, end: float, step: float) -> list[tuple[Labels, list[tuple[float, float]]]]:
        """A range query: each series' values at start, start + step, ... end (where it has one)."""
        if (end - start) / step + 1 > MAX_POINTS:
            raise QueryError(f"{promql!r}: {int((end - start) / step) + 1} steps, more than the {MAX_POINTS} "
                             "Prometheus answers per series; ask for a shorter period or a coarser step")
        data = self._query(promql, {"start": repr(start), "end": repr(end), "step": repr(step)}, "query_range")
        return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in data["result"]]

    def _query(self, promql: str, at: float | dict[str, str], api: str = "query") -> dict[str, Any]:
        url = f"{self.url}/api/v1/{api}"
        when = at if isinstance(at, dict) else {"time": repr(at)}
        body = urllib.parse.urlencode({"query": promql, **when}).encode()
        headers = {**self.headers, "Content-Type": "application/x-www-form-urlencoded"}
        if self._signer is not None:
            try:
                headers = self._signer.headers(headers, url, body)
            except self._signer.CredentialsUnavailable as exc:
                raise QueryError(f"{url}: AWS credentials unavailable for signing: {exc}") from exc
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as exc:
            raise QueryError(f"{url} answered HTTP {exc.code} to {promql!r}: {_error_of(exc)}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise QueryError(f"{url}: {getattr(exc, 'reason', exc)}") from exc
        if answer.get("status") != "success":
            raise QueryError(f"{url} refused {promql!r}: {answer.get('error', answer)}")
        return answer["data"]


def _error_of(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.load(exc).get("error", ""))[:500]
    except (ValueError, OSError):
        return exc.reason


def selector(name: str, labels: Labels) -> str:
    """`name{k="v", ...}` with the values escaped as PromQL string literals."""
    inner = ", ".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
