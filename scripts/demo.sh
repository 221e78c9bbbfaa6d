#!/usr/bin/env bash
# The demo: set up, then run kvgate's demo on embedded simulated replicas.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvgate demo "$@"
