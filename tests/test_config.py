"""Config: YAML + overrides, one-line errors naming the key, saved resolved."""

import re
import subprocess
import sys

import pytest

from schemas.config import ConfigError, RunConfig, apply_overrides, build_config, dump_config, load_config
from tests.conftest import ROOT


def test_demo_config_loads_and_overrides_apply():
    cfg = load_config("infra/configs/demo.yaml", ["rl.iterations=3", "optim.lr=0.01", "kl.placement=none"])
    assert cfg.rl.iterations == 3 and cfg.optim.lr == 0.01 and cfg.kl.placement == "none"
    with pytest.raises(Exception):
        cfg.rl.iterations = 4  # frozen


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["rollout.group_sizee=4"], "rollout.group_sizee: unknown key"),
        (["advantage.estimator=ppo2"], "advantage.estimator"),
        (["rollout.group_size=0"], "rollout.group_size"),
        (["reward.functions.bogus.weight=1"], "'bogus' is not a built-in reward function"),
        (["eval.pass_k=16"], "pass_k"),
        (["rl"], "expected key=value"),
    ],
)
def test_invalid_values_fail_with_the_key_named(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config("infra/configs/demo.yaml", overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_set_indexes_a_list_by_number():
    data = {"data": {"sources": [{"name": "a", "weight": 1}, {"name": "b", "weight": 1}]}, "rl": {"iterations": 3}}
    out = apply_overrides(data, ["data.sources.1.weight=2", "data.sources.0.curriculum.start_level=1"])
    assert out["data"]["sources"] == [
        {"name": "a", "weight": 1, "curriculum": {"start_level": 1}},
        {"name": "b", "weight": 2},
    ]
    assert data["data"]["sources"][1]["weight"] == 1  # the input is not changed
    for item, needle in [
        ("data.sources.2.weight=1", "data.sources is a list of 2, so '2' must be an index 0 .. 1"),
        ("data.sources.b.weight=1", "so 'b' must be an index"),
        ("rl.iterations.x=1", "iterations is not a section"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            apply_overrides(data, [item])


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_resolved_config_round_trips():
    cfg = load_config("infra/configs/demo.yaml")
    import yaml

    assert build_config(yaml.safe_load(dump_config(cfg))) == cfg
    assert RunConfig().section_hash("optim") != build_config({"optim": {"lr": 0.5}}).section_hash("optim")


def test_a_key_added_later_enters_the_fingerprint_only_when_set():
    # rollout.min_tokens and partial_tokens came after runs existed: at their defaults the rollout hash is the one
    # written without the keys (the section dumped by hand, as the hash was computed before), so their stages are not
    # recomputed.
    import hashlib
    import json

    cfg = RunConfig()
    legacy = {
        k: v
        for k, v in cfg.rollout.model_dump(mode="json").items()
        if k not in {"min_tokens", "partial_tokens", "carry_surplus", "engines", "tensor_parallel_size"}
    }
    expected = hashlib.sha256(json.dumps({"rollout": legacy, "seed": cfg.seed}, sort_keys=True).encode()).hexdigest()[
        :16
    ]
    assert cfg.section_hash("rollout") == expected
    assert build_config({"rollout": {"min_tokens": 4}}).section_hash("rollout") != expected
    assert build_config({"rollout": {"partial_tokens": 4}}).section_hash("rollout") != expected
    surplus = build_config({"rollout": {"partial_tokens": 4, "carry_surplus": True}, "rl": {"max_staleness": 1}})
    surplus = surplus.section_hash("rollout")
    assert surplus not in (expected, build_config({"rollout": {"partial_tokens": 4}}).section_hash("rollout"))
    with pytest.raises(ConfigError, match="rollout.carry_surplus carries ended groups of partial rollouts"):
        build_config({"rollout": {"carry_surplus": True}})
    with pytest.raises(ConfigError, match="rollout.carry_surplus with rl.max_staleness 0"):
        build_config({"rollout": {"partial_tokens": 4, "carry_surplus": True}})
    with pytest.raises(ConfigError, match="rollout.min_tokens=9 exceeds rollout.max_tokens=8"):
        build_config({"rollout": {"min_tokens": 9, "max_tokens": 8}})


def test_a_section_added_to_by_a_default_factory_keeps_its_fingerprint_at_the_default():
    # reward.judges (a dict, default_factory) came after runs existed: with no judge, the reward hash is the one
    # written without the key, so a run from before resumes without re-scoring.
    import hashlib
    import json

    cfg = RunConfig()
    later = ("judges", "process_model", "stop_when_unscored")  # the last one is in no fingerprint at all
    legacy = {k: v for k, v in cfg.reward.model_dump(mode="json").items() if k not in later}
    legacy["sandbox"] = {k: v for k, v in legacy["sandbox"].items() if k != "allow_unisolated"}
    expected = hashlib.sha256(json.dumps({"reward": legacy, "seed": cfg.seed}, sort_keys=True).encode()).hexdigest()
    assert cfg.section_hash("reward") == expected[:16]
    judged = build_config({"reward": {"judges": {"j": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}}}})
    assert judged.section_hash("reward") != expected[:16]
    # reward.process_model and reward_model.objective came later still: the same holds for them
    assert build_config({}, ["reward.process_model={path: m}"]).section_hash("reward") != expected[:16]
    added = ("objective", "step_label", "trainable_layers")
    rm = {k: v for k, v in cfg.reward_model.model_dump(mode="json").items() if k not in added}
    legacy_rm = hashlib.sha256(json.dumps({"reward_model": rm, "seed": cfg.seed}, sort_keys=True).encode()).hexdigest()
    assert cfg.section_hash("reward_model") == legacy_rm[:16]
    assert build_config({}, ["reward_model.trainable_layers=2"]).section_hash("reward_model") != legacy_rm[:16]


def test_a_saved_config_is_parsed_once_per_content():
    from tasks.stages.common import saved_config

    text = dump_config(load_config("infra/configs/demo.yaml", ["rl.iterations=30"])).encode()
    first = saved_config(text)
    assert saved_config(text) is first  # every stage of every iteration loads it: one parse
    changed = saved_config(text.replace(b"iterations: 30", b"iterations: 7"))  # rewritten (--reconfigure)
    assert changed.rl.iterations == 7 and first.rl.iterations == 30
    with pytest.raises(ConfigError, match="rl.iterations"):
        saved_config(text.replace(b"iterations: 30", b"iterations: -1"))


@pytest.mark.parametrize(
    "config",
    [
        "infra/configs/demo.yaml",
        "infra/configs/arithmetic_tiny.yaml",
        "infra/configs/long_addition.yaml",
        "examples/word_problems/config.yaml",
        "examples/gsm8k_qwen/config.yaml",
    ],
)
def test_every_shipped_config_loads_with_every_preset(config):
    from schemas.config import algorithm_presets

    for algo in [None, *algorithm_presets()]:
        load_config(config, algo=algo)


def test_validating_a_config_imports_no_stage_code():
    """The config asks the registries it validates against (built-in rewards, estimators' needs) and nothing above."""
    probe = (
        "import sys; from schemas.config import load_config; "
        "cfg = load_config('infra/configs/demo.yaml', algo='ppo'); assert cfg.uses_critic; "
        "print(sorted(m for m in sys.modules if m.startswith(('tasks.stages', 'tasks.engines', 'flows'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


REGISTERED = {
    "advantage.estimator": "tasks.algos.advantages:ADVANTAGE_ESTIMATORS",
    "loss.objective": "tasks.algos.losses:OBJECTIVES",
    "loss.aggregation": "tasks.algos.losses:AGGREGATIONS",
    "kl.estimator": "tasks.algos.kl:KL_ESTIMATORS",
    "agent.tool_call_format": "tasks.agents.tool_calls:TOOL_CALL_PARSERS",
}


# What a choice needs elsewhere in the config to be valid.
NEEDS = {"grpo_process": {"reward": {"functions": {"accuracy": {}, "s": {"path": "r.py", "per_step": True}}}}}


@pytest.mark.parametrize("key", sorted(REGISTERED))
def test_a_registrys_names_are_the_configs_choices_and_the_references(key):
    """The registry is the one list: every name it holds is accepted, anything else is refused naming them all, and the
    config reference shows exactly them."""
    import importlib

    from schemas.reference import fields

    module, attr = REGISTERED[key].split(":")
    names = getattr(importlib.import_module(module), attr).names()
    for name in names:
        build_config(NEEDS.get(name, {}), [f"{key}={name}"])
    with pytest.raises(ConfigError) as err:
        build_config({}, [f"{key}=nope"])
    assert f"{key}:" in str(err.value) and str(err.value).endswith(f"'nope': choose one of {', '.join(names)}")
    shown = next(t for k, t, _, _ in fields() if k == key)
    assert shown == " | ".join(repr(n) for n in names)


def test_a_misspelled_capability_fails_at_registration():
    from tasks.algos.advantages import EstimatorNeeds
    from tasks.registry import Registry

    registry = Registry("advantage estimator", EstimatorNeeds)
    registry.register("mine", needs_critic=True)(lambda df, s, h: df)
    assert registry.entry("mine").needs_critic and not registry.entry("mine").keeps_prompt_state
    with pytest.raises(TypeError):
        registry.register("typo", needs_critc=True)
    with pytest.raises(AttributeError):
        registry.entry("mine").needs_critc


@pytest.mark.parametrize("scale", ["infra/scale/one_node_8gpu.yaml", "infra/scale/two_nodes.yaml"])
def test_the_scale_out_recipes_are_valid_overrides_of_the_demo(scale):
    """The GPU recipes (docs/operations.md, "Scale out") cannot run here, but their keys and values are checked."""
    import yaml

    from schemas.config import build_config

    demo = yaml.safe_load(open("infra/configs/demo.yaml"))
    recipe = yaml.safe_load(open(scale))
    merged = {k: {**demo.get(k, {}), **v} if isinstance(v, dict) else v for k, v in recipe.items()}
    cfg = build_config({**demo, **merged})
    assert cfg.engines.train_ranks > 1 and cfg.engines.trainer_bundle.get("GPU", 0) > 0
    assert cfg.engines.rollout_bundle.get("GPU", 0) == cfg.rollout.tensor_parallel_size


def test_a_teacher_is_only_read_by_distillation():
    with pytest.raises(ConfigError, match="advantage.teacher_path is only read by advantage.estimator distill"):
        build_config({}, ["advantage.teacher_path=models/teacher"])
    cfg = build_config({}, ["advantage.estimator=distill", "advantage.teacher_path=models/teacher"])
    assert cfg.advantage.teacher_path == "models/teacher"


def test_arpo_branching_needs_tools_no_environment_and_fits_the_group():
    tools = ["agent.tools={add: {path: tools.py}}", "rollout.group_size=8"]
    cfg = build_config({}, [*tools, "agent.branching={initial: 4}", "advantage.branch_attribution=hard"])
    b = cfg.agent.branching
    assert (b.initial, b.alpha, b.beta, b.copies, b.entropy_tokens, b.top_logprobs) == (4, 0.5, 0.2, 1, 20, 10)
    with pytest.raises(ConfigError, match=r"agent.branching.initial \(9\) exceeds rollout.group_size \(8\)"):
        build_config({}, [*tools, "agent.branching={initial: 9}"])
    with pytest.raises(ConfigError, match="agent.branching branches after tool results: it needs agent.tools"):
        build_config({}, ["agent.environment={path: env.py, function: Env}", "agent.branching={}"])
    with pytest.raises(ConfigError, match="branch_attribution hard averages over a branching tree"):
        build_config({}, [*tools, "advantage.branch_attribution=hard"])
    # a run without branching keeps the fingerprints it was written with (both keys came after runs existed)
    from schemas.config import _dump

    plain = build_config({}, tools)
    assert "branching" not in _dump(plain.agent) and "branch_attribution" not in _dump(plain.advantage)
    assert _dump(cfg.agent)["branching"]["initial"] == 4 and _dump(cfg.advantage)["branch_attribution"] == "hard"


@pytest.mark.parametrize("path", sorted((ROOT / "infra/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    load_config(path)


def test_the_classic_rlhf_configs_documented_ppo_command_is_ppo_on_the_reward_model_alone():
    sets = ["reward.kind=model", "reward.model_path=models/smollm2-arith-rm", "reward.functions.correct.weight=0"]
    cfg = load_config("infra/configs/chat_arithmetic_rlhf.yaml", sets, algo="ppo")
    assert cfg.advantage.estimator == "gae" and cfg.kl.placement == "reward" and cfg.critic.lr == 5e-5
    assert [f.weight for f in cfg.reward.functions.values()] == [0.0] and cfg.reward.model_weight == 1.0
    assert cfg.reward_model.out_path == cfg.reward.model_path  # PPO reads the reward model rm-train wrote


def test_sampler_old_logprobs_refuse_a_rollout_correction_and_token_budgets_are_bounded():
    with pytest.raises(ConfigError, match="old_logprobs sampler .* compare them with themselves") as err:
        build_config({"loss": {"old_logprobs": "sampler", "rollout_is": "token"}})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="optim.micro_batch_tokens"):
        build_config({"optim": {"micro_batch_tokens": 8}})
    cfg = build_config({"loss": {"old_logprobs": "sampler"}, "optim": {"micro_batch_tokens": 4096}})
    assert cfg.loss.old_logprobs == "sampler" and cfg.optim.logprob_micro_batch_tokens is None


def test_sampler_old_logprobs_with_bf16_engines_need_the_off_policy_mask():
    """A bf16 sampler's logprobs are far from the trainer's: as π_old they are refused in one line unless the
    off-policy mask bounds the gap; fp32 and the trainer's π_old are untouched."""
    sampler_bf16 = {"loss": {"old_logprobs": "sampler"}, "model": {"dtype": "bfloat16"}}
    with pytest.raises(ConfigError, match="old_logprobs sampler with model.dtype bfloat16") as err:
        build_config(sampler_bf16)
    assert "\n" not in str(err.value)
    masked = {**sampler_bf16, "loss": {"old_logprobs": "sampler", "off_policy_mask_threshold": 0.5}}
    assert build_config(masked).loss.off_policy_mask_threshold == 0.5
    assert build_config({"model": {"dtype": "bfloat16"}}).loss.old_logprobs == "trainer"
    assert build_config({"loss": {"old_logprobs": "sampler"}}).model.dtype == "float32"


@pytest.mark.parametrize(
    "loss", [{"old_logprobs": "sampler"}, {"rollout_is": "token"}, {"off_policy_mask_threshold": 1}]
)
def test_settings_that_read_the_samplers_logprobs_at_a_temperature_refuse_what_vllm_folds_in(loss):
    """At T ≠ 1 vLLM reports its logprobs after the temperature, as the trainer scores them (VLLMSettings'
    processed_logprobs), except with LoRA; top_p and min_tokens would be folded in too, and the trainer applies
    neither."""
    from schemas.requests import VLLMSettings

    def engine_mode(cfg: RunConfig) -> str:
        r, lora = cfg.rollout, cfg.lora
        return VLLMSettings.from_config(
            model_path="m", model=cfg.model, rollout=r, seed=0, lora=lora, sleep=False, weight_transfer="-"
        ).logprobs_mode

    cfg = build_config({"loss": loss, "rollout": {"temperature": 0.7}})
    assert cfg.sampler_logprobs_comparable
    assert engine_mode(cfg) == "processed_logprobs"
    for extra, named in [
        ({"lora": {"rank": 8}}, "lora.rank 8"),
        ({"rollout": {"temperature": 0.7, "top_p": 0.9}}, "rollout.top_p 0.9"),
        ({"rollout": {"temperature": 0.7, "min_tokens": 4}}, "rollout.min_tokens 4"),
    ]:
        data = {"loss": loss, "rollout": {"temperature": 0.7}, **extra}
        with pytest.raises(ConfigError, match="rollout.temperature 0.7 with loss.old_logprobs sampler") as err:
            build_config(data)
        assert named in str(err.value) and "\n" not in str(err.value)
    # at T = 1 the raw logprobs are the trainer's, whatever top_p and LoRA do
    assert build_config({"loss": loss, "lora": {"rank": 8}, "rollout": {"top_p": 0.9}}).sampler_logprobs_comparable
    cfg = build_config({"lora": {"rank": 8}, "rollout": {"temperature": 0.7}})  # π_old from the trainer: allowed
    assert engine_mode(cfg) == "raw_logprobs" and not cfg.sampler_logprobs_comparable


def test_gdpo_takes_a_reward_whose_only_weighted_part_is_a_judge_or_the_process_model():
    """The GDPO check counted functions and the reward model while the advantages stage's parts also hold judges and
    the PRM: a judge-only reward was refused. Both now ask reward.weighted_parts()."""
    judge = {"j": {"base_url": "http://127.0.0.1:9/v1", "model": "m", "weight": 1}}
    no_function = {"functions": {"accuracy": {"weight": 0}}}
    only_judge = {"advantage": {"estimator": "gdpo"}, "reward": {**no_function, "judges": judge}}
    assert build_config(only_judge).reward.weighted_parts() == (("score_j", 1),)
    only_prm = {"advantage": {"estimator": "gdpo"}, "reward": {"functions": {"accuracy": {"weight": 0}}}}
    assert build_config(only_prm, ["reward.process_model={path: models/prm, weight: 0.5}"])
    with pytest.raises(ConfigError, match="gdpo normalises the reward's weighted parts, and every weight is 0"):
        build_config(only_prm)


def test_an_estimator_that_reads_k_needs_groups_of_k():
    with pytest.raises(ConfigError, match=r"advantage.pass_k \(9\) exceeds rollout.group_size \(8\)"):
        build_config({"advantage": {"estimator": "passk", "pass_k": 9}, "rollout": {"group_size": 8}})
    build_config({"advantage": {"estimator": "grpo", "pass_k": 9}, "rollout": {"group_size": 8}})  # not read: fine


def test_preset_overrides_name_the_written_keys_a_preset_replaces(tmp_path):
    from schemas.config import preset_overrides

    path = tmp_path / "c.yaml"
    path.write_text("batch: {drop_zero_variance: true, max_rounds: 3}\nkl: {placement: loss, beta: 0.04}\n")
    assert preset_overrides(path, None) == []
    assert preset_overrides(path, "grpo") == [("grpo", "batch.drop_zero_variance", False, True)]  # β: the same
    # dapo, merged after grpo, sets drop_zero_variance back to the file's true: only its KL replaces a written key
    assert preset_overrides(path, "grpo,dapo") == [("dapo", "kl.placement", "none", "loss")]
