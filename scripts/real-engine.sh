#!/usr/bin/env bash
# A real llama.cpp llama-server and a tiny model for the test suite, both cached outside the
# repository (once per machine; a second run returns in seconds).
#
# llama.cpp comes from the PyPI sdist of llama-cpp-python, which vendors the whole llama.cpp
# tree (vendor/llama.cpp, with tools/server); Debian has no llama.cpp package and this
# machine reaches no other source. Only the llama-server target is built: CPU, Release,
# static, portable (GGML_NATIVE=OFF), no web UI, no OpenSSL: 12 minutes on 2 idle cores
# (measured 710 s of cmake + build; 986 s while other work shared the cores).
# The model is a random-weight Llama GGUF written by scripts/make_tiny_gguf.py.
#
# Prints, on stdout and nothing else:
#     KVGATE_LLAMA_SERVER=<path>
#     KVGATE_LLAMA_MODEL=<path>
#     KVGATE_LLAMA_TOKENIZER=<path>   (the model's tokenizer as a Hugging Face tokenizer.json)
# and writes the same lines to $KVGATE_CACHE/real-engine.env. Progress goes to stderr.
#
# Environment: KVGATE_CACHE (default ~/.cache/kvgate), KVGATE_BUILD_JOBS (default 2),
# KVGATE_PYTHON (a python with pip, gguf, numpy and tokenizers; default .venv/bin/python,
# which scripts/setup.sh makes).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

LLAMA_CPP_PYTHON_VERSION=0.3.36
CACHE=${KVGATE_CACHE:-$HOME/.cache/kvgate}
ENGINE_DIR=$CACHE/llama.cpp-py$LLAMA_CPP_PYTHON_VERSION
BIN=$ENGINE_DIR/bin/llama-server
JOBS=${KVGATE_BUILD_JOBS:-2}
PY=${KVGATE_PYTHON:-$repo/.venv/bin/python}

log() { echo "real-engine: $*" >&2; }

if [ ! -x "$PY" ]; then
  log "no $PY: run scripts/setup.sh first (or set KVGATE_PYTHON)"
  exit 1
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/real-engine.lock"
if ! flock -n 9; then
  log "another run holds $CACHE/real-engine.lock (building?); waiting"
  flock 9
fi

build_llama_server() {
  local work=$ENGINE_DIR/work src build started
  mkdir -p "$work"
  for tool in cmake g++ make; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      log "installing cmake g++ make with apt-get"
      (apt-get update -qq && apt-get install -y -qq cmake g++ make) >&2
      break
    fi
  done
  local sdist=$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
  if [ ! -f "$sdist" ]; then
    log "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist from PyPI"
    local dl
    dl=$(mktemp -d "$work/dl.XXXXXX")
    "$PY" -m pip download -q --no-binary :all: --no-deps -d "$dl" \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
    mv "$dl"/llama_cpp_python-*.tar.gz "$sdist"
    rm -rf "$dl"
  fi
  src=$work/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
  if [ ! -f "$src/tools/server/CMakeLists.txt" ]; then
    log "extracting vendor/llama.cpp"
    rm -rf "$work/src"
    mkdir -p "$work/src"
    tar -xzf "$sdist" -C "$work/src" "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
  fi
  build=$work/build
  started=$(date +%s)
  log "building llama-server with -j$JOBS (about 12 minutes on 2 idle cores; log: $work/build.log)"
  if ! {
    cmake -S "$src" -B "$build" \
      -DCMAKE_BUILD_TYPE=Release \
      -DBUILD_SHARED_LIBS=OFF \
      -DGGML_NATIVE=OFF \
      -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_TOOLS=ON &&
      cmake --build "$build" --config Release --target llama-server -j "$JOBS"
  } >"$work/build.log" 2>&1; then
    tail -n 40 "$work/build.log" >&2
    log "build FAILED; full log: $work/build.log"
    return 1
  fi
  mkdir -p "$ENGINE_DIR/bin"
  cp "$build/bin/llama-server" "$BIN.tmp"
  "$BIN.tmp" --version >&2
  mv "$BIN.tmp" "$BIN"
  echo "$(($(date +%s) - started))" >"$ENGINE_DIR/build-seconds"
  log "built $BIN in $(cat "$ENGINE_DIR/build-seconds") s"
  # The sdist stays (a rebuild needs no download); the sources and objects go.
  rm -rf "$work/src" "$build"
}

if [ ! -x "$BIN" ]; then
  build_llama_server
fi

# The model is named after the script that makes it: editing the script makes a new one.
model_key=$(sha256sum scripts/make_tiny_gguf.py | cut -c1-12)
MODEL=$CACHE/models/tiny-llama-$model_key.gguf
TOKENIZER=$CACHE/models/tiny-llama-$model_key.tokenizer.json
if [ ! -f "$MODEL" ] || [ ! -f "$TOKENIZER" ]; then
  log "writing the tiny model $MODEL"
  mkdir -p "$CACHE/models"
  "$PY" scripts/make_tiny_gguf.py --out "$MODEL.tmp" --tokenizer-out "$TOKENIZER.tmp" >&2
  mv "$TOKENIZER.tmp" "$TOKENIZER"
  mv "$MODEL.tmp" "$MODEL"
fi

printf 'KVGATE_LLAMA_SERVER=%s\nKVGATE_LLAMA_MODEL=%s\nKVGATE_LLAMA_TOKENIZER=%s\n' \
  "$BIN" "$MODEL" "$TOKENIZER" >"$CACHE/real-engine.env.tmp"
mv "$CACHE/real-engine.env.tmp" "$CACHE/real-engine.env"
cat "$CACHE/real-engine.env"
