"""Robustness evaluation of a trained model: attacks, routing change, eps
sweeps, the local corruption suite and evaluation datasets (corrupted sets,
class-subset accuracy, OOD; `vmoe_ext.evaluate.datasets`), written to
`metrics.jsonl`, PNGs and report sections.

Attacks work on raw images in [0, 1] (eps in those units); the model sees them
normalised, inside `logits_fn`. Clean and attacked inputs are evaluated in the
same batches, deterministically (no router noise, no dropout): with
capacity-limited routing a token's experts depend on the other tokens of its
routing group, so only identical batching makes "clean vs attacked" a
per-example comparison.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vmoe_ext.attacks.autoattack import stages_of
from vmoe_ext.attacks.progress import listening
from vmoe_ext.attacks.projected_gradient import DEFAULT_STEP_FACTOR
from vmoe_ext.attacks.registry import get_attack
from vmoe_ext.classification import topk_correct
from vmoe_ext.config.defaults import fill_defaults
from vmoe_ext.config.schema import plain
from vmoe_ext.data import ArrayDataset, default_normalization, eval_batches
from vmoe_ext.data.readers import ArrayReader
from vmoe_ext.data.corruptions import CORRUPTIONS, corrupt
from vmoe_ext.evaluate.autoattack_report import autoattack_section
from vmoe_ext.evaluate.config import ROBUSTNESS
from vmoe_ext.evaluate.corruption_metrics import corruption_errors
from vmoe_ext.evaluate.datasets import check_datasets, evaluate_datasets
from vmoe_ext.evaluate.evaluator import Evaluator
from vmoe_ext.evaluate.metrics import routing_change_rate
from vmoe_ext.evaluate.per_example import PerExample, eval_name, subset_index
from vmoe_ext.naming import block_index, metric_key_of
from vmoe_ext.reporting import figures
from vmoe_ext.reporting.report_parts import bar_chart, markdown_table
from vmoe_ext.reporting.progress import (BatchProgress, progress_bar,
                                         progress_line)
from vmoe_ext.reporting.writers import MetricWriter


def robustness_config(config: Mapping[str, Any]) -> dict[str, Any]:
  """A checked `robustness` section with its defaults filled (the schema's,
  `vmoe_ext.evaluate.config.ROBUSTNESS`) and its evaluation datasets'
  entries completed (`check_datasets`)."""
  out = fill_defaults(ROBUSTNESS, plain(config))
  out["datasets"] = check_datasets(out["datasets"])
  return out


def _subset(dataset: ArrayDataset, n: Optional[int]) -> ArrayDataset:
  """The evaluation subset of `n` images (`per_example.subset_index`)."""
  if n is None or n >= len(dataset):
    return dataset
  idx = subset_index(len(dataset), n)
  return ArrayDataset(dataset.images[idx], dataset.labels[idx],
                      dataset.num_classes, dataset.name)


def _correct(evaluator: Evaluator, dataset: ArrayDataset, batch_size: int
             ) -> tuple[np.ndarray, np.ndarray]:
  """`[n]` top-1 and top-5 correctness of every example of `dataset`."""
  logits, labels = evaluator.predict(ArrayReader(dataset), batch_size)
  if not len(labels):
    return np.zeros(0, bool), np.zeros(0, bool)
  return topk_correct(logits, labels, 1), topk_correct(logits, labels, 5)


def _accumulate(total: dict, key: str, value: float, weight: float) -> None:
  s, w = total.get(key, (0.0, 0.0))
  total[key] = (s + value * weight, w + weight)


def attack_metrics(evaluator: Evaluator, dataset: ArrayDataset,
                   attack_config: Mapping[str, Any], batch_size: int,
                   seed: int, desc: str = "attack",
                   outcomes: Optional[dict[str, np.ndarray]] = None
                   ) -> dict[str, float]:
  """Clean vs attacked metrics of one attack over every example of `dataset`.

  Returns `clean_accuracy`, `accuracy` and `top5_accuracy` (attacked),
  `prediction_change_rate` and, per MoE block, `layer_i/routing_change_rate`
  (1 - IoU of each token's selected-expert set, averaged over tokens), and
  the attack's diagnostics averaged over the examples (registry `details`:
  e.g. AutoAttack's `robust_after/<attack>`, APGD's `apgd_loss/<attack>`
  trajectory). With `outcomes` (a dict), also each example's `[n]`
  top-1 / top-5 correctness on the attacked inputs (`correct`, `top5`),
  in the dataset's order.
  """
  attack = evaluator.attack(attack_config, details=True)
  per_batch: dict[str, list[np.ndarray]] = {"correct": [], "top5": []}
  total: dict[str, tuple[Any, Any]] = {}
  key = jax.random.key(seed)
  num_batches = -(-len(dataset) // batch_size)
  batches = eval_batches(dataset, batch_size)  # raw [0, 1] images
  with progress_bar(total=num_batches, desc=desc) as bar:
    progress_line(bar, f"evaluate: {desc} on {len(dataset)} images, "
                  f"{num_batches} batch{'es' if num_batches > 1 else ''}...")
    progress = BatchProgress(bar, num_batches, f"evaluate: {desc}")
    for i, batch in enumerate(batches):
      x, y, mask = batch["image"], batch["label"], batch["mask"]

      def stage_note(stage: str, robust: np.ndarray, mask=mask) -> None:
        progress.note(f"{stage} done, {int(robust[mask].sum())} of the "
                      f"batch's {int(mask.sum())} images still robust")

      with listening(stage_note):  # An ensemble's stages (AutoAttack).
        x_adv, diagnostics = jax.block_until_ready(attack(
            jnp.asarray(x), jnp.asarray(y), jax.random.fold_in(key, i)))
      for name, value in jax.device_get(diagnostics).items():
        value = np.asarray(value, np.float64)[mask]
        present = ~np.isnan(value)
        s, w = total.get(name, (0.0, 0.0))
        total[name] = (s + np.where(present, value, 0.0).sum(0),
                       w + present.sum(0))
      logits, masks = jax.device_get(evaluator.forward(jnp.asarray(x)))
      logits_adv, masks_adv = jax.device_get(evaluator.forward(x_adv))
      n = float(mask.sum())
      pred, pred_adv = logits.argmax(-1), logits_adv.argmax(-1)
      correct_adv = topk_correct(logits_adv, y, 1)[mask]
      top5_adv = topk_correct(logits_adv, y, 5)[mask]
      per_batch["correct"].append(correct_adv)
      per_batch["top5"].append(top5_adv)
      _accumulate(total, "clean_accuracy",
                  np.mean(topk_correct(logits, y, 1)[mask]), n)
      _accumulate(total, "accuracy", np.mean(correct_adv), n)
      _accumulate(total, "top5_accuracy", np.mean(top5_adv), n)
      _accumulate(total, "prediction_change_rate",
                  np.mean((pred != pred_adv)[mask]), n)
      for block, m in masks.items():
        layer = metric_key_of(block)
        _accumulate(total, f"{layer}/routing_change_rate",
                    routing_change_rate(m[mask], masks_adv[block][mask]), n)
      progress.update(1)
    if outcomes is not None:
      outcomes.update({k: np.concatenate(v) if v else np.zeros(0, bool)
                       for k, v in per_batch.items()})
    result = {k: s / np.maximum(w, 1.0) for k, (s, w) in total.items()}
    result = {k: float(v) if np.ndim(v) == 0 else v
              for k, v in result.items()}
    if "accuracy" in result:
      progress_line(bar, f"{desc}: accuracy {result['accuracy']:.4f} (clean "
                    f"{result['clean_accuracy']:.4f}) on {len(dataset)} "
                    "examples")
  return result


# The settings an attack's report line names (config or default), in order.
SHOWN_SETTINGS = ("version", "attacks", "norm", "steps", "step_size",
                  "random_start", "restarts", "samples", "queries",
                  "patch_size", "rate", "value")


def _derived(name: str, attack: Mapping[str, Any],
             params: Mapping[str, inspect.Parameter]) -> str:
  """How an attack derives a setting left at None: AutoAttack's version's
  attacks, PGD's step size; `auto` for another."""
  if name == "attacks" and "version" in params:
    version = attack.get("version", params["version"].default)
    return "+".join(stages_of(version, None))
  if name == "step_size" and attack["name"] == "pgd":
    return f"{DEFAULT_STEP_FACTOR:g}*eps/steps"
  return "auto"


def attack_settings(attack: Mapping[str, Any]) -> str:
  """`"steps=10, step_size=0.0125, random_start=True, ..."`: the attack's
  main settings as it runs (the config's value, else the attack's default;
  for a default the attack derives, how: `step_size=2.5*eps/steps`), eps and
  the example count left out."""
  params = inspect.signature(get_attack(attack["name"])).parameters
  out = []
  for name in SHOWN_SETTINGS:
    if name in attack:
      value = attack[name]
    elif name in params and params[name].default is not params[name].empty:
      value = params[name].default
    else:
      continue
    value = _derived(name, attack, params) if value is None else value
    if isinstance(value, (tuple, list)):
      value = "+".join(map(str, value))
    out.append(f"{name}={value}")
  return ", ".join(out) or "-"


def routing_by_layer(metrics: Mapping[str, Any]) -> dict[str, float]:
  """`{"layer_i": routing change rate}` of an attack's metrics, by block."""
  suffix = "/routing_change_rate"
  rates = {k[:-len(suffix)]: v for k, v in metrics.items()
           if k.endswith(suffix)}
  return {l: rates[l] for l in sorted(rates, key=block_index)}


def sweep_settings_text(sweep_attack: Mapping[str, Any],
                        table_attacks: Sequence[Mapping[str, Any]]) -> str:
  """The sweep section's first paragraph: its attack's settings, and where
  the attack table has the same attack with other settings, that the two
  accuracies at one eps differ for that reason."""
  mine = attack_settings(sweep_attack)
  name = sweep_attack["name"]
  text = f"{name.upper()} with {mine}, at each eps of the sweep."
  others = sorted({attack_settings(a) for a in table_attacks
                   if a["name"] == name} - {mine})
  if others:
    text += (f" These are not the settings of the attack table's "
             f"{name.upper()} ({'; '.join(others)}): at the same eps the two "
             "accuracies need not agree (the stronger attack gives the "
             "lower one).")
  return text


def _plot_sweep(eps: Sequence[float], acc: Sequence[float],
                routing: dict[str, list[float]], title: str,
                path: str) -> None:
  fig, (ax1, ax2) = figures.subplots(1, 2, figsize=(10, 3.5))
  ax1.plot(eps, acc, "o-")
  ax1.set(xlabel="eps (pixel units, [0, 1] images)", ylabel="accuracy",
          title=f"{title}: accuracy", ylim=(0, 1))
  for layer, values in sorted(routing.items()):
    ax2.plot(eps, values, "o-", label=layer)
  ax2.set(xlabel="eps", ylabel="routing change rate (1 - IoU)",
          title=f"{title}: routing change")
  if routing:
    ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def evaluate_robustness(model: nn.Module, variables: Mapping[str, Any],
                        test: ArrayDataset,
                        data_config: ml_collections.ConfigDict,
                        robustness: Mapping[str, Any], *, batch_size: int,
                        writer: MetricWriter, step: int,
                        workdir: str, partitioning: Any = None) -> list[str]:
  """Runs every configured evaluation; returns markdown report sections.

  `partitioning`: the run's mesh, for global variables of a multi-process
  job (see `Evaluator`)."""
  cfg = robustness_config(robustness)
  mean, std = default_normalization(data_config)
  # Attacks and corruptions act on the stored test images (eps in their
  # pixel units); with `data.image_size` the model's forward resizes them
  # as the pipeline does.
  evaluator = Evaluator(model, variables, mean, std, partitioning,
                        image_size=data_config.get("image_size"))
  data = _subset(test, cfg["num_examples"])
  data_index = subset_index(len(test), cfg["num_examples"])
  record = PerExample(test.labels, cfg["per_example"])
  if record.enabled:
    record.add("clean", data_index, *_correct(evaluator, data, batch_size))
  sections, results = [], []

  if cfg["attacks"]:
    rows = []
    for attack in cfg["attacks"]:
      attack = dict(attack)
      n = attack.pop("num_examples", None)
      subset = _subset(data, n)
      name = attack["name"]
      outcomes: Optional[dict[str, np.ndarray]] = (
          {} if record.enabled else None)
      m = attack_metrics(evaluator, subset, attack, batch_size, cfg["seed"],
                         desc=name, outcomes=outcomes)
      eps = attack.get("eps")
      if outcomes is not None:
        record.add(eval_name("adversarial", name, eps),
                   data_index[subset_index(len(data), n)],
                   outcomes["correct"], outcomes["top5"])
      writer.write(step, f"adversarial/{name}",
                   {**m, "eps": eps, "num_examples": len(subset)})
      results.append((attack, m, len(subset)))
      routing = routing_by_layer(m)
      rows.append([name, attack_settings(attack),
                   "-" if eps is None else eps, len(subset),
                   m["clean_accuracy"], m["accuracy"],
                   m["prediction_change_rate"],
                   ", ".join(f"{l}: {v:.3f}" for l, v in routing.items())
                   or "-"])
    sections.append(
        "## Adversarial robustness\n\nAttacks on raw [0, 1] images (eps in "
        "those units), deterministic model, identical batching for clean and "
        "attacked inputs.\n\n" + markdown_table(
            ["attack", "settings", "eps", "examples", "clean acc", "adv acc",
             "prediction change", "routing change per MoE layer"], rows))
    sections += autoattack_section(results, workdir)

  if cfg["sweep"]:
    sweep = dict(cfg["sweep"])
    attack = dict(sweep["attack"])
    eps_list = [float(e) for e in sweep["eps"]]
    acc, routing = [], {}
    for e in eps_list:  # eps = 0 is the clean input (the eps-ball is a point).
      outcomes = {} if record.enabled else None
      m = attack_metrics(evaluator, data, {**attack, "eps": e}, batch_size,
                         cfg["seed"], desc=f"{attack['name']} eps={e:g}",
                         outcomes=outcomes)
      if outcomes is not None:
        record.add(eval_name("sweep", attack["name"], e), data_index,
                   outcomes["correct"], outcomes["top5"])
      writer.write(step, f"sweep/{attack['name']}",
                   {**m, "eps": e, "num_examples": len(data)})
      acc.append(m["accuracy"])
      for k, v in m.items():
        if k.endswith("routing_change_rate"):
          routing.setdefault(k.split("/")[0], []).append(v)
    path = os.path.join(workdir, f"robustness_{attack['name']}.png")
    _plot_sweep(eps_list, acc, routing, attack["name"].upper(), path)
    layers = sorted(routing, key=block_index)
    rows = [[e, a] + [routing[l][i] for l in layers]
            for i, (e, a) in enumerate(zip(eps_list, acc))]
    sections.append(
        f"## Robustness curve ({attack['name']})\n\n"
        + sweep_settings_text(attack, [a for a, _, _ in results])
        + "\n\n" + markdown_table(
            ["eps", "accuracy"] + [f"{l} routing change" for l in layers],
            rows)
        + f"\n\n![robustness curve]({os.path.basename(path)})")

  if cfg["corruptions"] is not None:
    corr = dict(cfg["corruptions"])
    names = tuple(corr["names"] or CORRUPTIONS)  # None: all
    severities = tuple(corr["severities"])
    subset = _subset(data, corr["num_examples"])
    subset_at = data_index[subset_index(len(data), corr["num_examples"])]
    table: dict[str, dict[int, float]] = {}
    total = len(names) * len(severities)
    with progress_bar(total=total, desc="corruptions") as bar:
      progress = BatchProgress(bar, total, "evaluate: corruptions",
                               unit="(corruption, severity) pairs")
      for name in names:
        table[name] = {}
        for severity in severities:
          images = corrupt(subset.images, name, severity, seed=cfg["seed"])
          corrupted = ArrayDataset(images, subset.labels, subset.num_classes,
                                   subset.name)
          correct, top5 = _correct(evaluator, corrupted, batch_size)
          table[name][severity] = (float(np.mean(correct)) if len(correct)
                                   else 0.0)
          record.add(f"corruption/{name}/s{severity}", subset_at, correct,
                     top5)
          progress.update(1)
        progress_line(bar, f"corruption {name}: accuracy per severity "
                      + ", ".join(f"{table[name][s]:.3f}" for s in severities))
    errors = corruption_errors(table)
    per_corruption = {n: float(np.mean(list(table[n].values())))
                      for n in names}
    writer.write(step, "corruption", {
        **{f"{n}/accuracy": per_corruption[n] for n in names},
        "mean_corruption_error": errors["mean_corruption_error"],
        "num_examples": len(subset)})
    path = os.path.join(workdir, "corruptions.png")
    bar_chart(per_corruption, path, ylabel="accuracy (mean over severities)",
              title="Corruption robustness", ylim=(0, 1))
    rows = [[n] + [table[n][s] for s in severities] + [per_corruption[n]]
            for n in names]
    sections.append(
        "## Corruption robustness\n\nLocal corruption suite "
        "(`vmoe_ext.data.corruptions`), accuracy per severity, on "
        f"{len(subset)} test images. Mean corruption error (unnormalised; "
        "no AlexNet baseline for this dataset): "
        f"{errors['mean_corruption_error']:.4f}.\n\n"
        + markdown_table(["corruption"] + [f"s{s}" for s in severities]
                         + ["mean"], rows)
        + "\n\n![corruptions](corruptions.png)")
  if cfg["datasets"]:
    sections += evaluate_datasets(
        evaluator, test, data_config, cfg["datasets"], batch_size=batch_size,
        writer=writer, step=step, workdir=workdir)
  record.write(workdir)
  return sections

