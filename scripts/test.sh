#!/usr/bin/env bash
# Installs everything (scripts/install.sh) and runs the whole test suite: the fast tier, then
# the slow tier (real SmolLM2 model, real cluster). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export RAY_AUTH_MODE=disabled   # local test clusters run without Ray's token auth
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"   # durations: where CI time goes (20-minute budget)
