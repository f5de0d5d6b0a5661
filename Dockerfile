# otelgpu's image: a slim Python base, the package in a virtual environment, numba's kernels
# compiled at build time, a non-root user. Build and push (linux/amd64, where EKS GPU nodes are):
#   docker buildx build --platform linux/amd64 -t <account>.dkr.ecr.<region>.amazonaws.com/otelgpu:0.1.0 .
# The manifests in k8s/ run it with a read-only root filesystem as uid 10001.

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY otelgpu ./otelgpu
RUN python -m venv /opt/otelgpu \
 && /opt/otelgpu/bin/pip install --no-cache-dir --no-compile .

FROM python:3.11-slim-bookworm
COPY --from=build /opt/otelgpu /opt/otelgpu
# NUMBA_CPU_NAME=generic: the cached kernels target any x86-64 CPU, so a cache built here still
# loads on the node's CPU (otherwise numba would find it built for another CPU and compile again).
# numba only reads a cache from a directory it may write to, so pods copy this one to an emptyDir
# and point NUMBA_CACHE_DIR there (k8s/gateway/deployment.yaml, the numba-cache init container).
# MALLOC_ARENA_MAX=2: glibc gives each busy thread (receivers, exporters) a heap arena of its own
# by default, and freed memory stays spread over them; two arenas cut the steady RSS of a
# 10,000-GPU gateway by about 100 MiB (benchmarks/bench_scale.py).
ENV PATH=/opt/otelgpu/bin:$PATH \
    MALLOC_ARENA_MAX=2 \
    NUMBA_CACHE_DIR=/opt/otelgpu/numba-cache \
    NUMBA_CPU_NAME=generic \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN python -m compileall -q /opt/otelgpu/lib \
 && otelgpu warm-up \
 && chmod -R a+rX /opt/otelgpu/numba-cache \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin otelgpu
USER 10001:10001
# 4317 OTLP/gRPC, 4318 OTLP/HTTP, 9464 /metrics /healthz /readyz
EXPOSE 4317 4318 9464
ENTRYPOINT ["otelgpu"]
CMD ["serve", "--config", "/etc/otelgpu/otelgpu.yaml"]
