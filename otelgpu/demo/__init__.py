"""`otelgpu demo`: the real sidecar, fed a realistic cluster through a real OTLP client."""
