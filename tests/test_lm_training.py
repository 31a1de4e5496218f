"""The language model in the binary (`vmoe_ext.app.lm_run`): training through
`train_and_evaluate`, perplexity against a naive loop over blocks, the
routing analysis against a naive count, bit-identical resume across a
restart of the stream, one device against a 2-device mesh, every router and
stream in a jitted train step against `jax.grad`, and the config errors.

One run is shared (`straight`): `configs/lm.py:tiny` with the AC router, the
momentum stream and Symphony's router state (`tiny,acmoe,momentum,symphony`)
for 6 steps on a corpus of ~5,500 words written here, whose 16 training
rows are short enough that the stream restarts (caches zeroed) at step 5.
Its programs compile once; the resumed runs and the 2-device subprocess
(started first, running beside the rest) reuse the persistent cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fake_devices import fake_devices_env
from vmoe_ext.app import train as loop
from vmoe_ext.app.context import RunContext
from vmoe_ext.app.lm_run import LanguageRun
from vmoe_ext.app.main import run as main_run
from vmoe_ext.app.schema import validate_config
from vmoe_ext.errors import ConfigError
from vmoe_ext.evaluate.final import after_training_hook
from vmoe_ext.models.language import LanguageModel
from vmoe_ext.models.lm_config import LM_ROUTER, LM_XMOE_ROUTER
from vmoe_ext.reporting.writers import TIMING_METRICS, read_metrics
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.lm_steps import LMTrainState, make_lm_train_step

HERE = os.path.dirname(os.path.abspath(__file__))
SPLIT_KEYS = {"valid": "valid_", "test": "", "valid_attacked":
              "valid_attacked_", "test_attacked": "attacked_"}
ROWS, BLOCK = 16, 32  # configs/lm.py:tiny's batch and block size.


def write_corpus(directory):
  """A tiny language in 7-token lines (6 words and `<eos>`) and one rare
  word (so `<unk>` exists for the word swap): 2,306 training tokens, 144
  per row of 16: the stream restarts after 4 blocks of 32."""
  rng = np.random.default_rng(0)
  nouns, verbs = "cat dog bird fox mat log tree hill".split(), (
      "sat ran saw hid fell slept".split())
  for split, count in (("train", 330), ("valid", 240), ("test", 240)):
    lines = [" ".join([rng.choice(["the", "a"]), rng.choice(nouns),
                       rng.choice(verbs), rng.choice(["on", "under", "by"]),
                       rng.choice(nouns), "."]) for _ in range(count)]
    if split == "train":
      lines[-1] = "zebra ."
    with open(os.path.join(directory, f"{split}.txt"), "w") as f:
      f.write("\n".join(lines) + "\n")


def run_config(path, total_steps=6):
  config = load_config("lm", "tiny,acmoe,momentum,symphony")
  config.data.update(dict(corpus="plain_text", path=str(path), min_count=2))
  config.train.update(dict(total_steps=total_steps, log_every=2,
                           eval_every=3, checkpoint_every=2,
                           keep_checkpoints=3))
  return config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus")
  write_corpus(path)
  return path


@pytest.fixture(scope="module")
def mesh_run(corpus, tmp_path_factory):
  """The shared run on a 2-device mesh, started in a subprocess (2 fake
  devices) before anything else: it runs while this process trains."""
  proc = subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), "--mesh", str(corpus),
       str(tmp_path_factory.mktemp("mesh"))], env=fake_devices_env(2),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)
  yield proc
  proc.kill()
  proc.communicate()


@pytest.fixture(scope="module")
def straight(corpus, mesh_run, tmp_path_factory):
  """The shared run, uninterrupted, with the binary's after-training hook
  (the routing analysis): `(workdir, final metrics, state)`."""
  del mesh_run  # Started first.
  workdir = str(tmp_path_factory.mktemp("straight"))
  states = []
  hook = after_training_hook(run_config(corpus), workdir)

  def keep(run, writer):
    states.append(jax.device_get(run.state))
    return hook(run, writer)

  final = loop.train_and_evaluate(run_config(corpus), workdir,
                                  after_training=keep)
  return workdir, final, states[0]


# --------------------------------------------------------------------------
# Naive references, from the authors' `full_eval` and ACMoE's definitions.
# --------------------------------------------------------------------------


def naive_stream(apply, variables, model, ids, rows, block):
  """The authors' `full_eval` as a loop: `rows` contiguous rows, blocks at
  0, M, 2M, ... from zero caches, stop once the next start leaves no whole
  block; the mean over blocks of the block's mean NLL, and per block the
  sown intermediates."""
  ids = np.asarray(ids)
  data = ids[:len(ids) // rows * rows].reshape(rows, -1)
  cache = model.zero_cache(rows)
  losses, sown, pos = [], [], 0
  while True:
    x, y = data[:, pos:pos + block], data[:, pos + 1:pos + block + 1]
    (log_probs, cache, _), state = apply(variables, x, cache)
    log_probs = np.asarray(log_probs, np.float64)
    nll = [-log_probs[b, t, y[b, t]] for b in range(rows)
           for t in range(block)]
    losses.append(np.mean(nll))
    sown.append(jax.device_get(state["intermediates"]))
    pos += block
    if pos >= data.shape[1] - block:
      return float(np.mean(losses)), sown


def naive_routing(sown, layers):
  """Per MoE layer the % of token->expert assignments per expert, and the
  instability `mean_{i,j} |S_{l-1}[i,j] - S_l[i,j]|` over every pair of
  the split's tokens (S[i, j] = 1 when i and j share their top-1 expert,
  the first selected one), by the definition."""
  load, top1 = {}, {}
  for layer in layers:
    name = layer.replace("layer_", "encoderblock_")
    selected = np.concatenate([
        np.asarray(s[name]["Moe"]["selected_experts"][0]).reshape(-1, 2)
        for s in sown])
    e = sown[0][name]["Moe"]["expert_mask"][0].shape[-1]
    load[layer] = 100 * np.bincount(selected.reshape(-1), minlength=e
                                    ) / selected.size
    top1[layer] = selected[:, 0]
  instability = {}
  for prev, cur in zip(layers, layers[1:]):
    a, b = top1[prev], top1[cur]
    same_a, same_b = a[:, None] == a[None], b[:, None] == b[None]
    instability[cur] = float(np.mean(same_a != same_b))
  return load, instability


# --------------------------------------------------------------------------
# The shared run: outputs, checkpoint, resume, mesh.
# --------------------------------------------------------------------------


def test_a_run_writes_perplexities_and_the_routing_analysis(straight):
  workdir, final, state = straight
  records = read_metrics(workdir)
  train = [r for r in records if r["split"] == "train"]
  assert [r["step"] for r in train] == [2, 4, 6]
  for r in train:
    assert r["tokens_seen"] == r["step"] * ROWS * BLOCK
    assert r["loss"] == pytest.approx(r["cross_entropy"]
                                      + r["auxiliary_loss"], rel=1e-6)
    assert 0 <= r["accuracy"] <= 1 and r["learning_rate"] > 0
    assert np.shape(r["layer_0/router_state/adjacency"]) == (4, 4)
  periodic, last = [r for r in records if r["split"] == "test"]
  assert periodic["step"] == 3 and "final" not in periodic
  assert {k for k in periodic if k.endswith("ppl")} == {"valid_ppl"}
  assert last["final"] and last["step"] == 6
  for prefix in SPLIT_KEYS.values():
    assert last[f"{prefix}ppl"] == pytest.approx(
        np.exp(last[f"{prefix}loss"]), rel=1e-12)
    assert last[f"{prefix}ppl"] == pytest.approx(final[f"{prefix}ppl"])
  # The word swap changed the text the attacked numbers score.
  assert last["attacked_loss"] != last["loss"]
  assert last["valid_attacked_loss"] != last["valid_loss"]
  (routing,) = [r for r in records if r["split"] == "routing"]
  assert {"layer_0/load_balance", "layer_1/load_balance",
          "layer_1/instability", "instability_mean"} <= set(routing)
  report = open(os.path.join(workdir, "report.md")).read()
  assert "## Routing analysis" in report and "| attacked_ppl |" in report
  for png in ("training_curves.png", "expert_load.png",
              "symphony_adjacency.png"):
    assert os.path.exists(os.path.join(workdir, png)), png
  assert int(state.step) == 6


def test_the_checkpoint_scores_as_a_naive_loop_over_blocks(corpus, straight):
  workdir, final, _ = straight
  run = RunContext.assemble(run_config(corpus))
  assert isinstance(run, LanguageRun)
  run.open_training(workdir)
  assert run.restore() == 6
  run.checkpoints.close()
  model = run.model
  variables = jax.device_get(run.state.variables())
  apply = jax.jit(lambda v, x, c: model.apply(
      v, x, c, deterministic=True, mutable=["intermediates"]))
  for split, prefix in SPLIT_KEYS.items():
    loss, sown = naive_stream(apply, variables, model,
                              run.text.eval_splits[split], ROWS, BLOCK)
    np.testing.assert_allclose(final[f"{prefix}loss"], loss, rtol=2e-6)
    if split == "test":  # The routing line: the test split's blocks.
      routing = [r for r in read_metrics(workdir)
                 if r["split"] == "routing"][0]
      load, instability = naive_routing(sown, ["layer_0", "layer_1"])
      for layer, percent in load.items():
        np.testing.assert_allclose(routing[f"{layer}/load_percent"],
                                   percent, rtol=1e-12)
        assert routing[f"{layer}/load_balance"] == pytest.approx(
            np.std(percent), rel=1e-9)
      assert routing["layer_1/instability"] == pytest.approx(
          instability["layer_1"], rel=1e-9)


def test_evaluate_only_rescores_the_checkpoint_as_training_did(corpus,
                                                                straight):
  """`robustness.checkpoint_dir`: the checkpoint's PPL (clean and
  word-swapped), per-block losses and routing line, written beside the
  training record, equal the training run's own final evaluation."""
  workdir, final, _ = straight
  config = run_config(corpus)
  config.robustness = {"checkpoint_dir": workdir}
  report = main_run(config, workdir)
  out = os.path.join(workdir, "evaluation")
  assert report == os.path.join(out, "report.md") and os.path.exists(report)
  records = read_metrics(out)
  (scores,) = [r for r in records if r["split"] == "test"]
  assert scores["step"] == 6 and scores["final"]
  for prefix in SPLIT_KEYS.values():
    for key in ("loss", "ppl"):
      assert scores[f"{prefix}{key}"] == final[f"{prefix}{key}"], key
  trained = dict(np.load(os.path.join(workdir, "per_block.npz")))
  evaluated = dict(np.load(os.path.join(out, "per_block.npz")))
  assert sorted(trained) == sorted(evaluated)
  for split in trained:
    np.testing.assert_array_equal(evaluated[split], trained[split])
  (routing,) = [r for r in records if r["split"] == "routing"]
  (trained_routing,) = [r for r in read_metrics(workdir)
                        if r["split"] == "routing"]
  assert routing["layer_1/instability"] == trained_routing[
      "layer_1/instability"]
  # The training record is untouched.
  assert [r["split"] for r in read_metrics(workdir)].count("test") == 2


def test_a_resumed_run_is_bit_identical_across_a_restart(corpus, straight,
                                                          tmp_path):
  workdir, final, a = straight
  # The stream restarts at step 5: its rows' caches are zeroed there.
  run = RunContext.assemble(run_config(corpus))
  blocks = run.data.train_iterator()
  assert [bool(next(blocks)["reset"]) for _ in range(6)] == [
      True, False, False, False, True, False]
  states = []

  def keep(run, writer):
    del writer
    states.append(jax.device_get(run.state))
    return []

  resumed = str(tmp_path / "resumed")
  assert loop.train_and_evaluate(run_config(corpus), resumed,
                                 stop_at_step=3) is None
  resumed_final = loop.train_and_evaluate(run_config(corpus), resumed,
                                          after_training=keep)
  assert resumed_final == final
  (b,) = states
  assert int(a.step) == int(b.step) == 6
  for field in ("params", "opt_state", "collections", "cache", "rng"):
    chex.assert_trees_all_equal(getattr(a, field), getattr(b, field))
  drop = lambda rs: [{k: v for k, v in r.items() if k not in TIMING_METRICS}
                     for r in rs if r["split"] != "routing"]
  assert drop(read_metrics(workdir)) == drop(read_metrics(resumed))


def test_one_device_equals_a_two_device_mesh(straight, mesh_run):
  workdir, final, _ = straight
  out, err = mesh_run.communicate(timeout=600)
  assert mesh_run.returncode == 0, err[-3000:]
  mesh = json.loads(out.strip().splitlines()[-1])
  assert mesh["devices"] == 2
  for key in ("loss", "ppl", "valid_ppl", "attacked_ppl"):
    np.testing.assert_allclose(mesh["final"][key], final[key], rtol=1e-5)
  lines = [r for r in read_metrics(workdir) if r["split"] == "train"]
  np.testing.assert_allclose(mesh["train_loss"], [r["loss"] for r in lines],
                             rtol=1e-5)


def _mesh_run(corpus, workdir):
  """The 2-device side of `test_one_device_equals_a_two_device_mesh` (in a
  subprocess with 2 fake devices): the shared run with the batch, the
  caches and the evaluation rows split over a ('data', 'expert') = (2, 1)
  mesh."""
  jax.config.update("jax_default_matmul_precision", "highest")  # conftest's
  config = run_config(corpus)
  config.sharding = dict(shape=(2, 1))
  final = loop.train_and_evaluate(config, workdir)
  losses = [r["loss"] for r in read_metrics(workdir)
            if r["split"] == "train"]
  print(json.dumps({"devices": jax.device_count(), "train_loss": losses,
                    "final": {k: final[k] for k in ("loss", "ppl",
                                                    "valid_ppl",
                                                    "attacked_ppl")}}))


# --------------------------------------------------------------------------
# Every router and stream in the jitted train step.
# --------------------------------------------------------------------------

V, D, B, M, SPAN = 11, 8, 2, 4, 5
NOISY = dict(LM_ROUTER, noise_std=1.0)  # Draws the step's gating key.
STEP_CASES = {
    # The noisy top-2 gate and the AC router; the heavy-ball stream.
    "noisy_gate+acmoe+momentum": dict(architecture="smsc",
                                      moe={"router": NOISY}),
    # Symphony (router state) over the XMoE gate; the Adam stream.
    "symphony_over_xmoe+adam": dict(architecture="sasa", moe={"router": {
        "name": "symphony", "base": LM_XMOE_ROUTER}}),
    # Top-p routing in a GLaM layer pair; robust momentum.
    "top_p+robust_momentum+glam": dict(
        architecture="smsf", base_arch="glam", num_layers=1,
        moe={"router": {"name": "top_p", "num_selected": 2,
                        "threshold": 0.3}},
        stream={"name": "robust_momentum", "p": 0.2, "kappa": 1.25}),
}


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_every_router_and_stream_trains_a_jitted_step(case):
  fields = {"num_layers": 2, **STEP_CASES[case]}
  fields["moe"] = dict(fields["moe"], num_experts=4)
  model = LanguageModel(vocab_size=V, hidden_size=D, inner_hidden_size=6,
                        num_heads=2, attn_span=SPAN, dropout_rate=0.1,
                        **fields)
  rng = np.random.default_rng(1)
  tokens = lambda: jnp.asarray(rng.integers(0, V, (B, M)), jnp.int32)
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens(),
                          model.zero_cache(B))
  variables = jax.tree.map(  # NumPy draws; Symphony's graph row-stochastic.
      lambda s: jnp.asarray(rng.uniform(0.1, 0.3, s.shape) if s.ndim == 2
                            and s.shape[0] == s.shape[1] == 4
                            else rng.normal(size=s.shape) * 0.5, s.dtype),
      dict(shapes))
  cache = tuple(jnp.asarray(rng.normal(size=c.shape), jnp.float32)
                for c in model.zero_cache(B))
  lr = lambda step: 1e-2 * (step + 1) / 3
  tx = optax.scale_by_learning_rate(lr)  # Plain SGD: the update is -lr g.
  state = LMTrainState.create_lm(variables, tx, jax.random.key(7), cache)
  batch = {"inputs": tokens(), "targets": tokens(),
           "reset": jnp.asarray([True, False])}
  train_step = make_lm_train_step(model, learning_rate_fn=lr)

  # Reference: row 0's caches zeroed by hand (it is flagged `reset`; row 1
  # keeps its own), jax.grad of the mean NLL (+ auxiliary losses), the
  # step's keys as the train step documents them.
  ref_cache = tuple(c.at[0].set(0.0) for c in cache)
  gating, dropout = jax.random.split(jax.random.fold_in(
      jax.random.key(7), 0))
  collections = {k: v for k, v in variables.items() if k != "params"}

  def loss(params):
    (log_probs, next_cache, aux), updated = model.apply(
        {"params": params, **collections}, batch["inputs"], ref_cache,
        deterministic=False, rngs={"gating": gating, "dropout": dropout},
        mutable=list(collections), update_state=True)
    nll = -jnp.take_along_axis(log_probs, batch["targets"][..., None],
                               -1).mean()
    return nll + aux["auxiliary_loss"], (nll, next_cache, updated)

  both = jax.jit(lambda state, batch, params: (
      train_step(state, batch),
      jax.value_and_grad(loss, has_aux=True)(params)))
  (new, metrics), ((value, (nll, next_cache, updated)), grads) = both(
      state, batch, variables["params"])
  expected = jax.tree.map(lambda p, g: p - lr(0) * g, variables["params"],
                          grads)
  np.testing.assert_allclose(metrics["loss"], value, rtol=1e-6)
  np.testing.assert_allclose(metrics["cross_entropy"], nll, rtol=1e-6)
  assert int(new.step) == 1 and int(new.nonfinite_count) == 0
  chex.assert_trees_all_close(new.params, expected, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(new.cache, next_cache, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(new.collections, dict(updated), rtol=1e-6,
                              atol=1e-7)
  if "symphony" in case:  # The graph moved in training.
    assert not np.allclose(jax.tree.leaves(new.collections)[0],
                           jax.tree.leaves(collections)[0])
  for layer in model.moe_layers:
    assert float(metrics[f"layer_{layer}/drop_rate"]) == 0.0  # Dropless.


# --------------------------------------------------------------------------
# Config errors, before anything compiles.
# --------------------------------------------------------------------------


def _with(config, **fields):
  for path, value in fields.items():
    section, key = path.split("__")
    config[section][key] = value
  return config


@pytest.mark.parametrize("change,field", [
    (dict(train__label_smoothing=0.1), "train.label_smoothing"),
    (dict(model__vocab_size=1000), "model.vocab_size"),
    (dict(data__batch_size=10 ** 9), "data.batch_size"),
    (dict(data__min_count=0), "data.min_count"),
    (dict(data__corpus="wikitext103"), "data.path"),
    (dict(model__architecture="sgsx"), "model.architecture"),
], ids=lambda v: "-".join(v) if isinstance(v, dict) else v)
def test_config_errors_name_the_field(change, field):
  config = _with(load_config("lm", "tiny"), **change)
  with pytest.raises(ConfigError) as error:
    validate_config(config)
    RunContext.assemble(config)
  assert error.value.field == field, error.value


def test_text_data_and_the_language_model_go_together():
  image, text = load_config("tiny"), load_config("lm", "tiny")
  for model, data in ((text.model, image.data), (image.model, text.data)):
    config = load_config("lm", "tiny")
    config.model, config.data = model, data
    with pytest.raises(ConfigError) as error:
      validate_config(config)
    assert error.value.field == "data.name", error.value
  config = load_config("lm", "tiny")
  config.robustness = image.robustness
  with pytest.raises(ConfigError, match="word-swap") as error:
    validate_config(config)
  assert error.value.field == "robustness.num_examples"
  config.robustness = {"attacks": image.robustness.attacks,
                       "checkpoint_dir": "/somewhere"}
  with pytest.raises(ConfigError, match="word-swap") as error:
    validate_config(config)
  assert error.value.field == "robustness.attacks"
  # The evaluate-only mode's section names the run to evaluate.
  config.robustness = {"per_example": False}
  with pytest.raises(ConfigError) as error:
    validate_config(config)
  assert error.value.field == "robustness.checkpoint_dir"


def test_paper_settings_resolve_and_need_their_corpus():
  for arg in ("switch_medium,acmoe", "glam_medium,momentum",
              "switch_small,symphony,xmoe", "smoe_large,adam", "enwik8",
              "glam_small,acmoe"):
    config = load_config("lm", arg)
    with pytest.raises(ConfigError) as error:
      validate_config(config)
    assert error.value.field == "data.path", (arg, error.value)
  config = load_config("lm", "glam_medium,acmoe,momentum")
  assert config.model.architecture == "smsfsmsfscsfscsfscsfscsf"
  config.data.path = None  # Checked past the data: the model resolves.
  config.data.corpus = "python_docs"
  config.model.vocab_size = None
  validate_config(config)
  with pytest.raises(ConfigError) as error:
    load_config("lm", "switch_medium,momentum,adam")
  assert error.value.field == "--config"


if __name__ == "__main__" and sys.argv[1:2] == ["--mesh"]:
  _mesh_run(sys.argv[2], sys.argv[3])
