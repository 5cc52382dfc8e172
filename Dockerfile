# syntax=docker/dockerfile:1
#
# deploy/image/build.sh builds this with buildah (no docker engine needed); with docker:
#
# docker build \
#   --secret id=ca-certificates,src=/etc/ssl/certs/ca-certificates.crt \
#   --build-arg GIT_COMMIT=$(git rev-parse --short HEAD) \
#   --build-arg BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ) \
#   --build-arg SOURCE_DATE_EPOCH=$(git log -1 --format=%ct) \
#   -t ghcr.io/kiamfast/kiamfast:0.1.0 .
#
# The base is debian:bookworm-slim with Debian's python3, in a venv (PEP 668: Debian's python
# refuses packages from pip outside one). Reproducible: one base image for every stage (pin
# its digest in a release build: --build-arg BASE_IMAGE=debian:bookworm-slim@sha256:...), no
# pip or apt caches, wheel timestamps from SOURCE_DATE_EPOCH, build facts only from build args.
# The ca-certificates secret is optional: a CA bundle for pip behind a TLS-intercepting proxy.
# tests/deploy/test_image.py lints this file; tests/image builds and runs the image.

ARG BASE_IMAGE=debian:bookworm-slim

# ---- python: Debian's python3 and the venv every later stage uses ----
FROM ${BASE_IMAGE} AS python
# DL3008 (pin apt versions) ignored: Debian stable replaces a package version when a security
# update lands and the old one leaves the mirror, so a pinned build breaks that day; the base
# image pin fixes the distribution release instead.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# ---- build: the kiamfast wheel (Cython extensions compiled here) and its dependencies ----
FROM python AS builder
# DL3008 ignored: as in the python stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates gcc python3-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The dependencies' wheels and the build tools first, in a layer that only pyproject.toml
# invalidates: a source change rebuilds kiamfast alone, without going to PyPI again.
COPY pyproject.toml .
RUN --mount=type=secret,id=ca-certificates,target=/etc/ssl/certs/ca-certificates.crt \
    python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); \
print(*p["project"]["dependencies"], *p["build-system"]["requires"], sep="\n")' \
        >/tmp/requirements.txt \
 && pip wheel --no-cache-dir --wheel-dir /wheels -r /tmp/requirements.txt \
 && pip install --no-cache-dir --no-index --find-links=/wheels -r /tmp/requirements.txt
COPY . .
ARG SOURCE_DATE_EPOCH=0
ENV SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH}
RUN pip wheel --no-cache-dir --no-index --no-deps --no-build-isolation --wheel-dir /wheels . \
 && sha256sum /wheels/*.whl >/wheels.sha256

# ---- runtime: the wheel and its dependencies in the venv, no compiler, no source tree ----
FROM python
# iptables ships both backends (iptables-nft, iptables-legacy); the agent uses the one the
# node's kube-proxy uses (--iptables-backend=auto).
# DL3008 ignored: as in the python stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables iproute2 \
 && rm -rf /var/lib/apt/lists/*
# The wheels are bind-mounted from the build stage, so no layer of this image holds them; their
# checksums are copied first because buildah (1.28) reuses a cached RUN whatever its bind
# mount holds, while a COPY's cache follows the content: new wheels, new install.
# /bin/kube2iam: manifests that name kube2iam's binary in `command:` keep working unchanged.
COPY --from=builder /wheels.sha256 /opt/venv/wheels.sha256
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    sha256sum --quiet --check /opt/venv/wheels.sha256 \
 && pip install --no-cache-dir --no-index --find-links=/wheels /wheels/kiamfast-*.whl \
 && ln -s "$(command -v kiamfast)" /bin/kube2iam
ARG GIT_COMMIT=unknown
ARG BUILD_DATE=unknown
ENV KIAMFAST_GIT_COMMIT=${GIT_COMMIT} \
    KIAMFAST_BUILD_DATE=${BUILD_DATE} \
    PYTHONUNBUFFERED=1 \
    TZ=UTC
# DL3002 (last USER should not be root) ignored: installing the DNAT rule needs uid 0 with
# NET_ADMIN; the DaemonSet drops every other capability. Numeric, so no passwd lookup.
# hadolint ignore=DL3002
USER 0
EXPOSE 8181
ENTRYPOINT ["kiamfast"]
