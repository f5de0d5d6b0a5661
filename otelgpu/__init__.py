"""otelgpu: GPU cost attribution for Kubernetes, as an OpenTelemetry Collector-compatible sidecar."""

__version__ = "0.1.0"
