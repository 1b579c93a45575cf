"""Reward functions: the built-ins, users' functions by reference, the worker pool, and the scorer.

from tasks.rewards import BUILTIN_REWARDS
BUILTIN_REWARDS.get("accuracy")(response="95.0", ground_truth="95")   # 1.0
"""

from tasks.rewards.builtin import BUILTIN_REWARDS

__all__ = ["BUILTIN_REWARDS"]
