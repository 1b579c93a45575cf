"""A multi-turn task for the end-to-end test (tests/test_agent_e2e.py), in the tiny arithmetic model's alphabet: after
each answer the environment poses the next sum (each operand one more), three in all. Each answer earns the share of
the true sum's digits it gets right in place (partial credit: a group's samples rarely all score the same, which
dynamic filtering would drop)."""

from __future__ import annotations


class MoreSums:
    def __init__(self, sums: int = 3):
        self.sums = sums

    def reset(self, row: dict) -> list[dict]:
        self.a, self.b = (int(x) for x in row["text"].rstrip("=").split("+"))
        self.posed = 1
        return [{"role": "user", "content": row["text"]}]

    def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]:
        said, truth = messages[-1]["content"].strip(), str(self.a + self.b)
        credit = sum(x == y for x, y in zip(said, truth)) / len(truth) if len(said) == len(truth) else 0.0
        if self.posed == self.sums:
            return [], credit, True
        self.a, self.b, self.posed = self.a + 1, self.b + 1, self.posed + 1
        return [{"role": "user", "content": f"{self.a}+{self.b}="}], credit, False


def solved(env_reward=None, **_) -> float:
    """The episode's credit (0 without an environment)."""
    return float(env_reward or 0.0)


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)
