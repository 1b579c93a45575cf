"""The building blocks of multi-turn rollouts (tasks/agents/): the user's tools and their schemas, contained calls,
tool calls parsed per format, environments whose failures end one episode, and the ids a turn adds (token in, token
out, checked against the chat template's rendering of the whole conversation)."""

import json
import textwrap

import polars as pl
import pytest

from tasks.agents.environments import load_environment, reset, step
from tasks.agents.tool_calls import TOOL_CALL_PARSERS, ToolCall, parse_tool_calls
from tasks.agents.tools import ToolLoadError, call_tool, load_tools
from tasks.agents.turn_tokens import TemplateError, observation_ids, prompt_ids, render_ids
from tasks.rewards.loader import FunctionSpec

TOOLS = '''
import time


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError("no luck")


def slow(x: int) -> str:
    """Never answers in time.

    Args:
        x: Anything.
    """
    time.sleep(5)
    return "late"


def number(x: int) -> int:
    """Returns a number, not text.

    Args:
        x: Anything.
    """
    return x


def shout(x: int) -> str:
    """A long result.

    Args:
        x: How many times.
    """
    return " ".join(["the result is 42"] * x)


def undocumented(x):
    return "x"
'''


@pytest.fixture
def tool_file(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOLS)
    return str(path)


def test_a_tools_schema_comes_from_its_signature_and_docstring_under_its_configured_name(tool_file):
    tools = load_tools([FunctionSpec("calculator", path=tool_file, function="add")])
    assert tools["calculator"].schema == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "string"},
        },
    }
    with pytest.raises(ToolLoadError, match=r"^tool 'undocumented' \(.*tools.py:undocumented\): .*no docstring"):
        load_tools([FunctionSpec("undocumented", path=tool_file)])
    with pytest.raises(ToolLoadError, match="^tool 'nope': .*tools.py has no function 'nope'"):
        load_tools([FunctionSpec("nope", path=tool_file)])
    with pytest.raises(ToolLoadError, match="tool 'add' is listed twice"):
        load_tools([FunctionSpec("add", path=tool_file), FunctionSpec("add", path=tool_file)])


def test_a_tool_that_raises_hangs_returns_no_text_or_is_misnamed_becomes_an_error_observation(tool_file):
    names = ("add", "broken", "slow", "number")
    tools = load_tools([FunctionSpec(n, path=tool_file) for n in names])
    ok = call_tool(tools, "add", {"a": 2, "b": 40}, timeout_s=2)
    assert (ok.text, ok.error) == ("42", None)
    cases = {
        ("broken", '{"x": 1}'): "broken: ValueError: no luck",
        ("slow", '{"x": 1}'): "slow: no result after 0.3s",
        ("number", '{"x": 7}'): "number returned int '7', not a string",
        ("add", '{"a": 1}'): "add: missing a required argument: 'b'",
        ("add", '{"a": 1, "b": 2, "c": 3}'): "add: got an unexpected keyword argument 'c'",
        ("sub", "{}"): "no tool named 'sub' (tools: add, broken, number, slow)",
    }
    for (name, args), error in cases.items():
        out = call_tool(tools, name, json.loads(args), timeout_s=0.3)
        assert out.error == error and out.text == f"error: {error}", (name, out)
    assert call_tool(tools, "slow", {"x": 1}, timeout_s=0.3).seconds < 1.5  # it was stopped, not waited for


def test_hermes_tool_calls_are_parsed_and_a_malformed_one_is_a_call_with_an_error():
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
        "<tool_call>{name: add}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 5,'  # cut off by the token limit
    )
    calls = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments) for c in calls[:2]] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert [c.error for c in calls[:2]] == [None, None]
    assert calls[2].error.startswith("the tool call is not JSON: Expecting property name")
    assert calls[3].error == 'a tool call needs a "name" string'
    assert calls[4] == ToolCall("add", error="add: arguments must be a JSON object", raw=calls[4].raw)
    assert calls[5].error.startswith("the tool call is not JSON")
    assert parse_tool_calls("The answer is 3.", "hermes") == []


def test_json_tool_calls_in_llama_form():
    calls = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "json")
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None)]
    two = parse_tool_calls('[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"x": 1}}]', "json")
    assert [(c.name, c.arguments) for c in two] == [("a", {}), ("b", {"x": 1})]
    assert parse_tool_calls("It is 3.", "json") == []
    assert TOOL_CALL_PARSERS.names() == ["hermes", "json"]


ENVIRONMENT = '''
class GuessTheNumber:
    """Higher/lower feedback until the model says the secret."""

    def __init__(self, limit: int = 3):
        self.limit, self.turns = limit, 0

    def reset(self, row):
        self.secret = row["secret"]
        return [{"role": "user", "content": "Guess my number from 1 to 9."}]

    def step(self, messages):
        self.turns += 1
        guess = int(messages[-1]["content"])
        if guess == self.secret:
            return [], 1.0, True
        hint = "higher" if guess < self.secret else "lower"
        return [{"role": "user", "content": hint}], None, self.turns >= self.limit


class Broken:
    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    def step(self, messages):
        if messages[-1]["content"] == "raise":
            raise RuntimeError("the game crashed")
        if messages[-1]["content"] == "hang":
            while True:
                pass
        if messages[-1]["content"] == "nan":
            return [], float("nan"), True
        return [{"role": "assistant", "content": "I speak for the model"}], None, False
'''


def test_an_environment_plays_and_one_that_fails_ends_only_its_episode(tmp_path):
    path = tmp_path / "env.py"
    path.write_text(ENVIRONMENT)
    env = load_environment(FunctionSpec("guess", path=str(path), function="GuessTheNumber"))(limit=3)
    opening, error = reset(env, {"secret": 7}, timeout_s=1)
    assert error is None and opening[0]["role"] == "user"
    history = [*opening, {"role": "assistant", "content": "5"}]
    first = step(env, history, timeout_s=1)
    assert (first.messages, first.reward, first.done, first.error) == (
        [{"role": "user", "content": "higher"}],
        None,
        False,
        None,
    )
    last = step(env, [*history, *first.messages, {"role": "assistant", "content": "7"}], timeout_s=1)
    assert (last.reward, last.done, last.error) == (1.0, True, None)

    broken = load_environment(FunctionSpec("broken", path=str(path), function="Broken"))()
    said = lambda text: [{"role": "user", "content": "go"}, {"role": "assistant", "content": text}]  # noqa: E731
    expected = {
        "raise": "step: RuntimeError: the game crashed",
        "hang": "step: no result after 0.3s",
        "nan": "step: TypeError: step returned reward nan: a finite number or None",
        "speak": "step: TypeError: step returned a message {'role': 'assistant', 'content': 'I speak for the model'}: "
        "needs a role of ('user', 'tool', 'system'), text content",
    }
    for text, error in expected.items():
        out = step(broken, said(text), timeout_s=0.3)
        assert (out.messages, out.reward, out.done, out.error) == ([], None, True, error), text


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    from tasks.data.model_recipe import bpe_tokenizer

    corpus = tmp_path_factory.mktemp("corpus") / "corpus.parquet"
    words = ["add", "the", "numbers", "result", "is", "tool_call", "name", "arguments", "higher", "lower", "guess"]
    pl.DataFrame(
        {"text": [" ".join(words[i:] + words[:i]) + ' 0123456789{}:",' for i in range(len(words))]}
    ).write_parquet(corpus)
    return bpe_tokenizer(300, [str(corpus)], "chatml")


def test_three_turns_appended_token_by_token_read_as_the_template_writes_the_whole_conversation(chatml_tokenizer):
    """The sampler's ids for each of the model's turns (ending with its end-of-turn token) and the observation ids
    between them concatenate to exactly the template's rendering of the whole conversation."""
    tok = chatml_tokenizer
    messages = [{"role": "user", "content": "add 2 and 40"}]
    turns = [
        ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>', {"role": "tool", "content": "42"}),
        ("guess 41", {"role": "user", "content": "higher"}),
        ("the result is 42", None),
    ]
    trajectory = prompt_ids(tok, messages)
    conversation = list(messages)
    for said, answer in turns:
        sampled = tok(said, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # as vLLM returns it
        trajectory += sampled
        conversation.append({"role": "assistant", "content": said})
        if answer is not None:
            trajectory += observation_ids(tok, [answer])
            conversation.append(answer)
    whole = render_ids(tok, conversation, None, generation_prompt=False)
    assert trajectory == whole[: len(trajectory)] and tok.decode(whole[len(trajectory) :]) == "\n"  # only the glue
    assert tok.decode(observation_ids(tok, [{"role": "tool", "content": "42"}])) == (
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_rewrites_earlier_turns_cannot_be_appended_to(chatml_tokenizer):
    tok = chatml_tokenizer
    rewriting = "{% for m in messages %}{% if loop.last %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    original, tok.chat_template = tok.chat_template, rewriting
    try:
        with pytest.raises(TemplateError, match="renders a finished conversation differently"):
            observation_ids(tok, [{"role": "user", "content": "higher"}])
    finally:
        tok.chat_template = original


def test_tool_schemas_reach_a_template_that_renders_them(tool_file, chatml_tokenizer):
    tok = chatml_tokenizer
    schema = load_tools([FunctionSpec("add", path=tool_file)])["add"].schema
    template = textwrap.dedent(
        """\
        {%- if tools %}<|im_start|>system
        {% for t in tools %}{{ t['function']['name'] }}: {{ t['function']['description'] }}
        {% endfor %}<|im_end|>
        {% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}
        {{ m['content'] }}<|im_end|>
        {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
        {% endif %}"""
    )
    original, tok.chat_template = tok.chat_template, template
    try:
        text = tok.decode(prompt_ids(tok, [{"role": "user", "content": "add 1 and 2"}], [schema]))
    finally:
        tok.chat_template = original
    assert text.startswith("<|im_start|>system\nadd: Add two integers.\n<|im_end|>")


LOOP_ENV = '''
class Countdown:
    """The model must say the numbers down from the row's start; the episode fails on a wrong one."""

    def __init__(self, crash_on: str = ""):
        self.crash_on = crash_on

    def reset(self, row):
        self.next = row["start"] - 1
        return [{"role": "user", "content": f"count down from {row['start']}"}]

    def step(self, messages):
        said = messages[-1]["content"]
        if said == self.crash_on:
            raise RuntimeError("environment bug")
        if said != str(self.next):
            return [], 0.0, True
        self.next -= 1
        return ([], 1.0, True) if self.next < 0 else ([{"role": "user", "content": "go on"}], 0.5, False)
'''


def scripted(tok, script: dict[int, list[str]], calls: list):
    """Generation from a script: trajectory i's n-th turn says script[i][n] (its tokens, then EOS; cut at max_tokens,
    as the sampler cuts)."""
    from tasks.agents.rollout_loop import Sampled

    def generate(items, max_tokens):
        calls.append(([i for i, _ in items], max_tokens))
        out = []
        for i, ids in items:
            turn = sum(1 for seen, _ in calls[:-1] if i in seen)
            said = tok(script[i][turn], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out.append(
                Sampled(
                    said[:max_tokens], [-0.5] * len(said[:max_tokens]), "length" if len(said) > max_tokens else "stop"
                )
            )
        return out

    return generate


def trajectory_reads_as_the_template_writes_it(tok, t) -> bool:
    whole = render_ids(tok, t.messages, None, generation_prompt=False)
    mine = t.prompt_ids + t.ids
    return mine == whole[: len(mine)]


def test_the_turn_loop_with_tools_ends_each_trajectory_for_its_own_reason(tool_file, chatml_tokenizer):
    from tasks.agents.rollout_loop import LoopSettings, Trajectory, run_episodes
    from tasks.agents.workers import AgentWorkers

    tok = chatml_tokenizer
    specs = [FunctionSpec(n, path=tool_file, kind="tool") for n in ("add", "broken", "slow")]
    schemas = [t.schema for t in load_tools(specs).values()]
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'
    script = {
        0: [call.format("add", '{"a": 2, "b": 40}'), "the result is 42"],  # a call, then the answer
        1: [call.format("broken", '{"x": 1}'), "no luck"],  # a tool that raises: an error observation
        2: [call.format("slow", '{"x": 1}'), "42"],  # a tool that hangs
        3: [call.format("add", '{"a": 1, "b": 1}')] * 5,  # calls until max_turns
        4: ["the result is " + "4" * 150],  # cut by the per-turn limit
        5: ["<tool_call>{broken json</tool_call>", "sorry"],  # a malformed call: an error observation too
    }
    trajectories = [Trajectory(i, f"p{i}", 0, [{"role": "user", "content": "add 2 and 40"}]) for i in script]
    settings = LoopSettings(
        max_turns=3, max_total_tokens=400, max_tokens_per_turn=100, tool_call_format="hermes", environment=False,
        tools=schemas,
    )  # fmt: skip
    workers = AgentWorkers(specs, None, {}, 2, tool_timeout_s=0.5, step_timeout_s=1)
    calls = []
    try:
        played = run_episodes(trajectories, [{}] * 6, tok, settings, scripted(tok, script, calls), workers)
    finally:
        workers.close()
    got = {t.index: (t.finish_reason, t.model_turns, t.tool_calls, t.tool_errors) for t in played}
    assert got == {
        0: ("stop", 2, 1, 0),
        1: ("stop", 2, 1, 1),
        2: ("stop", 2, 1, 1),
        3: ("max_turns", 3, 2, 0),  # the last turn's call is not run: no turn would read its result
        4: ("length", 1, 0, 0),
        5: ("stop", 2, 1, 1),
    }
    assert [c[0] for c in calls] == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 5], [3]]  # all live ones advance together
    tool_rows = {t.index: [r for r in t.turns if r["role"] == "tool"] for t in played}
    assert tool_rows[0][0]["text"] == "42" and tool_rows[0][0]["tool_arguments"] == '{"a": 2, "b": 40}'
    assert tool_rows[1][0]["error"] == "broken: ValueError: no luck"
    assert tool_rows[2][0]["error"] == "slow: no result after 0.5s" and tool_rows[2][0]["text"].startswith("error:")
    assert tool_rows[5][0]["error"].startswith("the tool call is not JSON")
    for t in played:
        assert len(t.ids) == len(t.actions) == len(t.logprobs) <= 400
        model_ids = [i for r in t.turns if r["role"] == "assistant" for i in r["token_ids"]]
        assert [i for i, a in zip(t.ids, t.actions) if a] == model_ids  # the mask covers exactly the sampled ids
        if not t.truncated:
            assert trajectory_reads_as_the_template_writes_it(tok, t), t.index
    assert played[4].truncated and len(played[4].ids) == 100


def test_a_long_tool_result_is_cut_to_max_tool_output_tokens_and_the_cut_recorded(tool_file, chatml_tokenizer):
    from tasks.agents.rollout_loop import CUT_MARK, LoopSettings, Trajectory, run_episodes
    from tasks.agents.workers import AgentWorkers

    tok = chatml_tokenizer
    specs = [FunctionSpec("shout", path=tool_file, kind="tool")]
    call = '<tool_call>{"name": "shout", "arguments": {"x": %d}}</tool_call>'
    script = {0: [call % 30, "42"], 1: [call % 1, "42"]}
    said = {0: " ".join(["the result is 42"] * 30), 1: "the result is 42"}
    full = {i: len(tok(text, add_special_tokens=False)["input_ids"]) for i, text in said.items()}
    assert full[0] > 12 >= full[1]
    trajectories = [Trajectory(i, f"p{i}", 0, [{"role": "user", "content": "shout"}]) for i in script]
    settings = LoopSettings(
        max_turns=2, max_total_tokens=400, max_tokens_per_turn=100, tool_call_format="hermes", environment=False,
        tools=[t.schema for t in load_tools(specs).values()], max_tool_output_tokens=12,
    )  # fmt: skip
    workers = AgentWorkers(specs, None, {}, 1, tool_timeout_s=2, step_timeout_s=1)
    try:
        played = run_episodes(trajectories, [{}, {}], tok, settings, scripted(tok, script, []), workers)
    finally:
        workers.close()
    long, short = ([r for r in t.turns if r["role"] == "tool"][0] for t in played)
    assert long["cut_tokens"] == full[0] - 12 and long["text"].endswith(CUT_MARK)
    assert (
        tok(long["text"][: -len(CUT_MARK)], add_special_tokens=False)["input_ids"]
        == tok(" ".join(["the result is 42"] * 30), add_special_tokens=False)["input_ids"][:12]
    )
    assert played[0].messages[2] == {"role": "tool", "content": long["text"]}  # what the model read is the cut text
    assert short["cut_tokens"] is None and short["text"] == "the result is 42"
    assert all(trajectory_reads_as_the_template_writes_it(tok, t) for t in played)


def test_the_turn_loop_with_an_environment_sums_its_rewards_and_survives_its_failure(tmp_path, chatml_tokenizer):
    from tasks.agents.rollout_loop import LoopSettings, Trajectory, run_episodes
    from tasks.agents.workers import AgentWorkers

    tok = chatml_tokenizer
    path = tmp_path / "countdown.py"
    path.write_text(LOOP_ENV)
    env = FunctionSpec("environment", path=str(path), function="Countdown", kind="environment")
    script = {0: ["2", "1", "0"], 1: ["2", "7"], 2: ["2", "boom"], 3: ["2", "1", "0"]}
    rows = [{"start": 3}, {"start": 3}, {"start": 3}, {"start": 3}]
    trajectories = [Trajectory(i, "p", i, [{"role": "user", "content": "unused"}]) for i in script]
    workers = AgentWorkers([], env, {"crash_on": "boom"}, 2, tool_timeout_s=1, step_timeout_s=1)
    try:
        settings = LoopSettings(
            max_turns=4, max_total_tokens=200, max_tokens_per_turn=16, tool_call_format=None, environment=True,
            tools=None,
        )  # fmt: skip
        played = run_episodes(trajectories, rows, tok, settings, scripted(tok, script, []), workers)
    finally:
        workers.close()
    got = {t.index: (t.finish_reason, t.model_turns, t.env_reward, t.error) for t in played}
    assert got == {
        0: ("stop", 3, 2.0, None),
        1: ("stop", 2, 0.5, None),
        2: ("error", 2, 0.5, "step: RuntimeError: environment bug"),
        3: ("stop", 3, 2.0, None),
    }
    assert played[0].messages[0] == {"role": "user", "content": "count down from 3"}  # reset replaced the prompt
    assert all(trajectory_reads_as_the_template_writes_it(tok, t) for t in played)


def test_replaying_a_trajectorys_tool_calls_against_a_changed_tool(tmp_path, tool_file):
    import time

    from schemas.config import build_config, dump_config
    from schemas.tables import TURNS
    from storage import RunLayout, write_stage
    from tasks.analysis.replay import replay_tool_calls

    layout = RunLayout(tmp_path / "runs", "r")
    layout.run_dir.mkdir(parents=True)
    layout.config_path.write_text(dump_config(build_config({"agent": {"tools": {"add": {"path": tool_file}}}})))
    row = {"iteration": 1, "round": 0, "prompt_id": "p", "sample_idx": 0, "token_ids": [], "sampler_logprobs": []}
    turns = pl.DataFrame(
        [
            {**row, "turn": 0, "role": "user", "text": "add 2 and 40", "tool_name": None, "tool_arguments": None},
            {**row, "turn": 1, "role": "tool", "text": "42", "tool_name": "add", "tool_arguments": '{"a": 2, "b": 40}'},
            {**row, "turn": 2, "role": "tool", "text": "error: bad", "tool_name": "", "tool_arguments": "{x"},
        ],
        schema_overrides=TURNS.columns,
        strict=False,
    ).with_columns(error=pl.lit(None, pl.Utf8), seconds=pl.lit(0.01), cut_tokens=pl.lit(None, pl.Int32))
    write_stage(
        layout, "turns", 1, TURNS.validate(turns), fp="f", inputs={}, config_hash="", started=time.time(), table=TURNS
    )
    same = replay_tool_calls(str(layout.root), "r", 1, "p", 0)
    assert same.select("tool", "replayed", "same").rows() == [("add", "42", True), ("", None, False)]
    changed = tmp_path / "changed.py"
    changed.write_text(TOOLS.replace("return str(a + b)", "return str(a - b)"))
    replayed = replay_tool_calls(str(layout.root), "r", 1, "p", 0, str(changed))
    assert replayed.select("replayed", "same").row(0) == ("-38", False)


def test_multi_turn_figures_per_iteration_by_hand():
    from tasks.analysis.agent_stats import per_iteration

    rollouts = pl.DataFrame(
        {
            "iteration": [1, 1, 2, 2],
            "action_mask": [[1], [1], [1], [1]],
            "turns": [1, 3, 2, 2],
            "tool_calls": [0, 2, 1, 3],
            "tool_errors": [0, 1, 0, 3],
            "env_reward": [None, None, 1.0, 0.0],
            "finish_reason": ["stop", "max_turns", "stop", "length"],
            "truncated": [False, False, False, True],
            "agent_error": [None, None, None, "step: boom"],
        }
    )
    got = per_iteration(rollouts).rows(named=True)
    assert got[0] == {
        "iteration": 1, "turns": 2.0, "tool_call_rate": 0.5, "calls": 1.0, "call_errors": 0.5, "env_reward": None,
        "max_turns": 0.5, "truncated": 0.0, "failed": 0.0,
    }  # fmt: skip
    assert got[1] == {
        "iteration": 2, "turns": 2.0, "tool_call_rate": 1.0, "calls": 2.0, "call_errors": 0.75, "env_reward": 0.5,
        "max_turns": 0.0, "truncated": 0.5, "failed": 0.5,
    }  # fmt: skip
    # A trajectory the environment never stepped earned 0 from it, as the reward counts it (it was left out: 1.0).
    once = rollouts.filter(pl.col("iteration") == 2).with_columns(env_reward=pl.Series([1.0, None]))
    assert per_iteration(once)["env_reward"].to_list() == [0.5]
    assert per_iteration(rollouts.drop("action_mask")) is None  # single-turn rollouts


ROW_ENV = '''
class Quiz:
    """Reads the dataset's own columns, as the docs describe the row."""

    def reset(self, row):
        if row.get("level") == "broken":
            raise KeyError("level")
        if "qid" in row:  # data.prompt_key question, data.id_key qid: both columns by their own names too
            return [{"role": "user", "content": f"{row['question']} (id {row['qid']}, level {row['level']})"}]
        assert row["extra"]["question"] == row["question"]  # also kept nested, as before
        self.answer = row["answer"]
        return [{"role": "user", "content": f"{row['question']} (level {row['level']})"}]

    def step(self, messages):
        return [], float(messages[-1]["content"].strip() == self.answer), True
'''


CHATTY_ENV = '''
class Chatty:
    """Never done: each step says "again" and pays 0.5."""

    def reset(self, row):
        return [{"role": "user", "content": "start"}]

    def step(self, messages):
        return [{"role": "user", "content": "again"}], 0.5, False
'''


def agent_play(tmp_path, tok, rows: list[dict], script: list[str], data=None, env=("Quiz", ROW_ENV)):
    """The rollouts stage's multi-turn path (agent_rollouts.play) on prompts read by the dataset loader from a JSONL
    file, with the environment above in its worker processes and generation scripted (each trajectory says the next
    line of `script`)."""
    from types import SimpleNamespace

    from schemas.config import AgentConfig, DataConfig
    from schemas.requests import GenerationReply, JobTiming
    from tasks.data.datasets import prompt_rows
    from tasks.stages import agent_rollouts

    (tmp_path / "model").mkdir()
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "env.py").write_text(env[1])
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = data or DataConfig()
    prompts = prompt_rows([str(path)], data, "data.train_files", "train").with_columns(
        text=pl.col("prompt"),
        messages=pl.col("prompt").map_elements(lambda p: [{"role": "user", "content": p}], return_dtype=pl.Object),
        prompt_token_ids=pl.lit([1, 2], dtype=pl.List(pl.Int32)),
    )
    agent = AgentConfig(environment={"path": str(tmp_path / "env.py"), "function": env[0]}, max_turns=2)
    rollout, engines = SimpleNamespace(max_tokens=8), SimpleNamespace(agent_workers=1)
    ctx = SimpleNamespace(cfg=SimpleNamespace(agent=agent, rollout=rollout, engines=engines, data=data))
    said = iter(script)

    def generate_frames(frame, job, name):
        ids = [tok(next(said), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _ in frame["prompt_id"]]
        logprobs = pl.Series([[-0.1] * len(i) for i in ids])
        out = frame.select("prompt_id").with_columns(
            token_ids=pl.Series(ids), sampler_logprobs=logprobs, finish_reason=pl.lit("stop")
        )
        timing = JobTiming(generate_seconds=0.0, tokens=sum(map(len, ids)))
        return out, GenerationReply(
            engine_start_seconds=0.0, sync_seconds=0.0, sync_logprob_gap=None, jobs=(timing,), vllm_version="",
            peak_rss_gib=0.0, kv_cache_gib=None,
        )  # fmt: skip

    return agent_rollouts.play(ctx, str(tmp_path / "model"), prompts, 1, 0, "t", generate_frames, lambda seed: {})


def test_an_environments_reset_gets_the_dataset_columns_at_the_top_of_the_row(tmp_path, chatml_tokenizer):
    rows = [
        {"prompt": "unused", "answer": "5", "question": "add 2 3", "level": 1},
        {"prompt": "unused", "answer": "9", "question": "add 4 5", "level": 2},
    ]
    frame, turns, _, _ = agent_play(tmp_path, chatml_tokenizer, rows, ["5", "7"])
    assert frame["agent_error"].to_list() == [None, None]
    assert frame["env_reward"].to_list() == [1.0, 0.0]
    opening = turns.filter(pl.col("role") == "user")["text"].to_list()
    assert opening == ["add 2 3 (level 1)", "add 4 5 (level 2)"]


def test_reset_gets_the_prompt_and_id_columns_by_their_own_names(tmp_path, chatml_tokenizer):
    from schemas.config import DataConfig

    rows = [{"question": "add 2 3", "answer": "5", "qid": 17, "level": 1}]
    data = DataConfig(prompt_key="question", id_key="qid")
    _, turns, _, _ = agent_play(tmp_path, chatml_tokenizer, rows, ["5"], data=data)
    assert turns.filter(pl.col("role") == "user")["text"].to_list() == ["add 2 3 (id 17, level 1)"]


def test_after_the_last_turn_the_environments_feedback_is_not_a_turn(tmp_path, chatml_tokenizer):
    """max_turns 2: the environment steps after each model turn (its rewards summed), but the feedback after the
    last one is never read by the model, so it is not in the trajectory's turns (issue 57 item 9)."""
    rows = [{"prompt": "p", "answer": "5"}]
    frame, turns, _, _ = agent_play(tmp_path, chatml_tokenizer, rows, ["a", "b"], env=("Chatty", CHATTY_ENV))
    assert frame["finish_reason"].to_list() == ["max_turns"] and frame["env_reward"].to_list() == [1.0]
    assert turns.filter(pl.col("role") == "user")["text"].to_list() == ["start", "again"]
    assert turns.filter(pl.col("role") == "assistant").height == 2


def test_every_episode_ending_before_the_first_turn_is_one_line_with_an_example_error(tmp_path, chatml_tokenizer):
    from tasks.stages.agent_rollouts import NoTurnError

    rows = [{"prompt": "p", "answer": "5", "question": "q", "level": "broken"}] * 3
    with pytest.raises(NoTurnError) as e:
        agent_play(tmp_path, chatml_tokenizer, rows, [])
    assert str(e.value) == (
        "agent: all 3 episodes ended before the model's first turn (3 with an environment error; e.g. prompt "
        "'train-000000': reset: KeyError: 'level')"
    )


def test_arpo_branches_at_high_entropy_after_a_tool_result_within_the_group_budget(tool_file, chatml_tokenizer):
    """A hand-worked tree (agent.branching): prompt p starts 2 trajectories of a budget of 4 and branches after its
    tool results; prompt q's trajectories answer without tools, so it is refilled with one fresh trajectory a step.
    α = 0.5, β = 0.2, entropies in units of log|V|, the draws scripted."""
    import math

    from tasks.agents.rollout_loop import Branching, LoopSettings, Sampled, Trajectory, run_episodes
    from tasks.agents.workers import AgentWorkers

    tok, vocab = chatml_tokenizer, 300
    unit = math.log(vocab)
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    # what each trajectory (by index) says at its n-th generation, with the head entropy (× log|V|)
    script = {
        0: [(call, 1.0), ("5", 2.5)],  # ΔH = 1.5: P = 0.8, draw 0.7 → branch 5 at the point before "5"
        1: [(call, 1.0), ("6", 0.0)],  # ΔH = −1: P = 0.3, draw 0.4 → no branch
        2: [("9", 1.0)],
        3: [("9", 1.0)],
        4: [("9", 1.0)],  # q's first refill: q has 3
        5: [(call, 0.2), ("5", 3.0)],  # the branch's own first turn does not branch; then ΔH = 2: P = 0.9, draw 0.85
        6: [("9", 1.0)],  # q's second refill: q is full (4)
        7: [("7", 0.5)],  # the branch of the branch: p is full, no draw
    }
    draws = iter([0.7, 0.4, 0.85])
    seen: dict[int, int] = {}
    steps = []

    def generate(items, max_tokens):
        steps.append([i for i, _ in items])
        out = []
        for i, _ in items:
            text, entropy = script[i][seen.get(i, 0)]
            seen[i] = seen.get(i, 0) + 1
            said = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out.append(Sampled(said, [-0.5] * len(said), "stop", entropy * unit))
        return out

    specs = [FunctionSpec("add", path=tool_file, kind="tool")]
    settings = LoopSettings(
        max_turns=3, max_total_tokens=400, max_tokens_per_turn=100, tool_call_format="hermes", environment=False,
        tools=[t.schema for t in load_tools(specs).values()],
    )  # fmt: skip
    user = [{"role": "user", "content": "add 2 and 3"}]
    trajectories = [Trajectory(i, pid, i % 2, list(user)) for i, pid in enumerate(["p", "p", "q", "q"])]
    rows = [{"id": t.prompt_id} for t in trajectories]
    tree = Branching(group_size=4, initial=2, alpha=0.5, beta=0.2, copies=1, vocab_size=vocab, draw=lambda: next(draws))
    workers = AgentWorkers(specs, None, {}, 1, tool_timeout_s=2, step_timeout_s=1)
    try:
        played = run_episodes(trajectories, rows, tok, settings, generate, workers, tree)
    finally:
        workers.close()
    assert next(draws, None) is None  # exactly the three draws above
    assert steps == [[0, 1, 2, 3], [0, 1, 4], [5, 6], [5], [7]]
    assert rows == [{"id": pid} for pid in "ppqqqpqp"]
    by = {t.index: t for t in played}
    got = {
        i: (t.prompt_id, t.sample_idx, t.parent, t.branch_point, t.model_turns, t.finish_reason) for i, t in by.items()
    }
    point_0, point_5 = by[5].branch_point, by[7].branch_point
    assert got == {
        0: ("p", 0, None, None, 2, "stop"),
        1: ("p", 1, None, None, 2, "stop"),
        2: ("q", 0, None, None, 1, "stop"),
        3: ("q", 1, None, None, 1, "stop"),
        4: ("q", 2, None, None, 1, "stop"),
        5: ("p", 2, 0, point_0, 3, "stop"),
        6: ("q", 3, None, None, 1, "stop"),
        7: ("p", 3, 2, point_5, 3, "stop"),
    }
    # the branch points: right after a tool result, the prefixes shared exactly, the turn after it sampled anew
    assert point_0 == len(by[0].ids) - len(by[0].turns[-1]["token_ids"])  # before trajectory 0's last turn, "5"
    assert [tree.probability(h * unit, 1.0 * unit) for h in (2.5, 0.0, -2.0, 4.0)] == pytest.approx([0.8, 0.3, 0, 1])
    for child, parent in ((5, 0), (7, 5)):
        point = by[child].branch_point
        assert by[child].ids[:point] == by[parent].ids[:point]
        assert by[child].actions[point - 1] == 0 and by[child].actions[point] == 1  # an observation, then the model
        inherited = by[child].turns[: by[child].inherited_turns]
        assert inherited == by[parent].turns[: len(inherited)] and inherited[-1]["role"] == "tool"
    assert by[5].tool_calls == 2 and by[7].tool_calls == 2 and by[7].initial_entropy == 1.0 * unit
    assert [by[i].last_text for i in (0, 1, 5, 7)] == ["5", "6", "5", "7"]
    assert all(trajectory_reads_as_the_template_writes_it(tok, t) for t in played)


def test_arpos_head_entropy_sums_the_candidates_entropy_over_the_first_k_positions():
    """The sampler's candidates at each position (vLLM's logprobs: the top ones and the sampled token), as the reference
    code sums them: −Σ_positions Σ_candidates p·log p over the first k positions only."""
    import math
    from types import SimpleNamespace as C

    from tasks.engines.workers.vllm_generate import head_entropy

    steps = [
        {1: C(logprob=math.log(0.5)), 2: C(logprob=math.log(0.25))},  # 0.5·ln2 + 0.25·ln4 = ln2
        {3: C(logprob=0.0)},  # certain: 0
        {4: C(logprob=math.log(0.5))},  # beyond k = 2: not counted
    ]
    assert head_entropy(steps, 2) == pytest.approx(math.log(2))
    assert head_entropy(steps, 3) == pytest.approx(1.5 * math.log(2))
    assert head_entropy([], 20) == 0.0
