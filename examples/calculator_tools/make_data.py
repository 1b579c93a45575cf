"""Two-digit additions asked of a chat model that has a calculator tool (examples/calculator_tools/config.yaml).

Writes data/calculator_tools/{train,eval,sft}.parquet: prompts as chat messages (a system message that describes the
tool and how to call it, then the question) with the sum as the answer, and demonstrations of both halves of a tool
turn: the call, and the answer given the tool's result.

    python examples/calculator_tools/make_data.py
"""

import json
import random
from pathlib import Path

import polars as pl

SYSTEM = (
    "You have a calculator tool. To add two numbers a and b, reply with exactly "
    '<tool_call>{"name": "add", "arguments": {"a": a, "b": b}}</tool_call> and wait for the result. '
    "Then reply with the number alone."
)
PHRASINGS = ("What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "Calculate {a} + {b}.")


def question(a: int, b: int, rnd: random.Random) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rnd.choice(PHRASINGS).format(a=a, b=b)}]


def call(a: int, b: int) -> str:
    return f"<tool_call>{json.dumps({'name': 'add', 'arguments': {'a': a, 'b': b}})}</tool_call>"


def main(out: Path = Path("data/calculator_tools"), n_eval: int = 256, n_sft: int = 256, seed: int = 0) -> None:
    rnd = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rnd.shuffle(pairs)
    held_out, train = pairs[:n_eval], pairs[n_eval:]
    out.mkdir(parents=True, exist_ok=True)
    for name, split in (("train", train), ("eval", held_out)):
        pl.DataFrame(
            {
                "prompt_id": [f"{name}-{i:05d}" for i in range(len(split))],
                "prompt": [question(a, b, rnd) for a, b in split],
                "answer": [str(a + b) for a, b in split],
            }
        ).write_parquet(out / f"{name}.parquet")
    demos = []
    for i, (a, b) in enumerate(train[:n_sft]):
        asked = question(a, b, rnd)
        if i % 2 == 0:  # the call
            demos.append(asked + [{"role": "assistant", "content": call(a, b)}])
        else:  # the answer, given the result
            demos.append(
                asked
                + [
                    {"role": "assistant", "content": call(a, b)},
                    {"role": "tool", "content": str(a + b)},
                    {"role": "assistant", "content": str(a + b)},
                ]
            )
    pl.DataFrame({"prompt_id": [f"sft-{i:05d}" for i in range(len(demos))], "messages": demos}).write_parquet(
        out / "sft.parquet"
    )
    print(f"wrote {len(train)} train, {len(held_out)} eval prompts and {len(demos)} demonstrations to {out}")


if __name__ == "__main__":
    main()
