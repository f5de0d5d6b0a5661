"""`otelgpu report` against a real Prometheus holding what a real otelgpu run remote-wrote: each
team's charge over the whole hour and over parts of it, to the cent of the run's own totals,
adding up with the idle capacity to the capacity cost; a pod whose series ended and started again
inside the period (a counter reset) counted in full; the CSV the command writes."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

import pytest
from costrun import remote_write, run, scenario
from sigv4ref import reference_sigv4

from otelgpu.enrich.window import NS
from otelgpu.report.promql import PromClient, QueryError
from otelgpu.report.showback import increases, showback

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver"]  # the `prometheus` fixture

def by_team(s) -> dict[str, float]:  # noqa: ANN001
    return {r.key[0]: r.charged for r in s.rows}


def test_showback_to_the_cent_adding_up_to_the_capacity(prometheus: PrometheusServer) -> None:
    c = scenario()
    p = run(c, prometheus.write_url)
    client = PromClient(prometheus.url)
    t0 = c.t0 / NS
    hour = showback(client, t0, t0 + 3600, ["team"], matchers={"cluster": "one"})
    expected = {team: v for (team,), v in p.store.totals("allocated", ("team",), {"cost_model": "request"}).items()}
    assert by_team(hour) == pytest.approx(expected, rel=1e-12)
    assert by_team(hour) == pytest.approx({"vision": 24 + 4, "nlp": 5, "research": 5}, rel=1e-12)
    assert hour.capacity == pytest.approx(48, rel=1e-12) and hour.idle == pytest.approx(10, rel=1e-12)
    assert abs(hour.gap) < 1e-9 and hour.idle_share == pytest.approx(10 / 48)
    vision = next(r for r in hour.rows if r.key == ("vision",))
    assert vision.gpu_hours == pytest.approx(2 + 1 / 3) and vision.cost_per_gpu_hour == pytest.approx(12.0)
    assert vision.effective + vision.waste + vision.unmeasured == pytest.approx(vision.allocated, rel=1e-12)

    # The second half hour: nlp's pod was gone; batch held a GPU twice, its counter starting again.
    half = showback(client, t0 + 1800, t0 + 3600, ["team"], matchers={"cluster": "one"})
    assert by_team(half) == pytest.approx({"vision": 12 + 4, "research": 5}, rel=1e-12)
    assert half.capacity == pytest.approx(24, rel=1e-12) and abs(half.gap) < 1e-9
    # The last 15 minutes: batch's second holding only. Its last value before the period (2.0, from
    # its first holding) is larger than its last value in it: the reset is read sample by sample.
    last = {labels["pod"]: v for labels, v in increases(client, "gpu_cost_allocated_total",
                                                         {"cluster": "one", "cost_model": "request"},
                                                         t0 + 2700, t0 + 3600)}
    assert last["batch"] == pytest.approx(2.0, rel=1e-12) and last["train"] == pytest.approx(6.0, rel=1e-12)


def test_the_report_command_writes_the_csv(prometheus: PrometheusServer, tmp_path) -> None:
    c = scenario()
    run(c, prometheus.write_url)
    t0 = c.t0 / NS

    def iso(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    out = tmp_path / "showback.csv"
    done = subprocess.run([sys.executable, "-m", "otelgpu", "report", "--prometheus", prometheus.url,
                           "--start", iso(t0), "--end", iso(t0 + 3600), "--by", "team,namespace",
                           "--cluster", "one", "--output", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    got = {(r["team"], r["namespace"]): float(r["charged"]) for r in rows}
    assert got == pytest.approx({("vision", "ml"): 28.0, ("nlp", "web"): 5.0, ("research", "lab"): 5.0,
                                 ("(idle)", ""): 10.0, ("(total)", ""): 48.0}, rel=1e-6)
    assert [r["team"] for r in rows][:3] == ["vision", "nlp", "research"] or \
        [r["team"] for r in rows][:3] == ["vision", "research", "nlp"]
    assert float(rows[-2]["share_of_capacity"]) == pytest.approx(10 / 48, rel=1e-5)

    refused = subprocess.run([sys.executable, "-m", "otelgpu", "report", "--prometheus", prometheus.url,
                              "--start", iso(t0 + 3600), "--end", iso(t0)], capture_output=True, text=True)
    assert refused.returncode == 2 and "must come after" in refused.stderr


def test_an_unreachable_or_refusing_server_is_a_clear_error(prometheus: PrometheusServer) -> None:
    with pytest.raises(QueryError, match="refused|HTTP 400"):
        PromClient(prometheus.url).vector("sum(", time.time())
    with pytest.raises(QueryError, match="127.0.0.1:9"):
        PromClient("http://127.0.0.1:9").vector("up", time.time())


class SigV4Gate:
    """An AMP-like front for the real Prometheus: it checks each request's SigV4 signature (recomputed
    step by step, `sigv4ref`) with the secret it knows, answers 403 on a mismatch, and forwards the
    rest."""

    def __init__(self, target: str, key: str, secret: str, region: str) -> None:
        gate = self
        self.checked = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                auth, date = self.headers.get("Authorization", ""), self.headers.get("X-Amz-Date", "")
                names = auth.partition("SignedHeaders=")[2].partition(",")[0].split(";")
                signed = {n: self.headers[n] for n in names if n != "host"}
                expected = reference_sigv4(signed, self.headers["Host"], self.path, body, key, secret, date,
                                           region, "aps")
                if auth != expected:
                    self.send_response(403)
                    self.end_headers()
                    self.wfile.write(b'{"message": "The request signature we calculated does not match"}')
                    return
                gate.checked += 1
                forward = urllib.request.Request(target + self.path, data=body, method="POST",
                                                 headers={"Content-Type": self.headers["Content-Type"]})
                with urllib.request.urlopen(forward, timeout=10) as answer:
                    data = answer.read()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # noqa: ANN002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_amp_queries_are_signed_with_sigv4(prometheus: PrometheusServer, monkeypatch, tmp_path) -> None:
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, var in (("config", "AWS_CONFIG_FILE"), ("credentials", "AWS_SHARED_CREDENTIALS_FILE")):
        (tmp_path / name).write_text("")
        monkeypatch.setenv(var, str(tmp_path / name))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    c = scenario()
    run(c, prometheus.write_url)
    t0 = c.t0 / NS
    gate = SigV4Gate(prometheus.url, "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "eu-west-1")
    try:
        signed = showback(PromClient(gate.url, sigv4_region="eu-west-1"), t0, t0 + 3600, ["team"])
        plain = showback(PromClient(prometheus.url), t0, t0 + 3600, ["team"])
        assert by_team(signed) == by_team(plain) and gate.checked >= 20
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        with pytest.raises(QueryError, match="HTTP 403"):
            showback(PromClient(gate.url, sigv4_region="eu-west-1"), t0, t0 + 3600, ["team"])
    finally:
        gate.stop()


class Page(HTMLParser):
    """What a test reads of the HTML page: its text, the charged bars' widths per group, and every
    element that could load something from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.bars: dict[str, float] = {}
        self.loads: list[str] = []
        self._title = ""

    def handle_starttag(self, tag: str, attrs: list) -> None:  # noqa: ANN001
        a = dict(attrs)
        if tag in ("script", "link", "img", "iframe", "object", "embed") or "src" in a or "href" in a:
            self.loads.append(tag)
        if tag == "rect" and a.get("class") in ("effective", "waste", "unmeasured", "other", "unused"):
            self._title = "bar"
            self._width = float(a["width"])

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._title == "bar":
            group = data.split(":")[0]
            self.bars[group] = self.bars.get(group, 0.0) + self._width
            self._title = ""


def test_the_report_page_is_self_contained_and_draws_what_it_says(prometheus: PrometheusServer, tmp_path) -> None:
    c = scenario()
    run(c, prometheus.write_url)
    t0 = c.t0 / NS
    out = tmp_path / "showback.html"
    done = subprocess.run([sys.executable, "-m", "otelgpu", "report", "--prometheus", prometheus.url,
                           "--start", str(int(t0)), "--end", str(int(t0 + 3600)), "--by", "team", "--format", "html",
                           "--output", str(out)], capture_output=True, text=True)
    assert done.returncode == 2 and "ISO 8601" in done.stderr  # seconds are not a date
    iso = [datetime.fromtimestamp(t, timezone.utc).isoformat() for t in (t0, t0 + 3600)]
    done = subprocess.run([sys.executable, "-m", "otelgpu", "report", "--prometheus", prometheus.url,
                           "--start", iso[0], "--end", iso[1], "--by", "team", "--format", "html",
                           "--output", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    page = Page()
    page.feed(out.read_text())
    text = " ".join(page.text)
    assert not page.loads  # no script, stylesheet, image or link: it opens offline
    for figure in ("48.00 USD", "38.00 USD", "10.00 USD (20.8 %)", "28.00 USD", "12.00 USD"):
        assert figure in text, figure
    assert page.bars.keys() == {"vision", "nlp", "research"}
    assert page.bars["vision"] / page.bars["nlp"] == pytest.approx(28 / 5, rel=1e-3)
    assert page.bars["research"] == pytest.approx(page.bars["nlp"], rel=1e-3)


def test_label_values_cannot_inject_markup_into_the_page() -> None:
    from otelgpu.report.html import write_html
    from otelgpu.report.showback import Row, Showback

    hostile = '<script>alert("x")</script>'
    s = Showback(0, 3600, ("team",), "request", {"cluster": '"><img src=x onerror=alert(1)>'},
                 [Row((hostile,), allocated=5.0, effective=2.0, waste=3.0, gpu_allocated=5.0, gpu_hours=1.0)],
                 idle=1.0, capacity=6.0)
    out = io.StringIO()
    write_html(s, out)
    page = Page()
    page.feed(out.getvalue())
    assert not page.loads and "<script>" not in out.getvalue() and "<img" not in out.getvalue()
    assert hostile in " ".join(page.text)  # shown as text


def write(prometheus: PrometheusServer, series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]) -> None:
    remote_write(prometheus.write_url, series)


def test_a_restarted_series_is_read_alone_though_another_has_its_labels_and_more(prometheus: PrometheusServer) -> None:
    """With attributes dropped, one series' labels can be all of another's and one more: the
    selector that reads the restarted one's samples matches both."""
    t0 = time.time() // 60 * 60 - 3000
    base = (("__name__", "gpu_cost_allocated_total"), ("cluster", "c"), ("cost_model", "request"), ("team", "a"))
    more = tuple(sorted(base + (("gpu_model", "X"),)))
    write(prometheus, {base: [(t0 + 60 * k, v) for k, v in enumerate([1.0, 2.0, 3.0, 1.0, 2.0])],  # reset at k=3
                       more: [(t0 + 60 * k, 10.0 * (k + 1)) for k in range(5)]})
    got = {labels.get("gpu_model", ""): v for labels, v in increases(
        PromClient(prometheus.url), "gpu_cost_allocated_total", {"cluster": "c"}, t0 + 30, t0 + 300)}
    assert got == {"": pytest.approx(1.0 + 1.0 + 2.0), "X": pytest.approx(40.0)}


def test_report_arguments_refused_before_any_query(prometheus: PrometheusServer, tmp_path) -> None:
    def report(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "otelgpu", "report", "--prometheus", prometheus.url,
                               "--start", "2026-11-01", "--end", "2026-11-02", *args], capture_output=True, text=True)

    for args, message in ((("--by", "team,resource"), "cannot group by resource"),
                          (("--output", str(tmp_path / "missing" / "x.csv")), "--output"),
                          (("--lookback", "0"), "--lookback")):
        done = report(*args)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_csv_without_groups_keeps_its_columns() -> None:
    from otelgpu.report import write_csv
    from otelgpu.report.showback import Row, Showback

    out = io.StringIO()
    write_csv(Showback(0, 3600, (), "request", {}, [Row((), allocated=4.0, gpu_hours=1.0)], idle=1.0, capacity=5.0), out)
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert rows[0][:2] == ["group", "charged"] and {len(r) for r in rows} == {len(rows[0])}
    assert [r[0] for r in rows[1:]] == ["everything", "(idle)", "(total)"] and rows[3][1] == "5.000000"
