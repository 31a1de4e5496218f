"""Robustness evaluation of a trained default model (no training).

    python -m vmoe_ext.main                                  # trains runs/default
    python -m vmoe_ext.main --config=configs/robustness.py --workdir=runs/robust
    # another training workdir (its config must match the model/data here):
    python -m vmoe_ext.main --config=configs/robustness.py:runs/soft \\
        --workdir=runs/soft_robust

Restores the newest checkpoint of `robustness.checkpoint_dir` (the arg, default
`./runs/default`) and evaluates all 1,000 MNIST-5k test images: FGSM, PGD
(random start, 20 steps) and SPSA (20 iterations) at eps 0.05; a PGD eps sweep;
the 15-type corruption suite at 5 severities. The model/data sections are the
default config's: override them (or use `robustness.checkpoint_dir` with the
config of that run) to evaluate other runs.
"""

from vmoe_ext.train.config_files import load_config


def get_config(arg=None):
  config = load_config("default")
  config.robustness.checkpoint_dir = arg or "./runs/default"
  config.robustness.num_examples = None
  config.robustness.attacks = (
      dict(name="fgsm", eps=0.05),
      dict(name="pgd", eps=0.05, steps=20, step_size=0.0075,
           random_start=True),
      dict(name="spsa", eps=0.05, steps=20, samples=32, num_examples=500),
  )
  config.robustness.sweep = dict(
      attack=dict(name="pgd", steps=10, random_start=False),
      eps=(0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2))
  return config
