"""Multi-process jobs on one machine: two CPU processes of the binary
(`scripts/launch_local.py`), `jax.distributed` over localhost, gloo
collectives, one shared workdir.

  * the global batch every process assembles from its rows holds the full
    batch in order (process p's rows are global rows [p*B/P, (p+1)*B/P));
  * a 2-process run of a few steps with the experts split over the two
    processes (training, evaluation, checkpoints, the routing analysis and
    an FGSM + corruption evaluation) writes the same `metrics.jsonl` and the
    same checkpoints as one process with the same two devices; only process
    0 prints and writes the report;
  * a workdir in use by another run stops both processes with exit 2;
  * the launcher passes the arguments on, and one failing process ends the
    job with its status.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fake_devices import without_device_count

from vmoe_ext.reporting.writers import TIMING_METRICS, read_metrics
from vmoe_ext.train.workdir import WorkdirLock

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
LAUNCHER = os.path.join(ROOT, "scripts", "launch_local.py")
ENV = {**os.environ, "CI": "1", "JAX_PLATFORMS": "cpu"}
# The launcher sets each process's device count; the suite's other XLA flags
# (fast compilation) are kept.
ENV["XLA_FLAGS"] = without_device_count(ENV.get("XLA_FLAGS", ""))

_spec = importlib.util.spec_from_file_location("launch_local", LAUNCHER)
launch_local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch_local)


def documented_command() -> list[str]:
  """The two-process command docs/sharding.md prints, as words."""
  text = open(os.path.join(ROOT, "docs", "sharding.md")).read()
  block = re.search(r"```bash\n(python scripts/launch_local\.py[^`]*)```",
                    text).group(1)
  words = shlex.split(block.replace("\\\n", " "))
  return [w for w in words if not w.startswith("[")]  # Optional flags.


# The documented command's binary arguments (configs/tiny.py: a tiny V-MoE
# on digits; mesh (-1, 2): with 2 devices (1, 2), the 2 experts split over
# the expert axis, which spans the two processes: all-to-alls between them,
# each saves its expert's shard), with 4 steps (a log line, an evaluation and
# a checkpoint every 2) and the attacks but no sweep or corruptions after
# training. G = 64 * 5 / 10 evaluation groups split over 2 devices.
_WORDS = documented_command()
assert _WORDS[:3] == ["python", "scripts/launch_local.py",
                      "--num_processes=2"], _WORDS
assert _WORDS[3:5] == ["--", "--config=configs/tiny.py"], _WORDS
RUN_ARGS = (*(w for w in _WORDS[4:] if not w.startswith("--workdir=")),
            "--config.train.total_steps=4", "--config.optimizer.warmup_steps=1",
            "--config.train.log_every=2", "--config.train.eval_every=2",
            "--config.train.checkpoint_every=2",
            "--config.robustness.sweep=None",
            "--config.robustness.corruptions=None")


def launch(*args, num_processes=2, timeout=300, **kw):
  return subprocess.run(
      [sys.executable, LAUNCHER, f"--num_processes={num_processes}",
       *(f"--{k}={v}" for k, v in kw.items()), "--", *args],
      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


_ROWS = textwrap.dedent("""
    import sys
    import numpy as np
    from vmoe_ext.sharding import multihost
    multihost.initialize(f"localhost:{sys.argv[1]}", 2, int(sys.argv[2]))
    import jax
    from vmoe_ext.sharding.partitioning import Partitioning
    assert jax.process_count() == 2 and jax.device_count() == 4
    part = Partitioning.from_config({"shape": (2, 2)})
    full = {"image": np.arange(8 * 3, dtype=np.float32).reshape(8, 3),
            "label": np.arange(8, dtype=np.int32)}
    batch = part.global_batch(multihost.process_rows(full))
    for key, value in batch.items():
      assert value.shape == full[key].shape, (key, value.shape)
      for shard in value.addressable_shards:  # Rows where they belong.
        np.testing.assert_array_equal(np.asarray(shard.data),
                                      full[key][shard.index])
    whole = jax.jit(lambda b: b, out_shardings=part.replicated)(batch)
    for key in full:
      np.testing.assert_array_equal(np.asarray(whole[key]), full[key])
    image = part.global_from_full(full["image"])
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda x: x, out_shardings=part.replicated)(image)),
        full["image"])
    assert multihost.agree(f"p{jax.process_index()}") == "p0"
    assert multihost.agree(None) is None
    assert multihost.is_main_process() == (jax.process_index() == 0)
    multihost.sync("rows checked")
    print("ok", jax.process_index())
""")


def test_process_rows_land_at_their_global_rows():
  port = launch_local.free_port()
  env = launch_local.process_env(2, ENV)
  procs = [subprocess.Popen([sys.executable, "-c", _ROWS, str(port), str(i)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=120))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i}:\n{err[-3000:]}"
    assert f"ok {i}" in out


def _state(workdir: str, step: int):
  """A checkpoint's saved state as numpy arrays (no target, no devices)."""
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree
  return checkpointer.restore(path, restore_args=jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))


def test_two_processes_train_like_one_process_with_their_devices(tmp_path):
  """docs/sharding.md's two-process command as printed (fewer steps, see
  RUN_ARGS) against one process with two devices: the same global mesh
  (1, 2), run side by side."""
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  single = subprocess.Popen(
      [sys.executable, "-m", "vmoe_ext.main", *RUN_ARGS, f"--workdir={one}"],
      cwd=ROOT, env=launch_local.process_env(2, ENV), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  try:
    job = launch(*RUN_ARGS, f"--workdir={two}",
                 log_dir=str(tmp_path / "logs"))
    out, err = single.communicate(timeout=300)
  finally:
    if single.poll() is None:
      single.kill()
  assert single.returncode == 0, err[-3000:]
  assert job.returncode == 0, job.stderr[-3000:]
  # Only process 0 printed progress.
  assert "train step 4/4" in job.stderr
  other = open(tmp_path / "logs" / "process_1.log").read()
  assert "train step" not in other and "routing:" not in other
  # The report (in the shared workdir) is printed once, by process 0.
  assert job.stdout.count("# Run report") == 1
  assert "# Run report" not in other
  records = read_metrics(two)
  assert [(r["split"], r["step"]) for r in records] == [
      ("train", 2), ("test", 2), ("train", 4), ("test", 4), ("routing", 4),
      ("adversarial/fgsm", 4), ("adversarial/pgd", 4),
      ("adversarial/spsa", 4)]
  for a, b in zip(read_metrics(one), records, strict=True):
    assert a.keys() == b.keys(), (a["split"], a.keys() ^ b.keys())
    for key in a:
      if key in TIMING_METRICS:
        continue
      if isinstance(a[key], (str, bool)):
        assert a[key] == b[key], key
      else:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{a['split']} {a['step']}: {key}")
  assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["2", "4"]
  for step in (2, 4):
    x, y = _state(one, step), _state(two, step)
    assert jax.tree.structure(x) == jax.tree.structure(y)
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(x),
                            jax.tree.leaves(y)):
      np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6,
                                 err_msg=jax.tree_util.keystr(path))
  files = set(os.listdir(two))
  assert {"report.md", "metrics.jsonl", "expert_maps.png",
          "training_curves.png"} <= files
  assert not any(name.startswith("vmoe_ext_plots_") for name in files)


def test_a_workdir_in_use_stops_every_process(tmp_path):
  workdir = str(tmp_path / "busy")
  with WorkdirLock(workdir):
    job = launch(*RUN_ARGS, f"--workdir={workdir}",
                 log_dir=str(tmp_path / "logs"), grace=60)
  assert job.returncode == 2, job.stderr[-3000:]
  assert "config error: --workdir:" in job.stderr
  assert "is in use by another run" in job.stderr
  other = open(tmp_path / "logs" / "process_1.log").read()
  assert "is in use by another run" in other  # Told by process 0.
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))


def test_launcher_arguments():
  ours, rest = launch_local.parse_args(
      ["--num_processes=3", "--devices_per_process", "4", "--workdir=w",
       "--", "--num_processes=9", "--config.seed=1"])
  assert (ours.num_processes, ours.devices_per_process) == (3, 4)
  assert rest == ["--workdir=w", "--num_processes=9", "--config.seed=1"]
  commands = launch_local.commands(2, rest, 1234, python="py")
  assert commands[1] == ["py", "-m", "vmoe_ext.main", *rest,
                         "--coordinator_address=localhost:1234",
                         "--num_processes=2", "--process_id=1"]
  env = launch_local.process_env(
      4, {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"})
  assert env["XLA_FLAGS"] == ("--xla_foo=1 "
                              "--xla_force_host_platform_device_count=4")
  assert env["JAX_PLATFORMS"] == "cpu"


def test_one_failing_process_ends_the_job(tmp_path):
  # Process 1 fails; process 0 would wait forever (for a collective).
  (tmp_path / "job.py").write_text(textwrap.dedent("""
      import sys, time
      if "--process_id=1" in sys.argv:
        print("process 1 fails", flush=True)
        sys.exit(3)
      time.sleep(120)
  """))
  env = {**ENV, "PYTHONPATH": str(tmp_path)}
  job = subprocess.run(
      [sys.executable, LAUNCHER, "--module=job", "--grace=0.5", "--", "-x"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  assert job.returncode == 3, job.stderr
  assert "process 1 exited with 3" in job.stderr
  assert "process 1 fails" in job.stderr  # The end of its log.

