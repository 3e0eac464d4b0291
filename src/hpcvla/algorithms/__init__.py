"""RL algorithms: PPO pieces (GAE, the decoupled loss, value loss), GRPO's group-relative
advantages, the chunk / action / token granularity helpers, and the learner's objective built
from them (objective.py: a micro-batch's advantages once, then the loss); off-policy: SAC's
losses (sac.py), the replay buffer (replay.py), segments cut into transitions
(transitions.py) and a sampled batch's loss (off_policy.py)."""

from hpcvla.algorithms.granularity import GRANULARITIES, expand_like, reduce_units, sum_to
from hpcvla.algorithms.grpo import (GroupAdvantages, episodes_of, first_episode_advantages,
                                    group_advantages, grpo_loss, per_episode)
from hpcvla.algorithms.ppo import decoupled_ppo_loss, gae, normalize_advantages, value_loss

__all__ = ["gae", "decoupled_ppo_loss", "value_loss", "normalize_advantages",
           "GRANULARITIES", "reduce_units", "expand_like", "sum_to",
           "GroupAdvantages", "group_advantages", "episodes_of", "per_episode", "grpo_loss",
           "first_episode_advantages"]
