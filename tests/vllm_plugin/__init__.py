"""The vLLM plugin's tests: a package, so that its conftest is not the top-level `conftest` that
the main tests (and the processes they spawn) import."""
