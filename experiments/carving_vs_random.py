"""CMoE carving vs the random split: a dense ViT made a V-MoE without training.

    python experiments/carving_vs_random.py [--seeds 0 1 2] [--root runs/carving]
    python experiments/carving_vs_random.py --quick   # smoke run, 1 seed

The paper (CMoE, "Carving MoE from dense LLMs", Figs. 4-5, Table 1) claims
that (1) a CMoE-carved model works training-free, far better than a random
split of the FFN's neurons (NaN perplexity for the random split); (2) after a
short fine-tune it recovers much of the dense model's quality and still beats
the random split; (3) quality rises with the activation ratio toward the
dense model (Fig. 5b); (4) carving takes seconds to minutes.

Here, at our scale (a 4-block ViT on MNIST-5k instead of LLaMA): per seed, the
dense ViT `configs/vit_dense.py:plain` (2,500 steps; ROOT/dense_s{seed}) is
carved by the binary's carve mode (`configs/carve.py:S{s}A{s}E8[,random]`,
256 training images for calibration) at S1A1E8 / S2A2E8 / S3A3E8, i.e. 25% /
50% / 75% of the hidden units active per token, with CMoE and with the random
split (ROOT/{S..A..E..}_{method}_s{seed}); each carved model is then
fine-tuned for 300 steps (`...,finetune`; ROOT/..._ft), and again with the
routers frozen (`...,finetune,freeze_router`: the router weights and CMoE's
scale `u` never updated, like the router weights under the paper's LoRA
fine-tune, which does train `u`; the balancing bias, a router state, still
moves; ROOT/..._ftfrozen). Finished runs are reused, interrupted trainings
resumed. Accuracy is on the 1,000 test images; nothing is tuned on them.
Writes ROOT/carving_vs_random.md (mean ± std over seeds, per-seed values,
verdicts) and ROOT/carving_vs_random.png, copied next to this script (not
with --quick: 1 seed, 300 dense / 50 fine-tune steps, default root
runs/carving_quick).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import time
from typing import Any, Optional, Sequence

from common import mean_std, parse_seeds_and_root, write_report
from vmoe_ext.app.carve import carve_checkpoint
from vmoe_ext.app.train import train_and_evaluate
from vmoe_ext.reporting.figures import subplots
from vmoe_ext.reporting.writers import read_metrics
from vmoe_ext.train.config_files import load_config

SIZES = {"S1A1E8": 0.25, "S2A2E8": 0.50, "S3A3E8": 0.75}  # -> active ratio
METHODS = ("cmoe", "random")
FIGURE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "carving_vs_random.png")


def final_test(workdir: str) -> Optional[dict[str, Any]]:
  """The final test line of a finished run (its report.md written), else
  None."""
  if not os.path.exists(os.path.join(workdir, "report.md")):
    return None
  rows = [r for r in read_metrics(workdir)
          if r.get("split") == "test" and r.get("final")]
  return rows[-1] if rows else None


def wall_seconds(workdir: str) -> float:
  text = open(os.path.join(workdir, "report.md")).read()
  match = re.search(r"Wall time: ([0-9.]+) s", text)
  return float(match.group(1)) if match else float("nan")


def dense(seed: int, workdir: str, steps: Optional[int]) -> float:
  if final_test(workdir) is None:
    config = load_config("vit_dense", "plain")
    config.seed, config.robustness = seed, None
    if steps is not None:
      config.train.total_steps = steps
    train_and_evaluate(config, workdir)
  return final_test(workdir)["accuracy"]


def carve(size: str, method: str, seed: int, dense_dir: str,
          workdir: str) -> tuple[float, float, float]:
  """(training-free accuracy, carving seconds, carve-mode wall seconds)."""
  arg = size + (",random" if method == "random" else "")
  if final_test(workdir) is None:
    shutil.rmtree(workdir, ignore_errors=True)  # An interrupted carve.
    config = load_config("carve", arg)
    config.seed = config.carve.seed = seed
    # Absolute: a relative one fails in orbax's metadata read (library bug).
    config.carve.checkpoint_dir = os.path.abspath(dense_dir)
    carve_checkpoint(config, workdir)
  line = final_test(workdir)
  return line["accuracy"], line["carve_seconds"], wall_seconds(workdir)


def finetune(size: str, method: str, seed: int, carve_dir: str, workdir: str,
             steps: Optional[int], freeze_router: bool = False) -> float:
  if final_test(workdir) is None:
    config = load_config(
        "carve", size + (",random" if method == "random" else "") +
        ",finetune" + (",freeze_router" if freeze_router else ""))
    config.init.workdir = os.path.abspath(carve_dir)  # Idem.
    config.seed, config.robustness = seed, None
    if steps is not None:
      config.train.total_steps = steps
    train_and_evaluate(config, workdir)
  return final_test(workdir)["accuracy"]


def plot(results: dict, dense_acc: Sequence[float], seeds: Sequence[int],
         path: str) -> None:
  """Left: every condition; right: the fine-tuned ones on a zoomed axis."""
  fig, axes = subplots(1, 2, figsize=(11.5, 4.6))
  x = list(SIZES.values())
  styles = {("cmoe", "free"): ("CMoE, training-free", "tab:blue", "-"),
            ("cmoe", "ft"): ("CMoE, fine-tuned", "tab:blue", "--"),
            ("cmoe", "ftfrozen"): ("CMoE, fine-tuned, router frozen",
                                   "tab:blue", ":"),
            ("random", "free"): ("random split, training-free", "tab:red",
                                 "-"),
            ("random", "ft"): ("random split, fine-tuned", "tab:red", "--"),
            ("random", "ftfrozen"): ("random split, fine-tuned, router frozen",
                                     "tab:red", ":")}
  mean, std = mean_std([100 * a for a in dense_acc])
  for ax, kinds in zip(axes, (("free", "ft", "ftfrozen"), ("ft", "ftfrozen"))):
    for (method, kind), (label, colour, style) in styles.items():
      if kind not in kinds:
        continue
      stats = [mean_std([100 * results[method, size, s][kind] for s in seeds])
               for size in SIZES]
      shift = (-0.004 if method == "cmoe" else 0.004) * (  # Separate the bars.
          1 if kind == "ftfrozen" else 2)
      ax.errorbar([r + shift for r in x], [m for m, _ in stats],
                  yerr=[e for _, e in stats], label=label, color=colour,
                  linestyle=style, marker="s" if kind == "ftfrozen" else "o",
                  capsize=3)
    ax.axhline(mean, color="black", label=f"dense ViT ({mean:.2f}%)")
    ax.axhspan(mean - std, mean + std, color="black", alpha=0.1)
    ax.set_xticks(x, [f"{int(100 * r)}%\n{s}" for s, r in SIZES.items()])
    ax.set_xlabel("activation ratio (hidden units active per token)")
    ax.set_ylabel("test accuracy % (mean ± std over seeds)")
    ax.legend(fontsize=7.5)
    ax.grid(alpha=0.3)
  axes[0].set_title(f"Carving a dense ViT on MNIST-5k (seeds {list(seeds)})")
  axes[1].set_title("Fine-tuned only, zoomed (dotted: routers frozen)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def verdicts(results: dict, dense_acc: Sequence[float],
             seeds: Sequence[int]) -> list[str]:
  """The paper's four claims, checked on the means (percentage points)."""
  def m(method: str, size: str, kind: str) -> float:
    return mean_std([100 * results[method, size, s][kind] for s in seeds])[0]
  d = mean_std([100 * a for a in dense_acc])[0]
  at = " at 25% / 50% / 75%"
  gaps_free = [m("cmoe", z, "free") - m("random", z, "free") for z in SIZES]
  gaps_ft = [m("cmoe", z, "ft") - m("random", z, "ft") for z in SIZES]
  gaps_frozen = [m("cmoe", z, "ftfrozen") - m("random", z, "ftfrozen")
                 for z in SIZES]
  recovered = [m("cmoe", z, "ft") / d for z in SIZES]
  free = [m("cmoe", z, "free") for z in SIZES]
  tuned = [m("cmoe", z, "ft") for z in SIZES]
  secs = [r["seconds"] for r in results.values()]
  rising = lambda v: all(a < b for a, b in zip(v, v[1:]))
  claims = (
      ("(1) CMoE training-free beats the random split", min(gaps_free) > 0,
       "gaps " + ", ".join(f"{g:+.2f}" for g in gaps_free) + " points" + at),
      ("(2a) after fine-tuning CMoE beats the random split", min(gaps_ft) > 0,
       "gaps " + ", ".join(f"{g:+.2f}" for g in gaps_ft) + " points" + at),
      ("(2a') after fine-tuning with the routers frozen (as LoRA leaves "
       "the router weights), CMoE beats the random split",
       min(gaps_frozen) > 0,
       "gaps " + ", ".join(f"{g:+.2f}" for g in gaps_frozen) + " points"
       + at),
      ("(2b) fine-tuned CMoE recovers >= 95% of the dense accuracy",
       min(recovered) >= 0.95,
       "ratios " + ", ".join(f"{r:.3f}" for r in recovered) + at),
      ("(3) CMoE training-free accuracy rises with the activation ratio",
       rising(free), ", ".join(f"{a:.2f}" for a in free) + f"; dense {d:.2f}"),
      ("(3) CMoE fine-tuned accuracy rises with the activation ratio",
       rising(tuned), ", ".join(f"{a:.2f}" for a in tuned)
       + f"; dense {d:.2f}"),
      ("(4) carving takes seconds to minutes", max(secs) < 600,
       f"{min(secs):.1f}-{max(secs):.1f} s"))
  return [f"- {claim}: {'yes' if ok else 'NO'} ({detail})"
          for claim, ok, detail in claims]


def main(argv: Optional[Sequence[str]] = None) -> str:
  def add(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(root=None)
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 300 dense / 50 fine-tune steps")
  args = parse_seeds_and_root(__doc__.splitlines()[0], argv, add)
  seeds = args.seeds[:1] if args.quick else args.seeds
  root = args.root or os.path.join(
      "runs", "carving_quick" if args.quick else "carving")
  dense_steps, ft_steps = (300, 50) if args.quick else (None, None)
  start = time.time()
  results: dict = {}
  dense_acc: list[float] = []
  mismatches: list[str] = []
  for seed in seeds:
    dense_dir = os.path.join(root, f"dense_s{seed}")
    dense_acc.append(dense(seed, dense_dir, dense_steps))
    for size in SIZES:
      for method in METHODS:
        name = os.path.join(root, f"{size}_{method}_s{seed}")
        free, secs, wall = carve(size, method, seed, dense_dir, name)
        ft = finetune(size, method, seed, name, name + "_ft", ft_steps)
        frozen = finetune(size, method, seed, name, name + "_ftfrozen",
                          ft_steps, freeze_router=True)
        results[method, size, seed] = dict(free=free, ft=ft, ftfrozen=frozen,
                                           seconds=secs, wall=wall)
        again = next(r["accuracy"] for r in read_metrics(name)
                     if r.get("split") == "dense_test")
        if abs(again - dense_acc[-1]) > 1e-6:  # Same checkpoint, same data.
          mismatches.append(f"{name}: dense_test {again} vs {dense_acc[-1]}")
  plot(results, dense_acc, seeds, os.path.join(root, "carving_vs_random.png"))
  if not args.quick:
    shutil.copyfile(os.path.join(root, "carving_vs_random.png"), FIGURE)
  pct = lambda v: "%.2f ± %.2f" % mean_std([100 * a for a in v])
  sec = lambda v: "%.1f ± %.1f" % mean_std(v)
  lines = ["# CMoE carving vs the random split (dense ViT, MNIST-5k)", "",
           f"Seeds {seeds}; mean ± std (sample) over seeds; test accuracy on "
           f"the 1,000 test images. Fine-tune: {ft_steps or 300} steps. "
           "Carving s: the carving itself (calibration forward passes, "
           "profiling, grouping, slicing); carve-mode wall s: the whole "
           "mode (data, restore, carving, checkpoint, both evaluations). "
           "Router frozen: the same fine-tune with `optimizer.frozen` on the "
           "routers' parameters (CMoE's router weights and scale `u`, the "
           "random split's fresh router; the balancing bias still moves).",
           "",
           "| method | carve | active ratio | training-free acc % | "
           "fine-tuned acc % | fine-tuned, router frozen acc % | carving s | "
           "carve-mode wall s |",
           "|---|---|---|---|---|---|---|---|",
           f"| dense ViT | - | 100% | {pct(dense_acc)} | - | - | - | - |"]
  for method in METHODS:
    for size, ratio in SIZES.items():
      rows = [results[method, size, s] for s in seeds]
      lines.append(
          f"| {method} | {size} | {int(100 * ratio)}% | "
          f"{pct([r['free'] for r in rows])} | {pct([r['ft'] for r in rows])}"
          f" | {pct([r['ftfrozen'] for r in rows])}"
          f" | {sec([r['seconds'] for r in rows])} | "
          f"{sec([r['wall'] for r in rows])} |")
  lines += ["", "Per seed (training-free / fine-tuned / fine-tuned with the "
            "routers frozen accuracy %, carving s):",
            "", "- dense: " + ", ".join(
                f"seed {s} {100 * a:.1f}" for s, a in zip(seeds, dense_acc))]
  for (method, size, seed), r in results.items():
    lines.append(f"- {method} {size} seed {seed}: {100 * r['free']:.1f} / "
                 f"{100 * r['ft']:.1f} / {100 * r['ftfrozen']:.1f}, "
                 f"{r['seconds']:.1f} s")
  lines += ["", "Claims (on the means):", ""]
  lines += verdicts(results, dense_acc, seeds)
  if mismatches:
    lines += ["", "WARNING: the carve mode's dense accuracy differs from the "
              "dense run's: " + "; ".join(mismatches)]
  lines += ["", f"Script wall time this invocation: {time.time() - start:.0f}"
            " s (reused runs cost nothing).", "",
            "![accuracy vs activation ratio](carving_vs_random.png)"]
  return write_report(root, "carving_vs_random.md", lines)


if __name__ == "__main__":
  main()
