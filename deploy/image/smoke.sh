#!/usr/bin/env bash
# Run the built image against a simulated replica on the host and check what a user
# would: it runs as non-root, /health and /ready answer, a completion goes through, the
# image's HEALTHCHECK passes, and SIGTERM (podman stop) drains and exits 0; the image
# holds neither the simulator nor the load tools.
#
#   bash deploy/image/smoke.sh [IMAGE]        (after deploy/image/build.sh)
#
# This sandbox (a Firecracker VM) refuses the container runtime's default rlimits, hence
# the explicit --ulimit values; and the runc runtime (crun needs cgroup v2 here).
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${1:-localhost/kvgate:dev}
PODMAN=(podman --runtime runc)
# Read-only root and a tmpfs /tmp, as the Kubernetes Deployment runs it.
RUN_OPTS=(--ulimit nofile=4096:4096 --ulimit nproc=4096:4096 --network host --read-only --tmpfs /tmp)
port() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P=$(port); G=$(port)
work=$(mktemp -d)
name=kvgate-smoke-$$
sim_pid=""
cleanup() {
  "${PODMAN[@]}" rm -f "$name" >/dev/null 2>&1 || true
  if [ -n "$sim_pid" ]; then kill "$sim_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

.venv/bin/python -m enginesim serve --profile tiny --port "$P" --speed 5 --log-level WARNING \
  >"$work/sim.log" 2>&1 &
sim_pid=$!
printf 'replicas:\n  - {name: r0, url: "http://127.0.0.1:%s"}\n' "$P" >"$work/kvgate.yaml"
chmod 644 "$work/kvgate.yaml"
for _ in $(seq 1 50); do curl -sf "http://127.0.0.1:$P/v1/models" >/dev/null && break; sleep 0.2; done

"${PODMAN[@]}" run -d --name "$name" "${RUN_OPTS[@]}" \
  -v "$work/kvgate.yaml:/etc/kvgate/kvgate.yaml:ro" -e "KVGATE_LISTEN=127.0.0.1:$G" "$IMAGE" >/dev/null
for _ in $(seq 1 50); do curl -sf "http://127.0.0.1:$G/ready" >/dev/null && break; sleep 0.2; done

echo "user:        $("${PODMAN[@]}" exec "$name" id -u 2>/dev/null)"
test "$("${PODMAN[@]}" exec "$name" id -u 2>/dev/null)" != 0
echo "health:      $(curl -sf "http://127.0.0.1:$G/health")"
echo "ready:       $(curl -sf "http://127.0.0.1:$G/ready")"
out=$(curl -sf "http://127.0.0.1:$G/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"tiny-llm","messages":[{"role":"user","content":"hi"}],"max_tokens":5}')
echo "completion:  $(echo "$out" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["usage"])')"
echo "healthcheck: $("${PODMAN[@]}" healthcheck run "$name" 2>/dev/null && echo healthy)"
for mod in enginesim loadtests kvgate_demo locust; do
  if "${PODMAN[@]}" exec "$name" python3 -c "import $mod" >/dev/null 2>&1; then
    echo "the image carries $mod" >&2; exit 1
  fi
done
echo "absent:      enginesim loadtests kvgate_demo locust"
"${PODMAN[@]}" stop -t 30 "$name" >/dev/null 2>&1
code=$("${PODMAN[@]}" inspect "$name" --format '{{.State.ExitCode}}' 2>/dev/null)
echo "SIGTERM exit: $code"
test "$code" = 0
"${PODMAN[@]}" logs "$name" 2>&1 | grep -c '"kvgate shutting down"' >/dev/null

# As the compose stack runs it: two workers on one port, shared state in Redis
# (REDIS_URL, default the local one), a request through each of several connections.
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
printf 'replicas:\n  - {name: r0, url: "http://127.0.0.1:%s"}\nstate: {backend: redis, key_prefix: smoke-%s}\n' \
  "$P" "$$" >"$work/kvgate-workers.yaml"
chmod 644 "$work/kvgate-workers.yaml"
"${PODMAN[@]}" rm -f "$name" >/dev/null 2>&1
"${PODMAN[@]}" run -d --name "$name" "${RUN_OPTS[@]}" \
  -v "$work/kvgate-workers.yaml:/etc/kvgate/kvgate.yaml:ro" -e "KVGATE_LISTEN=127.0.0.1:$G" \
  -e "KVGATE_REDIS_URL=$REDIS_URL" "$IMAGE" serve --config /etc/kvgate/kvgate.yaml --workers 2 >/dev/null
for _ in $(seq 1 50); do curl -sf "http://127.0.0.1:$G/ready" >/dev/null && break; sleep 0.2; done
sleep 1
ok=0
for _ in $(seq 1 10); do
  curl -sf "http://127.0.0.1:$G/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"tiny-llm","messages":[{"role":"user","content":"hi"}],"max_tokens":3}' >/dev/null && ok=$((ok + 1))
done
workers=$(for _ in $(seq 1 20); do curl -sf "http://127.0.0.1:$G/metrics" | grep -o 'worker="[0-9]*"' | head -1; done | sort -u | tr '\n' ' ')
echo "--workers 2: $ok/10 completions, metrics from: $workers"
test "$ok" = 10
"${PODMAN[@]}" stop -t 30 "$name" >/dev/null 2>&1
code=$("${PODMAN[@]}" inspect "$name" --format '{{.State.ExitCode}}' 2>/dev/null)
echo "--workers 2 SIGTERM exit: $code"
test "$code" = 0
echo "image smoke test passed"
