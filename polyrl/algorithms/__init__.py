"""Pure algorithm functions and their registries."""

from polyrl.algorithms.advantages import ADVANTAGES
from polyrl.algorithms.kl import kl_estimate, kl_penalty_to_go
from polyrl.algorithms.losses import LOSSES, aggregate
from polyrl.algorithms.trust_losses import dppo_loss, sapo_loss

__all__ = ["ADVANTAGES", "LOSSES", "aggregate", "kl_estimate", "kl_penalty_to_go", "dppo_loss", "sapo_loss"]
