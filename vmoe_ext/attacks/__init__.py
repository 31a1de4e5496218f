"""Adversarial attacks: FGSM, PGD (Linf, L2), SPSA, and AutoAttack's APGD
(CE, DLR, targeted DLR), FAB-T, Square and their ensemble — pure jitted
functions. The AutoAttack family lives in the modules of the same names
(`vmoe_ext.attacks.apgd.apgd`, `.fab.fab`, `.square.square`,
`.autoattack.autoattack`; by name: `get_attack("apgd")`).

Every attack takes a deterministic `logits_fn(x [B, ...]) -> [B, C]`, clean
images `x` in `[clip_min, clip_max]` and labels `[B]`, and returns `x_adv`
of the same shape, within the eps-ball and the valid range (except PGD's
`vmoe_compatible` mode, which does not clip to the range). The model is only
ever called on `[B, ...]` batches, as the clean evaluation is: capacity-based
MoE routing couples the images of a routing group, so clean and attacked
accuracy must be measured with the same batching. See `base` for the
conventions, each module for its update rule, and `registry` for the
contract a new attack follows (one module plus one line in `ATTACKS`; from
a module of your own, a "package.module:attr" config name or
`register_attack`, docs/extending.md).
"""

from vmoe_ext.attacks.base import cross_entropy, margin_loss
from vmoe_ext.attacks.fast_gradient import fgsm
from vmoe_ext.attacks.gradient_free import spsa, spsa_gradient
from vmoe_ext.attacks.projected_gradient import pgd
from vmoe_ext.attacks.registry import (ATTACKS, CALL_ARGS, AttackSpec,
                                       as_attack_spec, get_attack,
                                       make_attack, register_attack)

__all__ = ["ATTACKS", "AttackSpec", "CALL_ARGS", "as_attack_spec",
           "cross_entropy", "fgsm", "get_attack", "make_attack",
           "margin_loss", "pgd", "register_attack", "spsa", "spsa_gradient"]
