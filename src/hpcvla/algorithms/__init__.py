"""RL algorithms: PPO pieces (GAE, the decoupled loss, value loss), GRPO's group-relative
advantages, and the chunk / action / token granularity helpers."""

from hpcvla.algorithms.granularity import (GRANULARITIES, expand_like, reduce_units, sum_to,
                                           unit_rewards)
from hpcvla.algorithms.grpo import (GroupAdvantages, episodes_of, first_episode_advantages,
                                    group_advantages, grpo_loss, per_episode)
from hpcvla.algorithms.ppo import decoupled_ppo_loss, gae, normalize_advantages, unit_gae, value_loss

__all__ = ["gae", "unit_gae", "decoupled_ppo_loss", "value_loss", "normalize_advantages",
           "GRANULARITIES", "reduce_units", "expand_like", "sum_to", "unit_rewards",
           "GroupAdvantages", "group_advantages", "episodes_of", "per_episode", "grpo_loss",
           "first_episode_advantages"]
