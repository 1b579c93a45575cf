"""Partial rollouts (rollout.partial_tokens): sequences generated a chunk per round and carried between rounds.

Each sampling round the pool of sequences in flight (the `carry` table the round before left, and new groups) gets at
most `partial_tokens` more tokens per unfinished sequence, every sequence its own request from its prompt and its
prefix so far. A sequence ends at EOS or a stop (vLLM's finish reason `stop`) or at rollout.max_tokens. A group whose
every sample has ended leaves the pool as rollouts rows; the rest is this round's `carry` table, which the next round
continues (the next iteration's first round with the weights of the update between). The schedule is fixed by the
config and the data, never by timing: a run is reproducible, and a resumed run continues the same carry table.

Where verl's, AReaL's and slime's partial rollouts differ: they pause unfinished requests when the trainer publishes
weights (whenever that happens); here a round's chunk bounds every sequence, so the carry table is the same whatever
the machine's speed. As in AReaL, the sampler's logprob of every token is the behaviour policy's (`sampler_logprobs`,
per token whatever weights produced it), and each token's policy version is a column (`token_versions`).

The planning steps below are pure (frames in, frames out); `sample`, the rollouts stage's partial mode
(tasks/stages/rollout_modes.py), reads the tables a round continues and returns what the stage writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from schemas.requests import GenerationReply, JobTiming
from schemas.tables import CARRY
from storage import RunLayout, read_stage, stage_part
from tasks.stages.common import RunContext
from tasks.stages.rollout_modes import SampledRound, Sampler, register
from tasks.stages.weights import Weights

# The carry table's columns but its stamps (schemas/tables.py's CARRY, with iteration and round added as it is written).
CARRY_COLUMNS = {k: v for k, v in CARRY.columns.items() if k not in ("iteration", "round")}


def empty_carry() -> pl.DataFrame:
    return pl.DataFrame(schema=CARRY_COLUMNS)


def carry_part(layout: RunLayout, iteration: int, round_: int) -> tuple[Path | None, str]:
    """The file of the carry table round `round_` of `iteration` continues, and its fingerprint (None and "" before the
    first round of the run): this iteration's round before, or the previous iteration's last round."""
    it, index = (iteration, round_ - 1) if round_ else (iteration - 1, None)
    if it < 1:
        return None, ""
    part = stage_part(layout, "carry", it, index)
    if part is None:
        raise FileNotFoundError(f"partial rollouts: the carry table of iteration {it} is not complete")
    return part


def read_carry(path: Path | None) -> pl.DataFrame:
    return empty_carry() if path is None else pl.read_parquet(path).select(*CARRY_COLUMNS)


def carry_before(layout: RunLayout, iteration: int, round_: int) -> tuple[pl.DataFrame, str]:
    """The carry table round `round_` of `iteration` continues (carry_part), read, and its fingerprint."""
    path, fp = carry_part(layout, iteration, round_)
    return read_carry(path), fp


@dataclass(frozen=True)
class RoundPlan:
    pool: pl.DataFrame  # CARRY_COLUMNS: every sequence of the round, carried ones first (their order), then new groups
    requests: pl.DataFrame  # one per unfinished sequence: prompt_id (its row in `pool`), its prefix, seed, limits
    stale_groups: int  # carried groups dropped for their age
    admitted_groups: int


def plan_round(
    carry: pl.DataFrame,
    prompts: pl.DataFrame,
    *,
    iteration: int,
    version: int,
    group_size: int,
    prompts_per_round: int,
    partial_tokens: int,
    max_tokens: int,
    min_tokens: int,
    max_staleness: int,
    taken: pl.Series | None = None,
) -> RoundPlan:
    """The round's pool and its generation requests.

    A carried group whose oldest token is more than `max_staleness` versions before `version` (the weights this
    iteration samples with and its update starts from) is dropped. New groups join while they fit in
    `prompts_per_round` × `group_size` unfinished sequences, from this round's prompts in order, skipping a prompt in
    flight or in `taken` (the groups this iteration's earlier rounds completed): a prompt_id is a group's key within an
    iteration.
    A request continues its sequence's prefix with what is left of its budget, at most `partial_tokens`, with its row
    in the pool as its seed offset (its seed: the round's plus that), so the pool, not the replicas, fixes the
    samples."""
    oldest = carry.explode("token_versions").group_by("prompt_id").agg(pl.col("token_versions").min().alias("oldest"))
    stale = oldest.filter(pl.col("oldest").is_not_null() & (version - pl.col("oldest") > max_staleness))["prompt_id"]
    kept = carry.filter(~pl.col("prompt_id").is_in(stale.implode()))
    # Sequences, not groups, fill the pool: a group waiting for its last sample holds one sequence of the sampler's
    # batch, not group_size of them.
    decoding = int((~kept["ended"]).sum())
    busy = pl.concat([kept["prompt_id"], taken if taken is not None else pl.Series([], dtype=pl.Utf8)])
    room = max(0, (prompts_per_round * group_size - decoding) // group_size)
    fresh = prompts.filter(~pl.col("prompt_id").is_in(busy.implode())).head(room)
    new = (
        fresh.select("prompt_id", "prompt_token_ids")
        .with_columns(
            pl.int_ranges(0, group_size, dtype=pl.Int32).alias("sample_idx"),
            pl.lit(iteration, pl.Int32).alias("prompt_iteration"),
        )
        .explode("sample_idx")
        .with_columns(
            pl.lit([], pl.List(pl.Int32)).alias("token_ids"),
            pl.lit("").alias("text"),
            pl.lit([], pl.List(pl.Float32)).alias("sampler_logprobs"),
            pl.lit([], pl.List(pl.Int32)).alias("token_versions"),
            pl.lit("").alias("finish_reason"),
            pl.lit(False).alias("ended"),
        )
    )
    pool = pl.concat([kept.select(*CARRY_COLUMNS), new.select(*CARRY_COLUMNS).cast(CARRY_COLUMNS)])
    done = pool["token_ids"].list.len()
    requests = (
        pool.with_row_index("row")
        .with_columns(done.cast(pl.Int64).alias("_done"))
        .filter(~pl.col("ended"))
        .select(
            pl.col("row").cast(pl.Utf8).alias("prompt_id"),
            pl.concat_list("prompt_token_ids", "token_ids").alias("prompt_token_ids"),
            pl.col("row").cast(pl.Int64).alias("seed_offset"),  # the request's seed: the round's + its row
            pl.col("prompt_id").alias("group"),  # a group's requests go to one replica (rollouts.deal_by_tokens)
            pl.min_horizontal(pl.lit(partial_tokens), pl.lit(max_tokens) - pl.col("_done")).alias("max_tokens"),
            pl.max_horizontal(pl.lit(0), pl.lit(min_tokens) - pl.col("_done")).alias("min_tokens"),
        )
        .with_columns(pl.min_horizontal("min_tokens", "max_tokens").alias("min_tokens"))
    )
    return RoundPlan(pool, requests, int(stale.len()), int(fresh.height))


def advance(pool: pl.DataFrame, generated: pl.DataFrame, *, version: int, max_tokens: int) -> pl.DataFrame:
    """The pool after the round's generation: each request's tokens, text and logprobs appended to its sequence (by
    its row: the request's prompt_id), its tokens stamped with `version`; a sequence has ended at a `stop` or at
    `max_tokens`, and its finish reason is its last chunk's."""
    out = generated.select(
        pl.col("prompt_id").cast(pl.UInt32).alias("row"),
        pl.col("token_ids").alias("_tokens"),
        pl.col("text").alias("_text"),
        pl.col("sampler_logprobs").alias("_logprobs"),
        pl.col("finish_reason").alias("_finish"),
    )
    merged = pool.with_row_index("row").join(out, on="row", how="left", maintain_order="left")
    grown = merged.with_columns(
        pl.concat_list("token_ids", pl.col("_tokens").fill_null([])).alias("token_ids"),
        (pl.col("text") + pl.col("_text").fill_null("")).alias("text"),
        pl.concat_list("sampler_logprobs", pl.col("_logprobs").fill_null([])).alias("sampler_logprobs"),
        pl.concat_list(
            "token_versions",
            pl.lit(version, pl.Int32).repeat_by(pl.col("_tokens").list.len().fill_null(0)),
        ).alias("token_versions"),
        pl.coalesce("_finish", "finish_reason").alias("finish_reason"),
    )
    return grown.with_columns(
        (pl.col("ended") | (pl.col("finish_reason") == "stop") | (pl.col("token_ids").list.len() >= max_tokens)).alias(
            "ended"
        )
    ).select(*CARRY_COLUMNS)


def split_ended(pool: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(the groups whose every sample has ended, as rollouts rows; the rest, the next carry table)."""
    complete = pool.group_by("prompt_id").agg(pl.col("ended").all().alias("_all"))
    ended = complete.filter("_all")["prompt_id"].implode()
    finished = pool.filter(pl.col("prompt_id").is_in(ended))
    rows = finished.with_columns(
        pl.col("token_ids").list.len().cast(pl.Int32).alias("length"),
        (pl.col("finish_reason") == "length").alias("truncated"),
        pl.col("token_versions").list.min().fill_null(-1).cast(pl.Int32).alias("policy_version"),
    ).drop("ended")
    return rows, pool.filter(~pl.col("prompt_id").is_in(ended))


def surplus_carry(rollouts: pl.DataFrame, batch: pl.DataFrame) -> pl.DataFrame:
    """The groups an iteration's batch left over (`over_target`: they ended after the batch had its target_groups) as
    carry rows whose every sample has ended, in the rollouts' order (rollout.carry_surplus): the next iteration's first
    round passes them on as ended groups, unless the staleness bound drops them first."""
    over = batch.filter(pl.col("filter_reason") == "over_target")["prompt_id"].implode()
    rows = rollouts.filter(pl.col("prompt_id").is_in(over)).with_columns(pl.lit(True).alias("ended"))
    return rows.select(*CARRY_COLUMNS).cast(CARRY_COLUMNS)


def source_prompts(layout: RunLayout, rollouts: pl.DataFrame, prompts: pl.DataFrame, iteration: int) -> pl.DataFrame:
    """The prompts table's rows of the rollouts' groups: this iteration's, and, for groups carried from an earlier
    iteration (partial rollouts), the rows of the iteration that admitted them, one per prompt_id."""
    if "prompt_iteration" not in rollouts.columns:
        return prompts
    older = sorted(set(rollouts["prompt_iteration"].unique().to_list()) - {iteration})
    if not older:
        return prompts
    wanted = rollouts.select(pl.col("prompt_iteration").alias("iteration"), "prompt_id").unique()
    every = pl.concat([prompts, *(read_stage(layout, "prompts", it) for it in older)], how="diagonal_relaxed")
    return every.join(wanted, on=["iteration", "prompt_id"], how="semi").unique("prompt_id", keep="first")


def passes_surplus(rollout, iteration: int, round_: int) -> bool:
    """Whether the round passes on the groups the batch before left over (rollout.carry_surplus): an iteration's first,
    after the first iteration."""
    return bool(rollout.carry_surplus) and round_ == 0 and iteration > 1


def continued(ctx: RunContext, iteration: int, round_: int) -> dict[str, str]:
    """The fingerprints of what a round continues (the mode's `inputs`): the carry table (carry_part) and, when it
    passes the surplus on, the batch before."""
    inputs = {"carry": carry_part(ctx.layout, iteration, round_)[1]}
    if passes_surplus(ctx.cfg.rollout, iteration, round_):
        batch_before = stage_part(ctx.layout, "batch", iteration - 1)
        if batch_before is None:
            raise FileNotFoundError(f"partial rollouts: the batch of iteration {iteration - 1} is not complete")
        inputs["surplus"] = batch_before[1]
    return inputs


# An empty round's (nothing in flight, every prompt of the round taken already): no engine asked.
NO_REPLY = GenerationReply(
    engine_start_seconds=0.0,
    sync_seconds=0.0,
    sync_logprob_gap=None,
    jobs=(JobTiming(generate_seconds=0.0, tokens=0),),
    vllm_version="",
    peak_rss_gib=0.0,
    kv_cache_gib=None,
)


@register("partial", inputs=continued)
def sample(
    *,
    ctx: RunContext,
    prompts: pl.DataFrame,
    policy: Weights,
    iteration: int,
    round_: int,
    seed: int,
    name: str,
    sampler: Sampler,
) -> SampledRound:
    """One round of partial rollouts: the pool's unfinished sequences each get at most rollout.partial_tokens more
    tokens; the ended groups the batch before left over (rollout.carry_surplus) go ahead of the carried sequences.
    The rows are the groups that ended, the second table the next carry; the figures add the round's pool's."""
    r = ctx.cfg.rollout
    surplus = empty_carry()
    if passes_surplus(r, iteration, round_):
        before = iteration - 1
        surplus = surplus_carry(read_stage(ctx.layout, "rollouts", before), read_stage(ctx.layout, "batch", before))
    carry = pl.concat([surplus, carry_before(ctx.layout, iteration, round_)[0]])
    taken = (
        read_stage(ctx.layout, "rollouts", iteration).filter(pl.col("round") < round_)["prompt_id"].unique()
        if round_
        else None
    )
    plan = plan_round(
        carry,
        prompts,
        iteration=iteration,
        version=policy.version,
        group_size=r.group_size,
        prompts_per_round=r.prompts_per_round,
        partial_tokens=r.partial_tokens,
        max_tokens=r.max_tokens,
        min_tokens=r.min_tokens,
        max_staleness=ctx.cfg.rl.max_staleness,
        taken=taken,
    )
    if plan.requests.height:  # n = 1: each sequence is its own request
        generated, reply = sampler.generate(plan.requests, sampler.job(1, seed), name)
    else:
        generated, reply = nothing_generated(plan.requests), NO_REPLY
    rows, left = split_ended(advance(plan.pool, generated, version=policy.version, max_tokens=r.max_tokens))
    # the surplus groups the staleness bound kept (the others are stale_groups) left at once: generation ended none
    kept_surplus = rows.filter(pl.col("prompt_id").is_in(surplus["prompt_id"].implode()))["prompt_id"].n_unique()
    figures = {
        **dataclasses.asdict(reply.jobs[0]),
        "stale_groups": plan.stale_groups,
        "admitted_groups": plan.admitted_groups,
        "surplus_groups": kept_surplus,
        "ended_groups": rows["prompt_id"].n_unique() - kept_surplus,
        "carried_sequences": left.height,
    }
    return SampledRound(rows, reply, figures, tables={"carry": left})


def nothing_generated(requests: pl.DataFrame) -> pl.DataFrame:
    return requests.select("prompt_id").with_columns(
        pl.lit(None, pl.List(pl.Int32)).alias("token_ids"),
        pl.lit(None, pl.Utf8).alias("text"),
        pl.lit(None, pl.List(pl.Float32)).alias("sampler_logprobs"),
        pl.lit(None, pl.Utf8).alias("finish_reason"),
    )
