"""Daemon configuration: one declaration per setting drives the TOML file, the CLI flag and the docs.

A config file is TOML with the settings at the top level (see configs/demo.toml). Values are
checked on load; an error names the file, the key and the bad value. Command-line flags
(`engramd serve --<key-with-dashes> VALUE`) override the file. This module does not start anything.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, TypeVar

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from engramd.client.errors import ConfigError
from engramd.client.shared.connection import default_socket_path

# A TCP port, 0 to 65535 (five digits reach 99999, which bind() refuses with a traceback).
PORT = r"0*(\d{1,4}|[1-5]\d{4}|6[0-4]\d{3}|65[0-4]\d{2}|655[0-2]\d|6553[0-5])"


@dataclass(frozen=True)
class Setting:
    key: str
    kind: type
    default: Any
    doc: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] | None = None
    pattern: str | None = None


SETTINGS: tuple[Setting, ...] = (
    Setting("tables", str, "demo",
            "checkpoint folder (config.json + safetensors shards), or 'demo' for the built-in demo table"),
    Setting("socket", str, "",
            "ZeroMQ ipc socket path; its folder is the runtime folder (0750). Empty: "
            "$ENGRAMD_SOCKET, else /run/engramd/engramd.sock for root, else "
            "<temp dir>/engramd-<uid>/engramd.sock"),
    Setting("shm_dir", str, "/dev/shm", "folder for the shared-memory table files"),
    Setting("instance", str, "default", "daemon instance name, part of every shared-memory file "
            "name; {uid} stands for the daemon's user id", pattern=r"[A-Za-z0-9_.-]{1,64}"),
    Setting("backend", str, "auto", "device backend: cpu, cuda, or auto (cuda when a GPU is visible)",
            choices=("auto", "cpu", "cuda")),
    Setting("max_clients", int, 64, "registered clients at most", low=1, high=4096),
    Setting("max_tokens", int, 16384, "largest max_tokens a client may register", low=1, high=1 << 20),
    Setting("max_slots", int, 16, "largest slot count a client may register", low=1, high=256),
    Setting("allowed_uids", str, "",
            "comma-separated user ids that may register (checked by the kernel's credentials of "
            "the handle-socket peer); empty: whoever may open the socket. With allowed_gids, a "
            "peer passes if either lists it", pattern=r"(\d+(,\d+)*)?"),
    Setting("allowed_gids", str, "",
            "comma-separated group ids (the peer's effective gid) that may register; empty: no "
            "group check", pattern=r"(\d+(,\d+)*)?"),
    Setting("admin_uids", str, "",
            "comma-separated user ids that may run admin operations (engramd drain, engramd "
            "reload) and see who each client is (engramd stats), checked by the kernel's "
            "credentials; the daemon's own user always may. Root is not implied: "
            "engines in containers often run as uid 0", pattern=r"(\d+(,\d+)*)?"),
    # Half of max_clients' default: one user cannot take every place (a node of 8 GPUs runs
    # a client or two per GPU); a node whose engines all run as one user with more clients
    # raises it (the refusal names it).
    Setting("max_clients_per_uid", int, 32,
            "attached clients one user (by its kernel credentials) may hold; 0: only max_clients "
            "caps them", low=0, high=4096),
    Setting("handle_connections_per_uid", int, 64,
            "handle-socket connections one user (by its kernel credentials) may have waiting for "
            "their request; past it, the user's oldest such connection is closed", low=1, high=65536),
    Setting("pending_registrations_per_uid", int, 8,
            "registrations one user (by the kernel's credentials of its ZeroMQ connection) may hold "
            "before attaching them; past it, the oldest of its process with the most is retired",
            low=1, high=4096),
    Setting("slab_budget_gib", float, 64.0,
            "GiB of slabs all served clients may hold together (device and host); a registration "
            "past it gets a 'resource' error", low=0.001, high=65536.0),
    Setting("workers", int, 2, "CPU backend gather threads", low=1, high=256),
    Setting("client_modes", str, "served,mapped",
            "how clients may be served: 'served' (the daemon gathers into the client's slab), "
            "'mapped' (the client maps the tables and gathers itself), or both, comma-separated",
            pattern=r"(served|mapped)(,(served|mapped))?"),
    Setting("cuda_dispatch", str, "inline",
            "CUDA backend: enqueue gathers on the request loop ('inline', no thread hop) or a "
            "thread per GPU ('worker')",
            choices=("inline", "worker")),
    Setting("hot_cache_gib", float, 2.0,
            "CUDA backend: HBM hot-row cache per GPU in GiB (rows, keys, sketch); 0 disables it",
            low=0.0, high=1024.0),
    Setting("hot_cache_warm_file", str, "",
            "CUDA backend: .npy of row IDs [N, layers, heads] (as EngramHasher.hash returns them) "
            "counted into every GPU's cache before serving, and into each mapped client's; "
            "empty: start cold"),
    Setting("hot_cache_refresh_ms", float, 50.0,
            "CUDA backend: milliseconds between hot-row cache refreshes (mapped clients' too)",
            low=1.0, high=60000.0),
    # A mapped client gathers in its own process, so it cannot read the daemon's cache (its
    # keeper waits out readers on the daemon's streams, and a client mapping that memory could
    # write every client's rows): it keeps one of its own on its GPU, in its own memory.
    Setting("mapped_hot_cache_gib", float, 2.0,
            "hot-row cache that each mapped GPU client keeps in its own GPU memory, in GiB, "
            "refreshed by a thread of the client and warmed from hot_cache_warm_file; 0: none",
            low=0.0, high=1024.0),
    # On real text, reading each distinct row once costs more than it saves (hot_cache_lookup).
    Setting("dedupe_min_tokens", int, 0,
            "CUDA backend: lookups of at least this many tokens read each distinct row once (0: never)",
            low=0, high=1 << 20),
    # Sorted reads share address translations: +58% rows/s at 4,096 tokens, -20% at 256, where the
    # sort costs more than it saves (gather_layouts).
    Setting("sort_min_tokens", int, 1024,
            "CUDA backend: lookups of at least this many tokens read their rows in sorted order (0: never)",
            low=0, high=1 << 20),
    # Half the SMs keep 97% of the gather's rate and slow a matmul beside it less (+9.8% against
    # +12.0% with all of them; sm_cap). In a model step (model_step_grid_*) with a mapped
    # client's 4,096-token lookup, the step then took 4-7% longer where the rows were wanted
    # after one matmul, and 2-24% less where after twelve: 1.0 suits a model that consumes its
    # rows right away (or such a lookup alone: lookup(..., sm_fraction=1.0)).
    Setting("gather_sm_fraction", float, 0.5,
            "CUDA backend: fraction of each GPU's SMs the gather may occupy (leaves the model room); "
            "mapped clients' own gathers by default (a mapped lookup may name its own share)",
            low=0.01, high=1.0),
    Setting("heartbeat_interval", float, 1.0,
            "seconds between client liveness checks; a dead client is retired within two (its slab "
            "is freed once its in-flight lookups finish)", low=0.05, high=60.0),
    Setting("ids_wait_s", float, 60.0,
            "CUDA backend: a served lookup whose IDs its client's stream has not handed over this "
            "many seconds after it was enqueued is reported in the log, naming the client (until "
            "they come, the daemon's stream waits, and so does every stream sharing its hardware "
            "queue, other clients' too)", low=0.1, high=3600.0),
    Setting("stall_dump_s", float, 30.0,
            "when the request loop has not turned for this many seconds (at least three heartbeat "
            "intervals), every thread's stack goes to stderr, headed 'Timeout'; 0: never",
            low=0.0, high=3600.0),
    Setting("verify_tables", bool, False,
            "before serving re-attached tables, compare every row with the checkpoint and reload "
            "a table that differs anywhere (reads the whole checkpoint: about as long as a load)"),
    Setting("collapse_pages", bool, True,
            "CUDA backend: when pinning tables in tmpfs (/dev/shm), first make their pages 2 MiB "
            "folios (MADV_COLLAPSE, Linux >= 6.1; a copy at ~7 GB/s, once per loaded table), "
            "which pins 3-5x faster for the daemon, a standby and mapped clients; false: 4 KiB "
            "pages stay (no compaction of host memory for it)"),
    Setting("self_check", bool, True,
            "before ready: sampled lookups through the serving kernel must equal the checkpoint"),
    Setting("metrics_address", str, "127.0.0.1:9464",
            "Prometheus metrics HOST:PORT; port 0 disables the endpoint", pattern=rf"[^:\s]*:{PORT}"),
    Setting("demo_seed", int, 0, "seed of the built-in demo table", low=0, high=2**32 - 1),
    Setting("cache_dir", str, "",
            "where the demo checkpoint is written (empty: engramd-demo-<uid> in the temp folder)"),
    Setting("log_level", str, "info", "logging level", choices=("debug", "info", "warning", "error")),
)
_BY_KEY = {s.key: s for s in SETTINGS}


class _ConfigPaths:
    """What a config derives from its settings (the fields themselves come from SETTINGS)."""

    @property
    def socket_path(self) -> Path:
        return Path(self.socket or default_socket_path())  # type: ignore[attr-defined]

    @property
    def runtime_dir(self) -> Path:
        return self.socket_path.parent

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


# The merged settings, one field per Setting in its order: declared once, in SETTINGS.
DaemonConfig = make_dataclass("DaemonConfig", [(s.key, s.kind) for s in SETTINGS],
                              bases=(_ConfigPaths,), frozen=True)
DaemonConfig.__doc__ = "The daemon's settings, checked (build_config); one field per SETTINGS entry."
DaemonConfig.__module__ = __name__  # so that it pickles and reprs as this module's class


def default(key: str) -> Any:
    """A setting's declared default: what options built without a config start from."""
    return _BY_KEY[key].default


def gib(value: float) -> int:
    """A size setting in GiB, in bytes."""
    return int(value * 2**30)


def ms(value: float) -> float:
    """A time setting in milliseconds, in seconds."""
    return value / 1e3


# The id settings the request socket filters by (request_socket.py), and the largest id its
# filter takes; admin_uids are compared in Python, any uid.
FILTERED_IDS = ("allowed_uids", "allowed_gids")
MAX_FILTERED_ID = (1 << 31) - 1


def id_set(listed: str) -> frozenset[int] | None:
    """A comma-separated id setting (allowed_uids, ...) as a set; None where it lists none."""
    return frozenset(int(x) for x in listed.split(",")) if listed else None


def listed(value: str) -> tuple[str, ...]:
    """A comma-separated setting (client_modes) as a tuple."""
    return tuple(value.split(","))


def from_setting(key: str, convert: Callable[[Any], Any] = lambda value: value) -> Any:
    """A field of options made from one setting (see options_from): its default is the setting's,
    converted to the unit the field holds. The setting declares the type, the bounds and the doc."""
    return field(default=convert(default(key)), metadata={"setting": key, "convert": convert})


_Options = TypeVar("_Options")


def options_from(cls: type[_Options], config: DaemonConfig, **others: Any) -> _Options:
    """`cls` (a dataclass whose fields are from_setting's) built from the settings in `config`;
    `others`: its fields that are no setting's."""
    made = {f.name: f.metadata["convert"](getattr(config, f.metadata["setting"]))
            for f in fields(cls) if "setting" in f.metadata}  # type: ignore[arg-type]
    return cls(**made, **others)


def _check(source: str, setting: Setting, value: Any) -> Any:
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{source}: key {setting.key!r} has bad value {value!r}: {why}")

    if setting.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if setting.key == "instance" and isinstance(value, str):
        # One config run by several users (the demo's) gives each their own files: the table
        # folder in a shared /dev/shm belongs to whoever made it first.
        value = value.replace("{uid}", str(os.geteuid()))
    if not isinstance(value, setting.kind) or (isinstance(value, bool) and setting.kind is not bool):
        raise bad(f"expected {setting.kind.__name__}")
    if setting.kind is float and not math.isfinite(value):  # NaN passes every bound below
        raise bad("expected a finite number")
    # TOML writes one as \u0000; no path or name holds one, and each system call that met it
    # raised ValueError (a traceback, or a table error, once the daemon had bound its socket).
    if setting.kind is str and "\0" in value:
        raise bad("a NUL character")
    if setting.low is not None and value < setting.low:
        raise bad(f"must be >= {setting.low}")
    if setting.high is not None and value > setting.high:
        raise bad(f"must be <= {setting.high}")
    if setting.choices and value not in setting.choices:
        raise bad(f"must be one of {', '.join(setting.choices)}")
    if setting.pattern and not re.fullmatch(setting.pattern, value):  # the doc says the form
        raise bad(f"expected {setting.doc} (the pattern {setting.pattern})")
    if setting.key in FILTERED_IDS and any(int(i) > MAX_FILTERED_ID for i in value.split(",") if i):
        raise bad(f"ids above {MAX_FILTERED_ID}: the kernel's filter of the request socket "
                  "(ZeroMQ's IPC_FILTER_UID/GID) takes a C int")
    return value


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # TOML is UTF-8
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def build_config(file_values: dict[str, Any], source: str,
                 overrides: dict[str, Any] | None = None) -> DaemonConfig:
    """Defaults <- file values <- overrides (None values in overrides are ignored)."""
    values = {s.key: s.default for s in SETTINGS}
    for key, value in file_values.items():
        if key not in _BY_KEY:
            raise ConfigError(f"{source}: unknown key {key!r} (value {value!r}); "
                              f"known keys: {', '.join(_BY_KEY)}")
        values[key] = _check(source, _BY_KEY[key], value)
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _check(f"command line --{key.replace('_', '-')}", _BY_KEY[key], value)
    return DaemonConfig(**values)


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> DaemonConfig:
    file_values = read_toml(Path(path)) if path else {}
    return build_config(file_values, str(path) if path else "defaults", overrides)


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One `--key` flag per setting; the help text is the setting's doc."""
    for s in SETTINGS:
        parser.add_argument(f"--{s.key.replace('_', '-')}", dest=s.key,
                            type=_parse_bool if s.kind is bool else s.kind,
                            default=None, choices=s.choices,
                            help=f"{s.doc} (default: {s.default!r})")


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "yes", "on", "1"):
        return True
    if lowered in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {s.key: getattr(args, s.key, None) for s in SETTINGS}


def describe_settings() -> str:
    """The settings as commented TOML, for docs and `engramd serve --print-config`."""
    lines = []
    for s in SETTINGS:
        lines.append(f"# {s.doc}")
        lines.append(f"{s.key} = {_toml_value(s.default)}")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def dump_toml(config: DaemonConfig, resolved: dict[str, tuple[Any, str]] | None = None) -> str:
    """The settings as TOML. `resolved`: key -> (the value in effect, why), for settings decided
    at start (an empty socket, backend auto): that value is shown, with the reason as a comment."""
    lines = []
    for key, value in config.to_dict().items():
        if resolved and key in resolved:
            value, why = resolved[key]
            lines.append(f"{key} = {_toml_value(value)}  # {why}")
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines)
