"""CMoE after fine-tuning: Table I against the random split and the
balancing bias (Fig. 5c), judged per image and over seeds.

    python experiments/cmoe_finetuned.py [--seeds 0 1 2] [--root runs/carving]
        [--quick]

Per seed the carves of `cmoe_ablations.py` (ROOT/{setting}_s{seed}, from the
dense ViT ROOT/dense_s{seed}; a missing one is carved first) are
fine-tuned for 300 steps by the binary's fine-tune mode
(`configs/carve.py:SIZE[,random],finetune`: every parameter trained, the
balancing bias at 1e-3; ROOT/{setting}_ft_s{seed}) and evaluated on the
1,000 test images, each image's outcome kept:

* Table I after fine-tuning: CMoE against the random split (LLaMA-MoE's
  neuron split with a fresh noisy top-k router) at S1A1E8 / S2A2E8 /
  S3A3E8 (25 / 50 / 75% of the hidden units active), per image;
* Fig. 5c: S2A2E16 fine-tuned with the balancing bias (its update rate
  gamma 1e-3, the paper's) against the same fine-tune with gamma 0 (the
  bias stays 0), on the routing analysis's expert load (std of the expert
  shares %, mean over the carved layers; the paper counts 100-11,225
  tokens per expert before and 1,443-3,584 after), judged over seeds; the
  table shows the smallest and largest expert share too.

About 30 minutes on the 2-core CPU once the carves exist; `--quick`: 1
seed, a 300-step dense model, S1A1E8 only (Fig. 5c on it), 10 fine-tuning
steps, 64 test images.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

import numpy as np

from carving_vs_random import dense, final_test
from cmoe_ablations import DEFAULT_CALIBRATION, carve, correct_per_image
from common import mean_std, parse_seeds_and_root, write_report
from paired_claims import claims_rows, write_images, write_json
from study import Claim
from vmoe_ext.app.train import train_and_evaluate
from vmoe_ext.evaluate.final import after_training_hook
from vmoe_ext.reporting.writers import read_metrics
from vmoe_ext.train.config_files import load_config

TABLE1 = ("S1A1E8", "S2A2E8", "S3A3E8")
BALANCE = "S2A2E16"
# (size, method, bias update rate; None: the config's 1e-3).
SETTINGS = (*((s, m, None) for s in TABLE1 for m in ("cmoe", "random")),
            (BALANCE, "cmoe", None), (BALANCE, "cmoe", 0.0))
QUICK_SETTINGS = (("S1A1E8", "cmoe", None), ("S1A1E8", "random", None),
                  ("S1A1E8", "cmoe", 0.0))

_T1 = ("CMoE Table I (LLaMA-2-7B, after fine-tuning, 25% active: CMoE "
       "S1A1E8 PPL 12.76, the random split 468.00)")
_F5C = ("CMoE Fig. 5c (the balancing bias evens the expert load: 100-11,225 "
        "tokens per expert before, 1,443-3,584 after)")


def claims_for(sizes: Sequence[str], balance: str) -> list[Claim]:
  ratios = dict(zip(TABLE1, ("25%", "50%", "75%")))
  return [*(Claim(_T1, "CMoE's carving beats the random split after "
                  f"fine-tuning ({ratios[s]} active)", f"{s}_random_ft",
                  f"{s}_ft", "clean",
                  paper=(468.00, 12.76, "ppl") if s == "S1A1E8" else None)
            for s in sizes),
          Claim(_F5C, "the balancing bias evens the routed experts' load "
                "during fine-tuning", f"{balance}_ft_nobias", f"{balance}_ft",
                "load")]


CLAIMS = tuple(claims_for(TABLE1, BALANCE))


def setting_name(size: str, method: str, bias_rate: Optional[float]) -> str:
  return size + ("" if method == "cmoe" else f"_{method}") + "_ft" + (
      "" if bias_rate is None else "_nobias")


def finetune_config(size: str, method: str, bias_rate: Optional[float],
                    seed: int, carve_dir: str, steps: Optional[int]):
  """The fine-tune of `carve_dir` (also the config that evaluates it)."""
  config = load_config("carve", size + ("" if method == "cmoe"
                                        else f",{method}") + ",finetune")
  config.init.workdir = os.path.abspath(carve_dir)  # orbax needs absolute.
  config.seed, config.robustness = seed, None
  config.data.analysis_tsne_tokens = 0
  if bias_rate is not None:
    config.model.moe.router.bias_update_rate = bias_rate
  if steps is not None:
    config.train.total_steps = config.train.eval_every = steps
    config.train.checkpoint_every = steps
    config.optimizer.warmup_steps = min(config.optimizer.warmup_steps,
                                        steps // 2)
  return config


def load(workdir: str) -> tuple[float, float, float]:
  """(load imbalance, smallest and largest expert share %) of the routing
  analysis, over the carved layers."""
  routing = [r for r in read_metrics(workdir) if r.get("split") == "routing"]
  shares = np.concatenate([v for k, v in routing[-1].items()
                           if k.endswith("/load_percent")])
  return (float(routing[-1]["load_balance_mean"]), float(shares.min()),
          float(shares.max()))


def main(argv: Optional[Sequence[str]] = None) -> str:
  def add(parser):
    parser.set_defaults(root=None)
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 300 dense steps, S1A1E8 only, 10 "
                        "fine-tuning steps, 64 test images")
  args = parse_seeds_and_root(__doc__.splitlines()[0], argv, add)
  seeds = args.seeds[:1] if args.quick else args.seeds
  root = args.root or os.path.join(
      "runs", "carving_quick" if args.quick else "carving")
  count, steps = (64, 10) if args.quick else (None, None)
  settings = QUICK_SETTINGS if args.quick else SETTINGS
  outcomes: dict = {}
  loads: dict = {}
  for seed in seeds:
    dense_dir = os.path.join(root, f"dense_s{seed}")
    dense(seed, dense_dir, 300 if args.quick else None)
    for size, method, bias_rate in settings:
      carve_key = size + ("" if method == "cmoe" else f"_{method}")
      carve_dir = os.path.join(root, f"{carve_key}_s{seed}")
      carve(size, DEFAULT_CALIBRATION, method, seed, dense_dir, carve_dir)
      key = setting_name(size, method, bias_rate)
      workdir = os.path.join(root, f"{key}_s{seed}")
      config = finetune_config(size, method, bias_rate, seed, carve_dir,
                               steps)
      if final_test(workdir) is None:
        train_and_evaluate(config, workdir,
                           after_training=after_training_hook(config, workdir))
      outcomes.setdefault((key, "clean"), []).append(
          correct_per_image(config, workdir, count))
      loads.setdefault(key, []).append(load(workdir))
  outcomes = {k: np.stack(v).astype(np.float64) for k, v in outcomes.items()}
  for key, values in loads.items():
    outcomes[key, "load"] = np.array([v[0] for v in values])
  balance = settings[-1][0]
  claims = claims_for(sorted({s for s, m, _ in settings if m == "random"}),
                      balance)
  labels = {k: k for k, _ in outcomes}
  lines = ["# CMoE after fine-tuning (carved dense ViT, MNIST-5k)", "",
           __doc__.split("\n\n")[2].replace("\n", " "), "",
           f"Seeds {seeds}." + (" QUICK MODE: the numbers mean nothing."
                                if args.quick else ""), "",
           "| setting | method | balancing bias | fine-tuned acc % | load "
           "imbalance | smallest / largest expert share % |",
           "|---|---|---|---|---|---|"]
  for size, method, bias_rate in settings:
    key = setting_name(size, method, bias_rate)
    values = np.array(loads[key])
    lines.append(
        f"| {size} | {method} | "
        + ("–" if method == "random" else
           "gamma 0" if bias_rate is not None else "gamma 1e-3") + " | "
        + "{:.2f} ± {:.2f}".format(
            *mean_std(list(100 * outcomes[key, "clean"].mean(1)))) + " | "
        + "{:.2f} ± {:.2f}".format(*mean_std(list(values[:, 0]))) + " | "
        + "{:.1f} / {:.1f}".format(values[:, 1].mean(), values[:, 2].mean())
        + " |")
  claim_lines, records = claims_rows(outcomes, "default", claims, labels)
  lines += ["", "Claims:", "", *claim_lines, ""]
  per_seed = {f"default/{k}": {"clean": list(100 * outcomes[k, "clean"]
                                             .mean(1)),
                               "load": [v[0] for v in loads[k]],
                               "load_min": [v[1] for v in loads[k]],
                               "load_max": [v[2] for v in loads[k]]}
              for k in loads}
  write_images(os.path.join(root, "cmoe_finetuned_images.npz"),
               {"default": {k: v for k, v in outcomes.items()
                            if k[1] == "clean"}})
  write_json(os.path.join(root, "cmoe_finetuned.json"),
             dict(seeds=list(seeds), claims={"default": records},
                  per_seed=per_seed, quick=bool(args.quick)))
  return write_report(root, "cmoe_finetuned.md", lines)


if __name__ == "__main__":
  main()
