#!/usr/bin/env bash
# The coding agents the test suite runs through kvgate: the Codex CLI (OpenAI's Responses
# API) and Claude Code (Anthropic's Messages API), installed from npm at pinned versions
# into a cache outside the repository (once per machine; a second run returns at once).
# Both packages ship their native binary as an npm dependency (nothing is downloaded from
# elsewhere); Claude Code's own postinstall, which only links that binary into place, is
# the one install script run.
#
# Prints, on stdout and nothing else:
#     KVGATE_CODEX=<the codex executable>
#     KVGATE_CLAUDE=<the claude executable>
# and writes the same lines to $KVGATE_CACHE/coding-agents.env. Progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

CODEX_VERSION=0.171.0
CLAUDE_CODE_VERSION=2.1.197
CACHE=${KVGATE_CACHE:-$HOME/.cache/kvgate}
DIR=$CACHE/coding-agents-codex$CODEX_VERSION-claude$CLAUDE_CODE_VERSION
DONE=$DIR/installed

mkdir -p "$CACHE"
exec 9>"$CACHE/coding-agents.lock"
flock 9
if [ ! -f "$DONE" ]; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "coding-agents: installing node and npm (Debian)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm) >&2
  fi
  echo "coding-agents: npm install @openai/codex@$CODEX_VERSION @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >&2
  rm -rf "$DIR"
  mkdir -p "$DIR"
  npm install --prefix "$DIR" --no-audit --no-fund --ignore-scripts \
    "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >&2
  (cd "$DIR/node_modules/@anthropic-ai/claude-code" && node install.cjs) >&2
  "$DIR/node_modules/.bin/codex" --version >&2
  "$DIR/node_modules/.bin/claude" --version >&2
  touch "$DONE"
fi
{
  echo "KVGATE_CODEX=$DIR/node_modules/.bin/codex"
  echo "KVGATE_CLAUDE=$DIR/node_modules/.bin/claude"
} | tee "$CACHE/coding-agents.env"
