"""Built-in example task for chat models: arithmetic questions in plain English, as chat messages.

A prompt is one user message in one of several phrasings (`What is 7 + 5?`, `Multiply 7 by 5.`, ...); the answer is
the integer. Prompts are distinct (problem, phrasing) pairs, split into train and held-out at random, so a held-out
question is never asked in training in the same words. Subtraction keeps its result non-negative. The optional
demonstrations (`sft.parquet`) answer with the equation alone (`7 × 5 = 35`).

Nothing here judges a response: that is the reward file's job (the demo's is `examples/chat_arithmetic/rewards.py`).
"""

from __future__ import annotations

import random

import polars as pl

from tasks.data.datasets import MESSAGES

SYMBOL = {"+": "+", "-": "-", "*": "×"}
PHRASINGS = {
    "+": ("What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "Calculate {a} + {b}."),
    "-": ("What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}.", "Calculate {a} - {b}."),
    "*": ("What is {a} × {b}?", "What is {a} times {b}?", "Multiply {a} by {b}.", "Calculate {a} × {b}."),
}


def problems(min_operand: int, max_operand: int, operations: str) -> list[tuple[int, str, int, int]]:
    """Every (a, op, b, answer), with a ≥ b for subtraction."""
    out = []
    for op in operations:
        for a in range(min_operand, max_operand + 1):
            for b in range(min_operand, max_operand + 1):
                if op == "-" and a < b:
                    continue
                out.append((a, op, b, a + b if op == "+" else a - b if op == "-" else a * b))
    return out


def make_files(
    min_operand: int, max_operand: int, operations: str, n_train: int | None, n_eval: int, seed: int, sft_demos: int
) -> dict[str, pl.DataFrame]:
    """train and eval prompt files (prompt_id, prompt: chat messages, answer, operation) and sft demonstrations."""
    rows = [
        (a, op, b, ans, text.format(a=a, b=b))
        for a, op, b, ans in problems(min_operand, max_operand, operations)
        for text in PHRASINGS[op]
    ]
    if n_eval >= len(rows):
        raise ValueError(f"task.n_eval ({n_eval}) must be below the {len(rows)} distinct prompts")
    rnd = random.Random(seed)
    rnd.shuffle(rows)
    held_out, train = rows[:n_eval], rows[n_eval:][: n_train or None]

    def frame(part, prefix):
        return pl.DataFrame(
            {
                "prompt_id": [f"{prefix}-{i:06d}" for i in range(len(part))],
                "prompt": [[{"role": "user", "content": text}] for *_, text in part],
                "answer": [str(ans) for _, _, _, ans, _ in part],
                "operation": [op for _, op, _, _, _ in part],
            },
            schema={"prompt_id": pl.Utf8, "prompt": MESSAGES, "answer": pl.Utf8, "operation": pl.Utf8},
        )

    picked = random.Random(seed + 1).choices(train, k=sft_demos)
    sft = frame(picked, "demo").with_columns(
        pl.Series("response", [f"{a} {SYMBOL[op]} {b} = {ans}" for a, op, b, ans, _ in picked], dtype=pl.Utf8)
    )
    return {"train": frame(train, "train"), "eval": frame(held_out, "eval"), "sft": sft.drop("answer", "operation")}
