"""otelgpu exporter stage."""
