"""otelgpu enrich stage."""
