"""The run assembly: a config resolved once, the model built once, defaults
filled from the schema, errors before any data, data injected through the
`DataSource` seam."""

from __future__ import annotations

import sys

import ml_collections
import numpy as np
import pytest

from vmoe_ext import models
from vmoe_ext.app import main as binary
from vmoe_ext.app import schema
from vmoe_ext.app.context import ResolvedConfig, RunContext, resolved
from vmoe_ext.data.source import DataSource
from vmoe_ext.errors import ConfigError
from vmoe_ext.train.config_files import load_config


def tiny(steps: int = 2) -> ml_collections.ConfigDict:
  config = load_config("tiny")
  config.train.update(dict(total_steps=steps, log_every=1, eval_every=0,
                           checkpoint_every=steps))
  config.optimizer.warmup_steps = 1
  config.robustness = None
  return config


@pytest.fixture
def counts(monkeypatch):
  """How often the root schema is walked and a model is built, wherever
  `build_model` is called from."""
  seen = {"resolve": 0, "build": 0}
  validate, build = schema.validate, models.build_model

  def counting_validate(*args, **kwargs):
    seen["resolve"] += 1
    return validate(*args, **kwargs)

  def counting_build(*args, **kwargs):
    seen["build"] += 1
    return build(*args, **kwargs)

  monkeypatch.setattr(schema, "validate", counting_validate)
  for module in list(sys.modules.values()):
    if (module is not None and getattr(module, "__name__", "").startswith(
        "vmoe_ext") and getattr(module, "build_model", None) is build):
      monkeypatch.setattr(module, "build_model", counting_build)
  return seen


def test_a_training_run_resolves_once_and_builds_the_model_once(
    counts, tmp_path):
  binary.run(tiny(), str(tmp_path / "run"))
  assert counts == {"resolve": 1, "build": 1}


def test_resolving_fills_every_default_from_the_schema():
  config = resolved(tiny())
  assert isinstance(config, ResolvedConfig)
  assert resolved(config) is config  # Never twice.
  # Defaults the file leaves out, as the sections declare them.
  assert config.train.loss == "softmax_xent"
  assert config.train.label_smoothing == 0.0 and config.train.mixup is None
  assert config.optimizer.b2 == 0.999 and config.optimizer.frozen == ()
  assert config.model.moe.dispatcher == "indices"
  assert config.model.moe.router.noise_std == 1.0
  assert config.sharding is None and config.init is None
  # A section that is on gets its absent fields.
  c = tiny()
  c.robustness = dict(corruptions=dict(names=("fog",)))
  robustness = resolved(c).robustness
  assert robustness.corruptions.severities == (1, 2, 3, 4, 5)
  assert robustness.attacks == () and robustness.seed == 0
  # What the user set is kept as set.
  assert config.data.batch_size == 32 and config.model.hidden_size == 16


@pytest.mark.parametrize("mutate,field", [
    (lambda c: c.model.moe.update(dict(dropout_rate=1.5)),
     "model.moe.dropout_rate"),
    (lambda c: c.model.moe.update(dict(capacity_multiple=0)),
     "model.moe.capacity_multiple"),
    (lambda c: c.model.moe.update(dict(expert_init="bogus")),
     "model.moe.expert_init"),
    (lambda c: c.model.moe.update(dict(capacity_factor=0.0)),
     "model.moe.capacity_factor"),
    (lambda c: c.model.moe.router.update(dict(num_selected=3)),
     "model.moe.router.num_selected"),
    (lambda c: c.optimizer.update(dict(warmup_steps=7)),
     "optimizer.warmup_steps"),
    (lambda c: c.update(dict(robustness=dict(from_init=True))),
     "robustness.from_init"),
])
def test_errors_come_before_any_data_naming_the_users_field(mutate, field):
  config = tiny()
  mutate(config)

  class Untouchable(DataSource):

    def __getattribute__(self, name):
      raise AssertionError(f"data touched ({name}) before the config error")

  with pytest.raises(ConfigError) as e:
    RunContext.assemble(config, data=Untouchable.__new__(Untouchable))
  assert e.value.field == field, e.value


def test_an_injected_data_source_is_the_one_the_run_reads(tmp_path):
  config = resolved(tiny(steps=2))

  class Counting(DataSource):
    batches = 0

    def eval_batches(self):
      for batch in super().eval_batches():
        Counting.batches += 1
        yield batch

  source = Counting(config.data, config.seed)
  ctx = RunContext.assemble(config, data=source)
  assert ctx.data is source
  ctx.open_training(str(tmp_path))
  ctx.checkpoints.close()
  metrics = ctx.evaluate()
  # digits: 1,797 images, the test split of the built-in loader, 64 a batch
  # (configs/tiny.py).
  assert config.data.eval_batch_size == 64
  assert Counting.batches == -(-len(source.test) // 64)
  assert metrics["num_examples"] == len(source.test)
  # Reference: the model applied batch by batch, padding masked out.
  hits = []
  for batch in DataSource(config.data, config.seed).eval_batches():
    logits = np.asarray(ctx.model.apply(ctx.state.variables(), batch["image"],
                                        deterministic=True)[0])
    hits.append((np.argmax(logits, -1) == batch["label"])[batch["mask"]])
  expected = float(np.mean(np.concatenate(hits)))
  assert metrics["accuracy"] == pytest.approx(expected, abs=1e-6)
