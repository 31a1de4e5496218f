"""The pre-training memory check of the attacks' gradient step
(`vmoe_ext.app.memory`): free memory read from the device or the host, the
estimate against the memory of the step's own buffers, and a run refused
before anything is written when the step does not fit."""

from __future__ import annotations

import os
import types

import jax
import pytest

from vmoe_ext.app import main as main_module
from vmoe_ext.app import memory
from vmoe_ext.app.train import setup
from vmoe_ext.errors import ConfigError
from vmoe_ext.train.config_files import load_config


def test_host_available_bytes_reads_meminfo(tmp_path):
  path = tmp_path / "meminfo"
  path.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\n"
                  "MemAvailable:   23212232 kB\n")
  assert memory.host_available_bytes(str(path)) == 23212232 * 1024
  # No such file: the free physical pages instead.
  want = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  got = memory.host_available_bytes(str(tmp_path / "missing"))
  assert abs(got - want) < 0.5 * want


def test_device_free_bytes_of_an_accelerator_and_of_the_cpu(monkeypatch):
  gpu = types.SimpleNamespace(memory_stats=lambda: {
      "bytes_limit": 80 * 2**30, "bytes_in_use": 5 * 2**30})
  assert memory.device_free_bytes(gpu) == 75 * 2**30
  monkeypatch.setattr(memory, "host_available_bytes", lambda: 8 * 2**30)
  monkeypatch.setattr(jax, "local_device_count", lambda: 4)
  cpu = types.SimpleNamespace(memory_stats=lambda: None)
  assert memory.device_free_bytes(cpu) == 2 * 2**30  # Shared by 4.
  monkeypatch.setattr(memory, "host_available_bytes", lambda: None)
  assert memory.device_free_bytes(cpu) is None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  config = load_config("tiny")
  return setup(config, str(tmp_path_factory.mktemp("memory") / "run"))


def test_the_estimate_covers_the_steps_buffers_and_grows_with_the_batch(
    tiny_run):
  """At least the input batch, its gradient (the output) and the
  activations kept for the backward pass (every block's `[B, T, D]` input,
  float32), and about twice as much for twice the batch."""
  run = tiny_run
  b = run.config.data.eval_batch_size
  h, w, c = run.eval_image_shape()[1:]
  model = run.config.model
  tokens = (h // model.patch_size[0]) * (w // model.patch_size[1]) + 1
  floor = 4 * (2 * b * h * w * c
               + model.num_layers * b * tokens * model.hidden_size)
  need = memory.attack_step_bytes(run)
  assert need >= floor
  run.config.data.eval_batch_size = 2 * b
  try:
    twice = memory.attack_step_bytes(run)
  finally:
    run.config.data.eval_batch_size = b
  assert 1.5 * need <= twice <= 2.5 * need


def test_a_step_that_does_not_fit_is_refused_before_training(tmp_path,
                                                             monkeypatch):
  """The binary's run: a config error naming data.eval_batch_size, the
  estimate and a batch that fits, and nothing trained or recorded."""
  # 256 KiB free: the tiny step needs ~0.7 MiB.
  monkeypatch.setattr(memory, "device_free_bytes", lambda device: 2**18)
  workdir = tmp_path / "run"
  with pytest.raises(ConfigError) as info:
    main_module.run(load_config("tiny"), str(workdir))
  assert info.value.field == "data.eval_batch_size"
  message = str(info.value)
  assert "GiB on each device" in message and "before training" in message
  fits = int(message.split("lower it to about ")[1].split()[0])
  assert 1 <= fits < 64
  # No step trained, no checkpoint, no record (the run's checkpoint
  # directory exists, empty).
  assert [f for f in os.listdir(workdir) if f != "checkpoints"] == []
  assert os.listdir(workdir / "checkpoints") == []
  # Without attacks nothing is compiled or refused.
  config = load_config("tiny")
  config.robustness.attacks = ()
  run = types.SimpleNamespace(config=config)
  memory.check_attack_memory(run)  # No AttributeError: returned first.


def test_the_step_is_compiled_at_the_size_the_model_sees(tmp_path):
  """`data.image_size` resizes the in-memory images: the step (and the
  evaluation's shape check) take the resized shape, not the dataset's
  native 8 x 8 (patch 6 divides 12, not 8)."""
  config = load_config("tiny")
  config.data.image_size = 12
  config.model.patch_size = (6, 6)
  run = setup(config, str(tmp_path / "run"))
  assert run.eval_image_shape()[1:] == (12, 12, 1)
  assert memory.attack_step_bytes(run) > 0
