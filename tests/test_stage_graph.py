"""The stage graph: each stage declared once (tasks/stages/graph.py), its body confined to the config sections it
declares, and what each config section's change recomputes. Plus the two caching defects the declarations fixed:
eval ignored rollout.max_tokens, and PPO-ptx's demonstrations were cached once whatever the sft settings."""

import time

import polars as pl
import pytest
import yaml

from schemas.config import RunConfig, build_config, dump_config, load_config
from schemas.tables import TABLES
from storage import RunLayout
from tasks.stages import graph
from tasks.stages.common import Computed, load_run, run_stage
from tasks.stages.spec import SectionView, StageSpec, UndeclaredSection
from tests.conftest import ROOT, tiny_config

# By hand: which stages a change to each config section recomputes (directly, or because they read a stage that
# is recomputed). `engines`, `rl` and `storage_root` change no stage's data.
INVALIDATES = {
    "data": [
        "dataset",
        "sft_data",
        "sft_metrics",
        "prompts",
        "rollouts",
        "turns",
        "carry",
        "scores",
        "batch",
        "logprobs",
        "advantages",
        "prompt_stats",
        "train_metrics",
        "eval",
        "preference_rankings",
        "preference_pairs",
        "ref_logprobs",
        "dpo_metrics",
        "dpo_eval",
        "rm_metrics",
        "rm_eval",
        "prm_steps",
        "prm_metrics",
        "prm_eval",
    ],
    "rollout": [
        "prompts",
        "rollouts",
        "turns",
        "carry",
        "scores",
        "batch",
        "logprobs",
        "advantages",
        "prompt_stats",
        "train_metrics",
        "eval",
        "preference_rankings",
        "preference_pairs",
        "ref_logprobs",
        "dpo_metrics",
        "dpo_eval",
        "rm_metrics",
        "rm_eval",
        "prm_steps",
        "prm_metrics",
        "prm_eval",
    ],
    "reward": [
        "scores",
        "batch",
        "logprobs",
        "advantages",
        "prompt_stats",
        "train_metrics",
        "eval",
        "preference_rankings",
        "preference_pairs",
        "ref_logprobs",
        "dpo_metrics",
        "dpo_eval",
        "rm_metrics",
        "rm_eval",
        "prm_steps",
        "prm_metrics",
        "prm_eval",
    ],
    "batch": ["batch", "logprobs", "advantages", "prompt_stats", "train_metrics", "eval"],
    "advantage": ["logprobs", "advantages", "prompt_stats", "train_metrics", "eval"],
    "kl": ["logprobs", "advantages", "prompt_stats", "train_metrics", "eval"],  # logprobs: kl.placement alone
    "loss": ["logprobs", "train_metrics", "advantages", "prompt_stats", "eval"],  # logprobs: loss.old_logprobs alone
    "critic": ["train_metrics", "advantages", "prompt_stats", "eval"],
    "eval": [
        "eval",
        "preference_rankings",
        "preference_pairs",
        "ref_logprobs",
        "dpo_metrics",
        "dpo_eval",
        "rm_metrics",
        "rm_eval",
    ],
    "sft": ["sft_data", "sft_metrics", "train_metrics", "advantages", "prompt_stats", "eval"],
    "preference": [
        "preference_rankings",
        "preference_pairs",
        "ref_logprobs",
        "dpo_metrics",
        "dpo_eval",
        "rm_metrics",
        "rm_eval",
        "prm_steps",
        "prm_metrics",
        "prm_eval",
    ],
    "dpo": ["ref_logprobs", "dpo_metrics", "dpo_eval"],
    "reward_model": ["rm_metrics", "rm_eval", "prm_steps", "prm_metrics", "prm_eval"],
    "optim": [
        "sft_metrics",
        "scores",
        "batch",
        "logprobs",
        "advantages",
        "prompt_stats",
        "train_metrics",
        "eval",
        "preference_rankings",
        "preference_pairs",
        "ref_logprobs",
        "dpo_metrics",
        "dpo_eval",
        "rm_metrics",
        "rm_eval",
        "prm_steps",
        "prm_metrics",
        "prm_eval",
    ],
    "agent": [
        "rollouts",
        "turns",
        "carry",
        "scores",
        "batch",
        "logprobs",
        "advantages",
        "prompt_stats",
        "train_metrics",
        "eval",
    ],
    "engines": [],
    "rl": [],
}
EVERYTHING = ("model", "prompt")  # the model folder and the prompt formatting: every stage


def test_what_each_config_section_invalidates():
    for section, expected in INVALIDATES.items():
        assert sorted(graph.invalidated_by(section)) == sorted(expected), section
    for section in EVERYTHING:
        assert graph.invalidated_by(section) == [s.name for s in graph.STAGES], section


def test_a_stage_reads_single_keys_it_declares_and_they_alone_enter_its_fingerprint():
    """logprobs declares loss.old_logprobs and kl.placement, not the loss and kl sections: it reads those two keys, any
    other key of those sections is refused, and only those two (when set away from their defaults) change its hash."""
    spec = graph.stage("logprobs")
    view = SectionView(build_config({"loss": {"old_logprobs": "sampler"}}), spec)
    assert view.loss.old_logprobs == "sampler" and view.kl.placement == "loss"
    with pytest.raises(UndeclaredSection, match="read config key loss.clip_eps_low"):
        view.loss.clip_eps_low

    def logprobs_hash(**sections):
        return build_config(sections).section_hash(*spec.sections, keys=spec.keys)

    base = logprobs_hash()
    assert base == RunConfig().section_hash(*spec.sections)  # at their defaults: the hash runs were written with
    assert logprobs_hash(loss={"clip_eps_low": 0.1}, kl={"beta": 0.5}) == base
    assert logprobs_hash(loss={"old_logprobs": "sampler"}) != base != logprobs_hash(kl={"placement": "none"})
    with pytest.raises(ValueError, match="declares config key 'loss.nope'"):
        StageSpec("w", (), ("model",), "run", keys=("loss.nope",))


def test_every_table_has_one_stage_and_every_stage_one_table():
    names = [s.name for s in graph.STAGES]
    assert len(names) == len(set(names))
    assert set(names) == set(TABLES) - {"bench_results"}  # benchmarks write their own results table
    assert graph.stage("optimize") is graph.stage("train_metrics")
    assert [s.name for s in graph.rerunnable()] == [
        "rollouts",
        "scores",
        "batch",
        "logprobs",
        "advantages",
        "train_metrics",
    ]
    assert graph.downstream_tables("advantages") == ["advantages", "prompt_stats", "train_metrics", "eval"]


def test_a_stage_sees_only_the_sections_it_declares():
    spec = StageSpec("t", reads=(), sections=("rollout", "model"), scope="run")
    view = SectionView(RunConfig(), spec)
    assert view.rollout.max_tokens == 8 and view.seed == 0 and view.engines.resident_trainer
    with pytest.raises(UndeclaredSection, match="stage 't' read config section 'advantage'"):
        view.uses_critic  # a property reads through the view: it needs `advantage`
    with pytest.raises(UndeclaredSection, match="'eval'"):
        view.eval
    assert SectionView(RunConfig(), StageSpec("u", (), ("advantage",), "run")).uses_critic is False
    with pytest.raises(ValueError, match="unknown config sections"):
        StageSpec("v", (), ("rolout",), "run")


def fake_run(tmp_path, **sections):
    layout = RunLayout(tmp_path / "runs", "r")
    layout.run_dir.mkdir(parents=True)
    cfg = load_config(tiny_config(tmp_path, **sections))
    layout.config_path.write_text(dump_config(cfg))
    return layout


def test_changing_the_generation_limit_recomputes_eval(tmp_path):
    """Before the declarations, eval read rollout.max_tokens without it in its fingerprint: never recomputed."""
    from tasks.stages.evaluate import SPEC

    layout = fake_run(tmp_path)
    calls = []

    def eval_once():
        ctx = load_run(str(layout.root), "r", SPEC)

        def compute():
            calls.append(ctx.cfg.rollout.max_tokens)
            return Computed(pl.DataFrame({"x": [len(calls)]}))

        return run_stage(ctx, 0, inputs={"weights": "w"}, compute=compute)

    import schemas.tables as tables

    tables.TABLES["eval"], saved = tables.TableSchema("eval", 1, {"x": pl.Int64}), tables.TABLES["eval"]
    try:
        eval_once(), eval_once()
        assert calls == [4]  # the second call was skipped: same fingerprint
        cfg = yaml.safe_load(layout.config_path.read_text())
        cfg["rollout"]["max_tokens"] = 12
        layout.config_path.write_text(yaml.safe_dump(cfg))
        eval_once()
        assert calls == [4, 12]
    finally:
        tables.TABLES["eval"] = saved


def test_changing_the_sft_settings_recomputes_the_ppo_ptx_demonstrations(tmp_path):
    """PPO-ptx read its demonstrations from a file cached once in _scratch; now they are the run's sft_data stage."""
    from tasks.data.example_tasks import ensure_task_files
    from tasks.data.model_recipe import init_model
    from tasks.stages.optimize import ptx_fingerprint
    from tasks.stages.sft import sft_data_task
    from tests.conftest import ROOT

    layout = fake_run(tmp_path, loss={"ptx_coef": 0.1})
    cfg = yaml.safe_load(layout.config_path.read_text())
    init_model(ROOT / "infra/model/demo_llama.yaml", cfg["model"]["path"])
    paths = ensure_task_files(load_config(layout.config_path).task)
    first = sft_data_task.fn(str(layout.root), "r", cfg["model"]["path"])
    ctx = load_run(str(layout.root), "r", StageSpec("train_metrics", (), ("loss",), "iteration"))
    assert ptx_fingerprint(ctx) == first.fingerprint
    pl.read_parquet(paths["sft"]).head(50).write_parquet(tmp_path / "fewer.parquet")
    cfg["sft"]["files"] = [str(tmp_path / "fewer.parquet")]
    layout.config_path.write_text(yaml.safe_dump(cfg))
    time.sleep(0.01)
    second = sft_data_task.fn(str(layout.root), "r", cfg["model"]["path"])
    assert second.fingerprint != first.fingerprint and second.rows == 50
    assert ptx_fingerprint(ctx) == second.fingerprint  # the update's input changed with it


def test_the_iteration_order_is_a_topological_order_of_the_declared_reads():
    order = [s.name for s in graph.RL_ITERATION]
    for i, spec in enumerate(graph.RL_ITERATION):
        assert not set(spec.all_reads) & set(order[i + 1 :]), spec.name  # nothing it reads comes after it
    shuffled = tuple(reversed(graph.RL_ITERATION))
    assert [s.name for s in graph.in_data_order(shuffled)] == [
        "prompts",
        "rollouts",
        "carry",
        "turns",
        "scores",
        "batch",
        "logprobs",
        "advantages",
        "train_metrics",
        "eval",
        "prompt_stats",
    ]  # from the reads alone (where several could come next, the declaration order decides)
    a, b = StageSpec("a", ("b",), (), "iteration"), StageSpec("b", ("a",), (), "iteration")
    with pytest.raises(ValueError, match="read each other in a cycle"):
        graph.in_data_order((a, b))


class Out:
    def __init__(self, fingerprint):
        self.fingerprint, self.extra = fingerprint, {}


def toy_graph(calls: list, rounds_needed: int):
    """Four stages as the flow sees them: two per round, one that gathers the rounds (AnotherRound until it has
    `rounds_needed`), one after it; each task records what it was handed."""
    from tasks.stages.spec import AnotherRound

    def draw(storage_root, run_id, iteration, round_, upstream):
        calls.append(("draw", round_, upstream))
        return Out(f"draw{iteration}.{round_}")

    def judge(storage_root, run_id, iteration, round_, upstream):
        calls.append(("judge", round_, upstream))
        return Out(f"judge({upstream['draw']})")

    def gather(storage_root, run_id, iteration, round_, upstream):
        calls.append(("gather", round_, upstream))
        return Out("gathered") if len(upstream) >= rounds_needed else AnotherRound("not enough")

    def learn(run_id, iteration, upstream, extra_knob: int = 3):
        calls.append(("learn", upstream, extra_knob))
        return Out("learned")

    # declared out of order on purpose: the order comes from the reads
    return graph.checked(
        graph.in_data_order(
            (
                StageSpec("learn", ("gather", "judge"), (), "iteration", task=learn),
                StageSpec("judge", ("draw",), (), "round", task=judge),
                StageSpec("gather", ("judge",), (), "iteration", task=gather),
                StageSpec("draw", (), (), "round", task=draw),
            )
        )
    )


def test_the_flow_calls_the_graph_in_order_with_the_fingerprints_of_what_each_stage_reads():
    calls = []
    out = graph.run_stages(toy_graph(calls, rounds_needed=2), "root", "r", 7)
    j0, j1 = "judge(draw7.0)", "judge(draw7.1)"
    assert calls == [
        ("draw", 0, {}),
        ("judge", 0, {"draw": "draw7.0"}),
        ("gather", 0, {"judge_round0": j0}),  # not enough: another round
        ("draw", 1, {}),
        ("judge", 1, {"draw": "draw7.1"}),
        ("gather", 1, {"judge_round0": j0, "judge_round1": j1}),
        ("learn", {"gather": "gathered", "judge_round0": j0, "judge_round1": j1}, 3),
    ]
    assert out["rounds"] == 2 and out["learn"].fingerprint == "learned"


def test_a_task_whose_parameters_the_graph_cannot_bind_fails_at_import_naming_it():
    def u(run_id, iteration, knob):
        return Out("x")

    def v(run_id, iteration, round_, upstream):
        return Out("x")

    once = StageSpec("once", (), (), "iteration", task=lambda run_id, upstream: Out("o"))
    with pytest.raises(TypeError, match="task parameter 'knob' is not one the graph hands a task"):
        graph.checked((StageSpec("u", (), (), "iteration", task=u),))
    with pytest.raises(TypeError, match="stage 'v' runs every round but reads a table written once per iteration"):
        graph.checked((once, StageSpec("v", ("once",), (), "round", task=v)))


def test_a_second_table_is_written_by_the_runner_with_its_stages_inputs_before_the_stage(tmp_path):
    """advantages' prompt_stats: the runner writes it first (the stage's manifest, last, marks both complete), its
    fingerprint over its own name, the stage's sections without the salt, and the stage's inputs; a table the stage
    does not declare is refused."""
    from schemas.tables import PROMPT_STATS
    from storage import fingerprint, read_manifest
    from tasks.algos.advantages import empty_prompt_stats
    from tasks.stages import advantages

    cfg = load_config("infra/configs/demo.yaml")
    layout = RunLayout(tmp_path, "r")
    layout.run_dir.mkdir(parents=True)
    layout.config_path.write_text(dump_config(cfg))
    ctx = load_run(str(tmp_path), "r", advantages.SPEC)
    f32 = pl.List(pl.Float32)
    frame = pl.DataFrame(
        {"iteration": [1], "prompt_id": ["p"], "sample_idx": [0], "reward": [1.0], "advantage": [0.5]},
        schema_overrides={"iteration": pl.Int32, "sample_idx": pl.Int32},
    ).with_columns(token_advantages=pl.Series([[0.5]], dtype=f32), returns=pl.Series([[1.0]], dtype=f32))
    stats = PROMPT_STATS.validate(empty_prompt_stats())
    inputs = {"logprobs": "l", "batch": "b", "prompt_stats": ""}
    run_stage(ctx, 1, inputs=inputs, salt="s", compute=lambda: Computed(frame, tables={"prompt_stats": stats}))
    second, first = read_manifest(layout, "prompt_stats", 1), read_manifest(layout, "advantages", 1)
    sections = cfg.section_hash(*advantages.SPEC.sections)
    assert second["fingerprint"] == fingerprint("prompt_stats", sections, inputs) and second["inputs"] == inputs
    assert first["fingerprint"] == fingerprint("advantages", sections + "s", inputs)
    mtime = lambda stage: layout.manifest_path(stage, 1).stat().st_mtime_ns  # noqa: E731
    assert mtime("prompt_stats") <= mtime("advantages")
    with pytest.raises(ValueError, match="returned table 'turns', which its also_writes does not declare"):
        run_stage(ctx, 2, inputs=inputs, compute=lambda: Computed(frame, tables={"turns": stats}))


def test_the_rl_flow_lists_no_stage():
    """The iteration's flow holds no stage's name or task: the graph drives it."""
    source = (ROOT / "flows" / "rl.py").read_text()
    for spec in graph.ITERATION_TASKS:
        assert spec.task.fn.__name__ not in source, spec.task.fn.__name__


def test_every_flow_is_a_declared_graph_in_data_order_whose_tasks_the_graph_can_call():
    """SFT, DPO, the reward model and the PRM: graphs of the iteration's form, each stage with its task; a flow frees
    the sampler between two spans of its graph."""
    assert {name: [s.name for s in specs] for name, specs in graph.RUN_GRAPHS.items()} == {
        "sft": ["sft_data", "sft_metrics"],
        "dpo": ["preference_rankings", "preference_pairs", "ref_logprobs", "dpo_metrics", "dpo_eval"],
        "rm": ["preference_rankings", "preference_pairs", "rm_metrics", "rm_eval"],
        "prm": ["prm_steps", "prm_metrics", "prm_eval"],
    }
    for specs in graph.RUN_GRAPHS.values():
        order = [s.name for s in specs]
        for i, spec in enumerate(specs):
            assert not set(spec.all_reads) & set(order[i + 1 :]) and spec.task is not None, spec.name
        graph.checked(specs)
    data, training = graph.split(graph.DPO, after="preference_rankings")
    assert [s.name for s in data] == ["preference_rankings"] and data + training == graph.DPO
    assert graph.run_graph_of({"dataset", "eval", "preference_rankings", "ref_logprobs"}) == "dpo"
    assert graph.run_graph_of({"preference_rankings", "preference_pairs", "rm_eval"}) == "rm"
    assert graph.run_graph_of({"dataset", "sft_data", "prompts", "eval"}) is None  # an RL run with PPO-ptx
    assert graph.downstream_tables("ref_logprobs") == ["ref_logprobs", "dpo_metrics", "dpo_eval"]


def test_run_scope_stages_fingerprint_the_inputs_they_had_before_their_flows_were_graphs(tmp_path, monkeypatch):
    """Each run-scope task, handed `upstream` by the graph, fingerprints exactly the inputs it had when its flow passed
    fingerprints by position (by hand, from the flows before): no existing run recomputes. Its iteration too."""
    from tasks.stages import dpo, preference_data, process_model, reward_model, sft

    layout = fake_run(tmp_path)
    seen = {}

    def fake_run_stage(ctx, iteration, *, inputs, compute, salt=""):
        seen[ctx.spec.name] = (iteration, inputs)
        return Out(f"fp-{ctx.spec.name}")

    for module in (sft, preference_data, dpo, reward_model, process_model):
        monkeypatch.setattr(module, "run_stage", fake_run_stage)
        monkeypatch.setattr(module, "model_fingerprint", lambda path: "model")
    for module in (dpo, reward_model, process_model):
        monkeypatch.setattr(module, "ensure_exported", lambda *a: None)
    monkeypatch.setattr(sft, "export_checkpoint", lambda *a: None)
    firsts = {"sft_data", "preference_rankings", "prm_steps"}  # what they read is not a stage of their graph
    for specs in graph.RUN_GRAPHS.values():
        fingerprints = {s.name: [f"fp-{s.name}"] for s in specs if s.name in firsts}
        for spec in (s for s in specs if s.name not in firsts):
            args = graph.task_arguments(spec, str(layout.root), "r", 0, 0, fingerprints, set())
            fingerprints[spec.name] = [spec.task.fn(**args).fingerprint]
    assert seen == {
        "sft_metrics": (0, {"data": "fp-sft_data", "base": "model"}),
        "preference_pairs": (0, {"rankings": "fp-preference_rankings"}),
        "ref_logprobs": (0, {"pairs": "fp-preference_pairs", "ref": "model"}),
        "dpo_metrics": (1, {"pairs": "fp-preference_pairs", "ref": "fp-ref_logprobs", "policy": "model"}),
        "dpo_eval": (1, {"pairs": "fp-preference_pairs", "ref": "fp-ref_logprobs", "dpo": "fp-dpo_metrics"}),
        "rm_metrics": (1, {"rankings": "fp-preference_rankings", "base": "model"}),
        "rm_eval": (1, {"pairs": "fp-preference_pairs", "reward_model": "fp-rm_metrics"}),
        "prm_metrics": (1, {"steps": "fp-prm_steps", "base": "model"}),
        "prm_eval": (1, {"steps": "fp-prm_steps", "prm": "fp-prm_metrics"}),
    }
    # prm_steps reads the run's dataset: handed from its manifest, the fingerprint it read itself before
    write_stage_placeholder(layout, "dataset", 0, "fp-dataset")
    spec = graph.stage("prm_steps")
    args = graph.task_arguments(spec, str(layout.root), "r", 0, 0, {}, set())
    assert args["upstream"] == {"dataset": "fp-dataset"}
    assert "upstream" not in graph.task_arguments(graph.stage("preference_rankings"), "root", "r", 0, 0, {}, set())


def write_stage_placeholder(layout, stage: str, iteration: int, fp: str) -> None:
    from schemas.tables import TableSchema
    from storage import write_stage

    table = TableSchema("placeholder", 1, {"x": pl.Int64})
    write_stage(layout, stage, iteration, pl.DataFrame({"x": [1]}), fp=fp, inputs={}, config_hash="", started=0.0,
                table=table)  # fmt: skip
