"""Partial rollouts against waiting for the longest response (`make bench ARGS=partial`), on the long-response
workload (infra/configs/long_reasoning.yaml: SmolLM2-135M-Instruct asked to reason step by step, answers of up to 512
tokens), one resident vLLM engine, the same prompts, side by side in one process:

- whole: rounds of 8 prompts × 8 samples, each generated to its end (EOS or 512 tokens), as a rollouts stage does
  without rollout.partial_tokens; run before and after the partial side, its seconds averaged;
- partial: the rollouts stage's planning (tasks/stages/partial_rollouts.py) with partial_tokens 128: each round every
  sequence in flight gets at most 128 tokens, ended groups leave, new prompts keep 8 groups in flight; run until as
  many groups have ended as the whole side generated.

Generated tokens/s counts every token each side's generation produced (the partial side's unfinished sequences'
included: they are continued, never generated again) over the generation wall time (engine start excluded from both).
The row also reports the ended responses' mean and 95th-percentile lengths, per side. A second row bounds what
any scheme that keeps the batch full can gain here: the engine's tokens/s with 64 sequences decoding at once against
8 (128 tokens each, every sequence forced to the end: min_tokens).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import polars as pl

from schemas.requests import GenerateRequest, VLLMSettings
from tasks.engines.vllm_client import ResidentEngine
from tasks.stages.partial_rollouts import advance, empty_carry, plan_round, split_ended
from tests.benchmarks import result_row
from tests.conftest import generation_job

MODEL = Path("models/smollm2-135m-instruct")
SYSTEM = "Think it through step by step, showing your work, then end with the final answer."  # long_reasoning.yaml's
GROUPS, GROUP_SIZE, MAX_TOKENS, CHUNK, WHOLE_ROUNDS = 8, 8, 512, 128, 2


def prompt_frame(tokenizer, n: int) -> pl.DataFrame:
    from tasks.data.chat_arithmetic import PHRASINGS, problems

    rows = problems(0, 30, "+-*")[::37][:n]  # spread over the three operations
    ids = []
    for k, (a, op, b, _) in enumerate(rows):
        question = PHRASINGS[op][k % 4].format(a=a, b=b)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        ids.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    return pl.DataFrame(
        {"prompt_id": [f"p{k}" for k in range(len(ids))], "prompt_token_ids": ids},
        schema={"prompt_id": pl.Utf8, "prompt_token_ids": pl.List(pl.Int32)},
    )


def lengths(frame: pl.DataFrame) -> dict:
    n = frame["token_ids"].list.len()
    return {"mean": float(n.mean()), "p95": float(n.quantile(0.95, "nearest")), "n": frame.height}


def whole(engine, settings, prompts: pl.DataFrame, work: Path) -> dict:
    tokens, seconds, ended = 0, 0.0, []
    for r in range(WHOLE_ROUNDS):
        inp, out = work / f"whole{r}.parquet", work / f"whole-out{r}.parquet"
        prompts.slice(r * GROUPS, GROUPS).write_parquet(inp)
        job = generation_job(inp, out, n=GROUP_SIZE, max_tokens=MAX_TOKENS, seed=1000 * r)
        timing = engine.generate(GenerateRequest(model_path=str(MODEL), jobs=(job,)), settings).jobs[0]
        tokens, seconds = tokens + timing.tokens, seconds + timing.generate_seconds
        ended.append(pl.read_parquet(out))
    return {"tokens": tokens, "seconds": seconds, "groups": WHOLE_ROUNDS * GROUPS, **lengths(pl.concat(ended))}


def partial(engine, settings, prompts: pl.DataFrame, work: Path, target_groups: int) -> dict:
    carry, cursor, tokens, seconds, rounds, ended = empty_carry(), 0, 0, 0.0, 0, []
    while sum(f["prompt_id"].n_unique() for f in ended) < target_groups:
        plan = plan_round(
            carry,
            prompts.slice(cursor, GROUPS),
            iteration=1,
            version=0,
            group_size=GROUP_SIZE,
            prompts_per_round=GROUPS,
            partial_tokens=CHUNK,
            max_tokens=MAX_TOKENS,
            min_tokens=0,
            max_staleness=0,
        )
        cursor += plan.admitted_groups
        inp, out = work / f"partial{rounds}.parquet", work / f"partial-out{rounds}.parquet"
        plan.requests.write_parquet(inp)
        job = generation_job(inp, out, n=1, max_tokens=MAX_TOKENS, seed=1000 * rounds)
        timing = engine.generate(GenerateRequest(model_path=str(MODEL), jobs=(job,)), settings).jobs[0]
        tokens, seconds = tokens + timing.tokens, seconds + timing.generate_seconds
        rows, carry = split_ended(advance(plan.pool, pl.read_parquet(out), version=0, max_tokens=MAX_TOKENS))
        ended.append(rows)
        rounds += 1
    done = pl.concat(ended)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "groups": done["prompt_id"].n_unique(),
        "rounds": rounds,
        "in_flight": carry.height,
        **lengths(done),
    }


def batch_rate(engine, settings, prompts: pl.DataFrame, work: Path, sequences: int) -> float:
    """Tokens/s with `sequences` sequences (8 a prompt) decoding 128 tokens each, none ending early."""
    inp, out = work / f"rate{sequences}.parquet", work / f"rate-out{sequences}.parquet"
    prompts.head(sequences // GROUP_SIZE).write_parquet(inp)
    job = generation_job(inp, out, n=GROUP_SIZE, max_tokens=CHUNK, min_tokens=CHUNK, seed=7)
    timing = engine.generate(GenerateRequest(model_path=str(MODEL), jobs=(job,)), settings).jobs[0]
    return timing.tokens / timing.generate_seconds


def run() -> list[dict]:
    from transformers import AutoTokenizer

    prompts = prompt_frame(AutoTokenizer.from_pretrained(MODEL), 64)
    settings = VLLMSettings(model_path=str(MODEL), dtype="float32", seed=0, kv_cache_gib=2, gpu_memory_utilization=0.5)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine = ResidentEngine(work / "vllm.log")
        try:
            warm = work / "warm.parquet"
            prompts.head(2).write_parquet(warm)
            engine.generate(
                GenerateRequest(model_path=str(MODEL), jobs=(generation_job(warm, work / "w.parquet", n=2),)), settings
            )
            # whole, partial, whole again: this machine's speed drifts by tens of percent over minutes, and the
            # baseline is the mean of the runs either side (the same seeds: the same tokens, other seconds)
            t0 = time.perf_counter()
            base = whole(engine, settings, prompts, work)
            mid = time.perf_counter()
            ours = partial(engine, settings, prompts, work, base["groups"])
            end = time.perf_counter()
            again = whole(engine, settings, prompts, work)
            print(f"partial_rollouts whole, again: {again['tokens'] / again['seconds']:.1f} tokens/s")
            base["seconds"] = (base["seconds"] + again["seconds"]) / 2
            small, full = (batch_rate(engine, settings, prompts, work, n) for n in (GROUP_SIZE, GROUPS * GROUP_SIZE))
        finally:
            engine.close()
    for name, side, wall in (("whole", base, mid - t0), ("partial", ours, end - mid)):
        print(
            f"partial_rollouts {name}: {side['tokens']} tokens in {side['seconds']:.1f}s of generation "
            f"({wall:.1f}s wall) = {side['tokens'] / side['seconds']:.1f} tokens/s; {side['groups']} groups ended, "
            f"responses mean {side['mean']:.0f} p95 {side['p95']:.0f} tokens over {side['n']}"
            + (f"; {side['rounds']} rounds, {side['in_flight']} sequences still in flight" if "rounds" in side else "")
        )
    return [
        result_row(
            "partial_rollout_tokens",
            f"whole responses (mean {base['mean']:.0f}, p95 {base['p95']:.0f} tokens)",
            base["tokens"] / base["seconds"],
            ours["tokens"] / ours["seconds"],
            "generated tokens/s",
        ),
        result_row("rollout_batch_64_vs_8", "8 sequences decoding", small, full, "generated tokens/s"),
    ]
