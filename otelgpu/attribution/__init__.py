"""otelgpu attribution stage."""
