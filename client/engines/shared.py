"""What engramd's engine plugins share (engramd.client.engines.vllm, engramd.client.engines.sglang): the settings
read from the environment, and the fail-closed checks of the engine's version and of the seams a
plugin replaces.

    ENGRAMD_SOCKET         the daemon's socket; unset or empty: the plugin does nothing
    ENGRAMD_MODE           auto | served | mapped (default auto, as when empty): the client's mode
    ENGRAMD_HOT_CACHE_GIB  a mapped client's own hot-row cache cap (0: none; unset: the daemon's)
    ENGRAMD_GATHER_AT      wait | lookup (default wait): the client's gather_at
    ENGRAMD_CAPTURE        off | on (default off): a mapped GPU worker's lookups are recorded in
                           the engine's CUDA graphs (EngramClient.capturable_lookup; vLLM only)

Every check raises the engine's own PluginError subclass, with a message that names the setting
or the seam. What it is not: anything that imports an engine, or replaces anything in one.

The engines' entry points import this module, and their loaders log an entry point whose import
fails and go on with the engine's own tables: so it imports nothing of engramd's client (pyzmq,
msgpack) at import time, and a client that cannot be imported fails `register()` instead
(client_import_error), where the plugin stops the engine.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

SOCKET_ENV = "ENGRAMD_SOCKET"  # engramd.client.shared.connection.SOCKET_ENV, not imported: above
MODE_ENV = "ENGRAMD_MODE"
HOT_CACHE_ENV = "ENGRAMD_HOT_CACHE_GIB"
GATHER_AT_ENV = "ENGRAMD_GATHER_AT"
CAPTURE_ENV = "ENGRAMD_CAPTURE"

# A seam: (class name or None for a module function, attribute, parameter names).
Seam = tuple[str | None, str, tuple[str, ...]]


class PluginError(RuntimeError):
    """The installed engine is not one an engramd plugin can serve, or serving it failed."""


@dataclass(frozen=True)
class Settings:
    """Where and how an engine's processes register their clients."""

    socket: str
    mode: str = "auto"
    hot_cache_gib: float | None = None
    gather_at: str = "wait"
    capture: bool = False

    @classmethod
    def from_environment(cls, error: type[PluginError]) -> Settings:
        """The settings of this process; `error` names a bad one before any worker registers."""
        return cls(os.environ[SOCKET_ENV], mode(os.environ.get(MODE_ENV), error),
                   hot_cache_cap(os.environ.get(HOT_CACHE_ENV), error),
                   gather_at(os.environ.get(GATHER_AT_ENV), error),
                   capture(os.environ.get(CAPTURE_ENV), error))


def enabled() -> bool:
    return bool(os.environ.get(SOCKET_ENV))


def hot_cache_cap(value: str | None, error: type[PluginError]) -> float | None:
    """ENGRAMD_HOT_CACHE_GIB as GiB (None: unset or empty), checked as EngramClient checks its
    hot_cache_gib."""
    if not value:
        return None
    from engramd.client.client import check_cache_cap
    from engramd.client.errors import BadRequestError

    try:
        gib = float(value)
        check_cache_cap(gib)
    except (ValueError, BadRequestError):
        raise error(f"{HOT_CACHE_ENV}={value!r}: expected GiB as a number >= 0 "
                    "(0: no hot-row cache in the client)") from None
    return gib


def mode(value: str | None, error: type[PluginError]) -> str:
    """ENGRAMD_MODE as EngramClient's mode ("auto" when unset or empty)."""
    from engramd.client.client import MODES

    if not value:
        return "auto"
    if value not in MODES:
        raise error(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def gather_at(value: str | None, error: type[PluginError]) -> str:
    """ENGRAMD_GATHER_AT as EngramClient's gather_at ("wait" when unset or empty)."""
    from engramd.client.client import GATHER_AT

    if not value:
        return GATHER_AT[0]
    if value not in GATHER_AT:
        raise error(f"{GATHER_AT_ENV}={value!r}: expected one of {', '.join(GATHER_AT)}")
    return value


def capture(value: str | None, error: type[PluginError]) -> bool:
    """ENGRAMD_CAPTURE as a flag (off when unset or empty)."""
    if not value or value == "off":
        return False
    if value != "on":
        raise error(f"{CAPTURE_ENV}={value!r}: expected on or off")
    return True


def client_import_error(exc: ImportError, engine: str, error: type[PluginError]) -> PluginError:
    """The engine's error for an engramd client that cannot be imported in the engine's Python."""
    return error(f"{SOCKET_ENV} is set but engramd's client cannot be imported beside this {engine} "
                 f"({exc}): install engramd with its dependencies into {engine}'s Python, or unset "
                 f"{SOCKET_ENV} to run {engine}'s own Engram tables.")


def check_version(engine: str, version: str, supported: tuple[str, ...],
                  error: type[PluginError]) -> None:
    if version not in supported:
        raise error(
            f"{SOCKET_ENV} is set but {engine} {version} is installed; the engramd plugin supports "
            f"{engine} {', '.join(supported)} only (its Engram seams change between releases). "
            f"Install a supported {engine}, or unset {SOCKET_ENV} to run {engine}'s own Engram "
            "tables.")


def seam(module, owner: str | None, name: str) -> Callable | None:
    holder = getattr(module, owner, None) if owner else module
    return getattr(holder, name, None) if holder is not None else None


def signature_changes(module, seams: tuple[Seam, ...]) -> list[str]:
    """Each seam that is missing or whose parameters are not the expected ones."""
    changes = []
    for owner, name, expected in seams:
        where = f"{owner}.{name}" if owner else name
        found = seam(module, owner, name)
        if found is None:
            changes.append(f"{where} is missing")
            continue
        got = tuple(inspect.signature(found).parameters)
        if got != expected:
            changes.append(f"{where} takes ({', '.join(got)}), expected ({', '.join(expected)})")
    return changes


def call_changes(module, calls: tuple[tuple[str, str, str], ...]) -> list[str]:
    """Each (class, method, callee) whose method no longer names the callee."""
    changes = []
    for owner, name, callee in calls:
        found = seam(module, owner, name)
        code = getattr(inspect.unwrap(found), "__code__", None) if found is not None else None
        if code is not None and callee not in code.co_names:
            changes.append(f"{owner}.{name} no longer calls {callee}")
    return changes


class ServedTables:
    """What an engine's model was checked against: the tables its client's daemon served at
    registration. A lookup may re-register with a restarted daemon (client/client.py); rows of
    other tables than the model's must not reach it."""

    def __init__(self, client, error: type[PluginError], engine: str):
        self.client, self._error, self._engine = client, error, engine
        self._registration = client.registrations
        self._served = (client.geometry, client.tables_id)

    def check(self) -> None:
        """After a lookup's wait: the engine's error unless a re-registration found the same
        geometry and tables (a daemon that does not name its tables: its geometry alone)."""
        client = self.client
        if client.registrations == self._registration:
            return
        geometry, tables = self._served
        if client.geometry != geometry or (
                None not in (tables, client.tables_id) and client.tables_id != tables):
            raise self._error(
                f"the engramd daemon at {client.socket_path} restarted on other Engram tables "
                f"(tables {client.tables_id}, before {tables}) than the ones this model was "
                f"checked against: restart this {self._engine} server")
        self._registration = client.registrations



class CheckpointRows:
    """A layer's checkpoint table as the engine's loader hands it in (its FP8 weight and its
    UE8M0 scales, either first), compared on a sample of rows with the rows the daemon serves.
    A daemon started on another checkpoint of the model's geometry (another revision of the
    model) passes every check of the config and of the tensors' shapes, and would serve its own
    rows: the sample (the first, middle and last row of each of this rank's heads' buckets) is
    what tells them apart, at load, before any step. Bit for bit but for a NaN's bits, which are
    not part of the contract (kernels/gather_ref.py)."""

    PARTS = ("weight", "scale")

    def __init__(self, client, layer_index: int, error: type[PluginError], slot: int,
                 check_still_served: Callable[[], None]):
        import torch

        self.client, self.layer_index, self._error = client, layer_index, error
        self._slot, self._check_still_served = slot, check_still_served
        geometry, shard = client.geometry, client.shard
        bounds = (*geometry.offsets[layer_index], geometry.rows[layer_index])
        picks = [(head, row) for head in range(shard.head_start, shard.head_end)
                 for row in dict.fromkeys((bounds[head], (bounds[head] + bounds[head + 1]) // 2,
                                           bounds[head + 1] - 1))]
        self._picks = picks[:client.max_tokens]
        self._rows = torch.tensor([row for _, row in self._picks], dtype=torch.int64, device="cpu")
        self._parts: dict[str, torch.Tensor] = {}

    def hand(self, part: str, loaded) -> None:
        """One of the layer's checkpoint tensors (`part`: weight or scale, full shape, checked);
        once both are in, the sample is compared (the engine's error naming a difference)."""
        if loaded.element_size() != 1:
            raise self._error(
                f"checkpoint Engram {part} of layer {self._layer_id} is {loaded.dtype}; the engramd "
                "daemon serves FP8 rows with UE8M0 scales (one byte each)")
        import torch

        sample = loaded.detach()[self._rows.to(loaded.device)].cpu().contiguous()
        self._parts[part] = sample.view(torch.uint8)
        if len(self._parts) == len(self.PARTS):
            self._compare()

    @property
    def _layer_id(self) -> int:
        return self.client.geometry.layer_ids[self.layer_index]

    def _compare(self) -> None:
        import torch

        from engramd.client.geometry import DEAD_ID
        from engramd.kernels.gather_ref import dequantize_rows, differing_values

        if not self._picks:  # a rank of no heads (more ranks than heads) serves no rows
            return
        geometry, shard = self.client.geometry, self.client.shard
        packed = torch.cat([self._parts[part] for part in self.PARTS], dim=1)
        expected = dequantize_rows(packed, geometry.head_dim)
        ids = torch.full((len(self._picks), geometry.n_layers, geometry.heads), DEAD_ID,
                         dtype=torch.int64, device=self.client.device)
        for token, (head, row) in enumerate(self._picks):
            ids[token, self.layer_index, head] = row
        served = self.client.lookup(ids, slot=self._slot).wait()[self.layer_index]
        self._check_still_served()
        for token, (head, row) in enumerate(self._picks):
            got = served[token, head - shard.head_start].cpu()
            if differing_values(got, expected[token]).any():
                raise self._error(
                    f"the engramd daemon at {self.client.socket_path} serves other rows than this "
                    f"checkpoint's Engram table (layer {self._layer_id}, row {row}, head {head}): "
                    "it was started on another checkpoint of the same geometry (another revision "
                    "of this model?); start the daemon on this model's checkpoint")
