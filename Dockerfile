# kvgate gateway image: the gateway only (gateway, admission, routing and their runtime
# dependencies); the simulator, the load tools and the demo harness are not in it.
#
#   docker build -t kvgate .            (or: podman build -t kvgate .)
#   docker run --stop-timeout 40 -p 8080:8080 -v $PWD/kvgate.yaml:/etc/kvgate/kvgate.yaml:ro \
#       -e KVGATE_ADMIN_TOKEN=... kvgate
# (SIGTERM drains running requests for shutdown.drain_grace_s, 25 s by default: the stop
# timeout must be longer.)
#
# BASE is any Debian-based image with python3 (3.11+) and its venv module: the default is
# the official slim Python image; deploy/image/build.sh builds on a base made with
# mmdebstrap where no registry is reachable.
ARG BASE=python:3.12-slim-bookworm

FROM ${BASE} AS build
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway/ gateway/
COPY admission/ admission/
COPY routing/ routing/
# A plain (non-editable) install into a venv that the runtime stage copies whole; only
# the three gateway packages exist in this context, so only they are installed.
RUN python3 -m venv /opt/kvgate \
 && /opt/kvgate/bin/pip install --no-compile . \
 && /opt/kvgate/bin/pip uninstall -y pip \
 && find /opt/kvgate -depth -name '__pycache__' -exec rm -rf {} + \
 && /opt/kvgate/bin/python -c "import gateway.cli, admission, routing" \
 && ! /opt/kvgate/bin/python -c "import enginesim" 2>/dev/null \
 && ! /opt/kvgate/bin/python -c "import loadtests" 2>/dev/null

FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/kvgate/bin:$PATH \
    KVGATE_LISTEN=0.0.0.0:8080
COPY --from=build /opt/kvgate /opt/kvgate
COPY deploy/kvgate.example.yaml /etc/kvgate/kvgate.yaml
# Non-root, by number (no passwd entry needed); the config is read-only to it.
USER 10001:10001
EXPOSE 8080
# /health answers 200 while the process serves (liveness); /ready is for load balancers.
# The port is KVGATE_LISTEN's (the config's listen section is overridden by it).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python3", "-c", "import os, sys, urllib.request as u; port = os.environ.get('KVGATE_LISTEN', ':8080').rpartition(':')[2]; sys.exit(u.urlopen(f'http://127.0.0.1:{port}/health', timeout=2).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvgate"]
CMD ["serve", "--config", "/etc/kvgate/kvgate.yaml"]
