"""`otelgpu nvml`: every interval, read the node's GPUs and who holds them, and export the series.

In `auto` mode the agent first asks whether a dcgm-exporter answers on the node (`--dcgm-url`):
while one does, it exports nothing (dcgm-exporter's series are richer, and two sources of the same
GPUs would report them twice); once none does, it exports, and it steps back when one answers
again. Each switch is logged. `nvml` mode always exports.
"""

from __future__ import annotations

import http.client
import logging
import os
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Optional

import pynvml

from otelgpu.nvml import DEFAULT_DCGM_URL, DEFAULT_POD_RESOURCES_SOCKET
from otelgpu.nvml.export import OtlpSeries
from otelgpu.nvml.holders import Holder, Key, holders_by_key
from otelgpu.nvml.podresources import PodResourcesClient, PodResourcesUnavailable
from otelgpu.nvml.procpods import ProcessPods
from otelgpu.nvml.reader import NvmlReader, NvmlUnavailable, Reading
from otelgpu.nvml.series import points

log = logging.getLogger("otelgpu.nvml")

FAILED_READINGS_TO_EXIT = 3  # in a row: a driver upgrade the container's library cannot follow


class NvmlGone(RuntimeError):
    """NVML keeps failing: the agent ends (status 1) for the kubelet to start it afresh."""


class DcgmProbe:
    """Whether a dcgm-exporter answers at `url`: a 200 whose body has a DCGM field in it (not any
    server that happens to listen on the port). Never through a proxy: the exporter is local."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url, self._timeout = url, timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def answers(self) -> bool:
        try:
            with self._opener.open(self.url, timeout=self._timeout) as reply:
                return reply.status == 200 and b"DCGM_FI_" in reply.read(1 << 20)
        except (OSError, http.client.HTTPException, ValueError):  # refused, timed out, not HTTP at all
            return False


class PodMapper:
    """Holders from the kubelet's pod-resources API; while it is unavailable, from the cgroups of
    the processes on each device (procpods); each change of source is logged."""

    def __init__(self, client: PodResourcesClient, processes: ProcessPods) -> None:
        self._client, self._processes = client, processes
        self._source = ""

    def holders(self, readings: tuple[Reading, ...]) -> dict[Key, list[Holder]]:
        try:
            found = holders_by_key(self._client.list(), readings)
            self._switch("pod-resources", f"pods from the kubelet's pod-resources API ({self._client.socket})")
            return found
        except PodResourcesUnavailable as exc:
            self._switch("processes", f"pod-resources unavailable ({exc}): pods from the cgroups of the GPUs' "
                                      f"processes, named from {self._processes.container_logs}")
            return self._processes.holders_by_key(readings)

    def _switch(self, source: str, message: str) -> None:
        if source != self._source:
            self._source = source
            log.info("pod mapping: %s", message)

    def close(self) -> None:
        self._client.close()


@dataclass(frozen=True)
class Options:
    node: str
    interval_s: float = 30.0
    mode: str = "auto"
    dcgm_url: str = DEFAULT_DCGM_URL
    pod_resources_socket: str = DEFAULT_POD_RESOURCES_SOCKET
    # Keep NVML started between readings. Off, it is started for each reading and shut down after,
    # so the driver's device files are not held open between readings: a driver upgrade can unload
    # the kernel modules without evicting the agent.
    hold_nvml: bool = False


class Agent:
    def __init__(self, options: Options, reader: NvmlReader, series: OtlpSeries, mapper: PodMapper,
                 probe: Optional[DcgmProbe] = None) -> None:
        self.options, self.reader, self.series, self.mapper = options, reader, series, mapper
        self.probe = probe if probe is not None else DcgmProbe(options.dcgm_url)
        self._exporting: Optional[bool] = None
        self._failed = 0  # readings failed in a row: NVML is started afresh before the next one

    def should_export(self) -> bool:
        if self.options.mode == "nvml":
            return True
        exporting = not self.probe.answers()
        if exporting != self._exporting:
            log.info("no dcgm-exporter answers at %s: exporting NVML's series" if exporting else
                     "dcgm-exporter answers at %s: NVML's series paused while it does", self.probe.url)
        self._exporting = exporting
        return exporting

    def cycle(self) -> int:
        """One reading exported (unless paused); the number of points exported."""
        if not self.should_export():
            return 0
        try:
            if self._failed or not self.reader.opened:  # after a failure (a driver reloaded): afresh
                self.reader.close()
                self.reader.open()
            snapshot = self.reader.read()
        except (pynvml.NVMLError, NvmlUnavailable) as exc:
            self._failed += 1
            if self._failed >= FAILED_READINGS_TO_EXIT:
                raise NvmlGone(f"NVML failed {self._failed} readings in a row ({exc}): exiting, so that the "
                               "container starts again with the node's driver library (after a driver upgrade, "
                               "the library it was given no longer matches the driver)") from None
            if self._failed == 1:
                log.warning("NVML: reading the GPUs failed (%s): nothing exported until NVML starts again; "
                            "it is started afresh each cycle", exc)
            return 0
        finally:
            if not self.options.hold_nvml:
                self.reader.close()
        if self._failed:
            log.info("NVML: reading the GPUs again")
            self._failed = 0
        found = points(snapshot, self.options.node, self.mapper.holders(snapshot.readings))
        self.series.publish(found)
        return len(found)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            self.cycle()
            stop.wait(max(0.0, self.options.interval_s - (time.monotonic() - started)))


def run(options: Options, series: OtlpSeries, nvml_library: Optional[str] = None) -> int:
    """The agent until SIGTERM or SIGINT; 1 with a one-line reason when NVML cannot be used."""
    reader = NvmlReader(nvml_library)
    try:
        driver = reader.open()
    except NvmlUnavailable as exc:
        series.shutdown()
        print(f"otelgpu nvml: {exc}", file=sys.stderr)
        return 1
    log.info("NVML ready (driver %s); node %s, every %gs, mode %s, NVML %s between readings", driver, options.node,
             options.interval_s, options.mode, "held" if options.hold_nvml else "released")
    if not options.hold_nvml:
        reader.close()
    # As `serve`: the signals wait for sigwait in this thread, blocked before the loop's thread starts.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    mapper = PodMapper(PodResourcesClient(options.pod_resources_socket), ProcessPods())
    stop, failed = threading.Event(), threading.Event()
    agent = Agent(options, reader, series, mapper)

    def loop() -> None:
        try:
            agent.run(stop)
        except NvmlGone as exc:
            log.error("%s", exc)
            failed.set()
            os.kill(os.getpid(), signal.SIGTERM)
        except BaseException:  # a fault of the agent itself: end the process, never hang in sigwait
            log.exception("the NVML agent failed")
            failed.set()
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=loop, name="nvml-agent")
    thread.start()
    received = signal.sigwait(stop_signals)
    if not failed.is_set():
        log.info("%s received, stopping", signal.Signals(received).name)
    stop.set()
    thread.join()
    series.shutdown()
    mapper.close()
    reader.close()
    return 1 if failed.is_set() else 0
