"""LLM judges' pure parts: templates, parsing, the expected score over score tokens, group ranking, and the columns
a judge writes (a stand-in `ask` in place of the model; the real engine and `vllm serve` are in test_e2e.py's
check_judges_from_saved_rollouts)."""

import math
import random

import polars as pl
import pytest

from schemas.config import ConfigError, JudgeConfig, load_config
from tasks.algos.metrics import auc
from tasks.analysis.judge_agreement import agreement_table
from tasks.rewards.judge import (
    JudgeError,
    Reply,
    ask_endpoint,
    check_endpoint,
    check_template,
    expected_score,
    judge_columns,
    numbered,
    parse_group,
    parse_pointwise,
    render,
)

URL = {"base_url": "http://127.0.0.1:9/v1", "model": "judge"}


def test_pointwise_reply_takes_the_first_number_normalised_by_the_scale():
    assert parse_pointwise("7", None, (0, 10)) == pytest.approx(0.7)
    assert parse_pointwise("Score: 7/10, a good answer", None, (0, 10)) == pytest.approx(0.7)
    assert parse_pointwise("rating -> 4.5", None, (1, 5)) == pytest.approx(3.5 / 4)
    assert parse_pointwise("Verdict: B, score 2", r"score (\d)", (0, 4)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no score"):
        parse_pointwise("I cannot judge this.", None, (0, 10))
    with pytest.raises(ValueError, match="outside the scale"):
        parse_pointwise("11", None, (0, 10))


def test_expected_score_weights_the_score_tokens_and_renormalises_over_them():
    # p(7) = 0.5, p(" 8") = 0.3, p("x") = 0.2: E = (7·0.5 + 8·0.3) / 0.8 = 7.375 on [0, 10]
    top = (("7", math.log(0.5)), (" 8", math.log(0.3)), ("x", math.log(0.2)))
    assert expected_score(top, (0, 10)) == pytest.approx(0.7375)
    # " 3" and "3" are the same score; 12 is outside [1, 5] and ignored: E = (3·0.4 + 5·0.2) / 0.6
    top = (("3", math.log(0.2)), (" 3", math.log(0.2)), ("5", math.log(0.2)), ("12", math.log(0.4)))
    assert expected_score(top, (1, 5)) == pytest.approx(((3 * 0.4 + 5 * 0.2) / 0.6 - 1) / 4)
    with pytest.raises(ValueError, match="no score token"):
        expected_score((("Sure", -0.1), (",", -2.0)), (0, 10))


def test_group_reply_gives_each_response_its_score_or_its_own_error():
    text = "Response 2: 9\nResponse 1: 3\nresponse #4 = 12\nResponse 2: 1"
    out = parse_group(text, None, 4, (0, 10))
    assert out[0] == pytest.approx(0.3) and out[1] == pytest.approx(0.9)  # the first "Response 2" counts
    assert "no score for response 3" in out[2]
    assert "response 4" in out[3] and "outside the scale" in out[3]


def test_templates_render_and_name_their_missing_fields():
    assert numbered(["a", "b"]) == "Response 1:\na\n\nResponse 2:\nb"
    assert render("{prompt} -> {response} ({topic})", {"prompt": "1+1", "response": "2", "topic": None}) == (
        "1+1 -> 2 ()"
    )
    judge = JudgeConfig(**URL, template="{prompt}\n{response}\nRubric: {rubric}")
    check_template(judge, "j", {"rubric"})
    with pytest.raises(JudgeError, match=r"reward.judges.j.template names \{rubric\}"):
        check_template(judge, "j", set())
    with pytest.raises(JudgeError, match="names 'rubric'"):
        render(judge.template, {"prompt": "p", "response": "r"})


def fake_judge(replies: dict[str, str]):
    """An `ask` that answers each judge prompt from `replies` (by the prompt's last line) and records its calls."""
    calls = []

    def ask(prompts):
        calls.append(list(prompts))
        return [Reply(replies[p.splitlines()[-1]]) if replies.get(p.splitlines()[-1]) else Reply(error="timed out")
                for p in prompts]  # fmt: skip

    return ask, calls


def sample(pid, k, response, **extra):
    return {"prompt": f"q{pid}", "prompt_id": pid, "sample_idx": k, "response": response, "ground_truth": "4", **extra}


def test_pointwise_columns_ask_each_distinct_response_once_and_keep_prompt_text_and_errors():
    judge = JudgeConfig(**URL, template="{prompt} (truth {ground_truth})\n{response}")
    ask, calls = fake_judge({"four": "Score: 8", "five": "nonsense"})
    samples = [sample("a", 0, "four"), sample("a", 1, "five"), sample("a", 2, "four"), sample("b", 0, "six")]
    cols = judge_columns(judge, "j", samples, ask)
    assert calls == [["qa (truth 4)\nfour", "qa (truth 4)\nfive", "qb (truth 4)\nsix"]]  # one batch, 3 distinct
    assert cols["score_j"] == [pytest.approx(0.8), 0.0, pytest.approx(0.8), 0.0]
    assert cols["error_j"][0] is None and "no score" in cols["error_j"][1] and cols["error_j"][3] == "timed out"
    assert cols["judge_prompt_j"][2] == "qa (truth 4)\nfour" and cols["judge_text_j"] == [
        "Score: 8",
        "nonsense",
        "Score: 8",
        None,
    ]


def test_group_columns_rank_a_prompts_responses_in_one_call_in_sample_order():
    judge = JudgeConfig(**URL, mode="group", template="{n} answers to {prompt}:\n{responses}\nend {prompt}")
    ask, calls = fake_judge({"end qa": "Response 1: 2\nResponse 2: 10\nResponse 3: 6", "end qb": ""})
    samples = [sample("a", 2, "z"), sample("b", 0, "y"), sample("a", 0, "x"), sample("a", 1, "w")]
    cols = judge_columns(judge, "rank", samples, ask)
    assert len(calls) == 1 and len(calls[0]) == 2  # one call per group
    assert calls[0][0] == "3 answers to qa:\nResponse 1:\nx\n\nResponse 2:\nw\n\nResponse 3:\nz\nend qa"
    # rows in the rollouts' order: a/2 is response 3, a/0 response 1, a/1 response 2; b's call failed
    assert cols["score_rank"] == [pytest.approx(0.6), 0.0, pytest.approx(0.2), pytest.approx(1.0)]
    assert cols["error_rank"][1] == "timed out" and cols["judge_prompt_rank"][0] == calls[0][0]


@pytest.mark.parametrize(
    "judge, needle",
    [
        ({}, "give model_path"),
        ({"model_path": "m", **URL}, "give model_path"),
        ({"base_url": "http://127.0.0.1:1/v1"}, "needs model"),
        ({**URL, "mode": "group", "score": "logprobs"}, "mode pointwise only"),
        ({**URL, "score": "logprobs", "scale": [0, 0.5]}, "single digits"),
        ({**URL, "score": "logprobs", "scale": [0, 10]}, "single digits"),
        ({"base_url": "http://[::1", "model": "m"}, "is not an http(s)"),
        ({"base_url": "127.0.0.1:8000/v1", "model": "m"}, "is not an http(s)"),
        ({**URL, "chat": False, "system": "Be strict."}, "needs chat: true"),
        ({**URL, "template": "{prompt}"}, "must contain {response}"),
        ({**URL, "mode": "group", "template": "{prompt} {response}"}, "must contain {responses}"),
        ({**URL, "score_pattern": "score ("}, "not a regular expression"),
        ({**URL, "mode": "group", "score_pattern": r"(\d+)"}, "two"),
        ({**URL, "scale": [5, 1]}, "lowest, highest"),
    ],
)
def test_judge_config_errors_name_the_problem(tmp_path, judge, needle):
    path = tmp_path / "c.yaml"
    path.write_text("{}")
    with pytest.raises(ConfigError, match="reward.judges") as err:
        load_config(path, [f"reward.judges={{j: {judge}}}"] if judge else ["reward.judges={j: {}}"])
    assert needle in str(err.value)


def test_a_judge_is_a_weighted_reward_component_and_cannot_share_a_functions_name(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("{}")
    cfg = load_config(path, [f"reward.judges={{helpful: {{weight: 0.5, base_url: '{URL['base_url']}', model: j}}}}"])
    assert ("score_helpful", 0.5) in cfg.reward.weighted_parts()
    with pytest.raises(ConfigError, match="names both a reward function and a judge"):
        load_config(path, [f"reward.judges={{accuracy: {{base_url: '{URL['base_url']}', model: j}}}}"])


def test_auc_matches_the_pairwise_definition_with_ties_counting_half():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(2, 30)
        scores = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(n)]  # many ties
        labels = [rng.random() < 0.4 for _ in range(n)]
        pos = [s for s, y in zip(scores, labels) if y]
        neg = [s for s, y in zip(scores, labels) if not y]
        got = auc(pl.Series(scores), pl.Series(labels))
        if not pos or not neg:
            assert got is None
            continue
        pairs = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
        assert got == pytest.approx(pairs / (len(pos) * len(neg)))


def test_agreement_table_by_hand_and_only_over_the_samples_a_judge_scored():
    scores = pl.DataFrame(
        {
            "score_correct": [1.0, 1.0, 0.0, 0.0, 0.0, 1.0],
            "score_j": [0.9, 0.4, 0.6, 0.1, 0.0, None],  # the last row was scored before the judge was added
            "error_j": [None, None, None, None, "no score in the judge's reply ''", None],
        }
    )
    row = agreement_table(scores, ["j"], "correct", 1.0).row(0, named=True)
    assert row["samples"] == 5 and row["errors"] == 1  # the error's 0.0 is not the judge's opinion: left out below
    # right: 0.9, 0.4; wrong: 0.6, 0.1 → pairs won: 0.9 beats both, 0.4 beats 0.1 → 3 of 4
    assert row["right_share"] == pytest.approx(0.5) and row["auc"] == pytest.approx(3 / 4)
    # ≥ 0.5 against the label: 0.9 ✓, 0.4 ✗, 0.6 ✗, 0.1 ✓
    assert row["agreement"] == pytest.approx(0.5)
    assert row["mean_right"] == pytest.approx(0.65) and row["mean_wrong"] == pytest.approx(0.35)


def test_a_template_or_pattern_that_cannot_be_applied_is_one_line_or_the_samples_error():
    with pytest.raises(JudgeError, match=r"reward.judges.j.template: a judge's template cannot be filled in"):
        check_template(JudgeConfig(**URL, template="{prompt} {response:d}"), "j", set())
    with pytest.raises(JudgeError, match=r"names \{\}"):
        check_template(JudgeConfig(**URL, template="{prompt} {} {response}"), "j", set())
    # a custom group pattern whose first group is not a response number, or whose score is not a number
    assert parse_group("Response A: 3", r"Response (\w): (\w+)", 1, (0, 10)) == [
        "no score for response 1 in the judge's reply 'Response A: 3'"
    ]
    assert "is not a number" in parse_group("Response 1: x", r"Response (\d): (\w+)", 1, (0, 10))[0]
    with pytest.raises(ValueError, match="is not a number"):
        parse_pointwise("score: .", r"score: (\S)", (0, 10))


def test_an_endpoint_that_refuses_costs_each_sample_its_score_and_fails_the_preflight_in_one_line():
    judge = JudgeConfig(base_url="http://127.0.0.1:9/v1", model="judge", timeout_s=5)  # port 9: nothing listens
    replies = ask_endpoint(judge, ["a", "b"])
    assert [r.text for r in replies] == [None, None] and all("APIConnectionError" in r.error for r in replies)
    with pytest.raises(JudgeError, match=r"reward.judges.j: the endpoint http://127.0.0.1:9/v1 did not answer"):
        check_endpoint(judge, "j")
