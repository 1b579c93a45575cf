"""Process rewards: splitting a response into steps, placing each step's end on a token, aggregating step scores,
the step-level advantages of GRPO with process supervision (hand values and a reference loop), per-step functions
through the scoring path, and the config's checks."""

import math
import random
import re
import statistics

import polars as pl
import pytest

from schemas.config import ConfigError, RewardConfig, build_config
from tasks.algos.advantages import AdvantageSettings, compute_advantages
from tasks.rewards.scoring import score_frame
from tasks.rewards.steps import aggregate_steps, split_steps, step_ends_column, step_token_ends
from tests.test_rewards import FIXTURES, prompts, rollouts

# ---- Splitting --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, kw, want",
    [
        ("1+7+0=08;2+6+0=08;#### 88", {"delimiter": ";"}, [("1+7+0=08;", 9), ("2+6+0=08;", 18), ("#### 88", 25)]),
        ("a\n\nb\n", {}, [("a\n\n", 3), ("b\n", 5)]),  # a blank line joins the step before; so does a trailing \n
        ("\na\nb", {}, [("\na\n", 3), ("b", 4)]),  # leading whitespace joins the first step
        ("no delimiter", {}, [("no delimiter", 12)]),
        ("", {}, [("", 0)]),  # an empty response is one empty step
        ("Step 1: x. Step 2: y", {"regex": r"\.\s+"}, [("Step 1: x. ", 11), ("Step 2: y", 20)]),
        ("a1b22c", {"regex": r"\d+"}, [("a1", 2), ("b22", 5), ("c", 6)]),
    ],
)
def test_split_steps_cases(text, kw, want):
    assert split_steps(text, **kw) == want


def test_steps_join_back_to_the_response_and_end_where_they_say():
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("ab;\n ") for _ in range(rng.randrange(0, 30)))
        for kw in ({"delimiter": ";"}, {"delimiter": "\n"}, {"regex": r";+"}):
            steps = split_steps(text, **kw)
            assert "".join(s for s, _ in steps) == text
            ends = [e for _, e in steps]
            assert ends == sorted(ends) and ends[-1] == len(text)
            assert all(text[:e].endswith(s) for s, e in steps)
            assert all(s.strip() for s, _ in steps) or len(steps) == 1


# ---- Step ends on tokens ----------------------------------------------------------------------------------------


def test_each_step_ends_on_the_token_that_completes_it_and_the_last_on_the_last_token():
    pieces = ["ab", ";", "c", "d;", "e", ""]  # the last token decodes to nothing (EOS, a special token)

    def length(k):
        return len("".join(pieces[:k]))

    assert step_token_ends([3, 6, 7], 6, length) == [1, 3, 5]  # ";" is token 1, "d;" token 3, EOS token 5
    assert step_token_ends([7], 6, length) == [5]
    assert step_token_ends([3, 6, 7], 0, length) == [-1, -1, -1]
    # a token that spans a step's end and the next step's start ends the first step
    assert step_token_ends([2, 4], 2, lambda k: [0, 3, 4][k]) == [0, 1]


def test_step_ends_column_splits_and_places_with_a_decoder():
    vocab = {1: "12", 2: ";", 3: "3", 4: "4;", 5: "#", 0: ""}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    split = RewardConfig(steps={"delimiter": ";"}).steps
    got = step_ends_column(["12;34;#", "12;34;#", "12"], [[1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 0], [1]], decode, split)
    assert got == [[1, 3, 5], [1, 3, 5], [0]]


def test_step_ends_with_a_byte_level_bpe_whose_tokens_span_the_delimiter():
    """A real tokenizer whose merges cross step boundaries (`;2`, `08;`): each step ends on the first token whose
    decoded prefix covers it, and the last step on the EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tasks.data.long_addition import worked_sum

    rng = random.Random(1)
    corpus = [worked_sum(rng.randrange(1000, 9999), rng.randrange(1000, 9999), 4) for _ in range(400)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")
    texts = corpus[:50]
    ids = [tok.encode(t) + [tok.eos_token_id] for t in texts]
    assert any(";" in piece[:-1] for t in ids for piece in tok.convert_ids_to_tokens(t))  # merges do span a ';'
    split = RewardConfig(steps={"delimiter": ";"}).steps
    got = step_ends_column(texts, ids, lambda x: tok.decode(x, skip_special_tokens=True), split)
    for text, t, ends in zip(texts, ids, got):
        char_ends = [e for _, e in split_steps(text, ";")]
        assert ends[-1] == len(t) - 1 and ends == sorted(ends)
        for end, char_end in zip(ends[:-1], char_ends):
            assert len(tok.decode(t[: end + 1])) >= char_end > len(tok.decode(t[:end]))


# ---- Aggregation ------------------------------------------------------------------------------------------------


def test_aggregates_by_hand():
    assert aggregate_steps([1.0, 0.5, 0.0, 0.5], "mean") == 0.5
    assert aggregate_steps([1.0, 0.5, 0.25], "min") == 0.25
    assert aggregate_steps([1.0, 0.5, 0.5], "product") == 0.25
    assert aggregate_steps([0.9], "product") == 0.9


# ---- Step-level advantages ----------------------------------------------------------------------------------------

L32, LF64 = pl.List(pl.Int32), pl.List(pl.Float64)
S = AdvantageSettings(eps=1e-12, step_parts=(("steps_p", 1.0),))


def step_frame(rows, outcome=None) -> pl.DataFrame:
    """rows: (prompt_id, length, step_ends, step scores or None)."""
    df = pl.DataFrame(
        {
            "prompt_id": [r[0] for r in rows],
            "sample_idx": list(range(len(rows))),
            "reward": [0.0] * len(rows),
            "length": [r[1] for r in rows],
            "step_ends": [r[2] for r in rows],
            "steps_p": [r[3] for r in rows],
        },
        schema_overrides={"sample_idx": pl.Int32, "length": pl.Int32, "step_ends": L32, "steps_p": LF64},
    )
    return df.with_columns(pl.Series("score_o", outcome, pl.Float64)) if outcome is not None else df


def tokens(df, s=S):
    return compute_advantages(df, "grpo_process", s)["token_advantages"].to_list()


def test_step_advantages_by_hand():
    # Group a: response 0 has 3 tokens and steps ending on tokens 0 and 2 with rewards 1, 0; response 1 has 2 tokens,
    # one step, reward 1. R = {1, 0, 1}: mean 2/3, unbiased std sqrt(1/3) = 0.57735; normalised 0.57735, −1.1547,
    # 0.57735. Token t sums the normalised rewards of the steps ending at or after it.
    # Group b: every step reward equal, so every advantage is 0.
    z = 1 / math.sqrt(3)
    df = step_frame(
        [("a", 3, [0, 2], [1.0, 0.0]), ("a", 2, [1], [1.0]), ("b", 2, [0, 1], [0.5, 0.5]), ("b", 1, [0], [0.5])]
    )
    out = compute_advantages(df, "grpo_process", S)
    assert out["token_advantages"].to_list() == [
        pytest.approx([z - 2 * z, -2 * z, -2 * z]),
        pytest.approx([z, z]),
        [0.0, 0.0],
        [0.0],
    ]
    assert out["advantage"].to_list() == pytest.approx([-z, z, 0.0, 0.0])  # the first token's
    assert out["returns"].to_list() == out["token_advantages"].to_list()


def test_outcome_parts_count_on_the_last_step_and_a_failed_process_reward_scores_zero_per_step():
    # response 0: steps [1, 0] + outcome 1 on its last step → [1, 1]; response 1: failed (null) → [0] + outcome 0.
    # R = {1, 1, 0}: mean 2/3, std 0.57735; normalised 0.57735, 0.57735, −1.1547.
    z = 1 / math.sqrt(3)
    df = step_frame([("a", 2, [0, 1], [1.0, 0.0]), ("a", 1, [0], None)], outcome=[1.0, 0.0])
    s = AdvantageSettings(eps=1e-12, step_parts=(("steps_p", 1.0),), outcome_parts=(("score_o", 1.0),))
    assert tokens(df, s) == [pytest.approx([2 * z, z], abs=1e-6), pytest.approx([-2 * z], abs=1e-6)]


def test_weights_scale_each_process_reward():
    df = step_frame([("a", 1, [0], [1.0]), ("a", 1, [0], [0.0])]).with_columns(
        pl.Series("steps_q", [[0.0], [1.0]], LF64)
    )
    # 2·p + 1·q: rewards 2 and 1, normalised ±0.7071
    s = AdvantageSettings(eps=1e-12, step_parts=(("steps_p", 2.0), ("steps_q", 1.0)))
    assert tokens(df, s) == [pytest.approx([math.sqrt(0.5)], abs=1e-6), pytest.approx([-math.sqrt(0.5)], abs=1e-6)]


def loop_step_advantages(rows, eps):
    """Reference: per group, normalise every step reward; per token, sum the normalised rewards of the steps that end
    at or after it."""
    out = [None] * len(rows)
    for group in sorted({r[0] for r in rows}):
        members = [i for i, r in enumerate(rows) if r[0] == group]
        values = [v for i in members for v in rows[i][3]]
        equal = max(values) == min(values) or len(values) < 2
        mean = statistics.fmean(values)
        std = 0.0 if equal else statistics.stdev(values)
        for i in members:
            _, length, ends, scores = rows[i]
            normed = [0.0 if equal else (v - mean) / (std + eps) for v in scores]
            out[i] = [sum(n for e, n in zip(ends, normed) if e >= t) for t in range(length)]
    return out


def test_step_advantages_match_a_reference_loop():
    rng = random.Random(7)
    rows = []
    for g in range(40):
        for _ in range(rng.choice([1, 2, 4, 8])):
            length = rng.randrange(0, 12)
            k = rng.randrange(1, 5)
            ends = sorted(rng.randrange(0, length) for _ in range(k - 1)) + [length - 1] if length else [-1] * k
            rows.append((f"p{g:02d}", length, ends, [rng.choice([0.0, 0.5, 1.0]) for _ in range(k)]))
    got = compute_advantages(step_frame(rows), "grpo_process", AdvantageSettings(step_parts=(("steps_p", 1.0),)))
    want = loop_step_advantages(rows, 1e-6)
    for g, w in zip(got["token_advantages"].to_list(), want):
        assert g == pytest.approx(w, abs=1e-4)


# ---- Through the scoring path -----------------------------------------------------------------------------------


@pytest.mark.parametrize("batched, workers", [(False, 0), (True, 2)])
def test_a_per_step_function_writes_its_steps_and_their_aggregate(batched, workers):
    function = "digit_steps_batched" if batched else "digit_steps"
    spec = {
        "digits": {"module": FIXTURES, "function": function, "batched": batched, "per_step": True},
        "worst": {
            "module": FIXTURES,
            "function": function,
            "batched": batched,
            "per_step": True,
            "step_aggregate": "min",
            "weight": 0.0,
        },
    }
    cfg = RewardConfig(functions=spec, workers=workers, steps={"delimiter": ";"})
    df = score_frame(rollouts(["1;x;2", "12", "a;b"]), prompts(), cfg, 8)
    assert df["steps_digits"].to_list() == [[1.0, 0.0, 1.0], [1.0], [0.0, 0.0]]
    assert df["score_digits"].to_list() == pytest.approx([2 / 3, 1.0, 0.0])
    assert df["score_worst"].to_list() == [0.0, 1.0, 0.0]
    assert df["reward"].to_list() == pytest.approx([2 / 3, 1.0, 0.0])


def test_a_per_step_function_with_the_wrong_count_costs_the_sample_its_score():
    cfg = RewardConfig(
        functions={"bad": {"module": FIXTURES, "function": "one_step_score", "per_step": True}}, workers=0
    )
    df = score_frame(rollouts(["a\nb", "c"]), prompts(), cfg, 8)
    assert df["error_bad"][0] == "ValueError: returned 1 step scores for 2 steps"
    assert df["steps_bad"].to_list() == [None, [1.0]] and df["score_bad"].to_list() == [0.0, 1.0]
    not_a_list = RewardConfig(functions={"n": {"module": FIXTURES, "function": "echo_length", "per_step": True}})
    df = score_frame(rollouts(["a"]), prompts(), not_a_list.model_copy(update={"workers": 0}), 8)
    assert "not a list of step scores" in df["error_n"][0]


# ---- Config -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"advantage": {"estimator": "grpo_process"}}, "grpo_process needs a process reward"),
        ({"reward": {"steps": {"regex": "("}}}, "reward.steps.regex '(' is not a regular expression"),
        ({"reward": {"steps": {"regex": "x*"}}}, "matches the empty string"),
        (
            {
                "reward": {"functions": {"accuracy": {}, "s": {"path": "r.py", "per_step": True}}},
                "agent": {"tools": {"add": {"path": "t.py"}}},
            },
            "process rewards score single-turn responses",
        ),
    ],
)
def test_process_reward_config_errors(data, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        build_config(data)
    ok = {"reward": {"functions": {"accuracy": {}, "s": {"path": "r.py", "per_step": True}}}}
    assert build_config({**ok, "advantage": {"estimator": "grpo_process"}}).reward.functions["s"].per_step


def test_the_documented_example_checks_each_column_of_a_worked_sum():
    """examples/process_rewards as docs/train-your-own-model.md shows it: its config's reward section, through the
    scoring path, on the long_addition task's answers (a dropped carry costs that column and the result)."""
    from schemas.config import load_config
    from tasks.data.long_addition import worked_sum
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "examples" / "process_rewards" / "config.yaml")
    assert cfg.advantage.estimator == "grpo_process" and cfg.reward.functions["columns"].per_step
    reward = cfg.reward.model_copy(update={"workers": 0})
    texts = [worked_sum(4821, 3567, 4), worked_sum(4821, 3567, 4, frozenset({3})), "1+7+0=08;junk"]
    prompt = pl.DataFrame({"prompt_id": ["p0"], "text": ["4821+3567="], "answer": ["8388"]})
    df = score_frame(rollouts(texts), prompt, reward, 64)
    assert df["steps_columns"].to_list() == [[1.0] * 5, [1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0]]
    assert df["score_columns"].to_list() == pytest.approx([1.0, 0.6, 0.5])
    assert df["score_accuracy"].to_list() == [1.0, 0.0, 0.0]


def test_the_process_models_loss_is_each_steps_binary_cross_entropy_averaged_over_the_response():
    import torch

    from tasks.algos.preference_losses import step_label_loss

    logits = [torch.tensor([0.0, 2.0]), torch.tensor([-1.0]), torch.tensor([])]
    labels = [torch.tensor([1.0, 0.0]), torch.tensor([0.0]), torch.tensor([])]
    p = 1 / (1 + math.exp(-2.0))  # σ(2)
    want = [(-math.log(0.5) - math.log(1 - p)) / 2, -math.log(1 - 1 / (1 + math.exp(1.0))), 0.0]
    assert step_label_loss(logits, labels).tolist() == pytest.approx(want)


def test_process_model_step_logits_are_the_heads_reading_at_each_steps_last_token():
    """The shared-prefix layout (a group's prompt once) against a plain forward of each prompt + response on a tiny
    token-classification model: the same logits at the steps' last tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForTokenClassification

    from tasks.engines.workers.sequence_scores import step_logits

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, classifier_dropout=0.0,
    )  # fmt: skip
    model = LlamaForTokenClassification(config).eval()
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5]]
    responses = [[6, 7, 8, 9], [10, 11], [12, 13, 14]]
    ends = [[0, 2, 3], [1], [0, 2]]
    with torch.no_grad():
        got = step_logits(model, prompts, responses, ends, pad=0)
        for p, r, e, g in zip(prompts, responses, ends, got):
            full = model(input_ids=torch.tensor([p + r])).logits[0, :, 0]
            assert g.tolist() == pytest.approx(full[[len(p) + j for j in e]].tolist(), abs=1e-5)


def test_process_model_held_out_figures_by_hand():
    from tasks.algos.metrics import prm_summary

    df = pl.DataFrame(
        {
            "step_labels": [[1.0, 1.0], [1.0, 0.0], [0.0]],
            "step_scores": [[0.9, 0.6], [0.8, 0.3], [0.7]],
        }
    )
    got = prm_summary(df)
    # steps: labels 1,1,1,0,0 against scores .9,.6,.8,.3,.7 → right at 0.5: 1,1,1,1,0 = 4/5; majority (1) 3/5;
    # AUC: positives .9,.6,.8 over negatives .3,.7: pairs won 2+1+2 = 5 of 6
    assert got["steps"] == 5 and got["step_accuracy"] == pytest.approx(0.8)
    assert got["step_majority_accuracy"] == pytest.approx(0.6) and got["step_auc"] == pytest.approx(5 / 6)
    # responses (the weakest step): right 1,0,0 with min scores .6,.3,.7 → at 0.5 right: 1,1,0 = 2/3; AUC .6 over .3,.7
    assert got["responses"] == 3 and got["response_accuracy"] == pytest.approx(2 / 3)
    assert got["response_auc"] == pytest.approx(0.5)


def test_a_process_model_joins_the_step_parts_and_grpo_process_accepts_it():
    from tasks.rewards.sources import outcome_parts

    cfg = build_config({}, ["reward.process_model={path: models/prm, weight: 0.5}", "advantage.estimator=grpo_process"])
    assert cfg.reward.weighted_step_parts() == (("steps_prm", 0.5),)
    assert ("score_prm", 0.5) in cfg.reward.weighted_parts()
    assert all(c != "score_prm" for c, _ in outcome_parts(cfg.reward))
    with pytest.raises(ConfigError, match="grpo_process needs a process reward"):
        build_config({}, ["advantage.estimator=grpo_process"])
    with pytest.raises(ConfigError, match="reward_model.step_label 'nope' is not a per_step function"):
        build_config({}, ["reward_model.objective=process", "reward_model.step_label=nope"])
