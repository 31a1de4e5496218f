"""Robustness evaluation of a CIFAR-10 V-MoE checkpoint (no training).

    python -m vmoe_ext.main --config=configs/cifar10_tfds.py \\
        --config.data.data_dir=DIR --workdir=runs/c10            # train
    python -m vmoe_ext.main --config=configs/robustness_cifar10.py:runs/c10 \\
        --config.data.data_dir=DIR --workdir=runs/c10_robust     # evaluate

Restores the newest checkpoint of the training workdir given as the arg
(default `./runs/c10`; the model/data sections are `configs/cifar10_tfds.py`'s
and must match that run) and evaluates, on prepared TFDS data under
`data.data_dir` (nothing downloads; prepare `cifar10`, `cifar10_corrupted`
and `svhn_cropped` there, e.g. `tfds build NAME --data_dir=DIR
--file_format=array_record`):

* FGSM, PGD (20 steps, random start) and SPSA (on 200 images) at the usual
  L-inf eps 8/255, and a PGD eps sweep, on 1,000 evenly spaced test images;
* CIFAR-10-C (`cifar10_corrupted`): the 15 ImageNet-C corruptions at
  severities 1..5 on the full 10,000 images, per-corruption accuracy and the
  unnormalised mean corruption error (there is no AlexNet baseline for
  CIFAR-10-C; add "gaussian_blur", "saturate", "spatter", "speckle_noise" to
  `corruptions` for all 19);
* OOD detection of SVHN (`svhn_cropped` test, 26,032 images) against the
  CIFAR-10 test set: AUPR with score -max softmax.
"""

import ml_collections

from vmoe_ext.train.config_files import load_config


def get_config(arg=None):
  config = load_config("cifar10_tfds")
  eps = 8 / 255
  config.robustness = ml_collections.ConfigDict(dict(
      checkpoint_dir=arg or "./runs/c10",
      num_examples=1000,
      attacks=(
          dict(name="fgsm", eps=eps),
          dict(name="pgd", eps=eps, steps=20, step_size=2 / 255,
               random_start=True),
          dict(name="spsa", eps=eps, steps=20, samples=32, num_examples=200),
      ),
      sweep=dict(attack=dict(name="pgd", steps=10, random_start=False),
                 eps=tuple(e / 255 for e in (0, 1, 2, 4, 8, 16))),
      corruptions=None,  # The real CIFAR-10-C below replaces the local suite.
      datasets=dict(
          cifar10_c=dict(kind="corrupted",
                         source=dict(tfds_name="cifar10_corrupted",
                                     split="test")),
          svhn=dict(kind="ood",
                    source=dict(tfds_name="svhn_cropped", split="test")),
      ),
      seed=0,
  ))
  return config
