"""`configs/tiny.py` with a short after-training evaluation (FGSM, one
corruption at one severity), for the end-to-end tests of the binary."""

from vmoe_ext.train.config_files import load_config


def get_config(arg=None):
  del arg
  config = load_config("tiny")
  config.robustness.attacks = (dict(name="fgsm", eps=0.1),)
  config.robustness.sweep = None
  config.robustness.corruptions = dict(names=("contrast",), severities=(1,))
  return config
