"""The text-data config fields, their checks, and the loader they drive.

Fields (`TEXT_DATA`, under the `data` section of a language-model run):

* `corpus`: "wikitext103" (word level: `path` is a directory of
  `train.txt`, `valid.txt`, `test.txt`, or WikiText-103's `wiki.*.tokens`;
  any pre-tokenised corpus in that layout reads the same way), "enwik8"
  (byte level: `path` is the raw `enwik8` file, `enwik8.zip`, or a directory
  of its `prep_enwik8.py` files), "plain_text" (`path` is a directory of raw
  UTF-8 `train.txt`, `valid.txt`, `test.txt`; `tokens` "words" or "bytes")
  or "python_docs" (shipped, no `path`; see `vmoe_ext.data.text_plain`).
* `block_size` (M), `batch_size` (B training rows), `eval_batch_size` (rows
  when evaluating; None: `batch_size`, as the authors evaluate).
* `word_swap_rate`: the "AAA" contamination of valid and test (None: the
  papers' 0.025 on word-level corpora, off on byte level; 0: off),
  `word_swap_method` ("textattack" or "uniform", `vmoe_ext.data.word_swap`),
  `word_swap_seed`.
* `min_count` (plain-text words and python_docs: rarer train tokens become
  `<unk>`), `cache_dir` (None: no cache; else the tokenised corpus is kept
  there as `.npz`, keyed by the sources' paths, sizes and times).

`check_text_data` (the section check: file checks, fields that do not apply)
names fields relative to the section; `TEXT_DATA_SECTION` scoped at "data"
and `load_text_data` report them as `data.path`, `data.block_size`, ... All
of it runs before anything is traced or compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from vmoe_ext.config.schema import REQUIRED, Field, Section, Spec, validate
from vmoe_ext.data import text_corpus, text_plain, word_swap
from vmoe_ext.data.text_stream import (BlockIterator, batchify,
                                       eval_positions)
from vmoe_ext.errors import ConfigError, require

TEXT_DATASET_NAME = "text"
CORPORA = ("wikitext103", "enwik8", "plain_text", "python_docs")
WORD_LEVEL = ("wikitext103", "python_docs")  # plus plain_text with words.
TEXT_DATA: dict[str, Spec] = {
    "corpus": Field("str", REQUIRED, choices=CORPORA),
    "path": Field("str", None, nullable=True,
                  doc="corpus directory or file (not for python_docs)"),
    "tokens": Field("str", "words", choices=("words", "bytes"),
                    doc="plain_text: whitespace/punctuation words or bytes"),
    "min_count": Field("int", text_plain.DEFAULT_MIN_COUNT, low=1,
                       doc="plain_text words, python_docs: rarer train "
                           "tokens become <unk>"),
    "block_size": Field("int", REQUIRED, low=1,
                        doc="M, tokens per row per block"),
    "batch_size": Field("int", REQUIRED, low=1, doc="B, training rows"),
    "eval_batch_size": Field("int", None, nullable=True, low=1,
                             doc="rows when evaluating (None: batch_size)"),
    "word_swap_rate": Field("float", None, nullable=True, low=0.0, high=1.0,
                            doc="AAA attack on valid/test (None: 0.025 on "
                                "words, off on bytes)"),
    "word_swap_method": Field("str", "textattack",
                              choices=word_swap.METHODS),
    "word_swap_seed": Field("int", 0),
    "cache_dir": Field("str", None, nullable=True,
                       doc="keep the tokenised corpus here (None: no cache)"),
}


def is_word_level(value: Mapping[str, Any]) -> bool:
  corpus = value.get("corpus")
  return corpus in WORD_LEVEL or (corpus == "plain_text" and
                                  value.get("tokens", "words") == "words")


def word_swap_rate(value: Mapping[str, Any]) -> float:
  """The rate in effect: the field, or its default for the corpus."""
  rate = value.get("word_swap_rate", None)
  if rate is None:
    return word_swap.PAPER_RATE if is_word_level(value) else 0.0
  return float(rate)


def check_text_data(value: Mapping[str, Any]) -> None:
  """The checks beyond each field's type and range, fields named relative
  to the section ("path"): the corpus files exist, and no field is set
  where it does not apply."""
  corpus, path = value.get("corpus"), value.get("path", None)
  if corpus == "python_docs":
    require(path is None, "path", "not used by corpus 'python_docs' (the "
            "shipped text); leave it None")
  else:
    require(path, "path", f"required for corpus {corpus!r}: "
            + ("the enwik8 file, enwik8.zip, or a directory of its prepared "
               "train.txt, valid.txt, test.txt" if corpus == "enwik8" else
               "a directory holding train.txt, valid.txt and test.txt"))
    require(os.path.exists(path), "path", f"{path!r} does not exist")
    if corpus != "enwik8" or os.path.isdir(path):
      text_corpus.split_files(path, field="path",
                              wikitext_names=corpus != "plain_text")
  if corpus != "plain_text":
    require(value.get("tokens", "words") == "words", "tokens",
            f"only for corpus 'plain_text' ({corpus!r} fixes its tokens)")
  uses_min_count = corpus == "python_docs" or (
      corpus == "plain_text" and is_word_level(value))
  if not uses_min_count:
    require(value.get("min_count", text_plain.DEFAULT_MIN_COUNT)
            == text_plain.DEFAULT_MIN_COUNT, "min_count",
            "only for corpus 'python_docs' and plain_text words")
  rate = value.get("word_swap_rate", None)
  require(rate is None or rate == 0 or is_word_level(value),
          "word_swap_rate", "the word swap replaces words; this corpus is "
          "byte level (set 0 or None)")
  cache = value.get("cache_dir", None)
  require(cache is None or not os.path.exists(cache) or os.path.isdir(cache),
          "cache_dir", f"{cache!r} exists and is not a directory")


TEXT_DATA_SECTION = Section(
    {"name": Field("str", TEXT_DATASET_NAME, choices=(TEXT_DATASET_NAME,)),
     **TEXT_DATA}, check=check_text_data)


def _read(value: Mapping[str, Any]) -> text_corpus.TextCorpus:
  corpus, path = value["corpus"], value.get("path", None)
  min_count = value.get("min_count", text_plain.DEFAULT_MIN_COUNT)
  if corpus == "wikitext103":
    return text_corpus.read_word_corpus(path)
  if corpus == "enwik8":
    return text_corpus.read_enwik8(path)
  if corpus == "python_docs":
    return text_plain.python_docs_corpus(min_count)
  if value.get("tokens", "words") == "bytes":
    return text_corpus.read_byte_corpus(path)
  return text_plain.read_plain_word_corpus(path, min_count)


def _sources(value: Mapping[str, Any]) -> list[str]:
  path = value.get("path", None)
  if value["corpus"] == "python_docs":
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top
    return [topics.__file__]
  if os.path.isdir(path):
    return sorted(os.path.join(path, n) for n in os.listdir(path)
                  if n.endswith((".txt", ".tokens")))
  return [path]


def cache_key(value: Mapping[str, Any]) -> str:
  """16 hex digits naming the cached corpus of a config: the corpus fields
  and every source file's absolute path, size and modification time."""
  stats = [(os.path.abspath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns)
           for p in _sources(value)]
  fields = {k: value.get(k, TEXT_DATA[k].default)
            for k in ("corpus", "path", "tokens", "min_count")}
  blob = json.dumps([1, fields, stats, sys.version], sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_text_corpus(value: Mapping[str, Any]) -> text_corpus.TextCorpus:
  """The corpus of a checked config, through `cache_dir` when set."""
  cache = value.get("cache_dir", None)
  if not cache:
    return _read(value)
  file = os.path.join(cache, f"text_corpus_{cache_key(value)}.npz")
  if os.path.exists(file):
    return text_corpus.load_corpus(file)
  corpus = _read(value)
  os.makedirs(cache, exist_ok=True)
  text_corpus.save_corpus(corpus, file)
  return corpus


@dataclasses.dataclass(frozen=True, eq=False)
class TextData:
  """A language-model run's data.

  Attributes:
    corpus: the tokenised corpus.
    block_size, batch_size, eval_batch_size: M, B, and B for evaluation.
    eval_splits: "valid", "test" and, with the word swap on,
      "valid_attacked", "test_attacked" -> `[N]` id streams.
    word_swap_rate: the contamination rate in effect (0: off).
  """
  corpus: text_corpus.TextCorpus
  block_size: int
  batch_size: int
  eval_batch_size: int
  eval_splits: Mapping[str, np.ndarray]
  word_swap_rate: float

  @property
  def vocab_size(self) -> int:
    return len(self.corpus.vocab)

  def train_blocks(self, seed: int) -> BlockIterator:
    """The training blocks (`text_stream.BlockIterator`)."""
    return BlockIterator(batchify(self.corpus.splits["train"],
                                  self.batch_size), self.block_size, seed)

  def eval_rows(self, name: str) -> np.ndarray:
    """`[eval_batch_size, L]` rows of an evaluation split."""
    return batchify(self.eval_splits[name], self.eval_batch_size,
                    field="data.eval_batch_size")


def load_text_data(config: Mapping[str, Any]) -> TextData:
  """Validates the `data` config, reads the corpus, attacks valid and test.

  Raises:
    ConfigError naming the field (`data.path`, `data.block_size`, ...) for
    bad values, missing files, or splits too short for the blocks.
  """
  validate(TEXT_DATA_SECTION, config, "data")
  value = dict(config.to_dict() if hasattr(config, "to_dict") else config)
  value = {k: value.get(k, spec.default) for k, spec in TEXT_DATA.items()}
  corpus = load_text_corpus(value)
  m, b = value["block_size"], value["batch_size"]
  eb = value["eval_batch_size"] or b
  BlockIterator(batchify(corpus.splits["train"], b), m, 0)  # Fits: checked.
  splits = {s: corpus.splits[s] for s in ("valid", "test")}
  for s, ids in splits.items():
    try:
      eval_positions(batchify(ids, eb, field="data.eval_batch_size").shape[1],
                     m)
    except ConfigError as e:
      raise ConfigError(e.field, f"{s} split ({len(ids)} tokens): "
                        f"{e.reason}") from e
  rate = word_swap_rate(value)
  if rate > 0:
    if corpus.vocab.get(text_corpus.UNK) is None and (
        value["word_swap_method"] == "textattack"
        or word_swap.REPLACEMENT not in corpus.vocab):
      raise ConfigError("data.word_swap_rate", f"corpus {corpus.name} has "
                        "no <unk> token for swapped words that are not in "
                        "its vocabulary; set 0 to turn the swap off")
    attacked = word_swap.attacked_splits(
        corpus, rate=rate, seed=value["word_swap_seed"],
        method=value["word_swap_method"])
    splits.update({f"{s}_attacked": ids for s, ids in attacked.items()})
  return TextData(corpus, m, b, eb, splits, rate)


__all__ = ["CORPORA", "TEXT_DATA", "TEXT_DATASET_NAME", "TEXT_DATA_SECTION",
           "TextData", "cache_key", "check_text_data", "is_word_level",
           "load_text_corpus", "load_text_data", "word_swap_rate"]
