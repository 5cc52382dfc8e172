# syntax=docker/dockerfile:1
#
# docker build \
#   --build-arg GIT_COMMIT=$(git rev-parse --short HEAD) \
#   --build-arg BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ) \
#   -t ghcr.io/kiamfast/kiamfast:0.1.0 .

# ---- build: the kiamfast wheel (Cython extensions compiled here) and its dependencies ----
FROM python:3.11-slim AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# ---- runtime ----
FROM python:3.11-slim
# iptables ships both backends (iptables-nft, iptables-legacy); the agent uses the one the
# node's kube-proxy uses (--iptables-backend=auto).
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels kiamfast \
 && rm -rf /wheels \
 && ln -s "$(command -v kiamfast)" /bin/kube2iam
# /bin/kube2iam: manifests that name kube2iam's binary in `command:` keep working unchanged.
ARG GIT_COMMIT=unknown
ARG BUILD_DATE=unknown
ENV KIAMFAST_GIT_COMMIT=${GIT_COMMIT} \
    KIAMFAST_BUILD_DATE=${BUILD_DATE} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TZ=UTC
# Installing the DNAT rule needs root (with NET_ADMIN); the DaemonSet drops every other
# capability.
USER root
EXPOSE 8181
ENTRYPOINT ["kiamfast"]
