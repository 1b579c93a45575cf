"""The `reasoning_gym` reward against reasoning-gym's own scorer called by hand, on entries its tasks generate."""

import json

import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer

from tasks.rewards.builtin import BUILTIN_REWARDS, extract_final

TASKS = ["leg_counting", "chain_sum", "spell_backward", "number_sorting", "simple_equations"]


def responses(answer: str) -> list[str]:
    """Right, right with words around it (partial credit where the task gives it), wrong, in no tags, two tags."""
    return [
        f"Let me think.\n<answer>{answer}</answer>",
        f"<answer>The answer is {answer} in total</answer>",
        "<answer>-1</answer>",
        answer,
        f"<answer>0</answer> on second thought <answer>{answer}</answer>",
    ]


@pytest.mark.parametrize("task", TASKS)
def test_the_reward_is_the_tasks_score_answer_on_the_extracted_answer(task):
    reward = BUILTIN_REWARDS.get("reasoning_gym")
    dataset = reasoning_gym.create_dataset(task, size=3, seed=7)
    for entry in dataset:
        for response in responses(entry["answer"]):
            by_hand = dataset.score_answer(extract_answer(response), entry)
            assert reward(response=response, entry=json.dumps(entry)) == by_hand, (task, response)


def test_partial_credit_stays_as_the_task_defines_it():
    entry = reasoning_gym.create_dataset("leg_counting", size=1, seed=1)[0]  # the base scorer: oracle inside the answer
    reward = BUILTIN_REWARDS.get("reasoning_gym")
    got = reward(response=f"<answer>{entry['answer']} legs</answer>", entry=json.dumps(entry))
    assert got == len(entry["answer"]) / len(f"{entry['answer']} legs") and 0 < got < 1


def test_last_line_format_and_the_entry_errors():
    entry = reasoning_gym.create_dataset("chain_sum", size=1, seed=3)[0]
    reward = BUILTIN_REWARDS.get("reasoning_gym")
    response = f"3 + 4 = 7\nso\n{entry['answer']}\n\n"
    assert extract_final(response, "last_line") == entry["answer"]
    assert reward(response=response, entry=json.dumps(entry), answer_format="last_line") == 1.0
    assert reward(response=response, entry=json.dumps(entry)) == 0.0  # no tags: no answer
    with pytest.raises(ValueError, match="is not a reasoning-gym entry"):
        reward(response="<answer>1</answer>", entry="{not json")
    with pytest.raises(ValueError, match="reasoning-gym has no task 'nope'"):
        reward(response="<answer>1</answer>", entry=json.dumps({**entry, "metadata": {"source_dataset": "nope"}}))
    with pytest.raises(ValueError, match="no reasoning-gym entry in column 'rg'"):
        reward(response="<answer>1</answer>", column="rg")
    with pytest.raises(ValueError, match="answer_format 'xml'"):
        reward(response="<answer>1</answer>", entry=json.dumps(entry), answer_format="xml")


ANSWER_IS = r"(?i)answer is:?\s*(.+?)\.?\s*$"


def test_pattern_format_takes_the_last_match_and_its_first_group():
    entry = reasoning_gym.create_dataset("chain_sum", size=1, seed=3)[0]
    reward = BUILTIN_REWARDS.get("reasoning_gym")
    wrong = str(int(entry["answer"]) + 1)
    response = f"The answer is {wrong}.\nNo, wait.\nSo, the final answer is {entry['answer']}."
    assert extract_final(response, "pattern", r"(?im)answer is:?\s*(.+?)\.?\s*$") == entry["answer"]
    assert (
        reward(
            response=response,
            entry=json.dumps(entry),
            answer_format="pattern",
            pattern=r"(?im)answer is:?\s*(.+?)\.?\s*$",
        )
        == 1.0
    )
    assert extract_final("x = 12 and y = 13", "pattern", r"-?\d+") == "13"  # no group: the whole last match
    assert extract_final("no number here", "pattern", r"-?\d+") is None
    # the group of the branch that did not match is no answer, nor is an empty match
    assert extract_final("ANSWER: 5", "pattern", r"answer is (\d+)|ANSWER: (\d+)") is None
    assert extract_final("answer is ", "pattern", r"answer is (\d*)") is None
    assert reward(response="nothing", entry=json.dumps(entry), answer_format="pattern", pattern=ANSWER_IS) == 0.0
    with pytest.raises(ValueError, match="needs a pattern"):
        extract_final("1", "pattern")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"answer_format": "pattern"}, "answer_format 'pattern' needs kwargs.pattern"),
        ({"answer_format": "pattern", "pattern": "(unclosed"}, "kwargs.pattern is not a regular expression"),
        ({"answer_format": "xml"}, "answer_format 'xml': one of tags, last_line, pattern"),
        ({"answer_format": "pattern", "pattern": 12}, "kwargs.pattern must be a string"),
        ({"pattern": "x"}, "kwargs.pattern is read only with answer_format pattern"),
    ],
)
def test_a_bad_answer_format_is_refused_before_any_engine_starts(kwargs, message):
    from schemas.errors import RewardLoadError

    preflight = BUILTIN_REWARDS.get("reasoning_gym").preflight
    with pytest.raises(RewardLoadError, match=message):
        preflight(None, kwargs, {"entry"})
