"""A multi-turn task for the end-to-end test (tests/test_agent_e2e.py), in the tiny arithmetic model's alphabet: after
each answer the environment poses the next sum (each operand one more), three in all; 1 per right answer."""

from __future__ import annotations


class MoreSums:
    def __init__(self, sums: int = 3):
        self.sums = sums

    def reset(self, row: dict) -> list[dict]:
        self.a, self.b = (int(x) for x in row["text"].rstrip("=").split("+"))
        self.posed = 1
        return [{"role": "user", "content": row["text"]}]

    def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]:
        right = messages[-1]["content"].strip() == str(self.a + self.b)
        if self.posed == self.sums:
            return [], float(right), True
        self.a, self.b, self.posed = self.a + 1, self.b + 1, self.posed + 1
        return [{"role": "user", "content": f"{self.a}+{self.b}="}], float(right), False


def solved(env_reward=None, **_) -> float:
    """The right answers of the episode (0 for a single-turn eval, which has no environment)."""
    return float(env_reward or 0.0)
