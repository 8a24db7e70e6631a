"""Pure algorithm functions and their registries."""

from polyrl.algorithms.advantages import ADVANTAGES
from polyrl.algorithms.kl import kl_estimate, kl_penalty_to_go
from polyrl.algorithms.losses import LOSSES, aggregate

__all__ = ["ADVANTAGES", "LOSSES", "aggregate", "kl_estimate", "kl_penalty_to_go"]
