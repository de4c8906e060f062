#!/usr/bin/env bash
# On the lent GPU machine: installs what benchmarks/device_bundle.sh carried into /tmp/site and
# writes SmolLM2's shape twin (random weights, real shapes and tokenizer) to /tmp/twin.
# Source it, so PYTHONPATH reaches the caller:   source benchmarks/device_setup.sh [DIR]
dir=${1:-.dev}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/whl/*.whl
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/tmp/site', filter='tar')" "$dir/ray.tar.xz"
export PYTHONPATH="/tmp/site:$PWD" RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
python3 -m benchmarks.shape_twin "$dir/model" /tmp/twin
