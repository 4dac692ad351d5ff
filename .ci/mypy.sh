#!/usr/bin/env bash
# mypy over the installed package's modules (settings in pyproject.toml, [tool.mypy]): every
# module of engramd.client, .server and .kernels except those pyproject lists as not type-checking
# yet, with their gaps. The folders client/, server/ and kernels/ are the package engramd.client,
# .server and .kernels (pyproject's package-dir), which mypy cannot map from a source tree: it
# reads them through a temporary engramd/ folder of links.
#
#   .ci/mypy.sh          the check CI runs (.ci/run); fails on any error
#   .ci/mypy.sh --gaps   the listed modules' errors counted per module (the list set aside), to
#                        see what is left and to take a module off the list once it has none
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/engramd"
for part in client server kernels; do ln -s "$repo/$part" "$tree/engramd/$part"; done
cd "$tree"
if [[ "${1:-}" != --gaps ]]; then
    exec python -m mypy --config-file "$repo/pyproject.toml" -p engramd
fi
# The same settings without the overrides that ignore the listed modules' errors.
python - "$repo/pyproject.toml" "$tree/all.toml" <<'PY'
import json
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

with open(sys.argv[1], "rb") as f:
    settings = tomllib.load(f)["tool"]["mypy"]
settings.pop("overrides", None)
with open(sys.argv[2], "w") as f:
    f.write("[tool.mypy]\n")
    for key, value in settings.items():
        f.write(f"{key} = {str(value).lower() if isinstance(value, bool) else json.dumps(value)}\n")
PY
{ python -m mypy --config-file "$tree/all.toml" -p engramd || true; } > "$tree/out"
grep ": error" "$tree/out" | cut -d: -f1 | sort | uniq -c | sort -rn || true
tail -n 1 "$tree/out"
