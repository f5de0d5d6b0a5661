"""otelgpu receiver stage."""
