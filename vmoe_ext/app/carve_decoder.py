"""CMoE carving of a decoder language model's MLPs, and the perplexity
before and after (training-free), as the CMoE paper's Table I reports.

    # a LLaMA-architecture Hugging Face checkpoint (config.json and
    # model.safetensors or its sharded index), text as token ids (.npy)
    python -m vmoe_ext.app.carve_decoder --family=llama \
        --checkpoint_dir=/models/llama-2-7b-hf --carve=S1A1E8 \
        --train_ids=wikitext2_train.npy --eval_ids=test=wikitext2_test.npy \
        --workdir=runs/carve_llama
    # the dense f layers of our GLaM language model, from its training run
    python -m vmoe_ext.app.carve_decoder --family=lm \
        --config=configs/lm.py:glam_small --config.data.path=/data/wt103 \
        --checkpoint_dir=runs/glam_small --carve=S1A1E8 \
        --workdir=runs/carve_glam

`--family=llama`: the checkpoint is read by `vmoe_ext.models.llama`; the
calibration windows come from the `--train_ids` stream (a 1-D integer
`.npy` of the model's own token ids: tokenise the text with the model's
tokenizer first; the paper: WikiText-2 train, `--num_calibration=8` windows
of `--sequence_length=2048`); each `--eval_ids` stream is scored over
consecutive windows of `--sequence_length` tokens
(`vmoe_ext.evaluate.window_ppl`), dense and carved.

`--family=lm`: `--config` (and `--config.FIELD=VALUE` overrides) must be the
training run's config (its fingerprint is checked); the newest checkpoint
of `--checkpoint_dir` is carved on windows of the corpus's training split,
and the valid / test (and word-swapped) splits are scored as the training
run scores them (`vmoe_ext.evaluate.lm_eval`).

Outputs in `--workdir`: `metrics.jsonl` (one `split: "carve"` line per
carved layer; `split: "dense"` and `split: "carved"` (`final: true`) with
the `loss` / `ppl` of every evaluation stream, `carve_seconds`),
`report.md`, and with `--save` the carved variables
(`carved_variables.msgpack`, flax serialization) and the carved layers'
`moe` config (`carved_model.json`). Exit status 2 with `config error:
FIELD: ...` for invalid input, before anything is compiled.

A separate entry point, not a mode of `vmoe_ext.main`: the binary's carve
mode restores and writes the train states of models its config describes,
and a carved decoder (a LLaMA, or a GLaM whose carved `f` layers and
original MoE layers carry different `moe` configs) is no such model.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import flax.serialization
import jax
import numpy as np
from absl import flags

from vmoe_ext.app.context import RunContext, resolved
from vmoe_ext.app.main import parse_config_flags
from vmoe_ext.carving.decoder import calibration_windows
from vmoe_ext.carving.language import (carve_language_model,
                                       carved_language_model, lm_blocks)
from vmoe_ext.carving.llama import carve_llama, carved_llama, llama_blocks
from vmoe_ext.carving.model import CarveResult
from vmoe_ext.carving.spec import CarveSpec
from vmoe_ext.errors import ConfigError, InputError, require
from vmoe_ext.evaluate.window_ppl import window_perplexity
from vmoe_ext.models.llama import LlamaDecoder, load_llama
from vmoe_ext.reporting.report import listify, write_report
from vmoe_ext.reporting.writers import MetricWriter, wall_time
from vmoe_ext.train.state import TrainState

FAMILIES = ("llama", "lm")


def define_flags(values: flags.FlagValues) -> None:
  """The entry point's own flags (the LM's `--config` comes on top)."""
  d = dict(flag_values=values)
  flags.DEFINE_enum("family", None, FAMILIES, "llama: a Hugging Face "
                    "LLaMA directory; lm: our language model's run.", **d)
  flags.DEFINE_string("checkpoint_dir", None, "The dense model: a Hugging "
                      "Face directory (llama) or a training workdir (lm).",
                      **d)
  flags.DEFINE_string("workdir", None, "Where the outputs go.", **d)
  flags.DEFINE_string("carve", "S1A1E8", "S{shared}A{activated}E{total}.",
                      **d)
  flags.DEFINE_string("method", "cmoe", "cmoe, or random (LLaMA-MoE's "
                      "split with a fresh router).", **d)
  flags.DEFINE_list("layers", None, "Carved layers (default: all; lm: the "
                    "dense f layers).", **d)
  flags.DEFINE_integer("activation_markers", 10, "K_a.", **d)
  flags.DEFINE_string("distance", "l2", "l2 (the paper) or l1 (the "
                      "authors' code).", **d)
  flags.DEFINE_integer("iterations", 1, "Balanced K-means rounds.", **d)
  flags.DEFINE_integer("num_calibration", 8, "Calibration windows.", **d)
  flags.DEFINE_integer("sequence_length", 2048, "Tokens per calibration "
                       "window (llama: per evaluation window too).", **d)
  flags.DEFINE_integer("batch_size", 1, "Windows per forward pass.", **d)
  flags.DEFINE_integer("seed", 0, "Calibration sample, random split.", **d)
  flags.DEFINE_string("train_ids", None, "llama: the calibration stream "
                      "(.npy token ids).", **d)
  flags.DEFINE_list("eval_ids", [], "llama: NAME=PATH.npy streams to "
                    "score.", **d)
  flags.DEFINE_integer("max_windows", None, "llama: score only the first "
                       "windows of each stream.", **d)
  flags.DEFINE_bool("save", False, "Write the carved variables.", **d)


def carve_spec(values: flags.FlagValues) -> CarveSpec:
  """The `CarveSpec` of the flags (`--carve=S1A1E8`, ...)."""
  match = re.fullmatch(r"S(\d+)A(\d+)E(\d+)", values.carve or "")
  require(match, "--carve", f"must be S{{s}}A{{a}}E{{e}} (e.g. S1A1E8), got "
          f"{values.carve!r}")
  s, a, e = map(int, match.groups())
  layers = None
  if values.layers:
    try:
      layers = tuple(int(v) for v in values.layers)
    except ValueError as err:
      raise ConfigError("--layers", f"must be integers, got "
                        f"{values.layers}") from err
  return CarveSpec(
      checkpoint_dir=values.checkpoint_dir, num_experts=e, num_shared=s,
      num_activated=a, layers=layers, every=None if layers else 1,
      method=values.method, activation_markers=values.activation_markers,
      distance=values.distance, iterations=values.iterations,
      num_calibration=values.num_calibration, batch_size=values.batch_size,
      seed=values.seed)


def _ids(path: str, field: str) -> np.ndarray:
  require(path and os.path.isfile(path), field, f"no file {path!r}")
  try:
    ids = np.load(path, allow_pickle=False)
  except (OSError, ValueError) as e:
    raise ConfigError(field, f"{path!r} is not a .npy file ({e})") from e
  require(ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer), field,
          f"{path!r} must hold a 1-D integer array of token ids, got "
          f"{ids.dtype} {ids.shape}")
  return ids.astype(np.int64)


def _check_ids(ids: np.ndarray, vocab_size: int, field: str) -> np.ndarray:
  require(len(ids) and ids.min() >= 0 and ids.max() < vocab_size, field,
          f"token ids must lie in [0, {vocab_size}) (the model's "
          f"vocabulary), got [{ids.min() if len(ids) else '-'}, "
          f"{ids.max() if len(ids) else '-'}]")
  return ids


def carve_llama_checkpoint(values: flags.FlagValues, spec: CarveSpec
                           ) -> tuple[CarveResult, dict, dict, dict]:
  """Reads, carves and scores a LLaMA; returns the carving, the dense and
  the carved metrics, and a description for the report."""
  require(values.checkpoint_dir, "--checkpoint_dir", "required")
  config, params = load_llama(values.checkpoint_dir, "--checkpoint_dir")
  llama_blocks(config, spec)  # The checks, before any data is read.
  streams = {}
  for item in values.eval_ids:
    name, _, path = item.partition("=")
    require(name and path, "--eval_ids", f"items are NAME=PATH, got {item!r}")
    streams[name] = _check_ids(_ids(path, "--eval_ids"), config.vocab_size,
                               "--eval_ids")
  require(streams, "--eval_ids", "required: at least one NAME=PATH.npy")
  windows = np.zeros((1, 2), np.int32)
  if spec.method == "cmoe":
    train = _check_ids(_ids(values.train_ids, "--train_ids"),
                       config.vocab_size, "--train_ids")
    windows = calibration_windows(train, spec.num_calibration,
                                  values.sequence_length, spec.seed,
                                  field="--sequence_length")
  result = carve_llama(config, params, windows, spec, progress=_progress)
  carved = carved_llama(config, spec)

  def score(model: LlamaDecoder, variables: Mapping[str, Any]) -> dict:
    apply = jax.jit(lambda v, t: model.apply(v, t)[0])
    out = {}
    for name, ids in streams.items():
      r = window_perplexity(lambda t: apply(variables, t), ids,
                            sequence_length=values.sequence_length,
                            batch_size=spec.batch_size,
                            max_windows=values.max_windows)
      out.update({f"{name}_loss": r.loss, f"{name}_ppl": r.ppl,
                  f"{name}_num_tokens": r.num_tokens})
    return out

  dense = score(LlamaDecoder(config), {"params": params})
  final = score(carved, {"params": result.params, **result.collections})
  about = {"checkpoint": os.path.abspath(values.checkpoint_dir),
           "calibration": f"{len(windows)} windows of "
                          f"{values.sequence_length} tokens"}
  return result, dense, final, about


def _restore_lm(ctx: RunContext, source: str) -> tuple[dict, int]:
  """The newest checkpoint's params and collections of the LM run."""
  model, text = ctx.model, ctx.text
  entries, step = ctx.checkpoint_variables(
      source, np.zeros((1, text.block_size), np.int32), model.zero_cache(1),
      field="--checkpoint_dir")
  return {"params": entries["params"], **entries["collections"]}, step


def carve_lm_checkpoint(config: Any, values: flags.FlagValues,
                        spec: CarveSpec) -> tuple[CarveResult, dict, dict,
                                                  dict]:
  """Restores, carves and scores our language model."""
  ctx = RunContext.assemble(resolved(config))
  lm_blocks(ctx.model, spec)  # The checks, before the checkpoint.
  require(values.checkpoint_dir, "--checkpoint_dir", "required")
  variables, step = _restore_lm(ctx, values.checkpoint_dir)
  text = ctx.text
  windows = np.zeros((1, text.block_size), np.int32)
  if spec.method == "cmoe":
    windows = calibration_windows(text.corpus.splits["train"],
                                  spec.num_calibration,
                                  values.sequence_length, spec.seed,
                                  field="--sequence_length")
  result = carve_language_model(ctx.model, variables, windows, spec,
                                block_size=text.block_size,
                                progress=_progress)
  carved = carved_language_model(ctx.model, spec)
  collections = {k: v for k, v in variables.items() if k != "params"}
  dense = ctx.evaluate(ctx.model, TrainState.for_evaluation(
      variables["params"], collections), final=True)
  final = ctx.evaluate(carved, TrainState.for_evaluation(
      result.params, result.collections), final=True)
  about = {"checkpoint": f"step {step} of "
                         f"{os.path.abspath(values.checkpoint_dir)}",
           "calibration": f"{len(windows)} windows of "
                         f"{values.sequence_length} tokens"}
  return result, listify(dense), listify(final), about


def _progress(block: int, layer: Any, seconds: float) -> None:
  cost = "" if layer.cost is None else f", assignment cost {layer.cost:.4g}"
  print(f"carved layer {block} in {seconds:.2f} s{cost}", file=sys.stderr)


def write_outputs(workdir: str, spec: CarveSpec, family: str,
                  result: CarveResult, dense: dict, final: dict,
                  about: Mapping[str, str], save: bool,
                  start: float) -> None:
  """`metrics.jsonl`, `report.md` and (with `save`) the carved variables."""
  os.makedirs(workdir, exist_ok=True)
  final = {**final, "carve_seconds": result.total_seconds}
  with MetricWriter(workdir, tensorboard=False) as writer:
    writer.truncate(keep_lines=0)
    for block, layer in result.layers.items():
      line = {"block": block, "seconds": result.seconds[block]}
      if layer.cost is not None:
        line["assignment_cost"] = layer.cost
      writer.write(0, "carve", line)
    writer.write(0, "dense", dense)
    writer.write(0, "carved", final, final=True)
  rows = ["| metric | dense | carved |", "|---|---|---|"]
  for key in sorted(k for k in dense if k.endswith(("ppl", "loss", "bpc"))):
    if isinstance(dense[key], (int, float)) and key in final:
      rows.append(f"| {key} | {dense[key]:.4f} | {final[key]:.4f} |")
  section = "\n".join([
      f"## Carving ({spec.method}, {spec.name()}, {family})", "",
      f"Dense checkpoint: {about['checkpoint']}.  ",
      f"Calibration: {about['calibration']}; carved layers "
      f"{sorted(result.layers)}; wall time "
      f"{wall_time(result.total_seconds)}.", "", *rows])
  write_report(workdir, final_metrics=final, records=[],
               config_summary={"carve": spec.__dict__, "family": family},
               wall_seconds=time.time() - start, extra_sections=[section],
               title="Decoder carving report")
  if save:
    with open(os.path.join(workdir, "carved_variables.msgpack"), "wb") as f:
      f.write(flax.serialization.to_bytes(
          {"params": result.params, **result.collections}))
    with open(os.path.join(workdir, "carved_model.json"), "w") as f:
      json.dump(result.model, f, indent=1, default=list)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the command (module doc); returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  start = time.time()
  values = flags.FlagValues()
  define_flags(values)
  try:
    family = next((a.split("=", 1)[1] for a in argv
                   if a.startswith("--family=")), None)
    if family == "lm":
      parse_config_flags(argv, values, [])
    else:
      values(argv)
    require(values.family in FAMILIES, "--family",
            f"required: one of {FAMILIES}")
    require(values.workdir, "--workdir", "required")
    spec = carve_spec(values)
    if values.family == "llama":
      out = carve_llama_checkpoint(values, spec)
    else:
      out = carve_lm_checkpoint(values.config, values, spec)
  except (ConfigError, InputError) as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  result, dense, final, about = out
  write_outputs(values.workdir, spec, values.family, result, dense, final,
                about, values.save, start)
  for key in sorted(k for k in dense if k.endswith(("ppl", "bpc"))):
    if isinstance(dense[key], (int, float)) and key in final:
      print(f"{key}: dense {dense[key]:.4f}, carved ({spec.name()}) "
            f"{final[key]:.4f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
