"""Reward for the calculator example: the model's last turn must end on the sum."""

import re

INTEGER = re.compile(r"-?\d+")


def correct(response: str, ground_truth: str) -> float:
    """1 when the last integer of the final answer is the sum."""
    found = INTEGER.findall(response)
    return float(bool(found) and int(found[-1]) == int(ground_truth))
