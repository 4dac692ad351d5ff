"""The SGLang plugin against SGLang 0.5.23's own Engram modules (its own environment: .ci/sglang_env.sh)."""
