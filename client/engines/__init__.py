"""engramd's engine plugins: an engine's worker becomes an engramd client with one setting.

    vllm.py, vllm_engram.py      vLLM 0.33 (entry point `engramd` in `vllm.general_plugins`)
    sglang.py, sglang_engram.py  SGLang 0.5.23 (entry point `engramd` in `sglang.srt.plugins`)
    shared.py                    what both share: the settings, the checks, failing closed

Each engine's first module is what its entry point loads: it imports nothing of the engine's
Engram code and changes nothing until `ENGRAMD_SOCKET` is set; the second holds the
replacements, imported only then. docs/engines.md says what each replaces and refuses.
"""
