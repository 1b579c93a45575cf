"""Advantage estimators in Polars: hand values, the edge rules, and simple reference loops on random data."""

import math
import random
import statistics

import polars as pl
import pytest

from tasks.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageSettings,
    compute_advantages,
    empty_prompt_stats,
    update_prompt_stats,
)

S = AdvantageSettings()
F32 = pl.List(pl.Float32)


def frame(groups: dict[str, list[float]], lengths=None) -> pl.DataFrame:
    rows = [(p, i, float(r)) for p, rs in groups.items() for i, r in enumerate(rs)]
    df = pl.DataFrame(rows, schema={"prompt_id": pl.Utf8, "sample_idx": pl.Int32, "reward": pl.Float64}, orient="row")
    return df.with_columns(pl.Series("length", lengths or [1] * df.height, dtype=pl.Int32))


def adv(name, groups, s=S, history=None):
    return compute_advantages(frame(groups), name, s, history)["advantage"].to_list()


# ---- Hand-computed values: group a = [1, 0, 0, 1] (mean 0.5, unbiased std sqrt(1/3) = 0.57735) ------------


def test_grpo_hand_values():
    expected = 0.5 / (0.5773503 + 1e-6)
    assert adv("grpo", {"a": [1, 0, 0, 1]}) == pytest.approx([expected, -expected, -expected, expected], rel=1e-6)
    assert expected == pytest.approx(0.8660, abs=1e-4)


def test_drgrpo_is_centered_reward_only():
    assert adv("drgrpo", {"a": [1, 0, 0, 1], "b": [3, 1]}) == pytest.approx([0.5, -0.5, -0.5, 0.5, 1.0, -1.0])


def test_lite_ppo_divides_by_the_batch_std():
    # batch rewards [1,0,0,1,3,1]: mean 1, unbiased var = (0+1+1+0+4+0)/5 = 1.2
    std = math.sqrt(1.2)
    got = adv("lite_ppo", {"a": [1, 0, 0, 1], "b": [3, 1]})
    assert got == pytest.approx([x / (std + 1e-6) for x in (0.5, -0.5, -0.5, 0.5, 1.0, -1.0)], rel=1e-6)


def test_rloo_is_leave_one_out():
    # [1, 0, 0, 1]: A_0 = 1 − mean(0, 0, 1) = 2/3 = 4/3 · 0.5
    assert adv("rloo", {"a": [1, 0, 0, 1]}) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert adv("rloo", {"single": [5.0]}) == [0.0]


def test_reinforce_pp_baseline_whitens_over_tokens():
    # centered [0.5, −0.5] on lengths [3, 1] → tokens [.5,.5,.5,−.5]: mean .25, unbiased std .5
    df = frame({"a": [1, 0]}, lengths=[3, 1])
    out = compute_advantages(df, "reinforce_pp_baseline", S).sort("sample_idx")
    assert out["token_advantages"].to_list()[0] == pytest.approx([0.25 / 0.500001] * 3, rel=1e-5)
    assert out["token_advantages"].to_list()[1] == pytest.approx([-0.75 / 0.500001], rel=1e-5)


# reinforce_pp_baseline is left out on purpose: its token whitening shifts zeros by the batch mean.
@pytest.mark.parametrize("name", ["grpo", "drgrpo", "lite_ppo", "rloo", "dcpo"])
def test_edge_rules_single_sample_and_all_equal_groups_get_zero(name):
    got = adv(name, {"single": [1.0], "same": [0.7, 0.7, 0.7], "mixed": [0.0, 1.0]})
    assert got[:4] == [0.0, 0.0, 0.0, 0.0]
    assert got[4] != 0.0  # the mixed group keeps its signal


def test_kl_in_the_reward_adds_the_penalty_reward_to_go():
    # k1 per token = old − ref = [0.5, 0.25, 0.0]; β = 0.1 → reward-to-go of −β·kl: [−0.075, −0.025, 0]
    df = frame({"a": [1, 0]}, lengths=[3, 1]).with_columns(
        pl.Series("old_logprobs", [[-1.0, -1.0, -1.0], [-2.0]], dtype=F32),
        pl.Series("ref_logprobs", [[-1.5, -1.25, -1.0], [-2.0]], dtype=F32),
    )
    out = compute_advantages(df, "drgrpo", AdvantageSettings(kl_beta=0.1, kl_estimator="k1")).sort("sample_idx")
    assert out["token_advantages"].to_list()[0] == pytest.approx([0.425, 0.475, 0.5], abs=1e-6)
    assert out["token_advantages"].to_list()[1] == pytest.approx([-0.5], abs=1e-6)


def test_advantages_broadcast_to_every_response_token():
    out = compute_advantages(frame({"a": [1.0, 0.0]}, lengths=[3, 1]), "grpo", S).sort("sample_idx")
    a = 0.5 / (0.7071068 + 1e-6)
    assert out["token_advantages"].to_list() == [pytest.approx([a, a, a], rel=1e-5), pytest.approx([-a], rel=1e-5)]
    assert out["returns"].to_list() == out["token_advantages"].to_list()


# ---- Reference loops on random data ----------------------------------------------------------------------


def random_groups(seed, n=300):
    rnd = random.Random(seed)
    return {f"p{i}": [rnd.choice([0.0, 0.1, 1.0, 1.1]) for _ in range(rnd.randint(1, 9))] for i in range(n)}


def loop_group_advantages(name, groups, eps=1e-6):
    batch = [r for rs in groups.values() for r in rs]
    batch_std = statistics.stdev(batch)
    out = []
    for rewards in groups.values():
        g, mean = len(rewards), statistics.mean(rewards)
        same = max(rewards) == min(rewards)
        for r in rewards:
            centered = 0.0 if same else r - mean
            if name == "grpo":
                out.append(0.0 if g < 2 or same else centered / (statistics.stdev(rewards) + eps))
            elif name == "drgrpo":
                out.append(centered)
            elif name == "lite_ppo":
                out.append(centered / (batch_std + eps))
            elif name == "rloo":
                out.append(0.0 if g < 2 else r - (sum(rewards) - r) / (g - 1) if not same else 0.0)
    return out


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "lite_ppo", "rloo"])
def test_group_estimators_match_a_reference_loop(name):
    groups = random_groups(0)
    assert adv(name, groups) == pytest.approx(loop_group_advantages(name, groups), abs=1e-9)


def loop_gae(rewards, values, kl, gamma, lam, beta):
    """The textbook reverse loop, one sequence at a time; returns (advantages, returns) before whitening."""
    advs, rets = [], []
    for r, v, k in zip(rewards, values, kl):
        T, a_next, a = len(v), 0.0, [0.0] * len(v)
        for t in reversed(range(T)):
            reward_t = -beta * k[t] + (r if t == T - 1 else 0.0)
            v_next = v[t + 1] if t + 1 < T else 0.0
            a_next = reward_t + gamma * v_next - v[t] + gamma * lam * a_next
            a[t] = a_next
        advs.append(a)
        rets.append([x + y for x, y in zip(a, v)])
    return advs, rets


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0), (1.0, 0.0)])
def test_gae_matches_the_reverse_loop_up_to_8k_tokens(gamma, lam):
    rnd = random.Random(1)
    lengths = [1, 2, 5, 64, 700, 8192] + [rnd.randint(1, 300) for _ in range(20)]
    values = [[rnd.uniform(-1, 1) for _ in range(n)] for n in lengths]
    old = [[-rnd.random() for _ in range(n)] for n in lengths]
    ref = [[-rnd.random() for _ in range(n)] for n in lengths]
    rewards = [rnd.choice([0.0, 1.0]) for _ in lengths]
    df = pl.DataFrame(
        {
            "prompt_id": [f"p{i // 2}" for i in range(len(lengths))],
            "sample_idx": list(range(len(lengths))),
            "reward": rewards,
            "length": lengths,
        },
        schema_overrides={"sample_idx": pl.Int32, "length": pl.Int32},
    ).with_columns(
        pl.Series("values", values, dtype=F32),
        pl.Series("old_logprobs", old, dtype=F32),
        pl.Series("ref_logprobs", ref, dtype=F32),
    )
    beta = 0.05
    out = compute_advantages(df, "gae", AdvantageSettings(gamma=gamma, lam=lam, kl_beta=beta, kl_estimator="k1"))
    f32 = lambda xs: [float(pl.Series([x], dtype=pl.Float32)[0]) for x in xs]  # noqa: E731 - the stored precision
    kl = [[a - b for a, b in zip(f32(o), f32(r))] for o, r in zip(old, ref)]
    advs, rets = loop_gae(rewards, [f32(v) for v in values], kl, gamma, lam, beta)
    flat = [x for a in advs for x in a]
    mean, std = statistics.mean(flat), statistics.stdev(flat)
    for got_a, got_r, a, r in zip(out["token_advantages"].to_list(), out["returns"].to_list(), advs, rets):
        assert got_r == pytest.approx(r, rel=1e-4, abs=1e-4)
        assert got_a == pytest.approx([(x - mean) / (std + 1e-6) for x in a], rel=1e-4, abs=1e-4)


def test_gae_hand_values():
    # One response of 2 tokens, r = 1, V = [0.5, 0.25], γ = 1, λ = 0.5, no KL:
    # δ_1 = 1 + 0 − 0.25 = 0.75; δ_0 = 0 + 0.25 − 0.5 = −0.25; A_1 = 0.75; A_0 = −0.25 + 0.5·0.75 = 0.125.
    df = frame({"a": [1.0]}, lengths=[2]).with_columns(pl.Series("values", [[0.5, 0.25]], dtype=F32))
    s = AdvantageSettings(gamma=1.0, lam=0.5)
    out = compute_advantages(df, "gae", s)
    assert out["returns"].to_list()[0] == pytest.approx([0.625, 1.0])
    mean, std = 0.4375, statistics.stdev([0.125, 0.75])
    assert out["token_advantages"].to_list()[0] == pytest.approx(
        [(0.125 - mean) / (std + 1e-6), (0.75 - mean) / (std + 1e-6)], rel=1e-5
    )


def test_gae_skips_observation_tokens_by_hand():
    # A multi-turn response: 2 model tokens, 2 observation tokens (a tool's result), 1 model token; r = 1,
    # V = [0.5, 0.25, 9, -9, 0.75], γ = 1, λ = 0.5, no KL. Over the model's tokens only (V = [0.5, 0.25, 0.75]):
    # A_4 = 1 − 0.75 = 0.25; A_1 = 0.75 − 0.25 + 0.5·0.25 = 0.625; A_0 = 0.25 − 0.5 + 0.5·0.625 = 0.0625.
    # The observations carry A_4 and its value: A = 0.25, returns = 0.25 + 0.75.
    values = [0.5, 0.25, 9.0, -9.0, 0.75]
    df = frame({"a": [1.0]}, lengths=[5]).with_columns(
        pl.Series("values", [values], dtype=F32), pl.Series("action_mask", [[1, 1, 0, 0, 1]], dtype=pl.List(pl.Int8))
    )
    out = compute_advantages(df, "gae", AdvantageSettings(gamma=1.0, lam=0.5))
    assert out["returns"].to_list()[0] == pytest.approx([0.5625, 0.875, 1.0, 1.0, 1.0])
    raw = [0.0625, 0.625, 0.25]  # whitened over the model's 3 tokens only
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    white = [(x - mean) / (std + 1e-6) for x in raw]
    assert out["token_advantages"].to_list()[0] == pytest.approx([white[0], white[1], white[2], white[2], white[2]])


def test_gae_with_a_mask_equals_gae_without_the_observations_and_ignores_their_values():
    """The critic's values (and KL) on observation tokens do not move any advantage or return of a model token;
    masked GAE equals plain GAE over the responses with the observation tokens cut out."""
    rnd = random.Random(3)
    n, lengths = 12, [rnd.randint(1, 40) for _ in range(12)]
    masks = [[1] + [int(rnd.random() < 0.6) for _ in range(k - 1)] for k in lengths]
    values = [[rnd.uniform(-1, 1) for _ in range(k)] for k in lengths]
    old = [[-rnd.random() for _ in range(k)] for k in lengths]
    ref = [[-rnd.random() for _ in range(k)] for k in lengths]

    def run(values, old, ref, masks, lengths):
        df = pl.DataFrame(
            {"prompt_id": [f"p{i // 3}" for i in range(n)], "sample_idx": [i % 3 for i in range(n)]},
            schema_overrides={"sample_idx": pl.Int32},
        ).with_columns(
            pl.Series("reward", [float(i % 2) for i in range(n)]),
            pl.Series("length", lengths, dtype=pl.Int32),
            pl.Series("values", values, dtype=F32),
            pl.Series("old_logprobs", old, dtype=F32),
            pl.Series("ref_logprobs", ref, dtype=F32),
            *([pl.Series("action_mask", masks, dtype=pl.List(pl.Int8))] if masks is not None else []),
        )
        return compute_advantages(df, "gae", AdvantageSettings(gamma=0.99, lam=0.9, kl_beta=0.05))

    def cut(lists):
        return [[x for x, a in zip(xs, m) if a] for xs, m in zip(lists, masks)]

    masked = run(values, old, ref, masks, lengths)
    plain = run(cut(values), cut(old), cut(ref), None, [sum(m) for m in masks])
    for col in ("token_advantages", "returns"):
        got = [x for xs in cut(masked[col].to_list()) for x in xs]
        assert got == pytest.approx([x for xs in plain[col].to_list() for x in xs], abs=1e-5)
    noise = [[v if a else rnd.uniform(-50, 50) for v, a in zip(vs, m)] for vs, m in zip(values, masks)]
    noisy_kl = [[o if a else rnd.uniform(-50, 0) for o, a in zip(os_, m)] for os_, m in zip(old, masks)]
    again = run(noise, noisy_kl, ref, masks, lengths)
    for col in ("token_advantages", "returns", "advantage"):
        assert again[col].to_list() == masked[col].to_list(), col


# ---- DCPO ---------------------------------------------------------------------------------------------------


def test_dcpo_smooth_advantage_over_three_steps_of_one_prompt():
    history = empty_prompt_stats()
    # Step 1, rewards [1,0,0,0]: μ = 0.25, σ = 0.5 (unbiased); n = 0 so A = A_new = [1.5, −0.5, −0.5, −0.5].
    step1 = frame({"p": [1, 0, 0, 0]})
    assert compute_advantages(step1, "dcpo", S, history)["advantage"].to_list() == pytest.approx(
        [1.5, -0.5, -0.5, -0.5]
    )
    history = update_prompt_stats(history, step1, 1)
    assert history.row(0, named=True) == {
        "prompt_id": "p",
        "n": 1,
        "mean": 0.25,
        "std": 0.5,
        "reward_min": 0.0,
        "reward_max": 1.0,
        "last_iteration": 1,
    }
    # Step 2, identical rewards [0,0,0,0]: A_new = 0; μ_c = 0.125, σ_c² = (0.25 + 0 + ½·0.25²)/2 = 0.140625
    # (σ_c = 0.375), A_cum = −0.125/0.375 = −1/3; w = ½ → S1 = S2 = −1/6. The group still trains.
    step2 = frame({"p": [0, 0, 0, 0]})
    assert compute_advantages(step2, "dcpo", S, history)["advantage"].to_list() == pytest.approx([-1 / 6] * 4)
    history = update_prompt_stats(history, step2, 2)
    assert history["std"][0] == pytest.approx(0.375) and history["n"][0] == 2
    # Step 3, rewards [1,1,0,0]: μ_new 0.5, σ_new 0.57735; μ_c = 0.25, σ_c² = (2·0.140625 + 1/3 + ⅔·0.375²)/3
    # = 0.2361111 (σ_c 0.4859127); w = ⅓. r = 1: A_new 0.8660254, A_cum 1.5434872 → S1 1.0918460, S2 1.3176666
    # → 1.0918460. r = 0: A_new −0.8660254, A_cum −0.5144958 → S1 −0.7488489, S2 −0.6316724 → −0.6316724.
    got = compute_advantages(frame({"p": [1, 1, 0, 0]}), "dcpo", S, history)["advantage"].to_list()
    assert got == pytest.approx([1.0918460, 1.0918460, -0.6316724, -0.6316724], abs=1e-6)


def loop_dcpo(steps):
    """Reference: per prompt, a dict of (n, μ_c, σ_c); returns the advantages of every step, in order."""
    state, out = {}, []
    for groups in steps:
        for p, rewards in groups.items():
            mu_new = statistics.mean(rewards)
            sigma_new = 0.0 if len(rewards) < 2 or max(rewards) == min(rewards) else statistics.stdev(rewards)
            n, mu_c, sigma_c, seen = state.get(p, (0, 0.0, 0.0, set()))
            seen = seen | set(rewards)
            if n == 0:
                mu_c, sigma_c = mu_new, sigma_new
            else:
                var = (n * sigma_c**2 + sigma_new**2 + n / (n + 1) * (mu_new - mu_c) ** 2) / (n + 1)
                mu_c, sigma_c = (n * mu_c + mu_new) / (n + 1), math.sqrt(var)
            if len(seen) == 1:  # rewards that never differed: σ_c = 0 exactly (docs/algorithms.md)
                mu_c, sigma_c = rewards[0], 0.0
            w = 1 / (n + 1)
            for r in rewards:
                a_new = (r - mu_new) / sigma_new if sigma_new > 0 else 0.0
                a_cum = (r - mu_c) / sigma_c if sigma_c > 0 else 0.0
                s1, s2 = w * a_cum + (1 - w) * a_new, w * a_new + (1 - w) * a_cum
                out.append(s1 if abs(s1) <= abs(s2) else s2)
            state[p] = (n + 1, mu_c, sigma_c, seen)
    return out


def test_dcpo_matches_a_reference_loop_over_many_steps():
    rnd = random.Random(2)
    prompts = [f"p{i}" for i in range(30)]
    steps = [
        {p: [rnd.choice([0.0, 1.0, 1.1]) for _ in range(rnd.randint(1, 6))] for p in rnd.sample(prompts, 12)}
        for _ in range(8)
    ]
    history, got = empty_prompt_stats(), []
    for k, groups in enumerate(steps, start=1):
        df = frame(groups)
        got += compute_advantages(df, "dcpo", S, history)["advantage"].to_list()
        history = update_prompt_stats(history, df, k)
    assert got == pytest.approx(loop_dcpo(steps), abs=1e-9)
    assert history.height == len({p for g in steps for p in g})


# ---- compare-advantages statistics -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "aggregation",
    ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "only-token-mean"],
)
def test_effective_token_weights_match_a_loop(aggregation):
    from tasks.analysis.advantage_analysis import estimator_summary

    rnd = random.Random(3)
    lengths = [rnd.choice([1, 2, 3, 5, 9, 17]) for _ in range(60)]
    advs = [rnd.choice([0.0, 0.5, -1.0, 2.0]) for _ in lengths]
    df = pl.DataFrame({"advantage": advs, "length": lengths}, schema_overrides={"length": pl.Int32})
    got = estimator_summary(df, pl.Series(advs), aggregation, max_len=20)
    b, n = len(lengths), sum(lengths)
    norm = {
        "token-mean": lambda L: 1 / n,
        "seq-mean-token-mean": lambda L: 1 / (b * L),
        "seq-mean-token-sum": lambda L: 1 / b,
        "seq-mean-token-sum-norm": lambda L: 1 / (b * 20),
        "only-token-mean": lambda L: 1 / L,
    }[aggregation]
    buckets = {}
    for a, L in zip(advs, lengths):
        label = {1: "1", 2: "2-3", 3: "2-3", 5: "4-7", 9: "8-15", 17: "16-31"}[L]
        buckets.setdefault(label, []).append(abs(a) * norm(L))
    table = dict(zip(got["weight_by_length"]["bucket"], got["weight_by_length"]["weight"]))
    assert table == pytest.approx({k: statistics.mean(v) for k, v in buckets.items()})
    assert got["nonzero_fraction"] == pytest.approx(sum(a != 0 for a in advs) / b)
    assert got["corr_grpo"] == pytest.approx(1.0)


@pytest.mark.parametrize("reward", [0.1, 0.7, 1 / 3, 2.5])
def test_dcpo_gives_a_constant_fractional_reward_advantage_zero_over_many_steps(reward):
    """The running mean of a constant fractional reward picks up rounding error; before the fix σ_c came out near
    1e-17 instead of 0 and the advantage was a ratio of rounding errors (−0.47 at step 6 for 0.7)."""
    history = empty_prompt_stats()
    for step in range(1, 31):
        df = frame({"p": [reward] * 4, "q": [0.0, 1.0, 0.0, 1.0]})
        out = compute_advantages(df, "dcpo", S, history)
        assert out.filter(pl.col("prompt_id") == "p")["advantage"].to_list() == [0.0] * 4, step
        history = update_prompt_stats(history, df, step)
    row = history.filter(pl.col("prompt_id") == "p").row(0, named=True)
    assert row["std"] == 0.0 and row["mean"] == reward and row["reward_min"] == row["reward_max"] == reward


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_one_rule_for_a_non_finite_reward_whatever_the_estimator(estimator):
    from tasks.algos.advantages import AdvantageInputError

    df = frame({"a": [1.0, 0.0], "b": [math.nan, 1.0]})
    if estimator == "gae":
        df = df.with_columns(pl.Series("values", [[0.0]] * 4, dtype=pl.List(pl.Float32)))
    with pytest.raises(AdvantageInputError, match="prompt 'b' has a non-finite reward"):
        compute_advantages(df, estimator, S, empty_prompt_stats())


# ---- Pass@k training and GDPO ------------------------------------------------------------------------------------


def test_passk_hand_values_and_edges():
    from tasks.algos.advantages import passk_advantages

    # n 4, c 1, k 2: ρ = 1 − C(3,2)/C(4,2) = 1/2, σ = 1/2; A_pos = (1/2)/(1/2) = 1, A_neg = (1/2 − C(2,1)/C(3,1))/(1/2)
    # = (1/2 − 2/3)·2 = −1/3: the group's advantages sum to 0 (1 − 3·1/3).
    pos, neg = passk_advantages(4, 1, 2, 0.0)
    assert pos == pytest.approx(1.0) and neg == pytest.approx(-1 / 3)
    for n, c, k in ((4, 0, 2), (4, 4, 2), (4, 3, 2)):  # none correct; all; n − c < k: every 2-subset passes
        assert passk_advantages(n, c, k, 1e-6) == pytest.approx((0.0, 0.0), abs=1e-9), (n, c, k)
    s = AdvantageSettings(pass_k=2)
    assert adv("passk", {"a": [1, 0, 0, 0]}, s) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-5)
    with pytest.raises(Exception, match="needs groups of at least k responses; prompt 'b' has 1"):
        adv("passk", {"a": [1, 0], "b": [1]}, s)


def test_passk_with_k_1_is_grpo_with_the_population_std():
    groups = {"a": [1, 0, 0, 1, 1], "b": [0, 0, 1, 0, 0], "c": [1, 1, 1, 1, 1]}
    got = adv("passk", groups, AdvantageSettings(pass_k=1, eps=0.0))
    want = []
    for rs in groups.values():
        mean, std = statistics.fmean(rs), statistics.pstdev(rs)
        want += [(r - mean) / std if std else 0.0 for r in rs]
    assert got == pytest.approx(want, abs=1e-9)


def test_passk_matches_a_reference_loop_with_a_threshold_on_the_reward():
    rng = random.Random(3)
    groups = {f"p{i}": [rng.choice([0.0, 0.1, 1.0, 1.1]) for _ in range(8)] for i in range(60)}
    s = AdvantageSettings(pass_k=3, correct_at=1.0)
    want = []
    for rs in groups.values():
        n, c = len(rs), sum(r >= 1.0 for r in rs)
        rho = 1 - math.comb(n - c, 3) / math.comb(n, 3)
        sigma = math.sqrt(rho * (1 - rho))
        pos = (1 - rho) / (sigma + s.eps)
        neg = (1 - rho - (math.comb(n - c - 1, 2) / math.comb(n - 1, 2) if n - c else 0)) / (sigma + s.eps)
        want += [pos if r >= 1.0 else neg for r in rs]
    assert adv("passk", groups, s) == pytest.approx(want, abs=1e-9)


def components_frame(groups: dict[str, list[tuple[float, float]]]) -> pl.DataFrame:
    rows = [(p, i, a, f, a + 0.1 * f) for p, rs in groups.items() for i, (a, f) in enumerate(rs)]
    schema = {"prompt_id": pl.Utf8, "sample_idx": pl.Int32, "score_a": pl.Float64, "score_f": pl.Float64}
    df = pl.DataFrame(rows, schema={**schema, "reward": pl.Float64}, orient="row")
    return df.with_columns(pl.lit(1, pl.Int32).alias("length"))


def test_gdpo_normalises_each_component_in_its_group_then_the_weighted_sum_over_the_batch():
    # Group g: a = [1, 0], f = [0, 1] → z_a = [0.7071, −0.7071], z_f = [−0.7071, 0.7071] (std 0.7071);
    # with weights 1 and 0.1: [0.6364, −0.6364]. Group h: a = [1, 1] (equal: z 0), f = [1, 0] → [0.0707, −0.0707].
    # Batch: mean 0, std of [0.6364, −0.6364, 0.0707, −0.0707] (ddof 1) = 0.5222 → divided by it.
    df = components_frame({"g": [(1, 0), (0, 1)], "h": [(1, 1), (1, 0)]})
    s = AdvantageSettings(components=(("score_a", 1.0), ("score_f", 0.1)), eps=0.0)
    got = compute_advantages(df, "gdpo", s)["advantage"].to_list()
    z = 1 / math.sqrt(2)
    raw = [z - 0.1 * z, -z + 0.1 * z, 0.1 * z, -0.1 * z]
    std = statistics.stdev(raw)
    assert got == pytest.approx([r / std for r in raw], abs=1e-9)
    # GRPO on the summed reward instead: group h's reward [1.1, 1.0] gives ±0.7071, as large as group g's.
    assert compute_advantages(df, "grpo", S)["advantage"].to_list()[2] == pytest.approx(z, abs=1e-5)


def test_gdpo_matches_a_reference_loop():
    rng = random.Random(5)
    groups = {f"p{i}": [(rng.choice([0.0, 1.0]), rng.random()) for _ in range(rng.randint(1, 6))] for i in range(80)}
    s = AdvantageSettings(components=(("score_a", 1.0), ("score_f", 0.5)))
    raw = []
    for rs in groups.values():
        parts = []
        for k, w in ((0, 1.0), (1, 0.5)):
            xs = [r[k] for r in rs]
            equal = max(xs) == min(xs)
            std = statistics.stdev(xs) if len(xs) > 1 else 0.0
            parts.append([0.0 if equal else w * (x - statistics.fmean(xs)) / (std + s.eps) for x in xs])
        raw += [a + b for a, b in zip(*parts)]
    mean, std = statistics.fmean(raw), statistics.stdev(raw)
    got = compute_advantages(components_frame(groups), "gdpo", s)["advantage"].to_list()
    assert got == pytest.approx([(r - mean) / (std + s.eps) for r in raw], abs=1e-9)


# ---- On-policy distillation --------------------------------------------------------------------------------------


def test_distill_gives_each_token_the_negative_reverse_kl_to_the_teacher():
    # Response 0: old [−1, −2], teacher [−0.5, −3] → A_t = teacher − old = [0.5, −1], mean −0.25; response 1 is empty.
    df = frame({"a": [1.0, 0.0]}, lengths=[2, 0]).with_columns(
        pl.Series("old_logprobs", [[-1.0, -2.0], []], dtype=F32),
        pl.Series("teacher_logprobs", [[-0.5, -3.0], []], dtype=F32),
    )
    out = compute_advantages(df, "distill", S)
    assert out["token_advantages"].to_list() == [[0.5, -1.0], []] and out["returns"].to_list() == [[0.5, -1.0], []]
    assert out["advantage"].to_list() == [-0.25, 0.0]  # the reward plays no part


def test_distill_matches_a_reference_loop():
    rng = random.Random(7)
    lengths = [rng.randint(0, 9) for _ in range(200)]
    old = [[-rng.random() * 5 for _ in range(n)] for n in lengths]
    teacher = [[-rng.random() * 5 for _ in range(n)] for n in lengths]
    df = pl.DataFrame(
        {
            "prompt_id": [f"p{i // 4}" for i in range(200)],
            "sample_idx": [i % 4 for i in range(200)],
            "reward": [0.0] * 200,
            "length": lengths,
            "old_logprobs": old,
            "teacher_logprobs": teacher,
        },
        schema_overrides={"length": pl.Int32, "old_logprobs": F32, "teacher_logprobs": F32, "sample_idx": pl.Int32},
    )
    out = compute_advantages(df, "distill", S)
    for row, o, t in zip(out.iter_rows(named=True), df["old_logprobs"].to_list(), df["teacher_logprobs"].to_list()):
        want = [b - a for a, b in zip(o, t)]
        assert row["token_advantages"] == pytest.approx(want, abs=1e-6)
        assert row["advantage"] == pytest.approx(statistics.fmean(want) if want else 0.0, abs=1e-6)


def test_arpo_hard_attribution_averages_each_shared_token_over_the_trajectories_sharing_it():
    """A hand-worked tree: s0 and s1 roots; s2 branched from s0 after 3 tokens; s3 from s2 after 5. A token shared
    by several trajectories gets the mean of their advantages; s1 shares nothing; another prompt is untouched."""
    from tasks.algos.advantages import shared_prefixes, tree_mean_advantages

    lengths, advantage = [6, 5, 8, 7], [1.0, -1.0, 0.5, -0.5]
    df = pl.DataFrame(
        {
            "prompt_id": ["p"] * 4 + ["q"],
            "sample_idx": [0, 1, 2, 3, 0],
            "parent_sample_idx": [None, None, 0, 2, None],
            "branch_point": [None, None, 3, 5, None],
            "advantage": [*advantage, 2.0],
            "token_advantages": [[a] * n for a, n in zip(advantage, lengths)] + [[2.0, 2.0]],
        },
        schema_overrides={"token_advantages": pl.List(pl.Float32)},
    )
    shared = shared_prefixes({0: None, 1: None, 2: 0, 3: 2}, {0: None, 1: None, 2: 3, 3: 5})
    assert (shared[0, 2], shared[0, 3], shared[2, 3], shared[0, 1], shared[3, 1]) == (3, 3, 5, 0, 0)
    third = (1.0 + 0.5 - 0.5) / 3  # positions 0-2: s0, s2 and s3 share them
    want = [
        [third] * 3 + [1.0] * 3,
        [-1.0] * 5,
        [third] * 3 + [0.0] * 2 + [0.5] * 3,  # positions 3-4: s2 and s3 share them, (0.5 − 0.5) / 2
        [third] * 3 + [0.0] * 2 + [-0.5] * 2,
        [2.0, 2.0],
    ]
    out = tree_mean_advantages(df)
    for got, expected in zip(out["token_advantages"].to_list(), want):
        assert got == pytest.approx(expected, abs=1e-7)
    assert out["advantage"].to_list() == df["advantage"].to_list()
