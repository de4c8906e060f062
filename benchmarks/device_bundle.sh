#!/usr/bin/env bash
# Builds what the lent GPU machine lacks, within its 64 MiB working-tree transfer: wheels for
# Python 3.12 x86-64 of the project's dependencies that its image does not hold (or holds at
# versions our generated protos refuse), and Ray without its Java jars, dashboard UI and
# libraries we do not use (rllib, data, serve, train, tune, llm). The model travels as its config
# and tokenizer only (benchmarks/shape_twin.py writes the random-weight twin there).
#
#   bash benchmarks/device_bundle.sh [DIR]      # DIR defaults to .dev (git-ignored via .git/info/exclude)
#
# On the device:  bash benchmarks/device_setup.sh  (unpacks into /tmp/site, writes the twin)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.dev}
mkdir -p "$dir/whl" "$dir/model"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
grep -qx "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >> "$exclude"
py=.venv/bin/python
version() { $py -c "import importlib.metadata as m; print(m.version('$1'))"; }
pkgs=(grpcio grpcio-health-checking grpcio-reflection protobuf jsonschema jsonschema-specifications
      referencing rpds-py fastapi starlette pydantic pydantic-core annotated-types annotated-doc
      typing-inspection uvicorn opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
      opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common opentelemetry-proto
      googleapis-common-protos ray)
specs=(); for p in "${pkgs[@]}"; do specs+=("$p==$(version "$p")"); done
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir/whl" "${specs[@]}"
# Ray: unpacked on the device from an xz tarball (half a zip's size) without what the cluster
# never loads; modes kept (raylet and gcs_server are executables).
ray_whl=$(ls "$dir"/whl/ray-*.whl)
$py - "$ray_whl" "$dir/ray.tar.xz" <<'PY'
import io, sys, tarfile, zipfile
DROP = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/data/", "ray/serve/", "ray/train/",
        "ray/tune/", "ray/llm/")
with zipfile.ZipFile(sys.argv[1]) as src, tarfile.open(sys.argv[2], "w:xz", preset=9) as dst:
    for info in src.infolist():
        if info.is_dir() or info.filename.startswith(DROP):
            continue
        member = tarfile.TarInfo(info.filename)
        data = src.read(info)
        member.size, member.mode = len(data), (info.external_attr >> 16) & 0o777 or 0o644
        dst.addfile(member, io.BytesIO(data))
PY
rm "$ray_whl"
# The default model's config and tokenizer (no weights) for the shape twin.
src=$($py -c "from engine.model_loader import default_model_gguf, ensure_converted; print(ensure_converted(default_model_gguf()))")
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  [ -f "$src/$f" ] && cp "$src/$f" "$dir/model/"
done
du -sh "$dir"
