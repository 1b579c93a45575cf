"""Bad user input for the general path (files, columns, reward references, model folders, templates): each case is
one line naming the problem and exit 1 from `rlpipe run` (or `sft`), before any engine starts. The CLI runs in this
process (typer's runner): what is checked is its exit code and its output."""

import glob
import json
import os
import tempfile

import polars as pl
import pytest
from typer.testing import CliRunner

from tasks.data.model_recipe import char_tokenizer, init_model
from tests.conftest import ROOT, tiny_config


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A character-tokenizer model (no chat template) and a folder with weights' config but no tokenizer."""
    root = tmp_path_factory.mktemp("models")
    char = init_model(ROOT / "infra/model/demo_llama.yaml", root / "char")
    bare = root / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((char / "config.json").read_text())
    return {"char": char, "bare": bare}


def write(path, rows):
    pl.DataFrame(rows).write_parquet(path) if str(path).endswith(".parquet") else path.write_text(
        "\n".join(json.dumps(r) for r in rows)
    )
    return path


GOOD = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def case_files(tmp):
    """Every input file a case below names."""
    files = {
        "good": write(tmp / "good.parquet", GOOD),
        "no_prompt": write(tmp / "no_prompt.parquet", [{"question": "1+1=", "answer": "2"}]),
        "null_prompt": write(tmp / "null_prompt.jsonl", [GOOD[0], {"prompt": None, "answer": "3"}]),
        "int_prompt": write(tmp / "int_prompt.parquet", [{"prompt": 7, "answer": "2"}]),
        "bad_role": write(tmp / "bad_role.jsonl", [{"prompt": [{"role": "robot", "content": "hi"}], "answer": "2"}]),
        "chat": write(
            tmp / "chat.jsonl",
            [{"prompt": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}], "answer": "2"}],
        ),
        "dup_ids": write(tmp / "dup_ids.parquet", [{"id": "a", **GOOD[0]}, {"id": "a", **GOOD[1]}]),
        "nested": write(tmp / "nested.parquet", [{"prompt": "1+1=", "reward_model": {"style": "rule"}}]),
        "shadow": write(tmp / "shadow.parquet", [{**GOOD[0], "response": "x"}]),
        "long": write(tmp / "long.parquet", [{"prompt": "1+" * 40 + "1=", "answer": "41"}]),
        "empty": tmp / "empty.parquet",
        "junk": tmp / "junk.parquet",
        "reward_syntax": tmp / "broken_rewards.py",
        "reward_ok": tmp / "rewards.py",
        "sft_conv": write(tmp / "sft.jsonl", [{"messages": [{"role": "user", "content": "1+1="}]}]),
    }
    pl.DataFrame(schema={"prompt": pl.Utf8, "answer": pl.Utf8}).write_parquet(files["empty"])
    files["junk"].write_bytes(b"not parquet")
    files["reward_syntax"].write_text("def score(response:\n")
    files["reward_ok"].write_text(
        "def score(response, ground_truth, **_):\n    return float(response == ground_truth)\n"
        "def needs(response, confidence):\n    return 1.0\n"
    )
    (tmp / "mine").mkdir()
    (tmp / "mine" / "train.parquet").write_bytes(files["good"].read_bytes())
    return files


CASES = [
    # (id, --set overrides, the line's needle)
    ("missing file", ["data.train_files={tmp}/nope.parquet"], "data.train_files: file not found: {tmp}/nope.parquet"),
    ("glob matches nothing", ["data.train_files={tmp}/*.csv"], "data.train_files: no file matches"),
    ("unreadable file", ["data.train_files={junk}"], "cannot read {junk} (Parquet or JSONL expected)"),
    ("empty file", ["data.train_files={empty}"], "data.train_files: {empty} is empty"),
    (
        "missing prompt column",
        ["data.train_files={no_prompt}"],
        "no column 'prompt' in {no_prompt} (columns: question, answer)",
    ),
    ("null prompt", ["data.train_files={null_prompt}"], "{null_prompt} row 1: empty or null 'prompt'"),
    (
        "prompt of the wrong type",
        ["data.train_files={int_prompt}"],
        "column 'prompt' has type Int64; expected a string or a list of chat messages",
    ),
    (
        "unknown chat role",
        ["data.train_files={bad_role}"],
        "{bad_role} row 0: 'prompt' has a role other than system, user, assistant, tool",
    ),
    ("repeated ids", ["data.train_files={dup_ids}", "data.id_key=id"], "{dup_ids} row 1: null or repeated id in 'id'"),
    (
        "nested answer field missing",
        ["data.train_files={nested}", "data.answer_key=reward_model.ground_truth"],
        "reward_model in {nested} has no field 'ground_truth' (fields: style)",
    ),
    (
        "column shadows an argument",
        ["data.train_files={shadow}"],
        "column 'response' would shadow the reward functions' argument",
    ),
    (
        "chat messages, no chat template",
        ["data.train_files={chat}"],
        "{chat} row 0: a prompt given as chat messages (user, assistant) needs a chat template",
    ),
    (
        "chat template forced",
        ["prompt.chat_template=always"],
        "prompt.chat_template=always but the tokenizer has no chat template",
    ),
    (
        "template placeholder",
        ["prompt.template='Q: {question}'"],
        "prompt.template: Value error, template 'Q: {question}' must contain {prompt}",
    ),
    (
        "overlong prompt refused",
        ["data.train_files={long}", "data.max_prompt_tokens=16", "data.overlong_prompts=error"],
        "{long} row 0: the prompt has 83 tokens, over data.max_prompt_tokens=16",
    ),
    (
        "every prompt overlong",
        ["data.train_files={long}", "data.max_prompt_tokens=16"],
        "every prompt is longer than data.max_prompt_tokens=16",
    ),
    (
        "reward file missing",
        ["reward.functions={r: {path: {tmp}/none.py}}", "eval.judge=reward"],
        "reward function 'r': file not found: {tmp}/none.py",
    ),
    (
        "reward function missing",
        ["reward.functions={r: {path: {reward_ok}, function: scor}}", "eval.judge=reward"],
        "reward function 'r': {reward_ok} has no function 'scor' (it defines: needs, score)",
    ),
    (
        "reward file does not import",
        ["reward.functions={r: {path: {reward_syntax}, function: score}}", "eval.judge=reward"],
        "reward function 'r': importing {reward_syntax} failed: SyntaxError",
    ),
    (
        "reward signature",
        ["reward.functions={r: {path: {reward_ok}, function: needs}}", "eval.judge=reward"],
        "rlpipe cannot fill parameter 'confidence'",
    ),
    (
        "unknown built-in reward",
        ["reward.functions={acurracy: {weight: 1}}", "eval.judge=reward"],
        "'acurracy' is not a built-in reward function",
    ),
    ("judge not scored", ["eval.judge=correct"], "eval.judge 'correct' is not scored by this run"),
    ("model folder missing", ["model.path={tmp}/no-model"], "does not exist or has no config.json"),
    (
        "a causal LM as the process reward model",
        ["reward.process_model={path: {char}}"],
        "reward.process_model.path {char} is a LlamaForCausalLM folder, not a process reward model",
    ),
    ("model folder without a tokenizer", ["model.path={bare}"], "model folder {bare} has no usable tokenizer"),
    (
        "task writing into your data",
        ["task.out_dir={tmp}/mine"],
        "task.out_dir {tmp}/mine holds files rlpipe did not write",
    ),
]


@pytest.mark.parametrize("overrides, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_before_any_engine(tmp_path, models, overrides, needle):
    from flows.cli import app

    files = case_files(tmp_path)
    subst = {
        "tmp": str(tmp_path),
        "bare": str(models["bare"]),
        "char": str(models["char"]),
        **{k: str(v) for k, v in files.items()},
    }

    def fill(text: str) -> str:  # {name} → that case file's path; anything else (a template's {prompt}) stays
        for key, value in subst.items():
            text = text.replace("{" + key + "}", value)
        return text

    cfg = tiny_config(
        tmp_path,
        model={"path": str(models["char"])},
        data={"train_files": str(files["good"]), "eval_files": [], "id_key": None},
    )
    args = ["run", str(cfg), "--run-id", "bad"]
    for item in overrides:
        args += ["--set", fill(item)]
    result = CliRunner().invoke(app, args)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert fill(needle) in " ".join(lines), result.output
    assert not list((tmp_path / "runs").glob("*/logs/*.log"))  # no engine was started
    assert not glob.glob(
        os.path.join(tempfile.gettempdir(), f"*-{os.getpid()}-*.out")
    )  # the held engine processes ended (resident.py)


def test_sft_conversations_must_end_with_the_assistant(tmp_path, models):
    from flows.cli import app

    files = case_files(tmp_path)
    cfg = tiny_config(
        tmp_path,
        model={"base_path": str(models["char"])},
        sft={"files": str(files["sft_conv"]), "messages_key": "messages"},
    )
    result = CliRunner().invoke(app, ["sft", str(cfg), "--run-id", "bad-sft"])
    assert result.exit_code == 1 and "a conversation must end with an assistant message" in result.output


def test_a_tokenizer_without_a_pad_token_pads_with_eos():
    from tasks.data.formatting import pad_id

    tok = char_tokenizer()
    assert pad_id(tok) == tok.pad_token_id
    tok.pad_token = None
    assert tok.pad_token_id is None and pad_id(tok) == tok.eos_token_id
