# syntax=docker/dockerfile:1
#
# docker build \
#   --build-arg GIT_COMMIT=$(git rev-parse --short HEAD) \
#   --build-arg BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ) \
#   --build-arg SOURCE_DATE_EPOCH=$(git log -1 --format=%ct) \
#   -t ghcr.io/kiamfast/kiamfast:0.1.0 .
#
# Reproducible: one pinned base image for both stages (pin its digest too in a release build:
# --build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:...), no pip or apt caches,
# wheel timestamps from SOURCE_DATE_EPOCH, build facts only from build args.
# tests/deploy/test_image.py lints this file with hadolint and runs the wheel's entry point.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- build: the kiamfast wheel (Cython extensions compiled here) and its dependencies ----
FROM ${PYTHON_IMAGE} AS builder
# DL3008 (pin apt versions) ignored: Debian stable replaces a package version when a security
# update lands and the old one leaves the mirror, so a pinned build breaks that day; the base
# image pin fixes the distribution release instead.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
ARG SOURCE_DATE_EPOCH=0
ENV SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH} \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# ---- runtime: the wheel and its dependencies, no compiler, no source tree ----
FROM ${PYTHON_IMAGE}
# iptables ships both backends (iptables-nft, iptables-legacy); the agent uses the one the
# node's kube-proxy uses (--iptables-backend=auto).
# DL3008 ignored: as in the build stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables \
 && rm -rf /var/lib/apt/lists/*
# The wheels are bind-mounted from the build stage, so no layer of this image holds them.
# /bin/kube2iam: manifests that name kube2iam's binary in `command:` keep working unchanged.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/kiamfast-*.whl \
 && ln -s "$(command -v kiamfast)" /bin/kube2iam
ARG GIT_COMMIT=unknown
ARG BUILD_DATE=unknown
ENV KIAMFAST_GIT_COMMIT=${GIT_COMMIT} \
    KIAMFAST_BUILD_DATE=${BUILD_DATE} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TZ=UTC
# DL3002 (last USER should not be root) ignored: installing the DNAT rule needs uid 0 with
# NET_ADMIN; the DaemonSet drops every other capability. Numeric, so no passwd lookup.
# hadolint ignore=DL3002
USER 0
EXPOSE 8181
ENTRYPOINT ["kiamfast"]
