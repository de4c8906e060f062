#!/usr/bin/env bash
# Installs everything (scripts/install.sh) and serves the embedded default model
# (SmolLM2-135M-Instruct): 1 prefill + 1 decode worker, gRPC on 127.0.0.1:50051, metrics on
# :9400. Extra arguments go to `pdserve serve` (see `pdserve serve --help`). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/pdserve serve "$@"
