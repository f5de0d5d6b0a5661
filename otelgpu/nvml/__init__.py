"""The NVML source: `otelgpu nvml`, a per-node agent for GPU nodes without dcgm-exporter.

It reads the node's GPUs and MIG instances with NVML (reader), learns which pod holds each one
from the kubelet's pod-resources API (podresources, holders) or, failing that, from the cgroups of
the processes on the device (procpods), and exports the series dcgm-exporter would have given
(series) over OTLP with the OpenTelemetry SDK (export), so that the sidecar takes them as dcgm
data. The loop and the choice between it and a dcgm-exporter on the node are in agent.
"""

DEFAULT_DCGM_URL = "http://localhost:9400/metrics"  # where dcgm-exporter listens by default
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
MODES = ("auto", "nvml")
