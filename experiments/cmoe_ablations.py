"""CMoE's ablations (Figs. 4, 5a, 5b), training-free, judged per image.

    python experiments/cmoe_ablations.py [--seeds 0 1 2] [--root runs/carving]
        [--quick]

Per seed the dense ViT of `carving_vs_random.py` (`configs/vit_dense.py:
plain`, ROOT/dense_s{seed}, shared with that script) is carved by the
binary's carve mode (`configs/carve.py`, CMoE, every block, dropless) and
each carved model is evaluated as is on the 1,000 test images, each
image's outcome kept (ROOT/{setting}_s{seed}/per_image.npz):

* Fig. 5a, the shared-expert ratio at 8 of 32 experts active: S1A7E32,
  S3A5E32, S5A3E32, S7A1E32 (ratios 0.125 to 0.875; the paper's PPL falls
  14.48 -> 11.93);
* Fig. 5b, the activation rate at 16 experts, shared : routed 1 : 1:
  S2A2E16, S4A4E16, S6A6E16 (25%, 50%, 75%: the PPL falls toward the dense
  model's, 5.79 vs 5.27 at 75% on WikiText-2);
* Fig. 4, the calibration set at S2A2E16: 16, 64, 256 (the default) and
  1,024 training images (the paper: 0 -> 4,096 samples, PPL 62.30 -> 12.21,
  most of it by 64 and little after 1,024), with the carving seconds;
* Table I, training-free: CMoE against the random split (LLaMA-MoE's
  neuron split with a fresh router) at S1A1E8 / S2A2E8 / S3A3E8 (25 / 50 /
  75% of the hidden units active), `carving_vs_random.py`'s settings.

Fig. 5c (load balancing) is about the balancing bias, which only moves
while fine-tuning; it is not run here. About 20 minutes on the 2-core CPU
(the dense models included); `--quick`: 1 seed, a 300-step dense model,
two carves, 64 test images.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Optional

import numpy as np

from carving_vs_random import dense, final_test
from common import mean_std, parse_seeds_and_root, write_report
from paired_claims import claims_rows, write_images, write_json
from study import Claim
from vmoe_ext.app.carve import carve_checkpoint
from vmoe_ext.app.context import RunContext
from vmoe_ext.train.config_files import load_config
from vmoe_ext.train.forward import forward_pass

TABLE1 = ("S1A1E8", "S2A2E8", "S3A3E8")
SHARED = ("S1A7E32", "S3A5E32", "S5A3E32", "S7A1E32")
ACTIVATION = ("S2A2E16", "S4A4E16", "S6A6E16")
CALIBRATION = (16, 64, 256, 1024)
DEFAULT_CALIBRATION = 256


def setting_name(size: str, calibration: int, method: str = "cmoe") -> str:
  return size + ("" if calibration == DEFAULT_CALIBRATION
                 else f"_n{calibration}") + (
                     "" if method == "cmoe" else f"_{method}")


# (size, calibration images, method), the first two the quick mode's.
SETTINGS = tuple(dict.fromkeys(
    [(s, DEFAULT_CALIBRATION, "cmoe") for s in SHARED + ACTIVATION]
    + [("S2A2E16", n, "cmoe") for n in CALIBRATION]
    + [(s, DEFAULT_CALIBRATION, m) for s in TABLE1
       for m in ("cmoe", "random")]))

_F5A = "CMoE Fig. 5a (LLaMA-2-7B, 8 of 32 experts active: PPL 14.48 → 11.93)"
_F5B = "CMoE Fig. 5b (16 experts, shared : routed 1 : 1)"
_F4 = ("CMoE Fig. 4 (S2A2E16: PPL 62.30 with no data; 64 samples cut it by "
       "63%, little gain after 1,024)")
_T1 = ("CMoE Table I (LLaMA-2-7B, training-free, 25% active: CMoE S1A1E8 "
       "PPL 60.86, the random split NaN)")
CLAIMS = (
    *(Claim(_T1, f"CMoE's carving beats the random split training-free "
            f"({ratio} active)", f"{size}_random", size, "clean")
      for size, ratio in zip(TABLE1, ("25%", "50%", "75%"))),
    Claim(_F5A, "more shared experts (at the same activation) improve the "
          "carved model", "S1A7E32", "S7A1E32", "clean",
          paper=(14.48, 11.93, "ppl")),
    Claim(_F5A, "more shared experts improve the carved model (0.125 → "
          "0.375)", "S1A7E32", "S3A5E32", "clean"),
    Claim(_F5B, "a higher activation rate improves the carved model (25% → "
          "50%)", "S2A2E16", "S4A4E16", "clean"),
    Claim(_F5B, "a higher activation rate improves the carved model (50% → "
          "75%)", "S4A4E16", "S6A6E16", "clean"),
    Claim(_F5B + ": at 75% nearly the dense model (WikiText-2 PPL 5.79 vs "
          "dense 5.27)", "the dense model is better than the 75% carve",
          "S6A6E16", "dense", "clean", paper=(5.79, 5.27, "ppl")),
    Claim(_F4, "more calibration data improves the carved model (16 → 64 "
          "images)", "S2A2E16_n16", "S2A2E16_n64", "clean"),
    Claim(_F4, "more calibration data improves the carved model (256 → "
          "1,024 images)", "S2A2E16", "S2A2E16_n1024", "clean"),
)
PER_IMAGE = "per_image.npz"


def carve(size: str, calibration: int, method: str, seed: int,
          dense_dir: str, workdir: str) -> float:
  """Carves the dense run (reused when finished); the carving seconds."""
  if final_test(workdir) is None:
    shutil.rmtree(workdir, ignore_errors=True)  # An interrupted carve.
    config = load_config("carve", size + _flag(method))
    config.seed = config.carve.seed = seed
    config.carve.num_calibration = calibration
    # Absolute: a relative one fails in orbax's metadata read (library bug).
    config.carve.checkpoint_dir = os.path.abspath(dense_dir)
    carve_checkpoint(config, workdir)
  return float(final_test(workdir)["carve_seconds"])


def _flag(method: str) -> str:
  return "" if method == "cmoe" else f",{method}"


def correct_per_image(config, workdir: str,
                      num_examples: Optional[int] = None) -> np.ndarray:
  """`[I]` 0/1: each test image classified right by `workdir`'s last
  checkpoint (`config`: the model that wrote it); cached in the workdir."""
  path = os.path.join(workdir, PER_IMAGE)
  if os.path.exists(path):
    with np.load(path) as data:
      return data["correct"]
  ctx = RunContext.assemble(config)
  ctx.open_evaluation(workdir)
  variables = ctx.state.variables()
  predict = jax_predict(ctx.model)
  rows = []
  for batch in ctx.eval_batches():
    right = np.asarray(predict(variables, batch["image"])) == np.asarray(
        batch["label"])
    rows.append(right[np.asarray(batch["mask"], bool)])
  correct = np.concatenate(rows)[:num_examples].astype(np.uint8)
  np.savez(path, correct=correct)
  return correct


def jax_predict(model):
  import jax
  return jax.jit(lambda v, x: forward_pass(model, v, x).logits.argmax(-1))


def main(argv: Optional[Sequence[str]] = None) -> str:
  def add(parser):
    parser.set_defaults(root=None)
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 300 dense steps, 64 test images")
  args = parse_seeds_and_root(__doc__.splitlines()[0], argv, add)
  seeds = args.seeds[:1] if args.quick else args.seeds
  root = args.root or os.path.join(
      "runs", "carving_quick" if args.quick else "carving")
  count = 64 if args.quick else None
  settings = SETTINGS[:2] if args.quick else SETTINGS
  claims = [c for c in CLAIMS if {c.baseline, c.candidate}
            <= {setting_name(*s) for s in settings} | {"dense"}]
  outcomes: dict = {}
  seconds: dict = {}
  for seed in seeds:
    dense_dir = os.path.join(root, f"dense_s{seed}")
    dense(seed, dense_dir, 300 if args.quick else None)
    outcomes.setdefault(("dense", "clean"), []).append(correct_per_image(
        load_config("vit_dense", "plain"), dense_dir, count))
    for size, calibration, method in settings:
      key = setting_name(size, calibration, method)
      workdir = os.path.join(root, f"{key}_s{seed}")
      seconds.setdefault(key, []).append(
          carve(size, calibration, method, seed, dense_dir, workdir))
      outcomes.setdefault((key, "clean"), []).append(correct_per_image(
          load_config("carve", f"{size}{_flag(method)},evaluate"), workdir,
          count))
  outcomes = {k: np.stack(v).astype(np.float64) for k, v in outcomes.items()}
  labels = {k: k for k, _ in outcomes}
  lines = ["# CMoE ablations, training-free, judged per image (dense ViT, "
           "MNIST-5k)", "", __doc__.split("\n\n")[2].replace("\n", " "), "",
           f"Seeds {seeds}." + (" QUICK MODE: the numbers mean nothing."
                                if args.quick else ""), "",
           "| setting | method | calibration images | training-free acc % "
           "| carving s |", "|---|---|---|---|---|",
           "| dense | – | – | {:.2f} ± {:.2f} | – |".format(*mean_std(
               list(100 * outcomes["dense", "clean"].mean(1))))]
  for size, calibration, method in settings:
    key = setting_name(size, calibration, method)
    lines.append(f"| {size} | {method} | {calibration} | "
                 + "{:.2f} ± {:.2f}".format(
        *mean_std(list(100 * outcomes[key, "clean"].mean(1)))) + " | "
        + "{:.1f} ± {:.1f}".format(*mean_std(seconds[key])) + " |")
  claim_lines, records = claims_rows(outcomes, "default", claims, labels)
  lines += ["", "Claims:", "", *claim_lines, ""]
  per_seed = {f"default/{k}": {"clean": list(100 * v.mean(1))}
              for (k, _), v in outcomes.items()}
  for key, values in seconds.items():
    per_seed[f"default/{key}"]["carve_seconds"] = values
  write_images(os.path.join(root, "cmoe_ablations_images.npz"),
               {"default": outcomes})
  write_json(os.path.join(root, "cmoe_ablations.json"),
             dict(seeds=list(seeds), claims={"default": records},
                  per_seed=per_seed, quick=bool(args.quick)))
  return write_report(root, "cmoe_ablations.md", lines)


if __name__ == "__main__":
  main()
