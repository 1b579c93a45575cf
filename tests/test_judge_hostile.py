"""Judges that misbehave, served on 127.0.0.1 by a real HTTP server speaking OpenAI's chat-completions format: one
that drips its reply a byte at a time (each read is quick, the call is not), one that replies 5 MiB, one that
accepts connections and never answers, one whose replies hold no score. Each costs its samples, bounded in time and
size, never the run, and says so in one line (issue 57, items 2-4); but a judge that scored none of a round's samples
stops the scores stage in one line (reward.stop_when_unscored, issue 75)."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import polars as pl
import pytest

from schemas.config import JudgeConfig, build_config, dump_config
from storage import RunLayout, read_manifest
from tasks.rewards.judge import JudgeError, ask_endpoint, judge_columns
from tasks.rewards.scoring import RewardError
from tasks.rewards.sources import unscored
from tasks.stages.scores import scores_task
from tests.conftest import write_sampled_round


def completion(text: str) -> bytes:
    return json.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "judge",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        }
    ).encode()


class Judge(BaseHTTPRequestHandler):
    """behaviour: ok (replies "7"), drip (the reply a byte every 0.2 s), huge (5 MiB ending in a score), noscore."""

    behaviour = "ok"

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = completion(
            {"ok": "7", "noscore": "I cannot judge this.", "huge": "x" * (5 << 20) + " 9"}.get(self.behaviour, "7")
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.behaviour != "drip":
            self.wfile.write(body)
            return
        for byte in body:  # a call of len(body) × 0.2 s (about 40 s); each read waits 0.2 s
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:
                return  # the client gave up
            time.sleep(0.2)


@pytest.fixture
def judge_server():
    servers = []

    def start(behaviour: str) -> str:
        handler = type("J", (Judge,), {"behaviour": behaviour})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/v1"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def silent_endpoint():
    """A port that accepts connections (the kernel's backlog) and never answers: a hung server."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    sock.close()


def samples(n: int) -> list[dict]:
    return [{"prompt_id": i, "sample_idx": 0, "prompt": f"q{i}", "response": f"r{i}"} for i in range(n)]


def test_a_dripping_judge_is_cut_off_at_the_calls_deadline(judge_server):
    judge = JudgeConfig(base_url=judge_server("drip"), model="judge", timeout_s=2, concurrency=4)
    t0 = time.time()
    replies = ask_endpoint(judge, ["a", "b", "c", "d"], name="slow")
    elapsed = time.time() - t0
    assert all(r.error == "judge call exceeded its deadline of 2 s" for r in replies)
    assert elapsed < 8, elapsed  # a per-read timeout let each call run its ~40 s


def test_a_huge_reply_is_cut_before_it_is_parsed_and_stored(judge_server):
    judge = JudgeConfig(base_url=judge_server("huge"), model="judge", max_reply_chars=1000)
    cols = judge_columns(judge, "big", samples(2), lambda prompts: ask_endpoint(judge, prompts, name="big"))
    assert [len(t) for t in cols["judge_text_big"]] == [1000, 1000]
    assert cols["judge_truncated_big"] == [True, True]
    # The score at the end of 5 MiB is not read: the reply as stored holds none.
    assert cols["score_big"] == [0.0, 0.0] and all("no score" in e for e in cols["error_big"])
    ok = JudgeConfig(base_url=judge_server("ok"), model="judge")
    cols = judge_columns(ok, "ok", samples(2), lambda prompts: ask_endpoint(ok, prompts, name="ok"))
    assert cols["judge_truncated_ok"] == [False, False] and cols["score_ok"] == [0.7, 0.7]


def test_a_dead_judge_trips_its_breaker_and_says_so_once(silent_endpoint, capsys):
    judge = JudgeConfig(base_url=silent_endpoint, model="judge", timeout_s=1, concurrency=4)
    t0 = time.time()
    replies = ask_endpoint(judge, [f"p{i}" for i in range(40)], name="dead")
    elapsed = time.time() - t0
    # 8 calls end (two rounds of 4, 1 s each) before it trips; without the breaker, 10 rounds: 10 s.
    assert elapsed < 5, elapsed
    late = [r for r in replies if r.error.startswith("judge dead stopped calling")]
    assert len(late) >= 30 and all("deadline" in r.error for r in replies if r not in late)
    lines = [x for x in capsys.readouterr().out.splitlines() if "stopped calling" in x]
    assert len(lines) == 1 and "8 of its first 8 calls failed" in lines[0] and "max_failure_rate 0.5" in lines[0]
    with pytest.raises(JudgeError, match="judge dead stopped calling"):
        ask_endpoint(judge.model_copy(update={"on_failure": "stop"}), ["p"] * 12, name="dead")


def test_a_judge_whose_replies_hold_no_score_is_named_in_one_line(judge_server, capsys):
    judge = JudgeConfig(base_url=judge_server("noscore"), model="judge")
    cols = judge_columns(judge, "mute", samples(4), lambda prompts: ask_endpoint(judge, prompts, name="mute"))
    assert cols["score_mute"] == [0.0] * 4
    out = capsys.readouterr().out
    assert "judge mute: 4 of 4 samples got no score" in out and "no score in the judge's reply" in out
    stop = judge.model_copy(update={"on_failure": "stop"})
    with pytest.raises(JudgeError, match="judge mute: 4 of 4 samples got no score"):
        judge_columns(stop, "mute", samples(4), lambda prompts: ask_endpoint(stop, prompts, name="mute"))


def saved_run(root, run_id: str, reward: dict) -> RunLayout:
    """A run folder holding only its config (the scores stage reads nothing else of it but the tables)."""
    layout = RunLayout(root, run_id)
    layout.run_dir.mkdir(parents=True)
    layout.config_path.write_text(dump_config(build_config({"storage_root": str(root), "reward": reward})))
    return layout


def test_a_judge_that_scored_no_sample_stops_the_scores_stage_in_one_line(judge_server, tmp_path):
    """A judge whose score_pattern matches none of its replies ("7" holds no "Score: N") gives every sample an error:
    the scores stage stops, naming the judge and the first error, and marks nothing complete (issue 75: the stage
    ended with one warning line and the run trained on zeros). reward.stop_when_unscored false lets the zeros through,
    each sample with its error; the functions scored as ever."""
    judge = {"base_url": judge_server("ok"), "model": "judge", "score_pattern": r"Score: (\d+)"}
    reward = {"judges": {"mute": judge}, "workers": 0}
    layout = saved_run(tmp_path, "judged", reward)
    upstream = {"rollouts": write_sampled_round(layout, 1, {"p0": ["7", "8"], "p1": ["6", "7"]})}
    with pytest.raises(RewardError) as stopped:
        scores_task.fn(str(tmp_path), "judged", iteration=1, round_=0, upstream=upstream)
    assert str(stopped.value) == (
        "scores: reward.judges.mute scored none of the 4 samples of iteration 1 round 0, each got an error (the "
        "first: no score in the judge's reply '7'); fix it, or set reward.stop_when_unscored=false to train on its "
        "zeros"
    )
    assert read_manifest(layout, "scores", 1) is None
    layout.config_path.write_text(
        dump_config(build_config({"storage_root": str(tmp_path), "reward": {**reward, "stop_when_unscored": False}}))
    )
    scores_task.fn(str(tmp_path), "judged", iteration=1, round_=0, upstream=upstream)
    scores = pl.read_parquet(layout.stage_dir("scores", 1) / "*.parquet").sort("prompt_id", "sample_idx")
    assert scores["score_mute"].to_list() == [0.0] * 4 and scores["error_mute"].null_count() == 0
    assert scores["score_accuracy"].to_list() == [1.0, 0.0, 0.0, 1.0]


def test_unscored_names_each_weighted_part_whose_every_sample_has_an_error():
    """By hand: a part all of whose rows hold an error is unscored; one row scored, a weight of 0, no rows or no error
    column (the reward model's) is not."""
    reward = build_config(
        {
            "reward": {
                "functions": {"accuracy": {"weight": 1.0}, "format": {"weight": 0.0}},
                "judges": {"j": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
                "kind": "model",
                "model_path": "/m",
            }
        }
    ).reward
    frame = pl.DataFrame(
        {
            "error_accuracy": ["boom", "bang"],
            "error_format": ["x", "y"],  # weight 0: trains nothing
            "error_j": [None, "no score"],  # one sample scored
            "score_model": [0.0, 0.0],
        }
    )
    assert unscored(reward, frame) == [("reward.functions.accuracy", "boom")]
    assert unscored(reward, frame.with_columns(pl.lit("e").alias("error_j"))) == [
        ("reward.functions.accuracy", "boom"),
        ("reward.judges.j", "e"),
    ]
    assert unscored(reward, frame.head(0)) == []
