# kvgate gateway image. Build: docker build -t kvgate .
# Run:   docker run -p 8080:8080 -v $PWD/kvgate.yaml:/etc/kvgate/kvgate.yaml:ro \
#          -e KVGATE_ADMIN_TOKEN=... kvgate
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/kvgate
COPY pyproject.toml README.md ./
COPY gateway/ gateway/
COPY admission/ admission/
COPY routing/ routing/
COPY enginesim/ enginesim/
COPY loadtests/ loadtests/
RUN pip install . && useradd --system --uid 10001 kvgate

USER kvgate
# Listen on all interfaces inside the container; the config's listen section or
# KVGATE_LISTEN can change it.
ENV KVGATE_LISTEN=0.0.0.0:8080
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=2s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/health').status != 200)"
ENTRYPOINT ["kvgate", "serve", "--config", "/etc/kvgate/kvgate.yaml"]
