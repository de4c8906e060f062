#!/usr/bin/env bash
# Installs everything and runs the whole test suite (fast tier, then the slow end-to-end tier).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export RAY_AUTH_MODE=disabled
python3 -m pytest -q -p no:cacheprovider "$@"
