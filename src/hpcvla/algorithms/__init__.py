"""RL algorithms; currently the PPO pieces used by the asynchronous learner."""

from hpcvla.algorithms.ppo import decoupled_ppo_loss, gae, normalize_advantages, value_loss

__all__ = ["gae", "decoupled_ppo_loss", "value_loss", "normalize_advantages"]
