"""The word-swap contamination of the evaluation text ("AAA" attack).

The ACMoE, Symphony and MomentumSMoE papers evaluate clean-trained language
models on WikiText-103 valid / test text in which TextAttack's word swap
(after Han et al.) replaced words by the generic token "AAA" at a 2.5% rate.
Their `data.py` runs, on every line of valid.txt and test.txt, TextAttack's
`Augmenter(AAAWordSwap, [StopwordModification()], pct_words_to_swap=0.025,
transformations_per_example=1, fast_augment=True)`, then tokenises the
result with the clean vocabulary, a token not in it becoming `<unk>`.
`method="textattack"` (the default) computes exactly what that does, as a
function of the id stream:

* a line is the tokens up to each `<eos>`; `<eos>` itself is never swapped,
  and the swap keeps every token in place (ids stay aligned);
* the words of a line are TextAttack's: per whitespace token, leading
  `'-_*@` stripped, the runs of word characters, `'-_*@`, and the
  homoglyphs among them that are not word characters (U+02D7, backtick,
  U+00D7), each again stripped of leading `'-_*@`: `@-@` has none, `'s` is
  `s`, `U.S.` is `U` and `S`, `<unk>` is `unk`;
* a word is eligible unless it is an NLTK English stopword (compared as
  written, case-sensitive) or already "AAA";
* the line's target is `k = max(int(rate * W), 1)` for W words (stopwords
  counted); with E eligible words, `fast_augment` swaps all E when E < k,
  and otherwise k words with probability `(E-k+1)/(E-k+2)` and k - 1 words
  with probability `1/(E-k+2)` (its last draw picks among the E-k+1 full
  swaps and the unfinished text); the swapped words are a uniform subset;
* a swapped word becomes "AAA" inside its token (`'s` -> `'AAA`), and the
  new token's id is the vocabulary's, else `<unk>`'s (WikiText-103 has
  `<unk>`, and "AAA" itself when it occurs in the corpus).

So the realised rate is above `rate`: a line of fewer than 80 words still
gets one swap (with probability E / (E + 1)), and WikiText's many short
lines (headings) are swapped far more often than 2.5%. Not reproduced: TextAttack segments a line holding CJK characters with jieba
first; here such lines split like any other. The authors' draws are unseeded;
here they come from `seed`, one stream per split.

`method="uniform"` is the papers' sentence taken literally: exactly
`round(rate * n)` of the n tokens other than `<eos>` (and other than the
replacement itself), uniformly at random over the split, become the "AAA"
id (or `<unk>`'s when "AAA" is not in the vocabulary).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from vmoe_ext.data.text_corpus import EOS, UNK, TextCorpus, Vocabulary
from vmoe_ext.errors import InputError

REPLACEMENT = "AAA"
METHODS = ("textattack", "uniform")
PAPER_RATE = 0.025
# NLTK's English stopword list (179 words), as StopwordModification uses it.
STOPWORDS = frozenset("""
i me my myself we our ours ourselves you you're you've you'll you'd your
yours yourself yourselves he him his himself she she's her hers herself it
it's its itself they them their theirs themselves what which who whom this
that that'll these those am is are was were be been being have has had
having do does did doing a an the and but if or because as until while of at
by for with about against between into through during before after above
below to from up down in out on off over under again further then once here
there when where why how all any both each few more most other some such no
nor not only own same so than too very s t can will just don don't should
should've now d ll m o re ve y ain aren aren't couldn couldn't didn didn't
doesn doesn't hadn hadn't hasn hasn't haven haven't isn isn't ma mightn
mightn't mustn mustn't needn needn't shan shan't shouldn shouldn't wasn
wasn't weren weren't won won't wouldn wouldn't
""".split())
_EDGE = "'-_*@"
_WORD = re.compile("[\\w\u02d7`\u00d7'\\-_*@]+")


def word_spans(token: str) -> list[tuple[int, int]]:
  """`(start, end)` of each TextAttack word in a whitespace token."""
  spans = []
  start = len(token) - len(token.lstrip(_EDGE))
  for m in _WORD.finditer(token, start):
    s = m.start() + len(m.group()) - len(m.group().lstrip(_EDGE))
    if s < m.end():
      spans.append((s, m.end()))
  return spans


def _swap(token: str, spans: Sequence[tuple[int, int]]) -> str:
  for s, e in sorted(spans, reverse=True):
    token = token[:s] + REPLACEMENT + token[e:]
  return token


def _lines(ids: np.ndarray, eos: int | None) -> list[tuple[int, int]]:
  """`[start, end)` of each line: tokens up to an `<eos>` (excluded); a tail
  after the last `<eos>` is a line too."""
  ends = np.flatnonzero(ids == eos) if eos is not None else np.zeros(0, int)
  starts = np.concatenate([[0], ends + 1])
  stops = np.concatenate([ends, [len(ids)]])
  return [(int(a), int(b)) for a, b in zip(starts, stops)]


def swap_textattack(ids: np.ndarray, vocab: Vocabulary, rate: float,
                    rng: np.random.Generator) -> np.ndarray:
  """TextAttack's fast-augment word swap, line by line (module docstring)."""
  eos, unk = vocab.get(EOS), vocab.get(UNK)
  out = ids.copy()
  words: dict[int, tuple[list[tuple[int, int]], list[bool]]] = {}
  for start, stop in _lines(ids, eos):
    eligible: list[tuple[int, tuple[int, int]]] = []
    total = 0
    for pos in range(start, stop):
      tid = int(ids[pos])
      if tid not in words:
        token = vocab.tokens[tid]
        spans = word_spans(token)
        words[tid] = (spans, [token[s:e] not in STOPWORDS and
                              token[s:e] != REPLACEMENT for s, e in spans])
      spans, ok = words[tid]
      total += len(spans)
      eligible += [(pos, sp) for sp, good in zip(spans, ok) if good]
    k, e = max(int(rate * total), 1), len(eligible)
    if not e:
      continue
    count = e if e < k else (k - 1 if rng.integers(e - k + 2) == 0 else k)
    chosen: dict[int, list[tuple[int, int]]] = {}
    for j in rng.choice(e, size=count, replace=False) if count else ():
      pos, span = eligible[int(j)]
      chosen.setdefault(pos, []).append(span)
    for pos, spans in chosen.items():
      new = _swap(vocab.tokens[int(ids[pos])], spans)
      tid = vocab.get(new, unk)
      if tid is None:
        raise InputError("vocab", f"has neither {new!r} nor {UNK!r}; the "
                         "swapped token needs one (as the authors' code, "
                         "which maps unknown tokens to <unk>)")
      out[pos] = tid
  return out


def swap_uniform(ids: np.ndarray, vocab: Vocabulary, rate: float,
                 rng: np.random.Generator) -> np.ndarray:
  """`round(rate * n)` uniform positions become "AAA" (module docstring)."""
  target = vocab.get(REPLACEMENT, vocab.get(UNK))
  if target is None:
    raise InputError("vocab", f"has neither {REPLACEMENT!r} nor {UNK!r} to "
                     "swap words for")
  eos = vocab.get(EOS, -1)
  positions = np.flatnonzero((ids != eos) & (ids != target))
  count = int(np.floor(rate * len(positions) + 0.5))
  out = ids.copy()
  out[rng.choice(positions, size=count, replace=False)] = target
  return out


def word_swap(ids: np.ndarray, vocab: Vocabulary, *, rate: float = PAPER_RATE,
              seed: int | Sequence[int] = 0,
              method: str = "textattack") -> np.ndarray:
  """The contaminated copy `[N]` of an id stream `[N]` (module docstring).

  Args:
    ids: a word-level split's ids.
    vocab: the corpus vocabulary (the swap reads tokens, writes ids).
    rate: TextAttack's `pct_words_to_swap` / the uniform fraction, in [0, 1].
    seed: an int or a sequence of ints (a SeedSequence's entropy).
    method: "textattack" (the authors' code) or "uniform".

  Raises:
    InputError: a bad rate or method; no id for a swapped token.
  """
  if method not in METHODS:
    raise InputError("method", f"unknown {method!r}; expected one of "
                     f"{METHODS}")
  if not 0.0 <= rate <= 1.0:
    raise InputError("rate", f"must be in [0, 1], got {rate!r}")
  ids = np.asarray(ids)
  if ids.ndim != 1:
    raise InputError("ids", f"must be one stream [N], got shape {ids.shape}")
  entropy = [seed] if isinstance(seed, (int, np.integer)) else list(seed)
  rng = np.random.default_rng([int(s) % 2**64 for s in entropy])
  if method == "uniform":
    return swap_uniform(ids, vocab, rate, rng)
  return swap_textattack(ids, vocab, rate, rng)


def attacked_splits(corpus: TextCorpus, *, rate: float = PAPER_RATE,
                    seed: int = 0, method: str = "textattack",
                    splits: Sequence[str] = ("valid", "test")
                    ) -> Mapping[str, np.ndarray]:
  """split -> its contaminated stream; split i of `splits` draws from the
  seed entropy `[seed, i + 1]`, so valid and test are attacked
  independently and the same way for every model."""
  if corpus.level != "word":
    raise InputError("corpus", f"{corpus.name} is {corpus.level}-level; the "
                     "word swap needs words")
  return {s: word_swap(corpus.splits[s], corpus.vocab, rate=rate,
                       seed=(seed, i + 1), method=method)
          for i, s in enumerate(splits)}


__all__ = ["METHODS", "PAPER_RATE", "REPLACEMENT", "STOPWORDS",
           "attacked_splits", "swap_textattack", "swap_uniform",
           "word_spans", "word_swap"]
