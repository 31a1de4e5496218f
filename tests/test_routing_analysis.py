"""Routing analysis: load balance and router instability against naive NumPy
(an O(n^2) loop that materialises S), streaming equals one pass, every
routing form, and the figures and report section of a tiny run through the
binary's after-training hook."""

from __future__ import annotations

import functools
import os
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vmoe_ext.data import (ArrayDataset, default_normalization,
                           eval_batches, load_dataset)
from vmoe_ext.evaluate.final import after_training_hook
from vmoe_ext.evaluate.metrics import (assignment_counts, load_balance,
                                       load_balance_from_counts,
                                       router_instability,
                                       router_instability_from_counts)
from vmoe_ext.evaluate.routing_analysis import (RoutingCounts, TokenSample,
                                                analyze_routing, top1_experts)
from vmoe_ext.evaluate.routing_plots import (plot_router_state_heatmaps,
                                             router_state_series)
from vmoe_ext.models import build_model
from vmoe_ext.moe.routing import TokenChoiceRouting
from vmoe_ext.reporting.writers import MetricWriter, read_metrics
from vmoe_ext.routers.base import Router, RouterOutput
from vmoe_ext.routers.registry import ROUTERS
from vmoe_ext.app import train as loop
from vmoe_ext.app.context import RunContext
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.steps import router_state_metrics

PNGS = ("expert_maps.png", "tsne_experts.png", "symphony_adjacency.png")


# ------------------------------------------------------------ references


def naive_percent(mask, example_mask):
  """Per-expert % of assignments, by a loop over real tokens."""
  counts = np.zeros(mask.shape[-1])
  for n, t in np.ndindex(mask.shape[:2]):
    if example_mask[n]:
      counts += mask[n, t]
  return 100 * counts / counts.sum()


def naive_instability(prev, cur):
  """mean |S_prev - S_cur| with S materialised (tokens as given)."""
  s_prev = prev[:, None] == prev[None, :]
  s_cur = cur[:, None] == cur[None, :]
  return float(np.mean(np.abs(s_prev.astype(int) - s_cur.astype(int))))


def naive_top1(mask, selected):
  out = np.full(mask.shape[:2], -1)
  for n, t in np.ndindex(mask.shape[:2]):
    experts = np.flatnonzero(mask[n, t])
    if len(experts) == 1:
      out[n, t] = experts[0]
    elif len(experts) > 1:
      out[n, t] = selected[n, t, 0]
  return out


# ------------------------------------------------------------ counts


def test_load_balance_score_on_a_hand_case():
  # 2 images x 2 tokens, E=3, K=2; image 1 is padding.
  mask = np.array([[[1, 1, 0], [1, 0, 1]],
                   [[0, 1, 1], [0, 1, 1]]], bool)
  counts = assignment_counts(mask, np.array([[1, 1], [0, 0]], bool))
  np.testing.assert_array_equal(counts, [2, 1, 1])
  got = load_balance_from_counts(counts)
  np.testing.assert_allclose(got["percent"], [50, 25, 25])
  # Population std of (50, 25, 25): mean 100/3, squared deviations
  # (50/3)^2 + 2 (25/3)^2 = 3750/9, over 3: sqrt(1250/9) = 11.785...
  assert got["std"] == pytest.approx(np.sqrt(1250 / 9))
  assert load_balance(mask, np.array([[1, 1], [0, 0]]))["std"] == got["std"]


def test_instability_hand_case_and_from_counts():
  # 4 tokens; layer l-1 groups {0, 1}, {2, 3}; layer l groups {0, 1, 2}, {3}.
  prev, cur = np.array([0, 0, 1, 1]), np.array([2, 2, 2, 0])
  # Pairs that disagree: (0,2), (1,2), (2,3) and their mirrors = 6 of 16.
  assert naive_instability(prev, cur) == 6 / 16
  assert router_instability(prev, cur) == 6 / 16
  joint = np.array([[0, 0, 2], [1, 0, 1]])  # [E_prev=2, E_cur=3]
  assert router_instability_from_counts(joint) == 6 / 16
  assert np.isnan(router_instability_from_counts(np.zeros((2, 3))))


def _random_batches(rng, num_batches, b=3, t=4, experts=(3, 2)):
  """Batches of per-layer masks / selections with padding and -1 top-1s."""
  batches = []
  for i in range(num_batches):
    example_mask = np.ones(b, bool)
    if i == num_batches - 1:
      example_mask[-1] = False  # padded row
    layers = {}
    for name, e in zip(("layer_1", "layer_3"), experts):
      mask = rng.uniform(size=(b, t, e)) < 0.5
      selected = np.where(mask, np.arange(e), -1)
      selected = -np.sort(-selected, axis=-1)  # valid first
      layers[name] = (mask, selected)
    batches.append((layers, example_mask))
  return batches


def _accumulate(batches):
  counts = RoutingCounts()
  for layers, example_mask in batches:
    token_mask = np.broadcast_to(example_mask[:, None],
                                 layers["layer_1"][0].shape[:2])
    counts.add({l: assignment_counts(m, token_mask)
                for l, (m, _) in layers.items()},
               {l: np.asarray(top1_experts(m, s))
                for l, (m, s) in layers.items()}, example_mask)
  return counts


def test_streamed_counts_equal_one_pass_and_naive_references(rng):
  batches = _random_batches(rng, 4)  # layers with different E (3 and 2)
  streamed = _accumulate(batches).metrics()
  whole = {l: tuple(np.concatenate([b[0][l][i] for b in batches])
                    for i in range(2)) for l in ("layer_1", "layer_3")}
  example_mask = np.concatenate([b[1] for b in batches])
  once = _accumulate([(whole, example_mask)]).metrics()
  assert streamed.keys() == once.keys()
  for key in streamed:
    np.testing.assert_allclose(streamed[key], once[key], rtol=1e-12)
  # Naive: percentages by a loop, instability with S materialised over the
  # real tokens that have a top-1 at both layers.
  for layer in ("layer_1", "layer_3"):
    percent = naive_percent(whole[layer][0], example_mask)
    np.testing.assert_allclose(streamed[f"{layer}/load_percent"], percent)
    assert streamed[f"{layer}/load_balance"] == pytest.approx(np.std(percent))
  prev = naive_top1(*whole["layer_1"])[example_mask].ravel()
  cur = naive_top1(*whole["layer_3"])[example_mask].ravel()
  keep = (prev >= 0) & (cur >= 0)
  assert (~keep).any()  # tokens without an expert are left out
  assert streamed["layer_3/instability"] == pytest.approx(
      naive_instability(prev[keep], cur[keep]))
  assert "layer_1/instability" not in streamed
  assert streamed["instability_mean"] == streamed["layer_3/instability"]
  scores = [streamed["layer_1/load_balance"], streamed["layer_3/load_balance"]]
  assert streamed["load_balance_mean"] == pytest.approx(np.mean(scores))
  assert streamed["load_balance_std"] == pytest.approx(np.std(scores))


def test_top1_rule():
  mask = np.array([[[0, 1, 0], [1, 1, 0], [0, 0, 0], [1, 0, 1]]], bool)
  selected = np.array([[[2, 0], [1, 0], [-1, -1], [2, 0]]])
  # One expert: that one (SoftMoE's slot order is ignored); several: the
  # first selected; none: -1.
  np.testing.assert_array_equal(top1_experts(mask, selected),
                                [[1, 1, -1, 2]])


def test_token_sample_is_the_smallest_keys_over_all_batches(rng):
  sample = TokenSample(5)
  keys = rng.uniform(size=12)
  keys[3] = np.inf  # padding: never kept
  feats = np.arange(12.0)[:, None] * np.ones((1, 2))
  for start in (0, 4, 8):
    part = slice(start, start + 4)
    sample.add(keys[part], {"layer_1": feats[part]},
               {"layer_1": np.arange(12)[part]})
  expected = np.argsort(keys)[:5]
  np.testing.assert_array_equal(sample.experts["layer_1"], expected)
  np.testing.assert_array_equal(sample.tokens["layer_1"][:, 0], expected)


# ------------------------------------------------------- every routing form


def _naive_forward(model, variables, batches):
  """`{layer: (mask, selected)}` over all batches and the example mask."""
  masks, selected, valid = {}, {}, []
  for batch in batches:
    _, state = model.apply(variables, batch["image"], mutable=["intermediates"])
    for block, sown in state["intermediates"].items():
      layer = "layer_" + block.split("_")[-1]
      masks.setdefault(layer, []).append(
          np.asarray(sown["Moe"]["expert_mask"][0]))
      selected.setdefault(layer, []).append(
          np.asarray(sown["Moe"]["selected_experts"][0]))
    valid.append(batch["mask"])
  return ({l: (np.concatenate(masks[l]), np.concatenate(selected[l]))
           for l in masks}, np.concatenate(valid))


@pytest.mark.parametrize("name,moe", [
    ("vit_moe", dict(layers=(0, 1), num_experts=3, group_size=10,
                     router=dict(name="noisy_topk", num_selected=2))),
    ("vit_moe", dict(layers=(0, 1), num_experts=3, group_size=10,
                     router=dict(name="top_p", num_selected=3,
                                 threshold=0.34))),
    ("vit_moe", dict(layers=(0, 1), num_experts=3, group_size=10,
                     capacity_factor=0.5, router=dict(name="expert_choice"))),
    ("soft_moe_vit", dict(layers=(1,), num_experts=3,
                          router=dict(name="soft", num_slots=2))),
    ("vit", None),
])
def test_every_routing_form_against_the_sown_routing(name, moe):
  model = build_model(dict(name=name, num_classes=10, patch_size=(4, 4),
                           hidden_size=8, num_layers=2, num_heads=2,
                           mlp_dim=8, moe=moe))
  data = load_dataset(load_config("tiny").data)["test"]
  data = ArrayDataset(data.images[:14], data.labels[:14], 10, "digits")
  variables = model.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)))
  variables = {"params": variables["params"]}
  batches = lambda: eval_batches(data, 4, mean=0.5, std=0.5)  # 2 padded
  got = analyze_routing(model, variables, batches(), mean=0.5, std=0.5,
                        map_examples=(0, 5, 13), num_tokens=30)
  if moe is None:
    assert got is None
    return
  layers, valid = _naive_forward(model, variables, batches())
  assert got.metrics["num_examples"] == 14
  for layer, (mask, selected) in layers.items():
    np.testing.assert_allclose(got.metrics[f"{layer}/load_percent"],
                               naive_percent(mask, valid))
    top1 = naive_top1(mask, selected)
    # Maps: images 0, 5, 13, class token dropped, 2x2 patch grid.
    np.testing.assert_array_equal(got.maps[layer],
                                  top1[valid][[0, 5, 13], 1:].reshape(3, 2, 2))
    assert got.sample.tokens[layer].shape == (30, 8)
    assert set(got.sample.experts[layer]) <= set(top1[valid].ravel())
  np.testing.assert_allclose(got.images[:, :, :, 0],
                             data.images[[0, 5, 13], :, :, 0], atol=1e-6)
  if len(layers) == 1:
    assert not any("instability" in k for k in got.metrics)
  else:
    prev = naive_top1(*layers["layer_0"])[valid].ravel()
    cur = naive_top1(*layers["layer_1"])[valid].ravel()
    keep = (prev >= 0) & (cur >= 0)
    if moe["router"]["name"] == "expert_choice":
      assert not keep.all()  # some tokens were picked by no expert
    assert got.metrics["layer_1/instability"] == pytest.approx(
        naive_instability(prev[keep], cur[keep]))


# ------------------------------------------------------------ a tiny run


class GraphProbeRouter(Router):
  """Top-2 softmax router with a Symphony-like expert graph: `adjacency`
  `[E, E]` in "router_state", an EMA of row-normalised co-selection counts,
  updated only with `update_state`."""

  @property
  def slots_per_token(self) -> int:
    return 2

  @nn.compact
  def __call__(self, x, ctx, *, capacity, deterministic, update_state=False):
    del capacity, deterministic
    e = self.num_experts
    adjacency = self.variable("router_state", "adjacency", jnp.zeros, (e, e),
                              jnp.float32)
    gates = jax.nn.softmax(nn.Dense(e, use_bias=False, name="dense")(x))
    top, idx = jax.lax.top_k(gates, 2)
    if update_state:
      hot = jax.nn.one_hot(idx, e).sum(-2)  # [G, S, E]
      co = jnp.einsum("gse,gsf->ef", hot, hot)
      co = co / jnp.maximum(co.sum(-1, keepdims=True), 1.0)
      adjacency.value = 0.5 * adjacency.value + 0.5 * ctx.reduce_mean(co)
    return RouterOutput(TokenChoiceRouting.create(idx, top),
                        {"auxiliary_loss": jnp.zeros(())})


def run_config():
  config = load_config("tiny")
  config.model.moe = dict(layers=(0, 1), num_experts=3, capacity_factor=1.5,
                          group_size=10, router=dict(name="graph_probe"))
  config.train.update(dict(total_steps=6, log_every=2, eval_every=0,
                           checkpoint_every=6))
  config.robustness = None
  return config


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """A 6-step run with 2 MoE layers of the graph router, through the hook
  of the binary; `(workdir, model, final variables)`."""
  ROUTERS.entries["graph_probe"] = "test_routing_analysis:GraphProbeRouter"
  try:
    workdir = str(tmp_path_factory.mktemp("run"))
    config = run_config()
    hook, seen = after_training_hook(config, workdir), {}

    def capture(run, writer):
      seen.update(model=run.model, variables=run.state.variables())
      return hook(run=run, writer=writer)

    loop.train_and_evaluate(config, workdir, after_training=capture)
    yield workdir, seen["model"], seen["variables"]
  finally:
    del ROUTERS.entries["graph_probe"]


def test_run_writes_the_routing_line_figures_and_section(tiny_run):
  workdir, model, variables = tiny_run
  records = read_metrics(workdir)
  # Right after the final evaluation; the clean line stays the only final.
  (final,) = [r for r in records if r.get("final")]
  assert final["split"] == "test"
  line = records[records.index(final) + 1]
  assert line["split"] == "routing"
  assert line["step"] == 6 and line["num_examples"] == 355
  assert len(line["layer_0/load_percent"]) == 3
  assert sum(line["layer_1/load_percent"]) == pytest.approx(100)
  assert "layer_0/instability" not in line
  assert line["instability_mean"] == line["layer_1/instability"]
  # The numbers, independently: the whole test split through the model.
  config = run_config()
  mean, std = default_normalization(config.data)
  layers, valid = _naive_forward(model, variables, eval_batches(
      load_dataset(config.data)["test"], 50, mean=mean, std=std))
  for layer, (mask, _) in layers.items():
    percent = naive_percent(mask, valid)
    np.testing.assert_allclose(line[f"{layer}/load_percent"], percent)
    assert line[f"{layer}/load_balance"] == pytest.approx(np.std(percent))
  prev = naive_top1(*layers["layer_0"])[valid].ravel()
  cur = naive_top1(*layers["layer_1"])[valid].ravel()
  assert line["layer_1/instability"] == pytest.approx(
      naive_instability(prev, cur))
  for name in PNGS:
    assert os.path.getsize(os.path.join(workdir, name)) > 0
  report = open(os.path.join(workdir, "report.md")).read()
  section = report[report.index("## Routing analysis"):]
  assert "| layer_0 | 3 | " in section and "(vs layer_0)" in section
  assert "mean ± std over layers" in section
  for name in PNGS:
    assert f"({name})" in section


def test_router_state_is_logged_at_every_log_step(tiny_run):
  workdir, _, variables = tiny_run
  train = [r for r in read_metrics(workdir) if r["split"] == "train"]
  assert [r["step"] for r in train] == [2, 4, 6]
  for block in (0, 1):
    key = f"layer_{block}/router_state/adjacency"
    assert all(np.shape(r[key]) == (3, 3) for r in train)
    np.testing.assert_allclose(
        train[-1][key], variables["router_state"][f"encoderblock_{block}"]
        ["Moe"]["router"]["adjacency"], rtol=1e-6)
    assert train[0][key] != train[-1][key]
  series = router_state_series(train)
  assert sorted(series) == ["layer_0/router_state/adjacency",
                            "layer_1/router_state/adjacency"]


def test_router_state_metrics_names():
  state = {"encoderblock_3": {"Moe": {"router": {
      "adjacency": jnp.eye(2), "base": {"adjacency": jnp.ones((2, 2))}}}},
           "other": {"count": jnp.int32(4),
                     "big": jnp.zeros((5000,))}}  # too large: left out
  got = router_state_metrics({"router_state": state, "params": {}})
  assert sorted(got) == ["layer_3/router_state/adjacency",
                         "layer_3/router_state/base/adjacency",
                         "router_state/other/count"]
  assert router_state_metrics({}) == {}


def test_adjacency_heatmaps_from_records(tmp_path):
  records = [{"step": s, "split": "train",
              "layer_1/router_state/base/adjacency": (np.eye(2) * s).tolist(),
              "layer_1/router_state/ema": [0.0, 1.0]}
             for s in range(10, 90, 10)]
  path = str(tmp_path / "a.png")
  assert plot_router_state_heatmaps(records, path, max_steps=5)
  assert os.path.getsize(path) > 0
  assert list(router_state_series(records)) == [
      "layer_1/router_state/base/adjacency"]
  assert not plot_router_state_heatmaps(
      [{"step": 1, "split": "train", "loss": 1.0}], str(tmp_path / "b.png"))
  assert not os.path.exists(tmp_path / "b.png")


def test_dense_model_gets_no_section_line_or_figure(tmp_path):
  config = load_config("tiny")
  config.model.name, config.model.moe = "vit", None
  config.robustness = None
  model = build_model(config.model)
  variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
  data = load_dataset(config.data)["test"]
  run = types.SimpleNamespace(  # What the hook reads of a run context.
      model=model, config=config, partitioning=None,
      data=types.SimpleNamespace(test=data),
      state=types.SimpleNamespace(step=3, variables=lambda: variables))
  # The hook asks the run for its after-training evaluations: an image
  # run's (`RunContext.final_evaluations`) on these parts.
  run.final_evaluations = functools.partial(RunContext.final_evaluations, run)
  workdir = str(tmp_path)
  with MetricWriter(workdir, tensorboard=False) as writer:
    assert after_training_hook(config, workdir)(run=run, writer=writer) == []
  assert read_metrics(workdir) == []
  assert not any(os.path.exists(os.path.join(workdir, p)) for p in PNGS)


def test_tsne_layers_are_at_most_four_evenly_spaced():
  from vmoe_ext.evaluate.routing_report import tsne_layers
  assert tsne_layers(["layer_3", "layer_1"]) == ["layer_1", "layer_3"]
  swin = [f"layer_{b}" for b in (5, 7, 9, 11, 13, 15, 17, 19, 21, 23)]
  # Positions 0, 3, 6, 9 of the ten, by block (not by string).
  assert tsne_layers(list(reversed(swin))) == ["layer_5", "layer_11",
                                               "layer_17", "layer_23"]
