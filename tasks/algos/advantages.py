"""Advantage estimators as Polars expressions over the stage tables (docs/algorithms.md); GAE's sequential scan runs
compiled over the token lists' flat buffers (tasks.algos.token_scan). Pure: no I/O.

Input: one row per response with prompt_id, sample_idx, reward (Float64) and length (Int32); estimators
that need token data also read the list columns old_logprobs and ref_logprobs (KL in the reward) and
values (GAE), and action_mask where a multi-turn rollout has one (GAE skips observation tokens). Output: the
same rows plus `advantage` (per sequence), `token_advantages` and `returns`
(list<float32>, one value per response token).

Edge rules (tested):
- a single-sample group has no spread, so its advantage is 0;
- a group whose rewards are all equal has r − mean = 0 exactly, so its advantage is 0 (whatever ε_adv is),
  except under dcpo, where the prompt's history can still give it a small weight, and under
  reinforce_pp_baseline, whose whitening over the batch's tokens shifts every advantage by the batch mean;
- for gae, `advantage` is the first response token's advantage (the credit of the whole response).

Over 400 lines as the estimators' registry: each is a short pure function beside the others, so that a new one
touches this file alone (docs/architecture.md, How to extend).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import polars as pl

from schemas.errors import UserError
from schemas.tables import PROMPT_STATS
from tasks.algos.kl import kl_expr
from tasks.algos.token_lists import flat_lists, from_flat, offsets_of
from tasks.registry import Registry

KEY = "prompt_id"
TOKEN_LISTS = pl.List(pl.Float32)


@dataclass(frozen=True)
class AdvantageSettings:
    eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 0.95
    kl_beta: float = 0.0  # > 0 only when the KL penalty is placed in the reward
    kl_estimator: str = "k1"
    pass_k: int = 1  # passk's k
    correct_at: float = 1.0  # passk: a response is correct when its reward is at least this
    # gdpo: the reward's components, (column of `scores`, weight), each normalised within its group before the sum
    components: tuple[tuple[str, float], ...] = ()
    # grpo_process: the process rewards' step-score lists (steps_<name>, weight), and the other parts of the reward
    # (score_<name> of the outcome functions, score_model), which count on the last step
    step_parts: tuple[tuple[str, float], ...] = ()
    outcome_parts: tuple[tuple[str, float], ...] = ()


Estimator = Callable[[pl.DataFrame, AdvantageSettings, "pl.DataFrame | None"], pl.DataFrame]


@dataclass(frozen=True)
class EstimatorNeeds:
    needs_critic: bool = False  # reads the critic's values per token
    keeps_prompt_state: bool = False  # reads and writes the prompt_stats history
    needs_components: bool = False  # reads each reward component's column (AdvantageSettings.components)
    needs_teacher: bool = False  # reads the teacher's logprobs (advantage.teacher_path)
    needs_steps: bool = False  # reads the process rewards' step scores and step ends (AdvantageSettings.step_parts)
    needs_k: bool = False  # reads advantage.pass_k: groups must hold at least k responses


ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator", EstimatorNeeds)
register = ADVANTAGE_ESTIMATORS.register


# ---- Group statistics ------------------------------------------------------------------------------------


GROUP_STATS = ("_g_mean", "_g_std", "_g_equal", "_g_n")


def _group_aggregations() -> list[pl.Expr]:
    r = pl.col("reward")
    equal = r.max() == r.min()
    return [
        r.mean().alias("_g_mean"),
        pl.when(equal).then(0.0).otherwise(r.std(ddof=1)).fill_null(0.0).alias("_g_std"),
        equal.alias("_g_equal"),
        pl.len().cast(pl.Float64).alias("_g_n"),
    ]


def with_group_stats(df: pl.DataFrame) -> pl.DataFrame:
    """df plus its group's mean, std, all-equal flag and size on every row (the GROUP_STATS columns).

    One group_by and a join rather than `.over(KEY)` windows: each window re-hashes the string key, and at
    10^6 responses that made GRPO 7× slower (make bench, advantages_group_1e6)."""
    stats = df.group_by(KEY).agg(_group_aggregations())
    return df.join(stats, on=KEY, how="left", maintain_order="left")


def centered() -> pl.Expr:
    """r − mean_g r, exactly 0 for a group whose rewards are all equal (float means are not exact).
    Reads the with_group_stats columns."""
    return pl.when(pl.col("_g_equal")).then(0.0).otherwise(pl.col("reward") - pl.col("_g_mean"))


def group_std() -> pl.Expr:
    """Unbiased std of the group's rewards; exactly 0 for all-equal or single-sample groups."""
    return pl.col("_g_std")


def _sequence_advantages(
    df: pl.DataFrame, s: AdvantageSettings, advantage: pl.Expr, whiten_tokens: bool = False
) -> pl.DataFrame:
    """A per-response advantage from the group statistics, then onto the tokens."""
    out = with_group_stats(df).with_columns(advantage.alias("advantage")).drop(GROUP_STATS)
    return to_tokens(out, s, whiten_tokens=whiten_tokens)


def _finite(expr: pl.Expr) -> pl.Expr:
    return expr.fill_null(0.0).fill_nan(0.0)


# ---- Token-level helpers (long format: one row per response token) ---------------------------------------


def explode_tokens(df: pl.DataFrame, lists: list[str], keep: tuple[str, ...] = ()) -> pl.DataFrame:
    """One row per response token: the `lists` columns exploded, the `keep` columns repeated, plus `_seq`
    (row of df), `_t` (position) and `_T` (response length)."""
    # Positions from the list lengths, exploded alongside: no window over `_seq` (2× faster at 5·10^6 tokens).
    n = pl.col(lists[0]).list.len()
    return df.select(
        pl.int_range(pl.len(), dtype=pl.UInt32).alias("_seq"),
        *keep,
        *lists,
        pl.int_ranges(0, n, dtype=pl.Int32).alias("_t"),
        n.cast(pl.Int32).alias("_T"),
    ).explode([*lists, "_t"])


def implode_tokens(df: pl.DataFrame, long: pl.DataFrame, **token_cols: pl.Expr) -> pl.DataFrame:
    """Gather per-token columns back into lists on df's rows (responses with no tokens get empty lists)."""
    lists = long.group_by("_seq", maintain_order=True).agg(**token_cols)
    indexed = df.with_row_index("_seq")
    out = indexed.join(lists, on="_seq", how="left", maintain_order="left").drop("_seq")
    return out.with_columns([pl.col(c).fill_null([]).cast(TOKEN_LISTS) for c in token_cols])


def whiten(expr: pl.Expr, eps: float) -> pl.Expr:
    """(x − mean)/(std + ε) over every response token of the batch (std unbiased)."""
    return (expr - expr.mean()) / (expr.std(ddof=1).fill_null(0.0) + eps)


def to_tokens(df: pl.DataFrame, s: AdvantageSettings, whiten_tokens: bool = False) -> pl.DataFrame:
    """Sequence advantages onto every response token.

    With the KL penalty in the reward (s.kl_beta > 0) each token also gets the penalty's reward-to-go,
    −β·Σ_{s≥t} kl_s (REINFORCE++); with `whiten_tokens` the result is whitened over the batch's tokens.
    Without a critic the returns equal the advantages.
    """
    if s.kl_beta == 0 and not whiten_tokens:  # one flat buffer serves both columns (4× repeat_by at 10^6 rows)
        offsets = offsets_of(df["length"])
        flat = np.repeat(df["advantage"].to_numpy().astype(np.float32), np.diff(offsets))
        return df.with_columns(from_flat("token_advantages", flat, offsets), from_flat("returns", flat, offsets))
    if s.kl_beta:
        long = explode_tokens(df, ["old_logprobs", "ref_logprobs"], keep=("advantage",))
        penalty = (-s.kl_beta * kl_expr(s.kl_estimator)).alias("_pen")
        long = long.with_columns(penalty).with_columns(
            (pl.col("advantage") + pl.col("_pen").cum_sum(reverse=True).over("_seq")).alias("_a")
        )
    else:
        long = explode_tokens(df.with_columns(pl.col("advantage").repeat_by(pl.col("length")).alias("_a")), ["_a"])
    a = whiten(pl.col("_a"), s.eps) if whiten_tokens else pl.col("_a")
    long = long.with_columns(a.alias("_a"))
    return implode_tokens(df, long, token_advantages=pl.col("_a"), returns=pl.col("_a"))


# ---- Sequence-level estimators ----------------------------------------------------------------------------


@register("grpo")
def grpo(df: pl.DataFrame, s: AdvantageSettings, history=None) -> pl.DataFrame:
    """A_i = (r_i − mean_g r) / (std_g r + ε)."""
    return _sequence_advantages(df, s, _finite(centered() / (group_std() + s.eps)))


@register("drgrpo")
def drgrpo(df: pl.DataFrame, s: AdvantageSettings, history=None) -> pl.DataFrame:
    """A_i = r_i − mean_g r: no std scaling, so easy and hard prompts are not up-weighted (Dr.GRPO)."""
    return _sequence_advantages(df, s, centered())


@register("lite_ppo")
def lite_ppo(df: pl.DataFrame, s: AdvantageSettings, history=None) -> pl.DataFrame:
    """A_i = (r_i − mean_g r) / (std over the whole batch of r + ε) (group mean, batch std)."""
    batch_std = pl.col("reward").std(ddof=1).fill_null(0.0)
    return _sequence_advantages(df, s, _finite(centered() / (batch_std + s.eps)))


@register("rloo")
def rloo(df: pl.DataFrame, s: AdvantageSettings, history=None) -> pl.DataFrame:
    """A_i = r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − mean_g r); 0 for a single sample."""
    g = pl.col("_g_n")
    return _sequence_advantages(df, s, pl.when(g > 1).then(centered() * g / (g - 1)).otherwise(0.0))


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(df: pl.DataFrame, s: AdvantageSettings, history=None) -> pl.DataFrame:
    """A_i = r_i − mean_g r on every token (plus the KL reward-to-go), then whitened over the batch's tokens."""
    return _sequence_advantages(df, s, centered(), whiten_tokens=True)


# ---- Pass@k training, GDPO ------------------------------------------------------------------------------


def passk_advantages(n: int, c: int, k: int, eps: float) -> tuple[float, float]:
    """Pass@k training's analytic advantages (Chen et al. 2025, 2508.10751) of a correct and of an incorrect response
    in a group of n with c correct: the group's pass@k reward mean ρ = 1 − C(n−c, k)/C(n, k), σ = sqrt(ρ(1 − ρ)),
    A_pos = (1 − ρ)/(σ + ε), A_neg = (1 − ρ − C(n−c−1, k−1)/C(n−1, k−1))/(σ + ε). Both are 0 when every k-subset
    passes or none does (c = n, c = 0, n − c < k): exactly 0. k = 1 is GRPO's advantage with the population std."""
    from math import comb, sqrt

    rho = 1.0 - comb(n - c, k) / comb(n, k)
    sigma = sqrt(max(rho * (1.0 - rho), 0.0))
    if sigma == 0.0:  # every k-subset passes, or none does: no signal (exactly 0, as GRPO's equal-reward groups)
        return 0.0, 0.0
    neg = 1.0 - rho - (comb(n - c - 1, k - 1) / comb(n - 1, k - 1) if n - c >= 1 else 0.0)
    return (1.0 - rho) / (sigma + eps), neg / (sigma + eps)


@register("passk", needs_k=True)
def passk(df: pl.DataFrame, s: AdvantageSettings, history=None) -> pl.DataFrame:
    """Pass@k training: each response's advantage is its share of the group's pass@k (`passk_advantages`), correct
    meaning reward ≥ advantage.correct_at; computed once per distinct (group size, correct count)."""
    correct = (pl.col("reward") >= s.correct_at).cast(pl.Int64)
    groups = df.group_by(KEY).agg(pl.len().alias("_n"), correct.sum().alias("_c"))
    small = groups.filter(pl.col("_n") < s.pass_k).head(1)
    if small.height:
        raise AdvantageInputError(
            f"advantages: passk with advantage.pass_k={s.pass_k} needs groups of at least k responses; prompt "
            f"{small[KEY][0]!r} has {small['_n'][0]} (rollout.group_size)"
        )
    pairs = groups.select("_n", "_c").unique()
    values = [passk_advantages(n, c, s.pass_k, s.eps) for n, c in pairs.iter_rows()]
    table = pairs.with_columns(
        pl.Series("_pos", [v[0] for v in values], pl.Float64), pl.Series("_neg", [v[1] for v in values], pl.Float64)
    )
    out = df.join(groups.join(table, on=["_n", "_c"]), on=KEY, how="left", maintain_order="left")
    advantage = pl.when(correct == 1).then(pl.col("_pos")).otherwise(pl.col("_neg"))
    return to_tokens(out.with_columns(advantage.alias("advantage")).drop("_n", "_c", "_pos", "_neg"), s)


@register("gdpo", needs_components=True)
def gdpo(df: pl.DataFrame, s: AdvantageSettings, history=None) -> pl.DataFrame:
    """GDPO (Group reward-Decoupled normalization Policy Optimization, NVIDIA 2026, NVlabs/GDPO): each reward
    component is normalised within its group, (s_k − mean_g s_k)/(std_g s_k + ε_adv) (0 where the group's s_k are all
    equal), the normalised components are summed with the reward's weights, and the sum is normalised over the batch's
    responses, (x − mean)/(std + ε_adv). Summing first (GRPO) lets the component with the largest spread drown the
    others. As TRL's `multi_objective_aggregation="normalize_then_sum"`."""
    if not s.components:
        raise AdvantageInputError("advantages: gdpo needs the reward's components, and the run's reward has none")
    parts = []
    for column, weight in s.components:
        x = pl.col(column)
        equal = x.max().over(KEY) == x.min().over(KEY)
        std = x.std(ddof=1).over(KEY).fill_null(0.0)
        z = pl.when(equal).then(0.0).otherwise((x - x.mean().over(KEY)) / (std + s.eps))
        parts.append(weight * _finite(z))
    total = pl.sum_horizontal(parts)
    batch_std = total.std(ddof=1).fill_null(0.0)
    return to_tokens(df.with_columns(_finite((total - total.mean()) / (batch_std + s.eps)).alias("advantage")), s)


# ---- Process rewards: GRPO with process supervision ---------------------------------------------------------


@register("grpo_process", needs_steps=True)
def grpo_process(df: pl.DataFrame, s: AdvantageSettings, history=None) -> pl.DataFrame:
    """GRPO with process supervision (Shao et al. 2024, DeepSeekMath, 2402.03300, §4.1.3): step j of response i has
    the reward r_i^j = Σ_f w_f·s_f,i^j over the process rewards (plus the outcome parts' weighted score on its last
    step); every step reward of the group is normalised by the mean and std of all of them,
    r̃ = (r − mean(R))/(std(R) + ε_adv); a token's advantage is the sum of the normalised rewards of the steps that
    end at or after it, A_i,t = Σ_{end(j) ≥ t} r̃_i^j. `advantage` is the first token's (the whole response's credit).
    Inputs: `step_ends` (each step's last response token) and the step_parts' lists, one value per step; a sample
    whose process reward failed (a null list) has step scores 0."""
    ends, step_offsets = flat_lists(df["step_ends"])
    n_steps = np.diff(step_offsets)
    rewards = np.zeros(len(ends))
    for column, weight in s.step_parts:
        zeros = pl.col("step_ends").list.eval(pl.element().cast(pl.Float64) * 0.0)
        filled = df.select(pl.when(pl.col(column).is_null()).then(zeros).otherwise(pl.col(column)).alias(column))
        values, offsets = flat_lists(filled[column])
        if not np.array_equal(offsets, step_offsets):
            raise ValueError(f"grpo_process: {column} and step_ends have different lengths in some response")
        rewards += weight * values.astype(np.float64)
    if s.outcome_parts:
        outcome = sum(weight * df[column].cast(pl.Float64).to_numpy() for column, weight in s.outcome_parts)
        last = n_steps > 0
        rewards[step_offsets[1:][last] - 1] += outcome[last]
    # GRPO's normalisation, over the group's step rewards in place of its responses' rewards.
    step_rows = pl.DataFrame({KEY: df[KEY].gather(np.repeat(np.arange(len(df)), n_steps)), "reward": rewards})
    normed = with_group_stats(step_rows).select(_finite(centered() / (group_std() + s.eps))).to_series().to_numpy()
    # Suffix sums within each response: the global reverse cumsum minus what lies past the response's last step.
    tail = np.append(np.cumsum(normed[::-1])[::-1], 0.0)
    suffix = tail[:-1] - np.repeat(tail[step_offsets[1:]], n_steps)
    # Each token takes the suffix sum of the first step that ends at or after it, in its own response (0 past the
    # last step's end, which the scores stage puts on the last token). Padded with one no-step entry for the search's
    # past-the-end result.
    token_offsets = offsets_of(df["length"])
    rows = np.arange(len(df))
    global_ends = np.repeat(token_offsets[:-1], n_steps) + ends
    step = np.searchsorted(global_ends, np.arange(token_offsets[-1]), side="left")
    step_row = np.append(np.repeat(rows, n_steps), -1)
    same = step_row[step] == np.repeat(rows, np.diff(token_offsets))
    token = np.where(same, np.append(suffix, 0.0)[step], 0.0).astype(np.float32)
    nonempty = token_offsets[1:] > token_offsets[:-1]
    first = np.zeros(len(df))
    first[nonempty] = token[token_offsets[:-1][nonempty]]
    tokens = from_flat("token_advantages", token, token_offsets)
    return df.with_columns(tokens, tokens.alias("returns"), pl.Series("advantage", first))


# ---- On-policy distillation ---------------------------------------------------------------------------------


@register("distill", needs_teacher=True)
def distill(df: pl.DataFrame, s: AdvantageSettings, history=None) -> pl.DataFrame:
    """On-policy distillation (Agarwal et al. 2024, GKD, 2306.13649; Lu et al. 2025, Thinking Machines): each sampled
    token's advantage is the negative per-token reverse KL to the teacher, A_t = log π_teacher(y_t) − log π_old(y_t),
    with no discount (the teacher grades every token itself); the reward is not used. `advantage` is the response's
    mean A_t. The teacher's and the policy's logprobs are the trainer's, of the same tokens."""
    old, offsets = flat_lists(df["old_logprobs"])
    teacher, teacher_offsets = flat_lists(df["teacher_logprobs"])
    if not np.array_equal(offsets, teacher_offsets):
        raise ValueError("distill: teacher_logprobs and old_logprobs have different lengths in some response")
    token = (teacher - old).astype(np.float32)
    lengths = np.diff(offsets)
    sums = np.bincount(np.repeat(np.arange(len(lengths)), lengths), weights=token, minlength=len(lengths))
    mean = np.where(lengths > 0, sums / np.maximum(lengths, 1), 0.0)
    tokens = from_flat("token_advantages", token, offsets)
    return df.with_columns(tokens, tokens.alias("returns"), pl.Series("advantage", mean))


# ---- DCPO: smooth advantage standardization over the prompt's history -------------------------------------


def empty_prompt_stats() -> pl.DataFrame:
    return pl.DataFrame(schema=PROMPT_STATS.columns)


def step_stats(df: pl.DataFrame) -> pl.DataFrame:
    """This step's μ_new, σ_new per prompt (σ unbiased; 0 for all-equal or single-sample groups), and its extremes."""
    stats = df.group_by(KEY, maintain_order=True).agg(
        *_group_aggregations(), pl.col("reward").min().alias("_g_min"), pl.col("reward").max().alias("_g_max")
    )
    return stats.select(KEY, pl.col("_g_mean").alias("mu_new"), pl.col("_g_std").alias("sigma_new"), "_g_min", "_g_max")


def cumulative_stats(step: pl.DataFrame, history: pl.DataFrame) -> pl.DataFrame:
    """Join the history (n earlier steps, μ_c, σ_c, the reward extremes) and fold this step in; each step counts once.

    n = 0: μ_c, σ_c := μ_new, σ_new. Otherwise μ_c := (n·μ_c + μ_new)/(n+1) and
    σ_c² := (n·σ_c² + σ_new² + n/(n+1)·(μ_new − μ_c_old)²)/(n+1).
    A prompt whose rewards never differed has σ_c = 0 and μ_c = that reward, exactly: with a fractional reward the
    running mean picks up rounding error (0.6999999999999998 for 0.7), σ_c comes out near 1e-17 instead of 0, and
    (r − μ_c)/σ_c would be a ratio of rounding errors (about ±0.5 after a few steps).
    """
    j = step.join(history.select(KEY, "n", "mean", "std", "reward_min", "reward_max"), on=KEY, how="left").with_columns(
        pl.col("n").fill_null(0)
    )
    n = pl.col("n").cast(pl.Float64)
    first = pl.col("n") == 0
    low = pl.when(first).then(pl.col("_g_min")).otherwise(pl.min_horizontal("reward_min", "_g_min"))
    high = pl.when(first).then(pl.col("_g_max")).otherwise(pl.max_horizontal("reward_max", "_g_max"))
    mu = pl.when(first).then(pl.col("mu_new")).otherwise((n * pl.col("mean") + pl.col("mu_new")) / (n + 1))
    var = (
        n * pl.col("std") ** 2 + pl.col("sigma_new") ** 2 + n / (n + 1) * (pl.col("mu_new") - pl.col("mean")) ** 2
    ) / (n + 1)
    sigma = pl.when(first).then(pl.col("sigma_new")).otherwise(var.sqrt())
    constant = low == high
    return j.with_columns(
        pl.when(constant).then(low).otherwise(mu).alias("mu_c"),
        pl.when(constant).then(0.0).otherwise(sigma).alias("sigma_c"),
        low.alias("low"),
        high.alias("high"),
    ).drop("mean", "std", "reward_min", "reward_max", "_g_min", "_g_max")


def update_prompt_stats(history: pl.DataFrame, df: pl.DataFrame, iteration: int) -> pl.DataFrame:
    """The next immutable snapshot: this step's prompts updated, every other prompt carried over."""
    cum = cumulative_stats(step_stats(df), history).select(
        KEY,
        (pl.col("n") + 1).cast(pl.Int32).alias("n"),
        pl.col("mu_c").alias("mean"),
        pl.col("sigma_c").alias("std"),
        pl.col("low").alias("reward_min"),
        pl.col("high").alias("reward_max"),
        pl.lit(iteration, pl.Int32).alias("last_iteration"),
    )
    kept = history.join(cum.select(KEY), on=KEY, how="anti")
    return pl.concat([kept, cum]).sort(KEY)


@register("dcpo", keeps_prompt_state=True)
def dcpo(df: pl.DataFrame, s: AdvantageSettings, history: pl.DataFrame | None = None) -> pl.DataFrame:
    """DCPO: A_new from this group, A_cum from the prompt's cumulative stats, blended both ways with
    w = 1/(n+1); the blend with the smaller |·| wins. An all-equal group still trains when the prompt's
    history varies."""
    cum = cumulative_stats(step_stats(df), history if history is not None else empty_prompt_stats())
    j = df.join(cum, on=KEY, how="left", maintain_order="left")
    r = pl.col("reward")
    a_new = pl.when(pl.col("sigma_new") > 0).then((r - pl.col("mu_new")) / pl.col("sigma_new")).otherwise(0.0)
    a_cum = pl.when(pl.col("sigma_c") > 0).then((r - pl.col("mu_c")) / pl.col("sigma_c")).otherwise(0.0)
    w = 1.0 / (pl.col("n").cast(pl.Float64) + 1.0)
    s1, s2 = w * a_cum + (1 - w) * a_new, w * a_new + (1 - w) * a_cum
    adv = pl.when(s1.abs() <= s2.abs()).then(s1).otherwise(s2)
    out = j.with_columns(adv.alias("advantage")).drop("mu_new", "sigma_new", "n", "mu_c", "sigma_c", "low", "high")
    return to_tokens(out, s)


# ---- GAE (PPO) --------------------------------------------------------------------------------------------


@register("gae", needs_critic=True)
def gae(df: pl.DataFrame, s: AdvantageSettings, history=None) -> pl.DataFrame:
    """Token rewards R_t = −β·kl_t, plus r on the last token; δ_t = R_t + γ·V_{t+1} − V_t (V_{T+1} = 0);
    A_t = δ_t + γλ·A_{t+1}; returns = A + V; then A is whitened over the batch's response tokens. With an
    action_mask the recursion runs over the model's own tokens only (observations skipped, as if absent).
    The scan runs on the list columns' flat buffers (tasks.algos.token_scan)."""
    from tasks.algos.token_scan import gae_flat  # numba (0.6 s to import) loads only for the estimator that needs it

    values, offsets = flat_lists(df["values"])
    penalty = None
    if s.kl_beta:
        flat = {}
        for col in ("old_logprobs", "ref_logprobs"):
            flat[col], col_offsets = flat_lists(df[col])
            if not np.array_equal(col_offsets, offsets):
                raise ValueError(f"gae: {col} and values have different lengths in some response")
        penalty = pl.DataFrame(flat).select(-s.kl_beta * kl_expr(s.kl_estimator)).to_series().to_numpy()
    mask = None
    if "action_mask" in df.columns and not df["action_mask"].null_count():  # multi-turn: skip the observations
        mask, mask_offsets = flat_lists(df["action_mask"])
        if not np.array_equal(mask_offsets, offsets):
            raise ValueError("gae: action_mask and values have different lengths in some response")
    advantages, returns = gae_flat(values, offsets, df["reward"].to_numpy(), penalty, s.gamma, s.lam, s.eps, mask=mask)
    nonempty = offsets[1:] > offsets[:-1]
    first = np.zeros(df.height)
    first[nonempty] = advantages[offsets[:-1][nonempty]]  # the first token: a model token, even in multi-turn
    return df.with_columns(
        from_flat("token_advantages", advantages, offsets),
        from_flat("returns", returns, offsets),
        pl.Series("advantage", first),
    )


class AdvantageInputError(UserError, ValueError):
    pass


def compute_advantages(
    df: pl.DataFrame, estimator: str, s: AdvantageSettings, history: pl.DataFrame | None = None
) -> pl.DataFrame:
    """The one entry point of every estimator. One rule for non-finite rewards, whatever the estimator: refused,
    naming the prompt (each estimator would spread a NaN differently: a group, a batch, every token)."""
    bad = df.filter(~pl.col("reward").is_finite() | pl.col("reward").is_null()).head(1)
    if bad.height:
        raise AdvantageInputError(
            f"advantages: prompt {bad['prompt_id'][0]!r} has a non-finite reward ({bad['reward'][0]}); "
            "rewards must be finite numbers"
        )
    return ADVANTAGE_ESTIMATORS.get(estimator)(df, s, history)


# ---- ARPO's attribution over a branching tree ---------------------------------------------------------------------


def shared_prefixes(parents: dict[int, int | None], points: dict[int, int | None]) -> dict[tuple[int, int], float]:
    """Response tokens shared by each pair of a group's trajectories (sample_idx → parent and branch point): the least
    branch point on the tree path between them (a branch shares its first `branch_point` tokens with its parent, and a
    prefix shared along each edge is shared end to end); inf with itself, 0 across separate roots."""
    up = {}  # node → {ancestor (itself included): the least branch point on the way up to it}
    for node in parents:
        seen, least, at = {node: math.inf}, math.inf, node
        while parents[at] is not None:
            least, at = min(least, points[at]), parents[at]
            seen[at] = least
        up[node] = seen
    shared = {}
    for i in parents:
        for j in parents:
            common = [min(up[i][a], up[j][a]) for a in up[i].keys() & up[j].keys()]
            shared[i, j] = max(common, default=0)
    return shared


def tree_mean_advantages(df: pl.DataFrame) -> pl.DataFrame:
    """ARPO's hard advantage attribution: a response token shared by several trajectories of a prompt's tree (the
    same prefix, copied into each branch) gets the mean of their token advantages at that position; a token of one
    trajectory alone keeps its own. Reads prompt_id, sample_idx, parent_sample_idx, branch_point, token_advantages;
    `advantage` (per response) and `returns` are left as they are."""
    lists = df["token_advantages"].to_list()
    out = [None] * df.height
    groups = (
        df.with_row_index("_row")
        .group_by(KEY, maintain_order=True)
        .agg("_row", "sample_idx", "parent_sample_idx", "branch_point")
    )
    for g in groups.iter_rows(named=True):
        parents = dict(zip(g["sample_idx"], g["parent_sample_idx"]))
        shared = shared_prefixes(parents, dict(zip(g["sample_idx"], g["branch_point"])))
        row_of = dict(zip(g["sample_idx"], g["_row"]))
        for i, r in row_of.items():
            total, count = np.zeros(len(lists[r])), np.zeros(len(lists[r]))
            for j, q in row_of.items():
                n = int(min(shared[i, j], len(lists[r]), len(lists[q])))
                total[:n] += lists[q][:n]
                count[:n] += 1
            out[r] = (total / count).astype(np.float32).tolist()
    return df.with_columns(pl.Series("token_advantages", out, dtype=TOKEN_LISTS))
