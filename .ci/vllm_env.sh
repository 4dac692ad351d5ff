#!/usr/bin/env bash
# Build the environment the vLLM plugin's tests run in (.ci/plugin_env.sh says how):
#   .ci/vllm_env.sh [DIR]        (default: .venv-vllm in the repository)
#   DIR/bin/python -m pytest -q tests/vllm_plugin
exec "$(dirname "$0")/plugin_env.sh" vllm "$@"
