"""Language-model corpora: one id stream per split and their vocabulary.

Word level (`read_word_corpus`, the WikiText-103 reading of the ACMoE /
Symphony / MomentumSMoE language code): every line of `train.txt`,
`valid.txt`, `test.txt` (UTF-8, universal newlines) is split on whitespace
(`str.split()`) and followed by the token `<eos>`; one vocabulary grows in
order of first appearance over train, then valid, then test, so ids are
positions of first appearance and valid / test words unseen in train get ids
too. Each split becomes one id stream `[N]` (int32).

Byte level (`byte_corpus`, EnWik-8 as Transformer-XL's `prep_enwik8.py`
writes it and the same word reader then reads it): every byte is the token
`str(byte)`, a newline byte is `<eos>`, and a split whose last byte is not a
newline gets one extra `<eos>` at its end (the reader ends its last line).
The raw `enwik8` file (or `enwik8.zip`) splits as that script does: the last
5,000,000 bytes are test, the 5,000,000 before them valid, the rest train.
A directory holding the prepared `train.txt` / `valid.txt` / `test.txt`
gives the same ids and vocabulary through the word reader.

`vmoe_ext.data.text_config.load_text_data` picks the reader from a config
and caches the result; `docs/language_data.md` has the layouts.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import os
import zipfile
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from vmoe_ext.errors import ConfigError, InputError

EOS = "<eos>"
UNK = "<unk>"
SPLITS = ("train", "valid", "test")
# WikiText-103's own file names, accepted where `train.txt` etc. are absent.
WIKITEXT_NAMES = {"train": "wiki.train.tokens", "valid": "wiki.valid.tokens",
                  "test": "wiki.test.tokens"}
ENWIK8_HOLDOUT_BYTES = 5_000_000
_NEWLINE = 10
_EOS_KEY = 256  # A byte's key is its value; <eos> is key 256.


class Vocabulary:
  """Tokens in id order: `tokens[i]` has id i."""

  def __init__(self, tokens: Sequence[str]):
    self._tokens = tuple(tokens)
    self._ids = {t: i for i, t in enumerate(self._tokens)}
    if len(self._ids) != len(self._tokens):
      raise InputError("tokens", "repeat a token; a vocabulary lists each "
                       "token once")

  @property
  def tokens(self) -> tuple[str, ...]:
    return self._tokens

  def __len__(self) -> int:
    return len(self._tokens)

  def __contains__(self, token: str) -> bool:
    return token in self._ids

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Vocabulary) and self._tokens == other._tokens

  def __hash__(self) -> int:
    return hash(self._tokens)

  def id(self, token: str) -> int:
    """The id of `token` (InputError when it is not in the vocabulary)."""
    if token not in self._ids:
      raise InputError("token", f"{token!r} is not in the vocabulary")
    return self._ids[token]

  def get(self, token: str, default: int | None = None) -> int | None:
    return self._ids.get(token, default)

  def decode(self, ids: Iterable[int]) -> list[str]:
    return [self._tokens[int(i)] for i in ids]


@dataclasses.dataclass(frozen=True, eq=False)
class TextCorpus:
  """A tokenised corpus.

  Attributes:
    name: the corpus name of the config (`wikitext103`, `enwik8`, ...).
    vocab: the vocabulary, ids in order of first appearance.
    splits: "train", "valid", "test" -> `[N]` int32 id streams.
    level: "word" or "byte" (the word swap applies to word level only).
    source: where the text came from, for logs and reports.
  """
  name: str
  vocab: Vocabulary
  splits: Mapping[str, np.ndarray]
  level: str
  source: str

  def fingerprint(self) -> str:
    """16 hex digits of SHA-256 over the vocabulary and the id streams."""
    h = hashlib.sha256("\n".join(self.vocab.tokens).encode("utf-8"))
    for split in SPLITS:
      h.update(split.encode())
      h.update(np.ascontiguousarray(self.splits[split], np.int32).tobytes())
    return h.hexdigest()[:16]


class _GrowingIds(dict):
  """token -> id; an unseen token gets the next id when first looked up."""

  def __missing__(self, token: str) -> int:
    self[token] = len(self)
    return self[token]


def word_ids(lines: Iterable[str], ids: dict[str, int]) -> np.ndarray:
  """`[N]` int32 ids of `lines`: each line's whitespace tokens, then `<eos>`.

  `ids` maps token -> id; a `_GrowingIds` (as `read_word_corpus` passes)
  adds unseen tokens, a plain dict raises KeyError on them.
  """
  out = array.array("i")
  lookup = ids.__getitem__
  for line in lines:
    out.extend(map(lookup, line.split()))
    out.append(lookup(EOS))
  return np.frombuffer(out, np.intc).astype(np.int32)


def word_corpus(lines: Mapping[str, Iterable[str]], *, name: str,
                source: str) -> TextCorpus:
  """The word-level corpus of `lines[split]` for split in train, valid,
  test (read in that order: the vocabulary grows across them)."""
  ids = _GrowingIds()
  splits = {split: word_ids(lines[split], ids) for split in SPLITS}
  return TextCorpus(name, Vocabulary(list(ids)), splits, "word", source)


def split_files(directory: str, *, field: str = "data.path",
                wikitext_names: bool = False) -> dict[str, str]:
  """split -> file: `train.txt`, `valid.txt`, `test.txt` in `directory`
  (with `wikitext_names`, WikiText-103's `wiki.<split>.tokens` where the
  `.txt` file is absent).

  Raises:
    ConfigError on `field` naming every missing file.
  """
  if not os.path.isdir(directory):
    raise ConfigError(field, f"{directory!r} is not a directory")
  found, missing = {}, []
  for split in SPLITS:
    path = os.path.join(directory, f"{split}.txt")
    alt = os.path.join(directory, WIKITEXT_NAMES[split])
    if os.path.isfile(path):
      found[split] = path
    elif wikitext_names and os.path.isfile(alt):
      found[split] = alt
    else:
      missing.append(f"{split}.txt" + (f" (or {WIKITEXT_NAMES[split]})"
                                       if wikitext_names else ""))
  if missing:
    raise ConfigError(field, f"{directory!r} lacks {', '.join(missing)}; a "
                      "corpus directory holds train.txt, valid.txt and "
                      "test.txt")
  return found


def _text_lines(path: str, field: str) -> Iterable[str]:
  try:
    with open(path, encoding="utf8") as f:
      yield from f
  except UnicodeDecodeError as e:
    raise ConfigError(field, f"{path!r} is not UTF-8 text ({e})") from e


def read_word_corpus(directory: str, *, name: str = "wikitext103",
                     field: str = "data.path") -> TextCorpus:
  """The word-level corpus of a directory of `train.txt`, `valid.txt`,
  `test.txt` (WikiText-103's `wiki.*.tokens` accepted too), read as the
  authors' `data.py` reads it (module docstring).

  Raises:
    ConfigError on `field`: missing files, text that is not UTF-8.
  """
  files = split_files(directory, field=field, wikitext_names=True)
  return word_corpus({s: _text_lines(p, field) for s, p in files.items()},
                     name=name, source=os.path.abspath(directory))


def _byte_keys(part: bytes) -> np.ndarray:
  keys = np.frombuffer(part, np.uint8).astype(np.int32)
  keys[keys == _NEWLINE] = _EOS_KEY
  if len(part) and part[-1] != _NEWLINE:
    keys = np.append(keys, np.int32(_EOS_KEY))
  return keys


def byte_corpus(parts: Mapping[str, bytes], *, name: str,
                source: str) -> TextCorpus:
  """The byte-level corpus of `parts[split]` (raw bytes): the ids and
  vocabulary the word reader gives on the `prep_enwik8.py` text of the same
  bytes (module docstring)."""
  keys = {split: _byte_keys(parts[split]) for split in SPLITS}
  stream = np.concatenate([keys[s] for s in SPLITS])
  uniq, first = np.unique(stream, return_index=True)
  order = uniq[np.argsort(first, kind="stable")]
  table = np.full(_EOS_KEY + 1, -1, np.int32)
  table[order] = np.arange(len(order), dtype=np.int32)
  vocab = Vocabulary([EOS if k == _EOS_KEY else str(k) for k in order])
  return TextCorpus(name, vocab, {s: table[keys[s]] for s in SPLITS},
                    "byte", source)


def enwik8_parts(data: bytes, holdout: int = ENWIK8_HOLDOUT_BYTES,
                 *, field: str = "data.path") -> dict[str, bytes]:
  """`prep_enwik8.py`'s split of the raw bytes: the last `holdout` bytes
  test, the `holdout` before them valid, the rest train."""
  if len(data) <= 2 * holdout:
    raise ConfigError(field, f"holds {len(data)} bytes; EnWik-8 keeps its "
                      f"last 2 x {holdout} bytes for valid and test, so it "
                      "needs more (the real file has 100,000,000)")
  return {"train": data[:-2 * holdout], "valid": data[-2 * holdout:-holdout],
          "test": data[-holdout:]}


def read_enwik8(path: str, *, holdout: int = ENWIK8_HOLDOUT_BYTES,
                field: str = "data.path") -> TextCorpus:
  """EnWik-8 at byte level from `path`: the raw `enwik8` file, the
  `enwik8.zip` holding it, or a directory of the `prep_enwik8.py` files
  `train.txt`, `valid.txt`, `test.txt` (read by the word reader, as the
  authors' scripts do; same ids either way).

  Raises:
    ConfigError on `field` for a missing path or missing files.
  """
  if os.path.isdir(path):
    corpus = read_word_corpus(path, name="enwik8", field=field)
    return dataclasses.replace(corpus, level="byte")
  if not os.path.isfile(path):
    raise ConfigError(field, f"{path!r} does not exist; give the enwik8 "
                      "file, enwik8.zip, or a directory of its prepared "
                      "train.txt, valid.txt, test.txt")
  if zipfile.is_zipfile(path):
    with zipfile.ZipFile(path) as z:
      names = [n for n in z.namelist() if not n.endswith("/")]
      member = "enwik8" if "enwik8" in names else (
          names[0] if len(names) == 1 else None)
      if member is None:
        raise ConfigError(field, f"{path!r} is a zip without an 'enwik8' "
                          f"member (it holds {names[:5]})")
      data = z.read(member)
  else:
    with open(path, "rb") as f:
      data = f.read()
  return byte_corpus(enwik8_parts(data, holdout, field=field), name="enwik8",
                     source=os.path.abspath(path))


def read_byte_corpus(directory: str, *, name: str = "plain_text",
                     field: str = "data.path") -> TextCorpus:
  """A directory of `train.txt`, `valid.txt`, `test.txt` read as raw bytes
  with the EnWik-8 convention (`byte_corpus`)."""
  files = split_files(directory, field=field)
  parts = {}
  for split, p in files.items():
    with open(p, "rb") as f:
      parts[split] = f.read()
  return byte_corpus(parts, name=name, source=os.path.abspath(directory))


def save_corpus(corpus: TextCorpus, path: str) -> None:
  """Writes `corpus` to `path` (`.npz`, no pickles), atomically."""
  tmp = f"{path}.tmp{os.getpid()}"
  vocab = np.frombuffer("\n".join(corpus.vocab.tokens).encode("utf-8"),
                        np.uint8)
  meta = np.frombuffer("\n".join([corpus.name, corpus.level,
                                  corpus.source]).encode("utf-8"), np.uint8)
  with open(tmp, "wb") as f:
    np.savez(f, vocab=vocab, meta=meta,
             **{s: corpus.splits[s] for s in SPLITS})
  os.replace(tmp, path)


def load_corpus(path: str) -> TextCorpus:
  """Reads a corpus written by `save_corpus`."""
  with np.load(path, allow_pickle=False) as z:
    tokens = z["vocab"].tobytes().decode("utf-8").split("\n")
    name, level, source = z["meta"].tobytes().decode("utf-8").split("\n", 2)
    splits = {s: z[s].astype(np.int32) for s in SPLITS}
  return TextCorpus(name, Vocabulary(tokens), splits, level, source)


__all__ = ["ENWIK8_HOLDOUT_BYTES", "EOS", "SPLITS", "TextCorpus", "UNK",
           "Vocabulary", "byte_corpus", "enwik8_parts", "load_corpus",
           "read_byte_corpus", "read_enwik8", "read_word_corpus",
           "save_corpus", "split_files", "word_corpus", "word_ids"]
