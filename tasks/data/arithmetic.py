"""The demo's verifiable task: integer arithmetic, generated offline (registered in tasks/data/example_tasks.py).

Train and held-out prompts (prompt_id, prompt, answer) and SFT demonstrations (prompt_id, prompt, response). A prompt
is `37+58=`; the expected response is the integer alone (`95`), followed by EOS. The split is by problem, so
held-out prompts are never seen in SFT or RL.
"""

from __future__ import annotations

import random

import polars as pl


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def all_problems(max_operand: int, operations: str, pad: bool = False) -> list[tuple[str, str]]:
    """Every (prompt, answer). With `pad`, operands are zero-padded to a fixed width (`07+58=`), which puts
    each digit at a fixed offset; answers are always canonical integers."""
    width = len(str(max_operand)) if pad else 0
    return [
        (f"{a:0{width}d}{op}{b:0{width}d}=", str(_apply(a, op, b)))
        for op in operations
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]


def make_splits(
    max_operand: int, operations: str, n_eval: int, seed: int, pad: bool = False
) -> tuple[pl.DataFrame, pl.DataFrame]:
    problems = all_problems(max_operand, operations, pad)
    if n_eval >= len(problems):
        raise ValueError(f"task.n_eval ({n_eval}) must be below the {len(problems)} distinct problems")
    random.Random(seed).shuffle(problems)

    def frame(rows, prefix):
        return pl.DataFrame(
            {
                "prompt_id": [f"{prefix}-{i:06d}" for i in range(len(rows))],
                "prompt": [t for t, _ in rows],
                "answer": [a for _, a in rows],
            },
            schema={"prompt_id": pl.Utf8, "prompt": pl.Utf8, "answer": pl.Utf8},
        )

    return frame(problems[n_eval:], "train"), frame(problems[:n_eval], "eval")


def no_carry_sum(a: int, b: int) -> int:
    """The sum a flawed teacher writes when it forgets every carry: each digit is (a_i + b_i) mod 10."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def flawed_answer(text: str, answer: str, flaw: str) -> str:
    """What a flawed teacher writes instead of `answer` (the same string when the flaw does not apply).

    forget_carry: each digit is (a_i + b_i) mod 10 (additions only).
    """
    if flaw == "forget_carry" and "+" in text:
        a, b = (int(x) for x in text.rstrip("=").split("+"))  # int() accepts zero-padded operands
        return str(no_carry_sum(a, b))
    return answer


def teacher_response(text: str, answer: str, flaw: str, rate: float, rnd: random.Random) -> str:
    """One demonstration: the gold answer, or with probability `rate` the teacher's flawed version of it.
    The draw happens only where the flaw changes the answer, so `rate` is the error rate where it applies."""
    if flaw == "none" or rate <= 0:
        return answer
    wrong = flawed_answer(text, answer, flaw)
    if wrong != answer and rnd.random() < rate:
        return wrong
    return answer


def demonstrations(train: pl.DataFrame, n: int, seed: int, flaw: str = "none", rate: float = 0.0) -> pl.DataFrame:
    """SFT demonstrations for `n` train prompts drawn with replacement, written by the (optionally flawed) teacher."""
    rnd = random.Random(seed)
    idx = rnd.choices(range(train.height), k=n)
    picked = train[idx]
    responses = [teacher_response(t, a, flaw, rate, rnd) for t, a in zip(picked["prompt"], picked["answer"])]
    return pl.DataFrame(
        {"prompt_id": [f"demo-{i:06d}" for i in range(n)], "prompt": picked["prompt"], "response": responses}
    )
