"""A router's persistent state on 8 data-parallel CPU devices vs one device.

`one_vs_eight_devices(router)` runs, in a subprocess with 8 fake CPU devices
(`XLA_FLAGS` must be set before jax is imported), a 4-block V-MoE with the
router config `router` in blocks 1 and 3 for two state-updating forward
passes on 16 images: once on one device, once with the batch split over a
`data` mesh axis (`state_axis_name="data"`). Returns both `[logits, *router
state leaves]` as nested lists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

from fake_devices import fake_devices_env

_SHARDED = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from vmoe_ext.models import build_model
    assert jax.device_count() == 8
    def model(axis):
      return build_model(dict(
          name="vit_moe", num_classes=3, patch_size=(4, 4), hidden_size=8,
          num_layers=4, num_heads=2, mlp_dim=8, state_axis_name=axis,
          moe=dict(layers=(1, 3), num_experts=4, capacity_factor=2.0,
                   group_size=5, router=json.loads(sys.argv[1]))))
    images = jax.random.uniform(jax.random.key(0), (16, 8, 8, 1))
    variables = model(None).init(jax.random.key(1), images)
    variables["params"] = jax.tree.map(  # A non-zero head.
        lambda v: v + 0.3 * jax.random.normal(jax.random.key(2), v.shape),
        variables["params"])
    def run(m, x, v):
      out = {}
      for _ in range(2):
        (logits, _), new = m.apply(v, x, update_state=True,
                                   mutable=["router_state"])
        v = {**v, **new}
      return logits, v["router_state"]
    one = jax.jit(lambda x, v: run(model(None), x, v))(images, variables)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    many = jax.jit(jax.shard_map(
        lambda x, v: run(model("data"), x, v), mesh=mesh,
        in_specs=(P("data"), P()), out_specs=(P("data"), P())))(
            images, variables)
    leaves = lambda t: [np.asarray(a).tolist() for a in jax.tree.leaves(t)]
    print(json.dumps({"one": leaves(one), "many": leaves(many)}))
""")

def one_vs_eight_devices(router: dict[str, Any]) -> tuple[list, list]:
  env = fake_devices_env(8)
  out = subprocess.run([sys.executable, "-c", _SHARDED, json.dumps(router)],
                       env=env, capture_output=True, text=True, timeout=300,
                       check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  return result["one"], result["many"]
