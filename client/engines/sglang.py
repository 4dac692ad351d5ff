"""The SGLang plugin: DeepSeek-V4.1 in SGLang takes its Engram rows from engramd.

    pip install engramd            # beside sglang==0.5.23; registers the plugin
    ENGRAMD_SOCKET=/run/engramd/engramd.sock python -m sglang.launch_server --model-path ...

SGLang runs `register()` early in every one of its processes (the `sglang.srt.plugins` entry
point `engramd`; `SGLANG_PLUGINS` may filter it). Without `ENGRAMD_SOCKET` it does nothing. With
it, it checks that the installed SGLang is a version this plugin was written against, that every
seam it replaces or relies on has the signature it expects, and that none of SGLang's other
Engram table placements (host table, scheduler staging, peer shards) is switched on, and raises
`SglangPluginError` naming what is wrong otherwise. Then it replaces, on SGLang's
`EngramEmbedding` class, the methods that own the table, and wraps `EngramHasher.forward` so that
a step's hash IDs make one lookup of every layer (engramd.client.engines.sglang_engram holds the
replacements and says what each does). The other settings (ENGRAMD_MODE, ENGRAMD_HOT_CACHE_GIB,
ENGRAMD_GATHER_AT) are the vLLM plugin's (engramd.client.engines.shared).

SGLang's plugin loader logs a plugin that raises and goes on, so a failed check (or any other
failure of `register()`, an engramd client that cannot be imported among them) also makes
SGLang's `EngramEmbedding` refuse to build (with the same message): the server stops at model
construction rather than serving its own tables while ENGRAMD_SOCKET names the daemon's.

What it is not: the replacements, and nothing of SGLang's hashing (the hash IDs are SGLang's,
computed by its `EngramHasher`).
"""

from __future__ import annotations

import importlib
import logging

from engramd.client.engines import shared
from engramd.client.engines.shared import SOCKET_ENV, PluginError, enabled

log = logging.getLogger("engramd.sglang")

SUPPORTED_SGLANG = ("0.5.23",)
ENGRAM_MODULE = "sglang.srt.layers.engram"

# The seams of SGLang's Engram code the plugin replaces or relies on, with their parameters.
SEAMS: tuple[shared.Seam, ...] = (
    ("EngramEmbedding", "__init__", ("self", "num_embeddings", "dim", "layer_id",
                                     "column_bounds")),
    ("EngramEmbedding", "_owned_rows", ("self", "indices")),
    ("EngramEmbedding", "enable_scheduler_staging", ("self",)),
    ("EngramEmbedding", "_lookup", ("self", "indices")),
    ("EngramEmbedding", "_dp_sharded_lookup", ("self", "indices", "forward_batch")),
    ("EngramEmbedding", "forward", ("self", "indices", "forward_batch", "cp_all_tokens")),
    ("EngramEmbedding", "new_rows", ("self", "indices")),
    ("EngramEmbedding", "finish_load", ("self", "label")),
    ("Engram", "__init__", ("self", "config", "layer_id", "layout", "quant_config", "prefix",
                            "image_token_id")),
    ("Engram", "embed_rows", ("self", "hash_ids", "forward_batch", "cp_all_tokens")),
    ("EngramHasher", "forward", ("self", "input_ids", "forward_batch")),
    (None, "eager_on_graph", ("fn", "capture_stub", "enable")),
)

# Calls the replacements depend on: SGLang's method must still make them (names it looks up).
CALLS: tuple[tuple[str, str, str], ...] = (
    ("Engram", "__init__", "EngramEmbedding"),
    ("EngramEmbedding", "forward", "_lookup"),
    ("EngramEmbedding", "forward", "peer"),  # the table-placement branches the plugin turns off
    ("EngramEmbedding", "forward", "_shared"),
    ("EngramEmbedding", "_lookup", "_owned_rows"),
    ("EngramEmbedding", "_dp_sharded_lookup", "_owned_rows"),
)

# SGLang's other places for the table: each reads a table the plugin does not allocate.
REFUSED_ENV = {
    "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "SGLang's own host-memory table",
    "SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING": "rows staged by SGLang's scheduler from its host table",
    "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS": "SGLang's own peer-mapped device shards",
}


class SglangPluginError(PluginError):
    """The installed SGLang is not one the engramd plugin can serve, or serving it failed."""


def register() -> None:
    """The `sglang.srt.plugins` entry point: with ENGRAMD_SOCKET set, check SGLang and install."""
    if not enabled():
        return
    try:
        settings = _checked_settings()
        engram = importlib.import_module(ENGRAM_MODULE)
        from engramd.client.engines import sglang_engram

        installed = sglang_engram.install(engram, settings)
    except Exception as exc:  # SGLang's loader would log it and go on with its own tables
        error = _plugin_error(exc)
        _refuse_engram_tables(error)
        if error is exc:
            raise
        raise error from exc
    if installed:
        log.info("engramd plugin installed: Engram rows come from the daemon at %s",
                 settings.socket)


def _plugin_error(exc: Exception) -> PluginError:
    if isinstance(exc, SglangPluginError):
        return exc
    if isinstance(exc, ImportError):
        return shared.client_import_error(exc, "SGLang", SglangPluginError)
    return SglangPluginError(f"{SOCKET_ENV} is set but installing the engramd plugin failed "
                             f"({type(exc).__name__}: {exc}); refusing to build Engram tables.")


def _checked_settings() -> shared.Settings:
    from sglang.version import __version__

    check_version(__version__)
    check_environment()
    check_seams(importlib.import_module(ENGRAM_MODULE))
    return shared.Settings.from_environment(SglangPluginError)


def _refuse_engram_tables(error: PluginError) -> None:
    """SGLang's loader logs a plugin's exception and goes on: make building an Engram table
    raise the same error, so the server stops at model construction instead of serving its own
    tables while ENGRAMD_SOCKET says the daemon's."""
    try:
        cls = importlib.import_module(ENGRAM_MODULE).EngramEmbedding
    except (ImportError, AttributeError):
        return  # no SGLang Engram code to build a table with

    def refuse(*args, **kwargs):
        raise SglangPluginError(str(error))

    cls.__init__ = refuse


def check_version(version: str) -> None:
    shared.check_version("SGLang", version, SUPPORTED_SGLANG, SglangPluginError)


def check_environment() -> None:
    """Refuse SGLang's other Engram table placements: each reads a local table there is none of."""
    from sglang.srt.environ import envs

    on = [name for name in REFUSED_ENV if getattr(envs, name).get()]
    if on:
        raise SglangPluginError(
            f"{SOCKET_ENV} is set, so the Engram table is the engramd daemon's, but "
            + "; ".join(f"{name} asks for {REFUSED_ENV[name]}" for name in on)
            + f": unset {' and '.join(on)} (engramd serves the rows), or unset {SOCKET_ENV}.")


def check_seams(engram_module) -> None:
    """Raise SglangPluginError listing every seam that is missing or changed."""
    changes = [*shared.signature_changes(engram_module, SEAMS),
               *shared.call_changes(engram_module, CALLS)]
    if changes:
        raise SglangPluginError(
            f"{SOCKET_ENV} is set but SGLang's Engram code ({ENGRAM_MODULE}) is not what the "
            f"engramd plugin was written against: {'; '.join(changes)}. Refusing to serve "
            "Engram rows.")
