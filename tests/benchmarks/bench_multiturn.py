"""Prefix reuse across the turns of a multi-turn rollout (`make bench ARGS=multiturn`), on the demo's model.

Each turn of a trajectory is a new vLLM request whose prompt is the whole trajectory so far (token in, token out:
tasks/agents/rollout_loop.py), so without a cache every turn prefills everything again. vLLM's automatic prefix
caching (on in rlpipe's engine) keeps the KV blocks of a prompt's already-seen prefix. Here 32 trajectories play
4 turns of up to 32 sampled tokens, each turn followed by a 48-token observation, on one engine with prefix caching
and one without (one after the other, never side by side); the row compares the seconds of turns 2-4, where the
reuse happens. Both engines replay the same prompts: the later turns' prompts come from the cached engine's outputs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import polars as pl

from schemas.config import load_config
from schemas.requests import GenerateRequest, VLLMSettings
from tasks.agents.turn_tokens import prompt_ids
from tasks.data.formatting import load_tokenizer
from tasks.engines.vllm_client import ResidentEngine
from tests.benchmarks import result_row
from tests.conftest import generation_job

CONFIG = "infra/configs/demo.yaml"
TRAJECTORIES, TURNS, MAX_TOKENS, OBSERVATION = 32, 4, 32, 48


def _write(path: Path, prompts: list[list[int]]) -> str:
    pl.DataFrame(
        {"prompt_id": [f"t{i}" for i in range(len(prompts))], "prompt_token_ids": prompts},
        schema={"prompt_id": pl.Utf8, "prompt_token_ids": pl.List(pl.Int32)},
    ).write_parquet(path)
    return str(path)


def play(model: str, work: Path, caching: bool, replay: list[list[list[int]]] | None) -> tuple[list, list[float]]:
    """(each turn's prompts, each turn's generate seconds). `replay`: the prompts to send (else built from this
    engine's own outputs, the observation a fixed run of ordinary tokens)."""
    tok = load_tokenizer(model)
    observation = tok(" the tool says 42." * 8, add_special_tokens=False)["input_ids"][:OBSERVATION]
    # The opening as the multi-turn loop renders it (the chat template, the model's turn opened).
    opening = [prompt_ids(tok, [{"role": "user", "content": f"What is {i} + {2 * i}?"}]) for i in range(TRAJECTORIES)]
    engine = ResidentEngine(work / f"vllm-{caching}.log")
    settings = VLLMSettings(
        model_path=model, dtype="float32", seed=0, kv_cache_gib=2, gpu_memory_utilization=0.5, prefix_caching=caching
    )
    prompts, turns, seconds = [list(p) for p in opening], [], []
    try:
        warm = generation_job(_write(work / "warm.parquet", [[1, 2, 3]]), work / "warm-out.parquet")
        # the one-off warm-up, out of the timing
        engine.generate(GenerateRequest(model_path=model, jobs=(warm,)), settings)
        for turn in range(TURNS):
            prompts = replay[turn] if replay else prompts
            turns.append(prompts)
            out = work / f"out-{caching}-{turn}.parquet"
            job = generation_job(
                _write(work / f"in-{caching}-{turn}.parquet", prompts), out, max_tokens=MAX_TOKENS, seed=turn
            )
            seconds.append(
                engine.generate(GenerateRequest(model_path=model, jobs=(job,)), settings).jobs[0].generate_seconds
            )
            said = pl.read_parquet(out).sort("prompt_id")["token_ids"].to_list()
            by_id = dict(zip(sorted(f"t{i}" for i in range(len(prompts))), said))
            prompts = [p + by_id[f"t{i}"] + observation for i, p in enumerate(prompts)]
    finally:
        engine.close()
    return turns, seconds


def run() -> list[dict]:
    model = load_config(CONFIG).model.path
    with tempfile.TemporaryDirectory() as work:
        turns, cached = play(model, Path(work), True, None)
        _, uncached = play(model, Path(work), False, turns)
    print(
        f"multiturn: prompt tokens per turn {[sum(map(len, t)) for t in turns]}; seconds per turn, prefix caching "
        f"{[round(s, 2) for s in cached]}, without {[round(s, 2) for s in uncached]}"
    )
    unit = "s for turns 2-4 (cached/uncached)"
    return [result_row("multiturn_prefix_reuse", "no prefix caching", sum(uncached[1:]), sum(cached[1:]), unit)]
