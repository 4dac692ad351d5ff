#!/usr/bin/env bash
# mypy over the installed package's modules (settings in pyproject.toml, [tool.mypy]). The
# folders client/, server/ and kernels/ are the package engramd.client, .server and .kernels
# (pyproject's package-dir), which mypy cannot map from a source tree: it reads them through a
# temporary engramd/ folder of links.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/engramd"
for part in client server kernels; do ln -s "$repo/$part" "$tree/engramd/$part"; done
cd "$tree"
python -m mypy --config-file "$repo/pyproject.toml" -p engramd
