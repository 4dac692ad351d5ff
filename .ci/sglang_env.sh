#!/usr/bin/env bash
# Build the environment the SGLang plugin's tests run in (.ci/plugin_env.sh says how):
#   .ci/sglang_env.sh [DIR]      (default: .venv-sglang in the repository)
#   DIR/bin/python -m pytest -q tests/sglang_plugin
exec "$(dirname "$0")/plugin_env.sh" sglang "$@"
