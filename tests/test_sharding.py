"""Expert parallelism on meshes of 8 CPU devices equals one device.

For the meshes (data, expert) = (8, 1), (4, 2) and (1, 8), a subprocess
(`sharded_runs`, 8 fake CPU devices) runs expert choice, SoftMoE,
Symphony, the momentum stream over noisy top-k, a CMoE-carved model and a
Swin-MoE under ACMoE (all on (4, 2); Symphony on (8, 1), plain top-k on
(1, 8): `sharded_runs.MESH_CASES`) on one device and expert-parallel on
the mesh: a training-mode forward (logits, auxiliary
loss, per-layer drop rate, expert usage, expert load, router losses), the
gradients and one train step (params, optimizer state, router state, step
metrics) must agree to 1e-5; the compiled MoE layers must move tokens with
two all-to-alls each and gather no expert weight.
"""

from __future__ import annotations

import functools

import pytest

import sharded_runs

TOL = 1e-5
# The router z-loss (vmoe's `mean(logsumexp(logits)^2)` over all tokens) is
# the one quantity of large magnitude: about 5-17 here, where a float32 ulp
# is 1-2e-6, and its mean over the batch is summed in another order on each
# mesh (per shard, then across shards), so it differs by a few ulps of its
# magnitude. It alone is compared relatively: 1e-6 of its magnitude (~8
# ulps), never less strictly than TOL.
RELATIVE = ("z_loss",)
REL_TOL = 1e-6
CASES = ("expert_choice", "soft_moe", "symphony", "momentum", "carved",
         "swin_moe")


@functools.lru_cache(maxsize=None)
def _reports() -> dict:
  """The subprocess's reports of every mesh, run once per test session."""
  return sharded_runs.result(sharded_runs.start(sharded_runs.MESHES))


def _report(shape: tuple[int, int]) -> dict:
  return _reports()[shape]


def _tolerance(quantity: str, scale: float) -> float:
  if quantity.rsplit("/", 1)[-1] in RELATIVE:
    return max(TOL, REL_TOL * scale)
  return TOL


def _mesh_id(shape):
  return f"data{shape[0]}_expert{shape[1]}"


@pytest.mark.parametrize("shape", sharded_runs.MESHES, ids=_mesh_id)
def test_expert_parallel_matches_one_device(shape):
  """Forward, gradients and a train step: every case, every quantity."""
  report = _report(shape)
  assert sorted(report["cases"]) == sorted(sharded_runs.MESH_CASES[shape])
  assert set(sharded_runs.MESH_CASES[(4, 2)]) == set(CASES)
  failures = []
  for case, result in report["cases"].items():
    for quantity, d in result["diffs"].items():
      tol = _tolerance(quantity, d["scale"])
      if not d["max"] <= tol:  # NaN fails too.
        failures.append(
            f"{case} on mesh {tuple(shape)}: {quantity} differs from one "
            f"device by {d['max']:.3g} at leaf {d['leaf']!r} (magnitude "
            f"{d['scale']:.3g}, tolerance {tol:.3g})")
  assert not failures, "\n".join(failures)


@pytest.mark.parametrize("shape", sharded_runs.MESHES, ids=_mesh_id)
def test_cases_are_not_trivial(shape):
  """What the comparison covers: non-zero logits and gradients, tokens
  dropped by token choice and expert choice, router state that trains."""
  cases = _report(shape)["cases"]
  problems = []
  for case, result in cases.items():
    diffs, ref = result["diffs"], result["reference"]
    for quantity in ("forward/logits", "step/grads"):
      if not diffs[quantity]["scale"] > 0.1:
        problems.append(f"{case}: {quantity} are ~0 "
                        f"({diffs[quantity]['scale']:.3g})")
    if case in ("topk", "expert_choice", "symphony", "momentum", "swin_moe"):
      if not any(v > 0 for v in ref["drop_rate"].values()):
        problems.append(f"{case}: no token dropped ({ref['drop_rate']})")
  for case, leaf in (("symphony", "adjacency"), ("carved", "bias")):
    if case not in cases:
      continue
    if not any(k.endswith(leaf) for k in cases[case]["reference"][
        "collections"]):
      problems.append(f"{case}: no router state {leaf!r} "
                      f"({cases[case]['reference']['collections']})")
    elif not cases[case]["diffs"]["step/collections"]["scale"] > 0:
      problems.append(f"{case}: router state {leaf!r} is all zeros")
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("shape", sharded_runs.MESHES, ids=_mesh_id)
def test_compiled_moe_layers_use_all_to_all(shape):
  """The compiled forward on the mesh: two all-to-alls per MoE layer (over
  an expert axis of size 1 the compiler removes them), no all-gather at
  all (so none of an expert weight: the experts stay split), and the
  trained expert weights keep their split over the expert axis."""
  expert_size = shape[1]
  failures = []
  for case, result in _report(shape)["cases"].items():
    hlo = result["hlo"]
    where = f"{case} on mesh {tuple(shape)}"
    if expert_size > 1 and hlo["all_to_all"] != 2 * hlo["moe_layers"]:
      failures.append(f"{where}: {hlo['all_to_all']} all-to-alls for "
                      f"{hlo['moe_layers']} MoE layers (expected 2 each)")
    if hlo["all_gather"] or hlo["all_gather_of_expert_weights"]:
      failures.append(f"{where}: all-gathers of shapes "
                      f"{hlo['all_gather_shapes']} "
                      f"({hlo['all_gather_of_expert_weights']} of an expert "
                      "weight's shape)")
    if hlo["expert_weight_specs"] != ["('expert',)"]:
      failures.append(f"{where}: expert weights after the step are split "
                      f"{hlo['expert_weight_specs']}, not over 'expert'")
  assert not failures, "\n".join(failures)
