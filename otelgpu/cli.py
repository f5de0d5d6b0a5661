"""`otelgpu serve --config FILE`, `otelgpu demo`, `otelgpu check-config FILE`, `otelgpu warm-up`,
`otelgpu rules [--budgets FILE] [--prometheusrule]`, `otelgpu report --prometheus URL --start T --end T`,
`otelgpu nvml --node NODE --endpoint HOST:PORT [--mode auto|nvml]`: the per-node NVML agent that
exports dcgm-exporter's series where no dcgm-exporter runs (docs/nvml.md)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from typing import Callable, TextIO

from otelgpu.attribution.config import load_prices_file
from otelgpu.config import load_config
from otelgpu.errors import ConfigError


def _serve(path: str) -> int:
    from otelgpu.core import jit
    from otelgpu.heap import fix_mmap_threshold, limit_arenas

    limit_arenas()  # before the receivers' threads allocate (otelgpu/heap.py)
    fix_mmap_threshold()

    config = load_config(path)
    jit.choose(config.kernels)  # before the pipeline's modules define their kernels
    from otelgpu.pipeline import Pipeline

    prices = config.attribution.prices
    if prices.file:  # a bad price file stops the start; a bad change later keeps the prices in force
        load_prices_file(prices.file, prices)
    log = logging.getLogger("otelgpu")
    if not config.checkpoint.directory:
        log.warning("no checkpoint.directory: a restart starts every cost counter afresh")
    # SIGTERM/SIGINT are taken with sigwait in this thread rather than by a handler: a handler that
    # sets a threading.Event can deadlock on the Event's own lock. Blocked before any thread starts,
    # so every thread inherits the mask and the signal waits here for sigwait.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints every thread's stack
    pipeline = Pipeline(config)
    pipeline.start()
    log.info("serving: OTLP/gRPC %s, OTLP/HTTP %s, metrics %s", config.receiver.grpc.endpoint,
             config.receiver.http.endpoint if config.receiver.http.enabled else "off",
             pipeline.metrics_server.url if pipeline.metrics_server else "off")
    received = signal.sigwait(stop_signals)
    log.info("%s received, shutting down (a second one stops at once)", signal.Signals(received).name)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
    pipeline.shutdown()
    return 0


def _warm_up() -> int:
    """What an image build runs, so that pods start without the JIT: compile every kernel into
    NUMBA_CACHE_DIR (or say that each came from it already). A cache only helps on another CPU if
    NUMBA_CPU_NAME=generic was set both here and where it is loaded."""
    import numba

    from otelgpu.kernels import warm_up

    where = numba.config.CACHE_DIR or "numba's default cache directory"
    for name, how in warm_up().items():
        print(f"{name}: {how} ({where})")
    return 0


def _report(args: argparse.Namespace) -> int:
    from otelgpu.report import parse_time
    from otelgpu.report.promql import PromClient, QueryError
    from otelgpu.report.showback import showback

    try:
        start, end = parse_time(args.start), parse_time(args.end)
    except ValueError as exc:
        raise ConfigError([f"report: {exc}"]) from exc
    if not end > start:
        raise ConfigError([f"report: --end ({args.end}) must come after --start ({args.start})"])
    by = tuple(b.strip() for b in args.by.split(",") if b.strip())
    if not args.lookback > 0:
        raise ConfigError(["report: --lookback must be a positive number of days"])
    if args.output:  # before the queries: a path that cannot be written fails now
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ConfigError([f"report: --output {args.output}: {folder} is not a folder this user can write"])
    if args.format == "focus-parquet" and not args.output:
        raise ConfigError(["report: --format focus-parquet needs --output FILE"])
    if args.reconciliation and not args.bill:
        raise ConfigError(["report: --reconciliation needs --bill FILE"])
    client = PromClient(args.prometheus, sigv4_region=args.sigv4_region)
    if args.bill:
        return _billed(args, client, start, end, by)
    if args.format.startswith("focus"):
        return _focus(args, client, start, end)
    try:
        result = showback(client, start, end, by, args.cost_model, {"cluster": args.cluster} if args.cluster else None,
                          int(args.lookback * 86_400))
    except ValueError as exc:
        raise ConfigError([f"report: {exc}"]) from exc
    except QueryError as exc:
        print(f"otelgpu: {exc}", file=sys.stderr)
        return 1
    _write_showback(args, result)
    return 0


def _write_showback(args: argparse.Namespace, result) -> None:  # noqa: ANN001 - a Showback
    from otelgpu.report import write_csv
    from otelgpu.report.showback import GAP_CAUSES

    if abs(result.gap) > 1e-6 * max(result.capacity, 1.0):
        print(f"otelgpu: warning: the rows and the idle add up to {result.charged + result.idle:.6f} of a capacity of "
              f"{result.capacity:.6f}: {GAP_CAUSES}", file=sys.stderr)

    def write(out: TextIO) -> None:
        if args.format == "html":
            from otelgpu.report.html import write_html

            write_html(result, out, args.currency)
        else:
            write_csv(result, out)

    if args.output:
        with open(args.output, "w", encoding="utf-8", newline="") as out:
            write(out)
    else:
        write(sys.stdout)


def _billed(args: argparse.Namespace, client, start: float, end: float, by: tuple[str, ...]) -> int:  # noqa: ANN001
    """The report tied out to the bill: each node-period at its instance's billed cost."""
    from otelgpu.report import focus
    from otelgpu.report.bill import read_bill
    from otelgpu.report.promql import QueryError
    from otelgpu.report.reconcile import BillPeriodError, reconcile, showback_of, summary, write_csv

    matchers = {"cluster": args.cluster} if args.cluster else {}
    try:
        bounds = focus.periods(start, end, focus.GRANULARITY_S[args.granularity])
        bill = read_bill(args.bill)  # before the queries: a bill that cannot be read fails now
        data = focus.collect(client, start, end, int(bounds[1] - bounds[0]), args.cost_model, matchers,
                             int(args.lookback * 86_400))
        result = reconcile(data, bill, bounds)
    except (ValueError, BillPeriodError) as exc:
        raise ConfigError([f"report: {exc}"]) from exc
    except QueryError as exc:
        print(f"otelgpu: {exc}", file=sys.stderr)
        return 1
    for line in [*data.warnings, *summary(result, args.currency)]:
        print(f"otelgpu: {line}", file=sys.stderr)
    if args.reconciliation:
        with open(args.reconciliation, "w", encoding="utf-8", newline="") as out:
            write_csv(result, out)
    if args.format.startswith("focus"):
        return _write_focus(args, data)
    try:
        unattributed = _unattributed(client, matchers, bounds, int(args.lookback * 86_400))
    except QueryError as exc:
        print(f"otelgpu: {exc}", file=sys.stderr)
        return 1
    result = showback_of(data, by, matchers, start, end, unattributed)
    result.basis = f"costs tied out to the bill {os.path.basename(os.path.normpath(args.bill))}"
    _write_showback(args, result)
    return 0


def _unattributed(client, matchers: dict[str, str], bounds: list[float], lookback_s: int) -> dict:  # noqa: ANN001
    from otelgpu.report.showback import NAMES, increases_by_period

    out: dict[tuple[float, str, str], float] = {}
    for period, series in enumerate(increases_by_period(client, NAMES["unattributed"], matchers, bounds, lookback_s)):
        for labels, value in series:
            key = (bounds[period], labels.get("cluster", ""), labels.get("node", ""))
            out[key] = out.get(key, 0.0) + value
    return out


def _focus(args: argparse.Namespace, client, start: float, end: float) -> int:  # noqa: ANN001 - PromClient
    from otelgpu.report import focus
    from otelgpu.report.promql import QueryError

    try:
        step = focus.GRANULARITY_S[args.granularity]
        focus.periods(start, end, step)
        data = focus.collect(client, start, end, step, args.cost_model,
                             {"cluster": args.cluster} if args.cluster else None, int(args.lookback * 86_400))
    except ValueError as exc:
        raise ConfigError([f"report: {exc}"]) from exc
    except QueryError as exc:
        print(f"otelgpu: {exc}", file=sys.stderr)
        return 1
    for warning in data.warnings:
        print(f"otelgpu: warning: {warning}", file=sys.stderr)
    return _write_focus(args, data)


def _write_focus(args: argparse.Namespace, data) -> int:  # noqa: ANN001 - a focus.Dataset
    from otelgpu.report import focus

    provider = focus.Provider(args.provider, args.service_name, args.billing_account)
    if args.format == "focus-parquet":
        try:
            focus.write_parquet(data, args.output, provider, args.currency)
        except ValueError as exc:
            raise ConfigError([f"report: {exc}"]) from exc
    elif args.output:
        with open(args.output, "w", encoding="utf-8", newline="") as out:
            focus.write_csv(data, out, provider, args.currency)
    else:
        focus.write_csv(data, sys.stdout, provider, args.currency)
    return 0


def _nvml(args: argparse.Namespace) -> int:
    from otelgpu.nvml import agent
    from otelgpu.nvml.export import OtlpSeries, exporter_config

    node = args.node or os.environ.get("NODE_NAME", "")
    problems = [] if node else ["nvml: --node or NODE_NAME must name this node (the downward API's spec.nodeName)"]
    if not args.interval > 0:
        problems.append("nvml: --interval must be a positive number of seconds")
    if not args.dcgm_url.startswith(("http://", "https://")):
        problems.append(f"nvml: --dcgm-url must be an http:// or https:// URL, got {args.dcgm_url!r}")
    if problems:
        raise ConfigError(problems)
    endpoint = exporter_config(args.endpoint, True if args.insecure else None, args.ca_file, args.cert_file,
                               args.key_file)
    options = agent.Options(node, args.interval, args.mode, args.dcgm_url, args.pod_resources_socket, args.hold_nvml)
    return agent.run(options, OtlpSeries(endpoint, node, timeout_s=min(10.0, max(args.interval, 1.0))),
                     args.nvml_library)


def _nvml_parser(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    from otelgpu.nvml import DEFAULT_DCGM_URL, DEFAULT_POD_RESOURCES_SOCKET as DEFAULT_SOCKET, MODES

    nvml = sub.add_parser(
        "nvml", help="per-node agent: read the GPUs with NVML, export dcgm-exporter's series over OTLP",
        description="Read this node's GPUs and MIG instances with NVML, map them to pods through the kubelet's "
                    "pod-resources API, and export the series dcgm-exporter would give (GPU_UTIL, FB_USED, FB_FREE, "
                    "POWER_USAGE, TOTAL_ENERGY_CONSUMPTION) over OTLP/gRPC, as service.name otelgpu-nvml. "
                    "See docs/nvml.md.")
    nvml.add_argument("--endpoint", default="127.0.0.1:4317",
                      help="OTLP/gRPC receiver: otelgpu's or a Collector's, host:port or https://host:port "
                           "(default 127.0.0.1:4317); TLS unless the host is a loopback address or --insecure")
    nvml.add_argument("--insecure", action="store_true", help="plaintext to a host that is not loopback")
    nvml.add_argument("--ca-file", help="CA of the receiver's certificate (default: the system's CAs)")
    nvml.add_argument("--cert-file", help="client certificate, for mutual TLS (with --key-file)")
    nvml.add_argument("--key-file", help="the client certificate's key")
    nvml.add_argument("--interval", type=float, default=30.0, help="seconds between readings (default 30)")
    nvml.add_argument("--node", help="this node's name, the series' Hostname (default: NODE_NAME)")
    nvml.add_argument("--mode", choices=MODES, default="auto",
                      help="auto (default): export only while no dcgm-exporter answers at --dcgm-url; nvml: always")
    nvml.add_argument("--dcgm-url", default=DEFAULT_DCGM_URL,
                      help=f"where a dcgm-exporter of this node would answer (default {DEFAULT_DCGM_URL})")
    nvml.add_argument("--pod-resources-socket", default=DEFAULT_SOCKET,
                      help=f"the kubelet's pod-resources socket (default {DEFAULT_SOCKET})")
    nvml.add_argument("--nvml-library", help="path of libnvidia-ml.so.1 where the dynamic linker does not find it")
    nvml.add_argument("--hold-nvml", action="store_true",
                      help="keep NVML started between readings (default: started for each reading and shut down "
                           "after, so the driver's device files are free for a driver upgrade)")


def _version() -> str:
    """The installed distribution's version (the package's own when run from a source tree)."""
    import importlib.metadata

    from otelgpu import __version__

    try:
        return importlib.metadata.version("otelgpu")
    except importlib.metadata.PackageNotFoundError:
        return __version__


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "serve": lambda a: _serve(a.config), "warm-up": lambda a: _warm_up(), "rules": _rules, "report": _report,
        "nvml": _nvml, "check-config": _check_config, "demo": _demo, "prices": _prices}
    try:
        return commands[args.command](args)
    except ConfigError as err:
        print(f"otelgpu: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otelgpu", description="GPU cost attribution sidecar")
    parser.add_argument("--version", action="version", version=f"otelgpu {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the sidecar")
    serve.add_argument("--config", required=True, help="YAML configuration file")
    check = sub.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("config")
    sub.add_parser("warm-up", help="compile the kernels into numba's cache (NUMBA_CACHE_DIR) and exit")
    demo = sub.add_parser("demo", help="run the sidecar on a simulated 3-node GPU cluster")
    demo.add_argument("--keep-running", action="store_true", help="keep serving until interrupted")
    demo.add_argument("--metrics-port", type=int, default=None, help="port of the /metrics page (default 9464)")
    rules = sub.add_parser("rules", help="print Prometheus recording and alerting rules for the cost series")
    rules.add_argument("--budgets", help="YAML: team budgets (USD per 30 days) and alert thresholds")
    rules.add_argument("--prometheusrule", action="store_true", help="as a Prometheus Operator PrometheusRule")
    rules.add_argument("--namespace", default="monitoring", help="the PrometheusRule's namespace")
    _report_parser(sub)
    _prices_parser(sub)
    _nvml_parser(sub)
    return parser


def _prices_parser(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    prices = sub.add_parser("prices", help="write a price file of the effective rates a cloud bill charged",
                            description="Read a FOCUS 1.x or AWS CUR 2.0 bill and write a price file (prices.file) "
                                        "of its effective rates per instance type and capacity type, which a running "
                                        "sidecar reloads. See docs/cost-model.md section 3.")
    prices.add_argument("--from-bill", required=True, metavar="FILE",
                        help="the bill: CSV, gzip CSV or Parquet, a file or a folder")
    prices.add_argument("--output", required=True, help="the price file to write (replaced whole, never in part)")
    prices.add_argument("--config", help="the sidecar's configuration: its prices the bill does not replace are kept")
    prices.add_argument("--start", help="only the bill's charge periods from this ISO 8601 time (default: all)")
    prices.add_argument("--end", help="only the bill's charge periods up to this ISO 8601 time (default: all)")
    prices.add_argument("--per-instance", action="store_true",
                        help="also each instance's own rate (instance_hour_by_instance_id), beating its type's")


def _report_parser(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    report = sub.add_parser("report", help="showback of a period from the cost series in Prometheus or AMP")
    report.add_argument("--prometheus", required=True,
                        help="server URL (AMP: https://aps-workspaces.REGION.amazonaws.com/workspaces/WS)")
    report.add_argument("--sigv4-region", help="sign requests with SigV4 for AMP in this region")
    report.add_argument("--start", required=True, help="ISO 8601 date or time (UTC without a zone)")
    report.add_argument("--end", required=True, help="ISO 8601 date or time: the period is (start, end]")
    report.add_argument("--by", default="team", help="labels to group by, comma-separated (default team)")
    report.add_argument("--cost-model", default="request", choices=["request", "scad", "opencost", "hybrid"])
    report.add_argument("--cluster", help="only this cluster (default: every cluster of the workspace)")
    report.add_argument("--format", default="csv", choices=["csv", "html", "focus-csv", "focus-parquet"],
                        help="csv; html: one self-contained page with charts; focus-csv, focus-parquet: a FOCUS 1.3 "
                             "cost and usage dataset of split cost allocation (docs/report.md)")
    report.add_argument("--currency", default="USD", help="the currency of the cost series (attribution.currency)")
    report.add_argument("--output", help="file to write (default standard output)")
    report.add_argument("--lookback", type=float, default=7.0,
                        help="days before --start to look for each series' last value (default 7)")
    report.add_argument("--granularity", default="day", choices=["hour", "day"],
                        help="FOCUS: the charge period (default day); --start and --end on its edges")
    report.add_argument("--provider", default="Amazon Web Services",
                        help="FOCUS: the provider of the nodes (HostProviderName, ServiceProviderName, ...)")
    report.add_argument("--service-name", default="Amazon Elastic Compute Cloud",
                        help="FOCUS: the provider's service the nodes are (ServiceName)")
    report.add_argument("--billing-account", help="FOCUS: BillingAccountId (default: the cluster's name)")
    report.add_argument("--bill", help="tie out to this cloud bill: a FOCUS 1.x dataset or an AWS CUR 2.0 export "
                                       "(CSV, gzip CSV or Parquet; a file or a folder): each node-period at its "
                                       "instance's billed cost (docs/report.md)")
    report.add_argument("--reconciliation", help="with --bill: write each node's bill against otelgpu's prices, and "
                                                 "every bill line no node took, to this CSV file")


def _rules(args: argparse.Namespace) -> int:
    from otelgpu import alerts

    settings = alerts.load_alerts_config(args.budgets)
    given = " ".join(a for a in (f"--budgets {args.budgets}" if args.budgets else "",
                                 "--prometheusrule" if args.prometheusrule else "",
                                 f"--namespace {args.namespace}" if args.namespace != "monitoring" else "") if a)
    given = f" {given}" if given else ""
    sys.stdout.write(alerts.prometheus_rule(settings, namespace=args.namespace, args=given)
                     if args.prometheusrule else alerts.rule_file(settings, args=given))
    return 0


def _prices(args: argparse.Namespace) -> int:
    from otelgpu.attribution.config import PricesConfig
    from otelgpu.report import parse_time
    from otelgpu.report.bill import read_bill
    from otelgpu.report.billprices import bill_rates, header, price_file, shadowed, write_price_file

    try:
        start = parse_time(args.start) if args.start else None
        end = parse_time(args.end) if args.end else None
        base = load_config(args.config).attribution.prices if args.config else PricesConfig()
        if args.config and base.file:  # the file in force now, over the configuration
            base = load_prices_file(base.file, base) if os.path.exists(base.file) else base
        rates = bill_rates(read_bill(args.from_bill), start, end)
        mapping = price_file(rates, base, args.per_instance)
        command = f"otelgpu prices --from-bill {args.from_bill}" + (" --per-instance" if args.per_instance else "")
        write_price_file(args.output, mapping, header(args.from_bill, rates, command))
    except ValueError as exc:
        raise ConfigError([f"prices: {exc}"]) from exc
    for rate in rates.rates:
        print(f"{rate.instance_type} {rate.capacity_type}: {rate.per_hour:.6f} per instance-hour "
              f"({rate.hours:,.2f} hours of {rate.instances} instances)", file=sys.stderr)
    for what, found in (("instances whose type the bill does not name", rates.unknown),
                        ("instances with a cost and no usage hours (discount or credit lines alone)", rates.no_hours),
                        ("instances whose usage cost nothing (a Capacity Block's: its fee is the block's); hours",
                         rates.free)):
        if found:
            print(f"otelgpu: warning: {len(found)} {what}, not priced: {sum(found.values()):,.6f}", file=sys.stderr)
    hidden = shadowed(rates, base)
    if hidden and not args.per_instance:
        print(f"otelgpu: warning: per-GPU prices of the configuration beat these types' bill rates: "
              f"{', '.join(hidden)}; remove them or use --per-instance", file=sys.stderr)
    print(f"{args.output}: {len(rates.rates)} rates written", file=sys.stderr)
    return 0


def _check_config(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    prices = config.attribution.prices
    if prices.file:  # the sidecar reads it at the first interval: check it now too
        load_prices_file(prices.file, prices)
    print(f"{args.config}: ok")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from otelgpu.demo.run import run_demo

    run_demo(keep_running=args.keep_running, metrics_port=args.metrics_port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
