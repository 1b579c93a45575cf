"""The data path every run takes: prompt formatting (chat template or plain template), the dataset built from a
user's files (column mapping, nested ground truth, splits, overlong prompts), SFT examples, and the built-in tasks'
files (which never overwrite a user's folder)."""

import json
import re

import polars as pl
import pytest

from schemas.config import (
    ArithmeticTask,
    ConfigError,
    DataConfig,
    LongAdditionTask,
    PromptConfig,
    SFTConfig,
    build_config,
)
from tasks.data.datasets import DatasetError
from tasks.data.example_tasks import TaskFilesError, ensure_task_files
from tasks.data.formatting import FormattingError, PromptFormatter
from tasks.data.long_addition import carry_columns, make_files, teacher, worked_sum
from tasks.data.model_recipe import bpe_tokenizer, char_tokenizer
from tasks.data.prompt_dataset import build_prompt_dataset
from tasks.data.sft_data import build_sft_examples

CHAR = char_tokenizer("0123456789+=QA: ")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    corpus.write_text(json.dumps({"t": "what is one plus two? three. be brief."}))
    return bpe_tokenizer(300, [str(corpus)], "chatml")


def test_a_plain_prompt_is_the_template_with_the_tokenizers_bos():
    f = PromptFormatter(CHAR, PromptConfig(template="Q:{prompt}A:"))
    out = f("1+2=")
    assert not f.chat and out.text == "Q:1+2=A:" and out.token_ids == CHAR("Q:1+2=A:")["input_ids"]
    assert out.token_ids[0] == CHAR.bos_token_id and out.messages == [{"role": "user", "content": "1+2="}]
    assert f.response_ids("3") == [CHAR.convert_tokens_to_ids("3"), CHAR.eos_token_id]
    assert f.response_ids("3", ended=False) == [CHAR.convert_tokens_to_ids("3")]  # cut off by max_tokens: no EOS


def test_a_chat_prompt_takes_the_template_with_the_generation_prompt_and_the_system_prompt(chatml):
    f = PromptFormatter(chatml, PromptConfig(system_prompt="be brief."))
    out = f([{"role": "user", "content": "what is one plus two?"}])
    assert f.chat and out.text == (
        "<|im_start|>system\nbe brief.<|im_end|>\n<|im_start|>user\nwhat is one plus two?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert out.token_ids == chatml(out.text, add_special_tokens=False)["input_ids"]  # the template writes the specials
    assert out.messages[0] == {"role": "system", "content": "be brief."}
    own = f([{"role": "system", "content": "no"}, {"role": "user", "content": "hi"}])
    assert own.messages[0]["content"] == "no" and len(own.messages) == 2  # a prompt's own system message wins
    assert f("what is one plus two?").text.endswith("<|im_start|>assistant\n")  # a string becomes a user message
    assert f.response_ids("three")[-1] == chatml.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize(
    "tokenizer, config",
    [("char", PromptConfig(template="Q:{prompt}A:")), ("chatml", PromptConfig(system_prompt="be brief."))],
)
def test_prompts_tokenized_in_one_call_equal_one_by_one(request, tokenizer, config):
    from tasks.data.datasets import formatted_prompts

    tok = CHAR if tokenizer == "char" else request.getfixturevalue("chatml")
    f = PromptFormatter(tok, config)
    prompts = (
        ["1+2=", "", "12+345=", "0 0"]
        if tokenizer == "char"
        else ["what is one plus two?", [{"role": "user", "content": "hi"}]]
    )
    rows = pl.DataFrame({"_file": ["f"] * len(prompts), "_row": list(range(len(prompts)))})
    got = formatted_prompts(f, prompts, rows, "data.train_files")
    # The reference: the tokenizer called on each text alone (a chat text holds its specials, a template's gets BOS).
    assert [p.token_ids for p in got] == [tok(p.text, add_special_tokens=not f.chat)["input_ids"] for p in got]
    assert got == [f(p) for p in prompts] and len({len(p.token_ids) for p in got}) > 1


def test_a_conversation_without_a_chat_template_is_refused(chatml):
    turns = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2"},
    ]
    with pytest.raises(
        FormattingError, match=r"chat messages \(user, assistant, user\) needs a chat template, and the"
    ):
        PromptFormatter(CHAR, PromptConfig())(turns)
    with pytest.raises(FormattingError, match="is never"):
        PromptFormatter(chatml, PromptConfig(chat_template="never"))(turns)


def test_one_user_message_fills_a_base_models_template_as_a_string_prompt_does():
    """reasoning-gym's rows (a system and a user message) on a model without a chat template: the template is filled
    as it is for the same prompt given as a string, the row's own system message as {system}."""
    f = PromptFormatter(CHAR, PromptConfig(template="{system}Q:{prompt}A:", system_prompt="S."))
    assert f([{"role": "user", "content": "1+1="}]) == f("1+1=")
    assert f("1+1=").text == "S.Q:1+1=A:"
    own = f([{"role": "system", "content": "T."}, {"role": "user", "content": "1+1="}])
    assert own.text == "T.Q:1+1=A:" and own.token_ids == CHAR("T.Q:1+1=A:")["input_ids"]
    assert (
        PromptFormatter(CHAR, PromptConfig(template="Q:{prompt}A:"))([{"role": "user", "content": "2"}]).text == "Q:2A:"
    )
    with pytest.raises(FormattingError, match="always but the tokenizer has no chat template"):
        PromptFormatter(CHAR, PromptConfig(chat_template="always"))


def verl_rows(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "prompt": f"{i}+{i}=",
            "reward_model": {"style": "rule", "ground_truth": i + i},
            "extra_info": {"index": i},
            "data_source": "unit",
        }
        for i in range(start, start + n)
    ]


def test_a_verl_layout_dataset_maps_onto_the_dataset_table(tmp_path):
    pl.DataFrame(verl_rows(30)).write_parquet(tmp_path / "train.parquet")
    data = DataConfig(
        train_files=[str(tmp_path / "*.parquet")], answer_key="reward_model.ground_truth", eval_fraction=0.2
    )
    table, stats = build_prompt_dataset(data, PromptConfig(), CHAR, seed=3)
    assert stats["prompts"] == {"train": 24, "eval": 6} and stats["dropped_overlong"] == {"train": 0, "eval": 0}
    train, held = (table.filter(pl.col("split") == s) for s in ("train", "eval"))
    assert set(train["prompt_id"]).isdisjoint(held["prompt_id"]) and train["prompt_id"][0] == "train-000000"
    assert train["prompt_id"].to_list() == sorted(train["prompt_id"].to_list())  # the files' order is kept
    again, _ = build_prompt_dataset(data, PromptConfig(), CHAR, seed=3)
    assert again.equals(table)  # the held-out fraction is seeded
    row = table.filter(pl.col("prompt_id") == "train-000007").row(0, named=True)
    assert row["answer"] == "14" and row["text"] == "7+7=" and row["prompt_token_ids"] == CHAR("7+7=")["input_ids"]
    assert row["extra"] == {
        "reward_model": {"style": "rule", "ground_truth": 14},
        "extra_info": {"index": 7},
        "data_source": "unit",
    }


def test_overlong_prompts_are_dropped_and_counted(tmp_path):
    rows = [{"prompt": "1+" * n + "1=", "answer": "1"} for n in (1, 20, 2)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    data = DataConfig(train_files=[str(tmp_path / "t.jsonl")], max_prompt_tokens=10)
    table, stats = build_prompt_dataset(data, PromptConfig(), CHAR, seed=0)
    assert table["prompt_id"].to_list() == ["train-000000", "train-000002"] and stats["dropped_overlong"]["train"] == 1
    with pytest.raises(DatasetError, match="row 1: the prompt has 43 tokens, over data.max_prompt_tokens=10"):
        build_prompt_dataset(data.model_copy(update={"overlong_prompts": "error"}), PromptConfig(), CHAR, seed=0)


def test_sft_examples_from_prompt_response_columns_and_from_conversations(tmp_path, chatml):
    pl.DataFrame({"prompt": ["1+1="], "response": ["2"]}).write_parquet(tmp_path / "pr.parquet")
    table, stats = build_sft_examples(SFTConfig(files=[str(tmp_path / "pr.parquet")]), PromptConfig(), CHAR, 64)
    assert stats == {"examples": 1, "dropped_overlong": 0}
    assert table.row(0, named=True)["response_token_ids"] == [CHAR.convert_tokens_to_ids("2"), CHAR.eos_token_id]
    conv = [{"role": "user", "content": "what is one plus two?"}, {"role": "assistant", "content": "three"}]
    pl.DataFrame({"messages": [conv]}).write_parquet(tmp_path / "conv.parquet")
    table, _ = build_sft_examples(
        SFTConfig(files=[str(tmp_path / "conv.parquet")], messages_key="messages"), PromptConfig(), chatml, 64
    )
    row = table.row(0, named=True)
    assert row["response"] == "three" and row["text"].endswith("<|im_start|>assistant\n") and "three" not in row["text"]


def test_a_builtin_task_writes_its_files_once_and_never_into_a_folder_of_yours(tmp_path):
    task = ArithmeticTask(out_dir=str(tmp_path / "arith"), max_operand=9, operations="+", n_eval=5, sft_demos=20)
    paths = ensure_task_files(task)
    train = pl.read_parquet(paths["train"])
    assert train.columns == ["prompt_id", "prompt", "answer"] and train.height == 100 - 5
    assert pl.read_parquet(paths["sft"]).columns == ["prompt_id", "prompt", "response"]
    stamp = (tmp_path / "arith" / "_rlpipe_task.json").stat().st_mtime_ns
    ensure_task_files(task)  # the same settings: nothing rewritten
    assert (tmp_path / "arith" / "_rlpipe_task.json").stat().st_mtime_ns == stamp
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.parquet").write_bytes(b"the user's own data")
    with pytest.raises(TaskFilesError, match="holds files rlpipe did not write"):
        ensure_task_files(task.model_copy(update={"out_dir": str(mine)}))
    assert (mine / "train.parquet").read_bytes() == b"the user's own data"


def test_long_addition_works_columns_and_its_flawed_teacher_drops_carries():
    assert worked_sum(4821, 3567, 4) == "1+7+0=08;2+6+0=08;8+5+0=13;4+3+1=08;#### 8388"
    assert worked_sum(9999, 1, 4) == "9+1+0=10;9+0+1=10;9+0+1=10;9+0+1=10;#### 10000"
    assert carry_columns(4821, 3567, 4) == [3] and carry_columns(9999, 1, 4) == [1, 2, 3]
    import random

    assert teacher(4821, 3567, 4, "forget_carry", 1.0, random.Random(0)).endswith("4+3+0=07;#### 7388")
    assert teacher(4821, 3567, 4, "none", 1.0, random.Random(0)) == worked_sum(4821, 3567, 4)
    files = make_files(4, 50, 10, 1, 20, "none", 0.0)
    assert files["train"].height == 50 and set(files["train"]["prompt"]).isdisjoint(files["eval"]["prompt"])
    response = files["sft"]["response"][0]
    a, b = (int(x) for x in files["sft"]["prompt"][0].rstrip("=").split("+"))
    assert response.endswith(f"#### {a + b}") and len(response) >= 24


def test_every_builtin_task_of_the_config_is_registered():
    from typing import get_args

    from schemas.config import TaskConfig
    from tasks.data.example_tasks import EXAMPLE_TASKS

    union = get_args(get_args(TaskConfig)[0])
    assert sorted(get_args(t.model_fields["name"].annotation)[0] for t in union) == EXAMPLE_TASKS.names()
    assert LongAdditionTask().name in EXAMPLE_TASKS


def test_chat_arithmetic_asks_in_words_as_chat_messages_and_holds_out_distinct_prompts():
    from schemas.config import ChatArithmeticTask
    from tasks.data.chat_arithmetic import PHRASINGS, make_files, problems

    assert len(problems(0, 2, "-")) == 6 and all(a >= b for a, _, b, _ in problems(0, 2, "-"))  # no negative results
    task = ChatArithmeticTask(max_operand=4, n_eval=20, sft_demos=30)
    files = make_files(
        task.min_operand, task.max_operand, task.operations, None, task.n_eval, task.seed, task.sft_demos
    )
    train, held_out, sft = files["train"], files["eval"], files["sft"]
    expected = (25 + 15 + 25) * len(PHRASINGS["+"])  # + and × over 5 × 5 operands, − with a ≥ b
    assert held_out.height == 20 and train.height + held_out.height == expected
    texts = lambda df: [m[0]["content"] for m in df["prompt"].to_list()]  # noqa: E731
    assert set(texts(train)).isdisjoint(texts(held_out)) and len(set(texts(train))) == train.height
    for text, answer, op in zip(texts(train), train["answer"], train["operation"]):
        a, b = (int(t) for t in re.findall(r"\d+", text))
        if text.startswith("Subtract"):
            a, b = b, a
        assert int(answer) == {"+": a + b, "-": a - b, "*": a * b}[op], text
    row = sft.row(0, named=True)
    a, sym, b, _, ans = row["response"].split()
    assert (
        row["prompt"][0]["role"] == "user"
        and int(ans) == {"+": int(a) + int(b), "-": int(a) - int(b), "×": int(a) * int(b)}[sym]
    )
    with pytest.raises(ConfigError, match="task.min_operand=5 exceeds task.max_operand=4"):
        build_config({"task": {"name": "chat_arithmetic", "min_operand": 5, "max_operand": 4}})
