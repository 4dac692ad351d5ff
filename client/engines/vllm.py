"""The vLLM plugin: DeepSeek-V4.1 in vLLM takes its Engram rows from engramd.

    pip install engramd            # beside vllm==0.33.0; registers the plugin
    ENGRAMD_SOCKET=/run/engramd/engramd.sock vllm serve deepseek-ai/DeepSeek-V4.1-Flash ...

vLLM runs `register()` once in every one of its processes (the `vllm.general_plugins` entry
point `engramd`; `VLLM_PLUGINS` may filter it). Without `ENGRAMD_SOCKET` it does nothing. With
it, it first checks that the installed vLLM is a version this plugin was written against and that
every seam it replaces has the signature it expects, and raises `VllmPluginError` naming what
changed otherwise: a seam that moved would otherwise leave the model reading a table nobody
loaded. Then it replaces, on vLLM's `Engram` class, the methods that own the table
(engramd.client.engines.vllm_engram holds the replacements and says what each does).
`ENGRAMD_MODE` (auto | served | mapped, default auto) picks the client mode;
`ENGRAMD_HOT_CACHE_GIB` caps a mapped client's own hot-row cache (0: none; unset: the daemon's
`mapped_hot_cache_gib`), for a vLLM that leaves its GPU little memory beside the KV cache.
`ENGRAMD_GATHER_AT` (wait | lookup, default wait) is the client's `gather_at`: where a mapped
client queues its gather, at the first Engram layer's wait for the rows or at the lookup.
`ENGRAMD_CAPTURE` (off | on, default off): a mapped GPU worker records its lookups in vLLM's
CUDA graphs, full ones included (engramd.client.engines.vllm_engram says how).

What it is not: the replacements themselves, and nothing that vLLM's own hashing does (the hash
IDs are vLLM's, computed once per forward by its `NgramHashState`).
"""

from __future__ import annotations

import logging
import os

from engramd.client.engines import shared
from engramd.client.engines.shared import (  # noqa: F401  (names this module has always had)
    CAPTURE_ENV,
    GATHER_AT_ENV,
    HOT_CACHE_ENV,
    MODE_ENV,
    SOCKET_ENV,
    PluginError,
    enabled,
)

log = logging.getLogger("engramd.vllm")

SUPPORTED_VLLM = ("0.33.0",)
ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"

# The seams of vLLM's Engram code the plugin replaces or relies on, with the parameters each must
# take: (class name or None for a module function, attribute, parameter names).
SEAMS: tuple[shared.Seam, ...] = (
    ("Engram", "__init__", ("self", "config", "quant_config", "layout", "layer_hash_index",
                            "use_sequence_parallel", "prefix", "prefetch_stream")),
    ("Engram", "_create_embedding", ("self", "layout", "layer_hash_index")),
    ("Engram", "_init_staging", ("self", "max_tokens", "head_dim")),
    ("Engram", "prepare_embeddings", ("self", "hash_ids")),
    ("Engram", "_start_prefetch", ("self", "hash_ids", "rows")),
    ("Engram", "_finish_prefetch", ("self", "event")),
    ("Engram", "_ready_rows", ("self", "num_tokens")),
    ("Engram", "embed", ("self", "hash_ids")),
    ("ParallelEngramEmbedding", "_allocate_weights", ("self",)),
    ("ParallelEngramEmbedding", "lookup", ("self", "indices", "out", "background")),
    ("ParallelEngramEmbedding", "forward", ("self", "indices")),
    (None, "_engram_head_shard_weight_loader", ("param", "loaded_weight")),
    (None, "eager_break_during_capture", ("fn",)),
)

# Calls the replacements depend on: vLLM's method must still make them (names it looks up).
CALLS: tuple[tuple[str, str, str], ...] = (
    ("Engram", "__init__", "_create_embedding"),
    ("Engram", "__init__", "_init_staging"),
    ("Engram", "embed", "_ready_rows"),
)

# ENGRAMD_CAPTURE: a full graph's replay runs no model code, so the check of the captured lookup's
# replays runs where every step of a worker still runs Python, before the step's forward.
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
WORKER_SEAMS: tuple[shared.Seam, ...] = (("Worker", "execute_model", ("self", "scheduler_output")),)

# vLLM's host work around a lookup sits in eager breaks of its breakable CUDA graphs; the
# replacements keep that wrapper, so vLLM's own methods must still carry it.
WRAPPED = (("Engram", "_start_prefetch"), ("Engram", "_finish_prefetch"))


class VllmPluginError(PluginError):
    """The installed vLLM is not one the engramd plugin can serve, or serving it failed."""


def register() -> None:
    """The `vllm.general_plugins` entry point: with ENGRAMD_SOCKET set, check vLLM and install."""
    if not enabled():
        return
    import importlib

    import vllm

    check_version(vllm.__version__)
    engram = importlib.import_module(ENGRAM_MODULE)
    check_seams(engram)
    try:
        from engramd.client.engines import vllm_engram
    except ImportError as exc:
        raise shared.client_import_error(exc, "vLLM", VllmPluginError) from exc

    settings = shared.Settings.from_environment(VllmPluginError)
    if vllm_engram.install(engram, settings.socket, settings.mode, settings.hot_cache_gib,
                           settings.gather_at, settings.capture):
        log.info("engramd plugin installed: Engram rows come from the daemon at %s",
                 os.environ[SOCKET_ENV])


def hot_cache_cap(value: str | None) -> float | None:
    """ENGRAMD_HOT_CACHE_GIB as GiB (None: unset or empty); VllmPluginError naming a bad one,
    before any worker registers."""
    return shared.hot_cache_cap(value, VllmPluginError)


def gather_at(value: str | None) -> str:
    """ENGRAMD_GATHER_AT as EngramClient's gather_at ("wait" when unset or empty);
    VllmPluginError naming a bad one, before any worker registers."""
    return shared.gather_at(value, VllmPluginError)


def check_version(version: str) -> None:
    shared.check_version("vLLM", version, SUPPORTED_VLLM, VllmPluginError)


def check_seams(engram_module) -> None:
    """Raise VllmPluginError listing every seam that is missing or changed."""
    changes = [*shared.signature_changes(engram_module, SEAMS),
               *shared.call_changes(engram_module, CALLS), *_wrapper_changes(engram_module)]
    if changes:
        raise VllmPluginError(
            f"{SOCKET_ENV} is set but vLLM's Engram code ({ENGRAM_MODULE}) is not what the engramd "
            f"plugin was written against: {'; '.join(changes)}. Refusing to serve Engram rows.")


def check_worker_seams(worker_module) -> None:
    """Raise VllmPluginError if vLLM's worker no longer has the step seam the captured check needs."""
    changes = shared.signature_changes(worker_module, WORKER_SEAMS)
    if changes:
        raise VllmPluginError(
            f"{CAPTURE_ENV}=on but vLLM's worker ({WORKER_MODULE}) is not what the engramd plugin "
            f"was written against: {'; '.join(changes)}. Refusing to record lookups in its graphs.")


def _wrapper_changes(engram_module) -> list[str]:
    changes = []
    for owner, name in WRAPPED:
        seam = shared.seam(engram_module, owner, name)
        if seam is not None and not hasattr(seam, "__wrapped__"):
            changes.append(f"{owner}.{name} is no longer wrapped by eager_break_during_capture")
    return changes
