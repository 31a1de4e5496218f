"""Evaluate-only variants: a run that changes only how a model is evaluated
starts from another run's finished training.

A study `Candidate` with `trained_as=SOURCE` shares SOURCE's training config
and differs only in the after-training evaluation (the `robustness` section,
the routing analysis' t-SNE). Where ROOT holds SOURCE's finished run for the
same regime and seed, the candidate's run directory is seeded with a copy of
SOURCE's last checkpoint and its metrics record; the binary then resumes at
the last step (dropping the record's lines written after that checkpoint,
i.e. SOURCE's evaluation) and runs only the candidate's evaluation. A
marker file in the run directory says where the training came from, so that
a report written later still says so.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

from flax.traverse_util import flatten_dict

from vmoe_ext.train.checkpoint_params import checkpoint_steps

MARKER = "trained_as.json"
# Config fields read only by the after-training evaluation.
EVALUATION_FIELDS = ("robustness", "data.analysis_tsne_tokens")


def training_fields(config: Any) -> dict[str, Any]:
  """`{dotted field: value}` of everything but `EVALUATION_FIELDS`."""
  tree = config.to_dict() if hasattr(config, "to_dict") else config
  flat = flatten_dict(tree, sep=".")
  return {k: v for k, v in flat.items()
          if not any(k == f or k.startswith(f + ".")
                     for f in EVALUATION_FIELDS)}


def check_same_training(name: str, config: Any, source: str,
                        source_config: Any) -> None:
  """Raises ValueError naming every training field where `config` (of
  candidate `name`) and `source_config` (of its `trained_as`) differ."""
  mine, theirs = training_fields(config), training_fields(source_config)
  differ = sorted(k for k in mine.keys() | theirs.keys()
                  if mine.get(k, "<unset>") != theirs.get(k, "<unset>"))
  if differ:
    detail = "; ".join(f"{k}: {mine.get(k, '<unset>')!r} vs "
                       f"{theirs.get(k, '<unset>')!r}" for k in differ)
    raise ValueError(
        f"candidate {name!r} names trained_as={source!r} but their training "
        f"configs differ (only {', '.join(EVALUATION_FIELDS)} may): {detail}")


def seed_from(source_dir: str, workdir: str) -> bool:
  """Copies the finished run `source_dir`'s last complete checkpoint and
  record into `workdir`, which must not exist yet, and writes the marker.
  Returns False (and does nothing) where there is nothing to seed from:
  `source_dir` not finished (no report.md) or without checkpoints, or
  `workdir` already started."""
  steps = checkpoint_steps(os.path.join(source_dir, "checkpoints"))
  step = str(steps[-1]) if steps else None
  if (os.path.exists(workdir) or step is None
      or not os.path.exists(os.path.join(source_dir, "report.md"))):
    return False
  tmp = workdir + ".seeding"  # Complete or absent, never half copied.
  shutil.rmtree(tmp, ignore_errors=True)
  shutil.copytree(os.path.join(source_dir, "checkpoints", step),
                  os.path.join(tmp, "checkpoints", step))
  shutil.copy(os.path.join(source_dir, "metrics.jsonl"), tmp)
  with open(os.path.join(tmp, MARKER), "w") as f:
    json.dump({"source": os.path.abspath(source_dir), "step": int(step)}, f)
  os.replace(tmp, workdir)
  return True


def seeded_from(workdir: str) -> Optional[dict[str, Any]]:
  """The marker of a seeded run (`{"source": dir, "step": n}`), else None."""
  path = os.path.join(workdir, MARKER)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)
