"""The `carve` config section and the V-MoE config a carving produces.

    carve = dict(
        checkpoint_dir="runs/vit_dense",  # a dense ViT's training workdir
        num_experts=8,         # E, shared included ("E8")
        num_shared=1,          # N_s ("S1")
        num_activated=1,       # routed experts per token ("A1")
        every=1,               # carved blocks: layers / every / last, as moe
        method="cmoe",         # "cmoe" | "random" (LLaMA-MoE's split)
        ...)

`CarveSpec.check(model)` validates the section against the dense model
config before anything is read or compiled; `carved_model_config` is the
`vit_moe` model config of the result, which the evaluation, robustness and
fine-tuning configs use as they are (`configs/carve.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

from vmoe_ext.carving.layer import check_activation_markers, check_sizes
from vmoe_ext.carving.grouping import DISTANCES
from vmoe_ext.config.schema import renamed_scope
from vmoe_ext.errors import require
from vmoe_ext.models.placement import resolve_moe_layers
from vmoe_ext.moe.experts import ACTIVATIONS

METHODS = ("cmoe", "random")
CARVABLE_ACTIVATIONS = ("gelu", "gelu_exact", "relu", "swiglu")


@dataclasses.dataclass(frozen=True)
class CarveSpec:
  """The `carve` section.

  Attributes:
    checkpoint_dir: the dense ViT's training workdir (its newest checkpoint
      is carved).
    num_experts: E, the total number of experts, shared ones included; the
      MLP's hidden width must be divisible by it (`m = H / E`).
    num_shared: N_s shared experts (always active), `0 <= N_s < E`.
    num_activated: routed experts per token, `1 <= A <= E - N_s`.
    layers / every / last: the carved blocks, as `model.moe`'s placement
      (default every block).
    method: "cmoe" (the paper) or "random" (random split, fresh router).
    activation_markers: K_a, the units each token marks (`1..H`).
    distance: "l2" (the paper) or "l1" (the authors' code).
    iterations: balanced K-means rounds (the authors: 1).
    normalize: normalised profiling; None: for gated activations only.
    num_calibration: training images to calibrate on (all their tokens).
    bias_update_rate: gamma of the balancing bias in the carved router.
    capacity_factor: of the carved layers; None: dropless
      (`(E - N_s) / A`, so `C = S`: every expert can take every token).
    batch_size: images per calibration forward pass.
    seed: calibration sample and random split.
  """
  checkpoint_dir: Optional[str] = None
  num_experts: int = 8
  num_shared: int = 1
  num_activated: int = 1
  layers: Optional[Sequence[int]] = None
  every: Optional[int] = 1
  last: Optional[int] = None
  method: str = "cmoe"
  activation_markers: int = 10
  distance: str = "l2"
  iterations: int = 1
  normalize: Optional[bool] = None
  num_calibration: int = 256
  bias_update_rate: float = 1e-3
  capacity_factor: Optional[float] = None
  batch_size: int = 256
  seed: int = 0

  @classmethod
  def from_config(cls, carve: Any) -> "CarveSpec":
    value = carve.to_dict() if hasattr(carve, "to_dict") else dict(carve)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    require(not unknown, f"carve.{unknown[0] if unknown else ''}",
            f"unknown field; known fields: {sorted(known)}")
    if value.get("layers") is not None:
      value["layers"] = tuple(value["layers"])
      value.setdefault("every", None)
      if value["every"] == 1:
        value["every"] = None
    return cls(**value)

  @property
  def num_routed(self) -> int:
    return self.num_experts - self.num_shared

  def blocks(self, num_layers: int) -> tuple[int, ...]:
    """The carved block indices (errors name `carve.*`)."""
    with renamed_scope("moe", "carve"):
      return resolve_moe_layers(num_layers, self.layers, self.every,
                                self.last)

  def check(self, model: Mapping[str, Any]) -> None:
    """Everything about this section and the dense model config `model`."""
    require(model.get("name") == "vit", "model.name",
            f"carving reads a dense ViT ('vit', configs/vit_dense.py:plain); "
            f"got {model.get('name')!r}")
    activation = model.get("mlp_activation", "gelu")
    require(activation in CARVABLE_ACTIVATIONS, "model.mlp_activation",
            f"carving knows the activations {CARVABLE_ACTIVATIONS}, not "
            f"{activation!r} (the model's: {ACTIVATIONS})")
    stream = dict(model.get("stream") or {"name": "plain"})
    require(stream.get("name", "plain") == "plain", "model.stream",
            "carving needs the plain residual stream: a carved block's MoE "
            "would run through the stream the dense MLP did not")
    require(self.checkpoint_dir, "carve.checkpoint_dir",
            "required: the workdir of a dense ViT training run")
    self.check_options(int(model.get("mlp_dim", 0)))
    self.blocks(int(model.get("num_layers", 0)))

  def check_options(self, hidden: int,
                    hidden_field: str = "model.mlp_dim") -> None:
    """The fields that depend only on the MLP's hidden width H (called
    `hidden_field` in the messages): sizes, ranges, names."""
    check_sizes(hidden, self.num_experts, self.num_shared, hidden_field)
    require(isinstance(self.num_activated, int)
            and 1 <= self.num_activated <= self.num_routed,
            "carve.num_activated",
            f"must be an integer in 1..{self.num_routed} (the routed experts: "
            f"carve.num_experts - carve.num_shared), got "
            f"{self.num_activated!r}")
    require(self.method in METHODS, "carve.method",
            f"must be one of {METHODS}, got {self.method!r}")
    check_activation_markers(self.activation_markers, hidden, hidden_field)
    require(self.distance in DISTANCES, "carve.distance",
            f"must be one of {DISTANCES}, got {self.distance!r}")
    require(isinstance(self.iterations, int) and self.iterations >= 1,
            "carve.iterations", f"must be an integer >= 1, got "
            f"{self.iterations!r}")
    require(isinstance(self.num_calibration, int)
            and self.num_calibration >= 1, "carve.num_calibration",
            f"must be an integer >= 1 (calibration images), got "
            f"{self.num_calibration!r}")
    require(self.bias_update_rate >= 0, "carve.bias_update_rate",
            f"must be >= 0, got {self.bias_update_rate!r}")
    require(self.capacity_factor is None or self.capacity_factor > 0,
            "carve.capacity_factor", f"must be > 0 or None (dropless), got "
            f"{self.capacity_factor!r}")
    require(isinstance(self.batch_size, int) and self.batch_size >= 1,
            "carve.batch_size", f"must be an integer >= 1, got "
            f"{self.batch_size!r}")

  def name(self) -> str:
    """`S{shared}A{activated}E{total}`, the paper's notation."""
    return f"S{self.num_shared}A{self.num_activated}E{self.num_experts}"


def carved_model_config(model: Mapping[str, Any], spec: CarveSpec
                        ) -> dict[str, Any]:
  """The `vit_moe` model config of the dense `model` carved by `spec`."""
  model = {k: (dict(v) if isinstance(v, Mapping) else v)
           for k, v in dict(model).items()}
  model.update(name="vit_moe", moe=carved_moe_config(
      spec, spec.blocks(model["num_layers"]), model["mlp_dim"],
      model.get("mlp_activation", "gelu")))
  return model


def carved_moe_config(spec: CarveSpec, blocks: Sequence[int], hidden: int,
                      activation: str) -> dict[str, Any]:
  """The `moe` dict of MLPs of hidden width `hidden` carved by `spec` at
  `blocks` (any backbone's)."""
  if spec.method == "cmoe":
    router = dict(name="cmoe", num_selected=spec.num_activated,
                  activation=activation,
                  bias_update_rate=spec.bias_update_rate)
  else:  # LLaMA-MoE: a fresh noisy top-k gate, softmax over the top K.
    router = dict(name="noisy_topk", num_selected=spec.num_activated,
                  renormalize_gates=True)
  capacity = spec.capacity_factor
  if capacity is None:
    capacity = spec.num_routed / spec.num_activated
  return dict(layers=tuple(blocks), num_experts=spec.num_routed,
              hidden_size=hidden // spec.num_experts,
              shared_experts=spec.num_shared, output_bias="once",
              capacity_factor=float(capacity), group_size=None,
              router=router)
