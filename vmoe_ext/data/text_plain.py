"""Plain English text to a WikiText-style word corpus, and the shipped one.

`plain_word_lines` turns raw text into lines of space-separated tokens the
way WikiText was made, so that the word reader of `text_corpus` reads them
as it reads WikiText-103: blank lines are dropped; each other line is cut
into runs of word characters and single other characters (`\\w+|[^\\w\\s]`:
"don't stop." -> `don ' t stop .`), case kept; a token seen fewer than
`min_count` times in the train split becomes `<unk>` in every split (a closed
vocabulary, as WikiText-103's, whose rare words are `<unk>`).

The shipped corpus (`python_docs_lines`): the English prose of the Python
Language Reference that every CPython installation carries for `help()`
(`pydoc_data.topics`, 79 topics, about 65,500 whitespace words and 114,000
tokens in CPython 3.11). A line is a paragraph (the topic's text between
blank lines, its wrapped lines joined by spaces), as a WikiText line is.
Topics in sorted order; the n paragraphs of each topic split 80 / 10 / 10 in
order (`8n // 10`, `9n // 10`): its first paragraphs to train, the next to
valid, its last to test, so every split holds contiguous passages of every
topic. The text changes with the Python
version; `TextCorpus.source` names the version and `fingerprint()` the ids.
"""

from __future__ import annotations

import collections
import os
import re
import sys
from collections.abc import Iterable, Mapping

from vmoe_ext.data.text_corpus import (SPLITS, UNK, TextCorpus, split_files,
                                       word_corpus)
from vmoe_ext.errors import ConfigError

_TOKEN = re.compile(r"\w+|[^\w\s]")
_BLANK = re.compile(r"\n[ \t]*\n")
DEFAULT_MIN_COUNT = 3  # WikiText's threshold.


def tokenize_line(line: str) -> list[str]:
  """`"Don't stop."` -> `["Don", "'", "t", "stop", "."]`."""
  return _TOKEN.findall(line)


def plain_word_lines(raw: Mapping[str, Iterable[str]],
                     min_count: int = DEFAULT_MIN_COUNT
                     ) -> dict[str, list[str]]:
  """split -> token lines (tokens joined by one space), rare tokens `<unk>`.

  Args:
    raw: "train", "valid", "test" -> lines of raw text.
    min_count: a token kept in the vocabulary occurs at least this often in
      the train split; every other token (of any split) becomes `<unk>`.
  """
  if min_count < 1:
    raise ConfigError("data.min_count", f"must be >= 1, got {min_count}")
  tokens = {s: [tokenize_line(line) for line in raw[s] if line.strip()]
            for s in SPLITS}
  counts = collections.Counter(t for line in tokens["train"] for t in line)
  keep = {t for t, n in counts.items() if n >= min_count}
  return {s: [" ".join(t if t in keep else UNK for t in line)
              for line in tokens[s]] for s in SPLITS}


def read_plain_word_corpus(directory: str, min_count: int = DEFAULT_MIN_COUNT,
                           *, field: str = "data.path") -> TextCorpus:
  """A directory of raw UTF-8 `train.txt`, `valid.txt`, `test.txt`, made a
  word corpus by `plain_word_lines`."""
  raw = {}
  for split, path in split_files(directory, field=field).items():
    try:
      with open(path, encoding="utf8") as f:
        raw[split] = f.readlines()
    except UnicodeDecodeError as e:
      raise ConfigError(field, f"{path!r} is not UTF-8 text ({e})") from e
  return word_corpus(plain_word_lines(raw, min_count), name="plain_text",
                     source=f"{os.path.abspath(directory)} (min_count "
                            f"{min_count})")


def python_docs_lines() -> dict[str, list[str]]:
  """split -> raw lines of the shipped corpus (module docstring)."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  out: dict[str, list[str]] = {s: [] for s in SPLITS}
  for key in sorted(topics.topics):
    lines = [" ".join(ln.strip() for ln in par.splitlines())
             for par in _BLANK.split(topics.topics[key]) if par.strip()]
    n = len(lines)
    out["train"] += lines[:8 * n // 10]
    out["valid"] += lines[8 * n // 10:9 * n // 10]
    out["test"] += lines[9 * n // 10:]
  return out


def python_docs_corpus(min_count: int = DEFAULT_MIN_COUNT) -> TextCorpus:
  """The shipped corpus as a word corpus (nothing is downloaded)."""
  version = sys.version.split()[0]
  return word_corpus(plain_word_lines(python_docs_lines(), min_count),
                     name="python_docs",
                     source=f"pydoc_data.topics of Python {version} "
                            f"(min_count {min_count})")


__all__ = ["DEFAULT_MIN_COUNT", "plain_word_lines", "python_docs_corpus",
           "python_docs_lines", "read_plain_word_corpus", "tokenize_line"]
