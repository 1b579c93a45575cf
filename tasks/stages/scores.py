"""Stage `scores`: rule rewards (and, with reward.kind=model, a trained reward model; with reward.judges, LLM judges)
for every rollout of one round.

Reads `rollouts` and `prompts` (the prompt, ground truth and dataset columns the functions receive) of the round;
writes `scores`: `score_<fn>` and `error_<fn>` per reward function, `score_model` for the reward model,
`score_<judge>`, `error_<judge>`, `judge_prompt_<judge>`, `judge_text_<judge>` (cut to its max_reply_chars) and
`judge_truncated_<judge>` per judge, the weighted `reward` and a combined `error`. The fingerprint includes a hash of
the reward functions' source (and the reward model's and local judges' identities), so fixing a reward function and
rerunning re-scores."""

from __future__ import annotations

import hashlib
from functools import partial

import polars as pl

from schemas.config import MAX_JUDGE_LOGPROBS, JudgeConfig
from schemas.requests import GenerateRequest, GenerationJob, VLLMSettings
from storage import StageOutput, read_stage
from storage.model_ids import model_fingerprint, tokenizer_fingerprint
from tasks.data.formatting import load_tokenizer, model_context
from tasks.engines.ray_cluster import Placement
from tasks.engines.vllm_client import resident_engine
from tasks.rewards.judge import Reply, judge_tokenizer
from tasks.rewards.loader import source_hash, specs_from_config
from tasks.rewards.scoring import RewardError
from tasks.rewards.sources import Calls, add_all, identities, unscored
from tasks.rewards.steps import step_ends_column
from tasks.stages.common import (
    Computed,
    RunContext,
    load_run,
    run_stage,
    score_frame_worker,
    scratch_file,
    stage_task,
)
from tasks.stages.partial_rollouts import source_prompts
from tasks.stages.spec import StageSpec


@stage_task("scores")
def scores_task(storage_root: str, run_id: str, iteration: int, round_: int, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)

    def compute():
        rollouts = read_stage(ctx.layout, "rollouts", iteration).filter(pl.col("round") == round_)
        # the prompts of groups carried from an earlier iteration (partial rollouts) are in that iteration's table
        prompts = source_prompts(ctx.layout, rollouts, read_stage(ctx.layout, "prompts", iteration), iteration)
        turns = (  # multi-turn rollouts: their turns table, for the reward functions that take `turns`
            read_stage(ctx.layout, "turns", iteration).filter(pl.col("round") == round_)
            if "conversation" in rollouts.columns
            else None
        )
        scores = scored(ctx, rollouts, prompts, f"{iteration:05d}-{round_}", turns)
        require_scored(ctx.cfg.reward, scores, where=f"iteration {iteration} round {round_}")
        return Computed(scores)

    return run_stage(
        ctx,
        iteration,
        part=round_,
        salt=source_hash(specs_from_config(ctx.cfg.reward)),
        inputs={**upstream, **reward_models(ctx.cfg.reward)},
        compute=compute,
    )


def require_scored(reward, scores: pl.DataFrame, *, where: str) -> None:
    """reward.stop_when_unscored: stop the run in one line, before the round's scores are written, when a weighted
    source scored none of its samples (tasks/rewards/sources.py, `unscored`). Its zeros are no signal: a run that
    went on trained on them, with one warning line (a judge's) among the progress (issue 75)."""
    if not reward.stop_when_unscored:
        return
    for key, first in unscored(reward, scores):
        first = (first.splitlines() or [""])[0][:200]
        raise RewardError(
            f"scores: {key} scored none of the {scores.height} samples of {where}, each got an error (the first: "
            f"{first}); fix it, or set reward.stop_when_unscored=false to train on its zeros"
        )


def reward_models(reward) -> dict[str, str]:
    """The identities of the models the reward reads (the reward-source family's: the reward model's, the PRM's, each
    local judge's with its tokenizer, whose chat template writes the judge's prompts), for a fingerprint."""
    return identities(reward, model_fingerprint, tokenizer_fingerprint)


def scored(
    ctx: RunContext, rollouts: pl.DataFrame, prompts: pl.DataFrame, name: str, turns: pl.DataFrame | None = None
) -> pl.DataFrame:
    """The rollouts scored by every source of the run's reward (tasks/rewards/sources.py), with the engines they ask
    for handed in; `name` tells this call's worker files and engine logs apart."""
    worker = partial(score_frame_worker, ctx, micro_batch_size=ctx.cfg.optim.micro_batch_size)
    reward = ctx.cfg.reward
    calls = Calls(
        rollouts=rollouts,
        prompts=prompts,
        turns=turns,
        max_tokens=ctx.cfg.rollout.max_tokens,
        answer_key=ctx.cfg.data.answer_key,
        step_ends=partial(step_ends, ctx, rollouts),
        reward_model=lambda data: worker(
            kind="rm_score", model_path=reward.model_path, frame=data, name=f"rm-score-{name}", log="rm_score"
        )["score"],
        process_model=lambda data: worker(
            kind="prm_score",
            model_path=reward.process_model.path,
            frame=data,
            name=f"prm-score-{name}",
            log="prm_score",
        )["step_scores"],
        local_judge=partial(ask_local_judge, ctx),
    )
    return add_all(ctx.cfg.reward, calls, name)


def ask_local_judge(ctx: RunContext, name: str, judge: JudgeConfig, log_name: str, prompts: list[str]) -> list[Reply]:
    """The judge's prompts answered by a resident vLLM engine of the judge's model (started at the first call, its
    weights never synced), as one batch: the prompts through the judge's chat template (judge.chat), or as plain text
    with the tokenizer's special tokens. A prompt too long for the judge's context with its reply is that sample's
    error, unasked."""
    tokenizer = judge_tokenizer(judge, name)
    if judge.chat:
        system = [{"role": "system", "content": judge.system}] if judge.system else []
        ids = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [*system, {"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
            for p in prompts
        ]
    else:
        ids = [tokenizer.encode(p) for p in prompts]
    context = model_context(judge.model_path)
    fits = [i for i, x in enumerate(ids) if not context or len(x) + judge.max_tokens <= context]
    replies = [
        Reply(
            error=f"the judge prompt's {len(x)} tokens and max_tokens {judge.max_tokens} exceed its context {context}"
        )
        for x in ids
    ]
    if not fits:
        return replies
    frame = pl.DataFrame(
        {"prompt_id": [f"j{i}" for i in fits], "prompt_token_ids": [ids[i] for i in fits]},
        schema={"prompt_id": pl.Utf8, "prompt_token_ids": pl.List(pl.Int32)},
    )
    inp, out = scratch_file(ctx, f"{log_name}.prompts.parquet"), scratch_file(ctx, f"{log_name}.out.parquet")
    frame.write_parquet(inp)
    settings = VLLMSettings(
        model_path=judge.model_path,
        dtype=judge.dtype,
        seed=ctx.cfg.seed,
        kv_cache_gib=judge.kv_cache_gib,
        gpu_memory_utilization=judge.gpu_memory_utilization,
        max_logprobs=MAX_JUDGE_LOGPROBS,
    )
    # Judges that run the same model with the same settings share one engine (named, and logged, by the first).
    e = ctx.cfg.engines
    engine = resident_engine(
        f"{ctx.layout.run_id}-judge-{hashlib.sha256(repr(settings).encode()).hexdigest()[:12]}",
        ctx.layout.log_path(f"judge-{name}"),
        Placement.from_config(e, e.rollout_bundle),
    )
    job = GenerationJob(
        prompts_path=str(inp),
        out_path=str(out),
        n=1,
        temperature=judge.temperature,
        top_p=1.0,
        max_tokens=judge.max_tokens,
        seed=ctx.cfg.seed,
        stop=(),
        stop_token_ids=(),
        # vLLM's engine dies asking for more candidates than the vocabulary holds
        top_logprobs=min(judge.top_logprobs, len(tokenizer)) if judge.score == "logprobs" else 0,
    )
    engine.generate(GenerateRequest(model_path=judge.model_path, jobs=(job,)), settings)
    answers = pl.read_parquet(out)
    inp.unlink()
    out.unlink()
    tops = answers["first_top"].to_list() if "first_top" in answers.columns else [[]] * answers.height
    for pid, text, top in zip(answers["prompt_id"], answers["text"], tops):
        replies[int(pid[1:])] = Reply(text, tuple((c["token"], c["logprob"]) for c in top))
    return replies


def step_ends(ctx: RunContext, rollouts: pl.DataFrame) -> pl.Series:
    """Process rewards: the response token on which each step ends (reward.steps), found with the policy's tokenizer
    on the tokens sampled."""
    tokenizer = load_tokenizer(ctx.cfg.model.path)
    ends = step_ends_column(
        rollouts["text"].to_list(),
        rollouts["token_ids"].to_list(),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        ctx.cfg.reward.steps,
    )
    return pl.Series("step_ends", ends, dtype=pl.List(pl.Int32))


SPEC = StageSpec(
    "scores",
    reads=("rollouts",),
    also_reads=("prompts", "turns"),  # the rollouts' own prompts and turns
    sections=("reward", "rollout", "data", "optim", "model"),  # model: its tokenizer places process rewards' steps
    scope="round",
    task=scores_task,
    rerunnable=True,  # every round again, from the saved rollouts: a fixed reward function re-scores, no generation
)
