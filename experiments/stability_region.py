"""The stability region of MomentumSMoE (Proposition 1) against plain SMoE.

    python experiments/stability_region.py [--out runs/stability_region]
        [--n-mu 481] [--n-gs 501]
    python experiments/stability_region.py --out experiments  # the committed
                                                              # figure

Claim (MomentumSMoE, Teo & Nguyen 2024, §3, Lemma 1, Proposition 1,
Corollary 1): linearised around a fixed point, each eigen-direction of the
MoE Jacobian (eigenvalue sigma) follows the heavy-ball iteration
x_{t+1} = x_t - gamma sigma x_t + mu (x_t - x_{t-1}), i.e. the 2x2 matrix
A = [[0, 1], [-mu, (1 + mu) - gamma sigma]] acting on (x_{t-1}, x_t). Its
spectral radius is < 1 iff mu in (-1, 1) and gamma sigma in (0, 2 + 2 mu):
a triangle in the (mu, gamma sigma) plane. Plain SMoE (mu = 0) is stable
only for gamma sigma in (0, 2), so momentum mu widens the interval to
2 + 2 mu (x1.7 at the paper's mu = 0.7).

What the script does, all in numpy (no model, seconds on CPU):
- computes rho(A) = max |eig(A)| with `np.linalg.eigvals` on a dense grid
  mu in [-1.2, 1.2] x gamma sigma in [-0.5, 4.5];
- draws log10 rho as a heatmap (blue stable, red unstable), the numerical
  rho = 1 contour, the analytic boundary lines of Proposition 1
  (gamma sigma = 0, gamma sigma = 2 + 2 mu, mu = +-1), plain SMoE's stable
  interval (mu = 0, gamma sigma in (0, 2)) as a thick segment, and vertical
  lines at the operating mu values (sigma is unknown, so only mu is marked):
  0.7 (paper, language, with gamma = 1), 0.8 (the authors' V-MoE config)
  and 0.04 (robust momentum's V-MoE reference; its extra alpha extrapolation
  changes A, so Proposition 1 covers it only at alpha = 0);
- prints how many grid points the numerical mask (rho < 1) and the analytic
  condition disagree on, and how many points lie within one grid cell of
  the analytic boundary (a check, printed, not asserted), and the stable
  gamma sigma interval measured on a fine 1-D sweep at each operating mu.

Writes `stability_region.png` (Agg backend, 7x5 in at 120 dpi) into the
directory --out (created if missing), by default `runs/stability_region`
like the other scripts' outputs; `--out experiments` replaces the figure
committed next to this script.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Optional

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.lines import Line2D

from vmoe_ext.reporting.figures import subplots

MU_RANGE = (-1.2, 1.2)
GS_RANGE = (-0.5, 4.5)
# (mu, label, colour, line style): sigma is unknown, so only mu is marked.
OPERATING_POINTS = (
    (0.7, r"$\mu = 0.7$ (paper, language, $\gamma = 1$)", "tab:green", "-"),
    (0.8, r"$\mu = 0.8$ (authors' V-MoE config)", "tab:brown", "--"),
    (0.04, r"$\mu = 0.04$ (robust momentum, V-MoE)", "tab:orange", ":"),
)
DEFAULT_OUT = os.path.join("runs", "stability_region")
FIGURE = "stability_region.png"


def iteration_matrices(mu: np.ndarray, gs: np.ndarray) -> np.ndarray:
  """A = [[0, 1], [-mu, 1 + mu - gamma sigma]], broadcast: shape [..., 2, 2]."""
  mu, gs = np.broadcast_arrays(mu, gs)
  a = np.zeros(mu.shape + (2, 2))
  a[..., 0, 1] = 1.0
  a[..., 1, 0] = -mu
  a[..., 1, 1] = 1.0 + mu - gs
  return a


def spectral_radius(mu: np.ndarray, gs: np.ndarray) -> np.ndarray:
  """max |eig(A)| for every (mu, gamma sigma) pair, numerically."""
  return np.abs(np.linalg.eigvals(iteration_matrices(mu, gs))).max(axis=-1)


def analytic_stable(mu: np.ndarray, gs: np.ndarray) -> np.ndarray:
  """Proposition 1: |mu| < 1 and 0 < gamma sigma < 2 + 2 mu."""
  return (np.abs(mu) < 1) & (gs > 0) & (gs < 2 + 2 * mu)


def near_boundary(stable: np.ndarray) -> np.ndarray:
  """Points whose 3x3 neighbourhood holds both labels (within one cell)."""
  padded = np.pad(stable, 1, mode="edge")
  rows, cols = stable.shape
  windows = [padded[i:i + rows, j:j + cols]
             for i in range(3) for j in range(3)]
  return np.any([w != stable for w in windows], axis=0)


def agreement(radius: np.ndarray, stable_ana: np.ndarray) -> dict[str, float]:
  """Disagreements of rho < 1 with Proposition 1, near/away from its edge."""
  differ = (radius < 1) != stable_ana
  near = near_boundary(stable_ana)
  gap = float(np.abs(radius[differ] - 1).max()) if differ.any() else 0.0
  return {"points": differ.size, "disagree": int(differ.sum()),
          "near_boundary": int(near.sum()),
          "disagree_near": int((differ & near).sum()),
          "disagree_away": int((differ & ~near).sum()),
          "max_gap": gap}


def stable_interval(mu: float, n: int = 100_001
                    ) -> tuple[float, float]:
  """First and last gamma sigma sample with rho(A) < 1 at `mu` (1-D sweep)."""
  gs = np.linspace(*GS_RANGE, n)
  stable = spectral_radius(np.full_like(gs, mu), gs) < 1
  if not stable.any():
    return float("nan"), float("nan")
  return float(gs[stable].min()), float(gs[stable].max())


def plot(mu: np.ndarray, gs: np.ndarray, radius: np.ndarray,
         out: str) -> None:
  """Heatmap of log10 rho(A) with the analytic and numerical boundaries,
  saved as the PNG file `out`."""
  fig, ax = subplots(figsize=(7, 5))
  log_rho = np.clip(np.log10(np.maximum(radius, 1e-12)), -0.3, 0.3)
  image = ax.imshow(log_rho, origin="lower", aspect="auto",
                    extent=(*MU_RANGE, *GS_RANGE), cmap="RdBu_r",
                    norm=TwoSlopeNorm(vmin=-0.3, vcenter=0.0, vmax=0.3),
                    interpolation="nearest")
  fig.colorbar(image, ax=ax, label=r"$\log_{10}\rho(A)$ (clipped to $\pm 0.3$)")
  ax.contour(mu, gs, radius, levels=[1.0], colors="magenta", linewidths=3.5)
  line = dict(color="black", linestyle="--", linewidth=1.2)
  ax.axhline(0.0, **line)
  ax.plot(MU_RANGE, [2 + 2 * m for m in MU_RANGE], **line)
  ax.axvline(-1.0, **line)
  ax.axvline(1.0, **line)
  ax.plot([0, 0], [0, 2], color="gold", linewidth=6, solid_capstyle="butt")
  for value, _, colour, style in OPERATING_POINTS:
    ax.axvline(value, color=colour, linestyle=style, linewidth=1.8)
  handles = [
      Line2D([], [], color="magenta", linewidth=3.5,
             label=r"numerical $\rho(A) = 1$"),
      Line2D([], [], label=r"Prop. 1: $\gamma\sigma = 0$, "
             r"$\gamma\sigma = 2 + 2\mu$, $\mu = \pm 1$", **line),
      Line2D([], [], color="gold", linewidth=6,
             label=r"plain SMoE: $\mu = 0$, $\gamma\sigma \in (0, 2)$"),
  ] + [Line2D([], [], color=c, linestyle=s, linewidth=1.8,
              label=f"{label}: " + r"$\gamma\sigma < $" + f"{2 + 2 * v:.2f}")
       for v, label, c, s in OPERATING_POINTS]
  ax.legend(handles=handles, loc="upper left", fontsize=7, framealpha=0.9)
  ax.set_xlim(*MU_RANGE)
  ax.set_ylim(*GS_RANGE)
  ax.set_xlabel(r"momentum $\mu$")
  ax.set_ylabel(r"step $\times$ Jacobian eigenvalue $\gamma\sigma$")
  ax.set_title("MomentumSMoE Proposition 1: stable iff $|\\mu| < 1$, "
               "$0 < \\gamma\\sigma < 2 + 2\\mu$\n(blue: spectral radius "
               "of A < 1; plain SMoE only $0 < \\gamma\\sigma < 2$)",
               fontsize=9)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120, format="png")


def main(argv: Optional[Sequence[str]] = None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=DEFAULT_OUT,
                      help=f"directory for {FIGURE} (default: %(default)s)")
  parser.add_argument("--n-mu", type=int, default=481,
                      help="grid points along mu (481: step 0.005)")
  parser.add_argument("--n-gs", type=int, default=501,
                      help="grid points along gamma sigma (501: step 0.01)")
  args = parser.parse_args(argv)
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    parser.error(f"--out {args.out}: not a directory (--out names the "
                 f"directory {FIGURE} is written into)")
  mu, gs = np.meshgrid(np.linspace(*MU_RANGE, args.n_mu),
                       np.linspace(*GS_RANGE, args.n_gs))
  radius = spectral_radius(mu, gs)
  counts = agreement(radius, analytic_stable(mu, gs))
  n = counts["points"]
  print(f"grid {args.n_mu} mu x {args.n_gs} gamma*sigma = {n} points")
  print(f"numerical (rho < 1) vs Proposition 1 disagree on "
        f"{counts['disagree']} points ({counts['disagree'] / n:.4%}): "
        f"{counts['disagree_near']} within one grid cell of the boundary, "
        f"{counts['disagree_away']} away from it; max |rho - 1| over them "
        f"{counts['max_gap']:.1e}"
        + (" (points on a boundary line, where rho = 1 exactly: rounding "
           "decides)" if counts["max_gap"] < 1e-9 else ""))
  print(f"points within one grid cell of the analytic boundary: "
        f"{counts['near_boundary']} ({counts['near_boundary'] / n:.2%})")
  for value in (0.0,) + tuple(p[0] for p in OPERATING_POINTS):
    low, high = stable_interval(value)
    print(f"mu = {value:<4}: first/last stable gamma*sigma sample (step "
          f"5e-5) {low:.5f} / {high:.5f}, Proposition 1 (0, "
          f"{2 + 2 * value:.2f}), width "
          f"x{(1 + value):.2f} that of plain SMoE")
  path = os.path.join(args.out, FIGURE)
  plot(mu, gs, radius, path)
  print(f"Wrote {path} ({os.path.getsize(path) / 1024:.0f} KB)")
  return path


if __name__ == "__main__":
  main()
