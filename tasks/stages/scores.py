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
from tasks.data.formatting import load_tokenizer, model_context
from tasks.engines.ray_cluster import Placement
from tasks.engines.vllm_client import resident_engine
from tasks.rewards.judge import JudgeError, Reply, ask_endpoint, judge_columns
from tasks.rewards.loader import source_hash, specs_from_config
from tasks.rewards.scoring import RewardError, joined_errors, prompt_arguments, score_frame
from tasks.rewards.steps import aggregate_steps, step_ends_column
from tasks.stages.common import (
    Computed,
    RunContext,
    load_run,
    run_stage,
    score_frame_worker,
    scratch_file,
    stage_task,
)
from tasks.stages.spec import StageSpec
from tasks.stages.weights import model_fingerprint, tokenizer_fingerprint


@stage_task("scores")
def scores_task(storage_root: str, run_id: str, iteration: int, round_: int, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)

    def compute():
        rollouts = read_stage(ctx.layout, "rollouts", iteration).filter(pl.col("round") == round_)
        prompts = read_stage(ctx.layout, "prompts", iteration)
        turns = (  # multi-turn rollouts: their turns table, for the reward functions that take `turns`
            read_stage(ctx.layout, "turns", iteration).filter(pl.col("round") == round_)
            if "conversation" in rollouts.columns
            else None
        )
        scores = score_frame(
            rollouts, prompts, ctx.cfg.reward, ctx.cfg.rollout.max_tokens, ctx.cfg.data.answer_key, turns
        )
        if any(f.per_step for f in ctx.cfg.reward.functions.values()):
            scores = scores.with_columns(step_ends(ctx, rollouts))
        return Computed(model_and_judges(ctx, scores, rollouts, prompts, f"{iteration:05d}-{round_}"))

    return run_stage(
        ctx,
        iteration,
        part=round_,
        salt=source_hash(specs_from_config(ctx.cfg.reward)),
        inputs={**upstream, **reward_models(ctx.cfg.reward)},
        compute=compute,
    )


def reward_models(reward) -> dict[str, str]:
    """The identities of the models the reward reads (the reward model's; each local judge's, with its tokenizer, whose
    chat template writes the judge's prompts), for a fingerprint."""
    out = {"reward_model": model_fingerprint(reward.model_path)} if reward.kind == "model" else {}
    if reward.process_model:
        out["process_model"] = model_fingerprint(reward.process_model.path)
    for name, judge in reward.judges.items():
        if judge.model_path:
            out[f"judge_{name}"] = model_fingerprint(judge.model_path) + tokenizer_fingerprint(judge.model_path)
    return out


def model_and_judges(
    ctx: RunContext, scores: pl.DataFrame, rollouts: pl.DataFrame, prompts: pl.DataFrame, name: str
) -> pl.DataFrame:
    """The rule scores with the reward model's column (reward.kind=model) and each judge's columns added, weighted
    into `reward` (a judge's errors join `error`)."""
    reward = ctx.cfg.reward
    if reward.kind == "model":
        scores = add_model_score(scores, reward_model_scores(ctx, rollouts, f"rm-score-{name}"), reward.model_weight)
    if reward.process_model:
        scores = add_process_model_scores(ctx, scores, rollouts, f"prm-score-{name}")
    if not reward.judges:
        return scores
    shared = prompt_arguments(prompts, ctx.cfg.data.answer_key)
    for fields in shared.values():  # a judge reads the question, not the policy's chat markup around it
        users = [m["content"] for m in fields["messages"] if m["role"] == "user"]
        fields["prompt"] = users[-1] if fields["chat"] and users else fields["prompt"]
    samples = [
        {**shared[pid], "prompt_id": pid, "sample_idx": k, "response": text}
        for pid, k, text in rollouts.select("prompt_id", "sample_idx", "text").iter_rows()
    ]
    for judge_name, judge in reward.judges.items():
        ask = partial(ask_local_judge, ctx, judge_name, judge, f"judge-{judge_name}-{name}")
        remote = partial(ask_endpoint, judge, name=judge_name)
        cols = judge_columns(judge, judge_name, samples, ask if judge.model_path else remote)
        scores = scores.with_columns(pl.Series(k, v, dtype=_judge_dtype(k)) for k, v in cols.items())
        scores = scores.with_columns(
            (pl.col("reward") + judge.weight * pl.col(f"score_{judge_name}")).alias("reward"),
            joined_errors(["error", f"error_{judge_name}"]).alias("error"),
        )
    return scores


def _judge_dtype(column: str):
    """A judge's column's type (tasks/rewards/judge.py, `columns`)."""
    if column.startswith("judge_truncated_"):
        return pl.Boolean
    return pl.Float64 if column.startswith("score_") else pl.Utf8


def judge_tokenizer(judge: JudgeConfig, name: str):
    """A local judge's tokenizer, with the chat template judge.chat needs (one line naming the judge, else)."""
    tokenizer = load_tokenizer(judge.model_path)
    if judge.chat and not getattr(tokenizer, "chat_template", None):
        raise JudgeError(f"reward.judges.{name}: {judge.model_path} has no chat template (set chat: false)")
    return tokenizer


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


def reward_model_scores(ctx: RunContext, rollouts: pl.DataFrame, name: str) -> pl.Series:
    """The reward model's score of each rollout, on exactly the tokens sampled (prompt, then the response with its
    EOS when it stopped), in batches in a torch worker."""
    data = rollouts.select("prompt_token_ids", pl.col("token_ids").alias("response_token_ids"))
    return score_frame_worker(
        ctx, "rm_score", ctx.cfg.reward.model_path, ctx.cfg.optim.micro_batch_size, data, name, log="rm_score"
    )["score"]


def add_process_model_scores(ctx: RunContext, scores: pl.DataFrame, rollouts: pl.DataFrame, name: str) -> pl.DataFrame:
    """The process reward model's columns: `steps_prm`, its probability that each step (reward.steps) is right, read
    at the step's last token of exactly the tokens sampled; `score_prm`, their step_aggregate, weighted into `reward`;
    and the steps' `step_ends`, when no per_step function has placed them."""
    pm = ctx.cfg.reward.process_model
    ends = scores["step_ends"] if "step_ends" in scores.columns else step_ends(ctx, rollouts)
    data = rollouts.select("prompt_token_ids", pl.col("token_ids").alias("response_token_ids")).with_columns(
        ends.alias("step_ends")
    )
    steps = score_frame_worker(ctx, "prm_score", pm.path, ctx.cfg.optim.micro_batch_size, data, name, log="prm_score")[
        "step_scores"
    ]
    if not steps.explode().drop_nulls().is_finite().all():
        raise RewardError("the process reward model returned a non-finite step score")
    score = pl.Series("score_prm", [aggregate_steps(v, pm.step_aggregate) for v in steps.to_list()], pl.Float64)
    return scores.with_columns(ends.alias("step_ends"), steps.alias("steps_prm"), score).with_columns(
        (pl.col("reward") + pm.weight * pl.col("score_prm")).alias("reward")
    )


def add_model_score(scores: pl.DataFrame, model_scores: pl.Series, weight: float) -> pl.DataFrame:
    """The reward model's column, added (weighted) to the rule reward; a non-finite score is refused."""
    if not model_scores.is_finite().all():
        raise RewardError("the reward model returned a non-finite score")
    return scores.with_columns(model_scores.alias("score_model")).with_columns(
        (pl.col("reward") + weight * pl.col("score_model")).alias("reward")
    )


SPEC = StageSpec(
    "scores",
    reads=("rollouts",),
    also_reads=("prompts", "turns"),  # the rollouts' own prompts and turns
    sections=("reward", "rollout", "data", "optim", "model"),  # model: its tokenizer places process rewards' steps
    scope="round",
    task=scores_task,
    rerunnable=True,  # every round again, from the saved rollouts: a fixed reward function re-scores, no generation
)
