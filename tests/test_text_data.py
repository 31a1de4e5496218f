"""Language-model data: corpora, contiguous rows and blocks, full-stream
evaluation, the "AAA" word swap, and the text-data config.

References are independent: hand-checked tiny corpora, naive loops written
from the authors' procedure (two-pass tokeniser, `prep_enwik8.py`'s text,
`train_iteration` / `full_eval`'s position loops, TextAttack's augment loop).
"""

from __future__ import annotations

import collections
import json
import math
import os
import random
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.config.schema import validate
from vmoe_ext.data import text_corpus, text_plain, text_stream, word_swap
from vmoe_ext.data.text_config import (TEXT_DATA_SECTION, cache_key,
                                       load_text_data)
from vmoe_ext.data.text_eval import evaluate_stream
from vmoe_ext.errors import ConfigError


def _field_error(field: str):
  return pytest.raises(ConfigError, match=f"^{field.replace('.', '[.]')}:")


def _write(directory, files: dict[str, str | bytes]) -> str:
  os.makedirs(directory, exist_ok=True)
  for name, text in files.items():
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(os.path.join(directory, name), mode, **(
        {} if isinstance(text, bytes) else {"encoding": "utf8",
                                            "newline": ""})) as f:
      f.write(text)
  return str(directory)


def _naive_word_reader(directory, names=("train.txt", "valid.txt",
                                         "test.txt")):
  """The authors' reading, two passes per file: grow the dictionary over the
  file's lines (whitespace tokens plus <eos>), then look every token up."""
  vocab, streams = {}, []
  for name in names:
    with open(os.path.join(directory, name), encoding="utf8") as f:
      lines = list(f)
    for line in lines:
      for tok in line.split() + ["<eos>"]:
        if tok not in vocab:
          vocab[tok] = len(vocab)
    streams.append([vocab[t] for line in lines
                    for t in line.split() + ["<eos>"]])
  return list(vocab), streams


# --------------------------------------------------------------------------
# Corpora.


def test_word_reader_hand_checked(tmp_path):
  d = _write(tmp_path, {"train.txt": "a b\r\n b  c\n",
                        "valid.txt": "c d\n\n", "test.txt": "a e"})
  corpus = text_corpus.read_word_corpus(d)
  assert corpus.vocab.tokens == ("a", "b", "<eos>", "c", "d", "e")
  assert corpus.splits["train"].tolist() == [0, 1, 2, 1, 3, 2]
  assert corpus.splits["valid"].tolist() == [3, 4, 2, 2]
  assert corpus.splits["test"].tolist() == [0, 5, 2]  # No newline: <eos>.
  assert corpus.splits["train"].dtype == np.int32 and corpus.level == "word"


def test_word_reader_matches_two_pass_reference(tmp_path):
  rng = np.random.default_rng(0)
  words = ["w%d" % i for i in range(40)] + ["@-@", "<unk>", "é", "AAA"]
  files = {}
  for name, n in (("wiki.train.tokens", 60), ("wiki.valid.tokens", 15),
                  ("wiki.test.tokens", 15)):
    files[name] = "".join(
        " " + " ".join(rng.choice(words, rng.integers(0, 9))) + " \n"
        for _ in range(n))
  d = _write(tmp_path, files)
  corpus = text_corpus.read_word_corpus(d)  # WikiText's own file names.
  tokens, streams = _naive_word_reader(d, list(files))
  assert list(corpus.vocab.tokens) == tokens
  for split, stream in zip(("train", "valid", "test"), streams):
    assert corpus.splits[split].tolist() == stream


def _prep_enwik8_text(part: bytes) -> str:
  """Transformer-XL's `prep_enwik8.py` text of some bytes."""
  return " ".join(str(c) if c != 10 else "\n" for c in part)


def test_byte_level_equals_word_reader_on_prepared_text(tmp_path):
  rng = np.random.default_rng(1)
  raw = bytes(rng.choice([10, 32, 65, 66, 200, 13, 0], 300).tolist())
  raw = b"\nAB\n\n" + raw + b"xyz"  # Leading / double newlines, no final one.
  holdout = 40
  parts = text_corpus.enwik8_parts(raw, holdout)
  assert parts["train"] + parts["valid"] + parts["test"] == raw
  assert len(parts["test"]) == len(parts["valid"]) == holdout
  prepared = _write(tmp_path / "prep", {
      f"{s}.txt": _prep_enwik8_text(parts[s]) for s in parts})
  tokens, streams = _naive_word_reader(prepared)
  for corpus in (text_corpus.byte_corpus(parts, name="enwik8", source="-"),
                 text_corpus.read_enwik8(prepared)):
    assert list(corpus.vocab.tokens) == tokens and corpus.level == "byte"
    for split, stream in zip(("train", "valid", "test"), streams):
      assert corpus.splits[split].tolist() == stream
  raw_file = _write(tmp_path, {"enwik8": raw})
  raw_file = os.path.join(raw_file, "enwik8")
  with zipfile.ZipFile(tmp_path / "enwik8.zip", "w") as z:
    z.write(raw_file, "enwik8")
  for path in (raw_file, str(tmp_path / "enwik8.zip")):
    corpus = text_corpus.read_enwik8(path, holdout=holdout)
    assert list(corpus.vocab.tokens) == tokens
    assert corpus.splits["test"].tolist() == streams[2]
  with _field_error("data.path"):
    text_corpus.read_enwik8(raw_file)  # 5,000,000-byte holdouts: too short.


def test_plain_text_words_and_unk():
  assert text_plain.tokenize_line("Don't stop, 2x.") == [
      "Don", "'", "t", "stop", ",", "2x", "."]
  raw = {"train": ["a b a", "", "b c a"], "valid": ["a d", "  "],
         "test": ["c b"]}
  lines = text_plain.plain_word_lines(raw, min_count=2)
  assert lines == {"train": ["a b a", "b <unk> a"], "valid": ["a <unk>"],
                   "test": ["<unk> b"]}


def test_python_docs_corpus_is_shipped_deterministic_and_closed():
  corpus = text_plain.python_docs_corpus()
  again = text_plain.python_docs_corpus()
  assert corpus.fingerprint() == again.fingerprint()
  sizes = {s: len(v) for s, v in corpus.splits.items()}
  assert sum(sizes.values()) > 100_000
  assert 0.75 < sizes["train"] / sum(sizes.values()) < 0.85
  assert 0.05 < sizes["valid"] / sum(sizes.values()) < 0.15
  train_ids = set(corpus.splits["train"].tolist())
  for split in ("valid", "test"):  # Closed vocabulary: no id unseen in train.
    assert set(corpus.splits[split].tolist()) <= train_ids
  assert "<unk>" in corpus.vocab and "Python" in corpus.vocab
  lines = text_plain.python_docs_lines()
  assert sum(len(line.split()) for v in lines.values() for line in v) > 50_000


# --------------------------------------------------------------------------
# Rows and training blocks.


def test_batchify_against_naive_loop():
  ids = np.arange(23, dtype=np.int32)
  rows = text_stream.batchify(ids, 4)
  length = 23 // 4
  naive = [[int(ids[b * length + j]) for j in range(length)]
           for b in range(4)]
  assert rows.tolist() == naive
  with _field_error("data.batch_size"):
    text_stream.batchify(ids, 24)


def _naive_training_positions(length, m, seed, steps):
  """The authors' `train_iteration` loop: block at `pos`, `pos += M`, and at
  the end a restart at an offset below M with the caches zeroed."""
  pos, restarts, fresh, out = 0, 0, True, []
  for _ in range(steps):
    out.append((pos, fresh))
    fresh = False
    pos += m
    if pos >= length - m:
      restarts += 1
      pos = text_stream.restart_offset(seed, restarts, m)
      assert 0 <= pos < m
      fresh = True
  return out


def test_block_iterator_against_naive_loop_and_restarts():
  rows = np.arange(3 * 17, dtype=np.int32).reshape(3, 17) * 7 % 101
  m, seed = 4, 5
  it = text_stream.BlockIterator(rows, m, seed)
  naive = _naive_training_positions(17, m, seed, 40)
  assert sum(fresh for _, fresh in naive) > 5  # Several restarts covered.
  for pos, fresh in naive:
    block = next(it)
    np.testing.assert_array_equal(block["inputs"], rows[:, pos:pos + m])
    np.testing.assert_array_equal(block["targets"], rows[:, pos + 1:pos + m + 1])
    assert block["reset"] == fresh
  offsets = [text_stream.restart_offset(s, r, 64) for s in range(3)
             for r in range(1, 200)]
  assert min(offsets) == 0 and max(offsets) == 63  # All of [0, M) reached.
  assert offsets[:199] != offsets[199:398]  # Seed-dependent.
  with _field_error("data.block_size"):
    text_stream.BlockIterator(rows, 9, seed)  # 17 < 2 x 9.


def test_block_iterator_exact_resume_from_json_state():
  rows = np.random.default_rng(0).integers(0, 50, (2, 25)).astype(np.int32)
  straight = text_stream.BlockIterator(rows, 6, seed=3)
  for _ in range(7):
    next(straight)
  state = json.loads(json.dumps(straight.get_state()))
  resumed = text_stream.BlockIterator(rows, 6, seed=3)
  resumed.set_state(state)
  for _ in range(20):
    a, b = next(straight), next(resumed)
    assert a["reset"] == b["reset"]
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    np.testing.assert_array_equal(a["targets"], b["targets"])
  with pytest.raises(ValueError, match="out of range"):
    resumed.set_state({"position": 19, "restarts": 0, "reset": False})


# --------------------------------------------------------------------------
# Full-stream evaluation.


def _toy_step(log_p):
  """A toy cached LM: target y_t costs `-(log_p[x_t, y_t] + 0.5 *
  log_p[x_{t-1}, y_t])`, where x_{-1}, the input before the block, is the
  carry (the row's last input of the previous block; zeros at the start)."""
  @jax.jit
  def step(carry, x, y):
    prev = jnp.concatenate([carry[:, None], x[:, :-1]], axis=1)
    nll = -(log_p[x, y] + 0.5 * log_p[prev, y])
    return x[:, -1], nll.sum(), nll.size
  return step


def _naive_full_eval(log_p, rows, m):
  """The authors' `full_eval` loop, block means averaged over blocks."""
  b, length = rows.shape
  cache = [0] * b
  pos, losses = 0, []
  for _ in range(math.ceil(length / m)):
    total = 0.0
    for r in range(b):
      for t in range(m):
        x, y = rows[r, pos + t], rows[r, pos + t + 1]
        prev = cache[r] if t == 0 else rows[r, pos + t - 1]
        total -= log_p[x, y] + 0.5 * log_p[prev, y]
      cache[r] = rows[r, pos + m - 1]
    losses.append(total / (b * m))
    pos += m
    if pos >= length - m:
      break
  return sum(losses) / len(losses), len(losses)


@pytest.mark.parametrize("length,m,blocks", [(10, 3, 3), (10, 2, 4),
                                              (9, 2, 4), (7, 3, 2), (5, 4, 1)])
def test_evaluate_stream_against_naive_full_eval(length, m, blocks):
  rng = np.random.default_rng(length * 10 + m)
  v, b = 6, 3
  log_p = np.log(rng.dirichlet(np.ones(v), v)).astype(np.float32)
  ids = rng.integers(0, v, b * length + 2).astype(np.int32)
  rows = text_stream.batchify(ids, b)
  want, count = _naive_full_eval(log_p.astype(np.float64), rows, m)
  assert count == blocks == text_stream.num_eval_blocks(length, m)
  got = evaluate_stream(_toy_step(jnp.asarray(log_p)), ids,
                        jnp.zeros(b, jnp.int32), block_size=m, batch_size=b)
  assert got.num_blocks == blocks and got.num_tokens == blocks * b * m
  np.testing.assert_allclose(got.loss, want, rtol=1e-6)
  np.testing.assert_allclose(got.ppl, math.exp(want), rtol=1e-6)


def test_evaluate_stream_needs_one_whole_block():
  step = _toy_step(jnp.zeros((4, 4)))
  with _field_error("data.block_size"):
    evaluate_stream(step, np.zeros((2, 4), np.int32), jnp.zeros(2, jnp.int32),
                    block_size=4)


# --------------------------------------------------------------------------
# Word swap.


def test_word_spans_hand_checked():
  cases = {"@-@": [], "'s": ["s"], "U.S.": ["U", "S"], "<unk>": ["unk"],
           "don't": ["don't"], "--ab": ["ab"], "1,000": ["1", "000"],
           "\u00d7": ["\u00d7"], "_": []}
  for token, want in cases.items():
    assert [token[s:e] for s, e in word_swap.word_spans(token)] == want


def _vocab(*tokens):
  return text_corpus.Vocabulary(tokens)


def test_word_swap_hand_checked_line():
  vocab = _vocab("<eos>", "<unk>", "the", "cat", "sat", "U.S.", "'s", "@-@",
                 "AAA", ".")
  line = vocab.tokens.index
  ids = np.array([line(t) for t in ("the", "cat", "'s", "@-@", "U.S.", ".",
                                    "<eos>", "the", ".", "<eos>")])
  # Rate 1: k = W = 5 words (the, cat, s, U, S) > E = 3 eligible (cat, U, S;
  # "the" and "s" are stopwords): all three swapped, whatever the seed.
  for seed in range(5):
    out = word_swap.word_swap(ids, vocab, rate=1.0, seed=seed)
    assert vocab.decode(out) == ["the", "AAA", "'s", "@-@", "<unk>", ".",
                                 "<eos>", "the", ".", "<eos>"]


def _naive_augment(words, eligible, pct, rnd):
  """TextAttack's `Augmenter.augment` with fast_augment and one example, on
  a line of `words` (indices `eligible` may be swapped): returns the set of
  swapped indices."""
  k = max(int(pct * len(words)), 1)
  current, found = frozenset(), set()
  while len(current) < k:
    candidates = [current | {i} for i in eligible if i not in current]
    if not candidates:
      break
    ready = [c for c in candidates if len(c) >= k]
    found.update(ready)
    unfinished = [c for c in candidates if c not in ready]
    if not unfinished:
      break
    current = rnd.choice(unfinished)
  found.add(current)
  return rnd.choice(sorted(found, key=sorted))


@pytest.mark.parametrize("words,rate,expected", [
    # E = 3 eligible of W = 4 (one stopword), k = 1: nothing or one of three.
    (["the", "cat", "dog", "fox"], 0.025, {0: 0.25, 1: 0.75}),
    # W = 80, k = int(0.025 * 80) = 2, E = 3: two swaps w.p. 2/3, else one.
    (["cat", "dog", "fox"] + ["the"] * 77, 0.025, {1: 1 / 3, 2: 2 / 3}),
])
def test_word_swap_distribution_matches_textattack_loop(words, rate, expected):
  vocab = _vocab("<eos>", "<unk>", "AAA", *sorted(set(words)))
  ids = np.array([vocab.id(w) for w in words] + [0])
  eligible = [i for i, w in enumerate(words) if w not in word_swap.STOPWORDS]
  trials = 3000
  ours = collections.Counter()
  for seed in range(trials):
    out = word_swap.word_swap(ids, vocab, rate=rate, seed=seed)
    changed = np.flatnonzero(out != ids)
    assert set(changed.tolist()) <= set(eligible)
    assert (out[changed] == vocab.id("AAA")).all()
    ours[len(changed)] += 1
  rnd = random.Random(0)
  naive = collections.Counter(len(_naive_augment(words, eligible, rate, rnd))
                              for _ in range(trials))
  for count, p in expected.items():
    sigma = math.sqrt(p * (1 - p) / trials)
    assert abs(ours[count] / trials - p) < 4 * sigma
    assert abs(naive[count] / trials - p) < 4 * sigma
  assert set(ours) == set(naive) == set(expected)


def test_word_swap_uniform_rate_positions_and_seeds():
  corpus = text_plain.python_docs_corpus()
  ids, vocab = corpus.splits["valid"], corpus.vocab
  eos = vocab.id("<eos>")
  for method in ("uniform", "textattack"):
    a = word_swap.word_swap(ids, vocab, rate=0.025, seed=1, method=method)
    b = word_swap.word_swap(ids, vocab, rate=0.025, seed=1, method=method)
    c = word_swap.word_swap(ids, vocab, rate=0.025, seed=2, method=method)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    changed = a != ids
    assert not changed[ids == eos].any() and (a == eos).sum() == (ids == eos).sum()
    assert (a[changed] == vocab.id("<unk>")).all()  # No "AAA" in this text.
    if method == "uniform":
      eligible = (ids != eos) & (ids != vocab.id("<unk>"))
      assert changed.sum() == round(0.025 * eligible.sum())
  attacked = word_swap.attacked_splits(corpus, seed=0)
  assert set(attacked) == {"valid", "test"}


# --------------------------------------------------------------------------
# Config: fields, missing files, sizes; cache.


def _config(**kw):
  return {"corpus": "python_docs", "block_size": 16, "batch_size": 4, **kw}


def test_load_text_data_python_docs():
  data = load_text_data(_config(eval_batch_size=2))
  assert set(data.eval_splits) == {"valid", "test", "valid_attacked",
                                   "test_attacked"}
  assert data.word_swap_rate == 0.025 and data.eval_batch_size == 2
  assert data.eval_rows("test").shape[0] == 2
  block = next(data.train_blocks(seed=0))
  assert block["inputs"].shape == (4, 16) and block["reset"]
  off = load_text_data(_config(word_swap_rate=0.0))
  assert set(off.eval_splits) == {"valid", "test"}


def test_config_errors_name_the_field(tmp_path):
  d = _write(tmp_path / "c", {"train.txt": "a b\n" * 50, "valid.txt": "a\n",
                              "test.txt": "b\n"})
  wiki = {"corpus": "wikitext103", "block_size": 4, "batch_size": 2}
  cases = [
      ({**wiki}, "data.path", "required"),
      ({**wiki, "path": str(tmp_path / "nope")}, "data.path", "not exist"),
      ({**wiki, "path": str(tmp_path)}, "data.path", "lacks train.txt"),
      (_config(path=d), "data.path", "not used"),
      ({**wiki, "path": d, "tokens": "bytes"}, "data.tokens", "plain_text"),
      ({**wiki, "path": d, "min_count": 5}, "data.min_count", "only"),
      ({"corpus": "enwik8", "path": d, "block_size": 4, "batch_size": 2,
        "word_swap_rate": 0.1}, "data.word_swap_rate", "byte level"),
      (_config(block_size=0), "data.block_size", ">= 1"),
      (_config(corpus="wikitext"), "data.corpus", "unknown value"),
  ]
  for config, field, text in cases:
    with pytest.raises(ConfigError, match=f"^{field.replace('.', '[.]')}:.*"
                       f"{text}"):
      validate(TEXT_DATA_SECTION, config, "data")
    with _field_error(field):
      load_text_data(config)
  # Sizes, checked once the corpus is read (still before any compile).
  with pytest.raises(ConfigError, match="^data[.]block_size:.*valid split"):
    load_text_data({**wiki, "path": d, "word_swap_rate": 0.0})
  with _field_error("data.block_size"):
    load_text_data(_config(block_size=20_000))
  with _field_error("data.batch_size"):
    load_text_data(_config(batch_size=10**6))
  # A word corpus without <unk> cannot take the swap (its tokens need one).
  ok = {**wiki, "path": d, "block_size": 1, "eval_batch_size": 1}
  with _field_error("data.word_swap_rate"):
    load_text_data(ok)
  assert load_text_data({**ok, "word_swap_rate": 0}).vocab_size == 3


def test_corpus_cache_round_trip_and_invalidation(tmp_path):
  d = _write(tmp_path / "c", {"train.txt": "a b <unk>\n" * 30,
                              "valid.txt": "a c\n" * 5, "test.txt": "b\n" * 5})
  config = {"corpus": "wikitext103", "path": d, "block_size": 2,
            "batch_size": 2, "cache_dir": str(tmp_path / "cache")}
  first = load_text_data(config).corpus
  files = os.listdir(tmp_path / "cache")
  assert files == [f"text_corpus_{cache_key(config)}.npz"]
  cached = load_text_data(config).corpus
  assert cached.fingerprint() == first.fingerprint()
  assert cached.vocab == first.vocab and cached.source == first.source
  _write(tmp_path / "c", {"test.txt": "b a\n" * 5})
  changed = load_text_data(config).corpus
  assert changed.fingerprint() != first.fingerprint()
  assert len(os.listdir(tmp_path / "cache")) == 2
