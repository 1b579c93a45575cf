"""LoRA end to end on the tiny model with real vLLM, DeepSpeed and Prefect: every preset for 2 iterations with an
adapter, the sampler on the adapter, the reference as the adapter switched off, a killed and resumed run, the merged
export, SFT and DPO with an adapter."""

import hashlib
import json

import pytest
import torch

from schemas.config import algorithm_presets
from storage import RunLayout
from tests.conftest import read_table, rlpipe, run_until_killed, write_rankings

pytestmark = pytest.mark.e2e

RANK = 4
# LoRA wants a larger learning rate than full training (docs/train-your-own-model.md, "LoRA").
LORA = ["--set", f"lora.rank={RANK}", "--set", "lora.alpha=8", "--set", "optim.lr=1e-3"]


def lora_run(workspace, cfg, algo: str) -> RunLayout:
    layout = RunLayout(workspace / "runs", f"lora-{algo}")
    # A preset that leaves a value to the user: distillation's teacher (here the untrained recipe model).
    needs = ["--set", f"advantage.teacher_path={workspace / 'models/base'}"] if algo == "distill" else []
    if not layout.summary_path.exists():
        rlpipe("run", str(cfg), "--algo", algo, "--run-id", layout.run_id, *LORA, *needs, cwd=workspace)
    return layout


def adapter_digest(layout: RunLayout, iteration: int) -> str:
    return hashlib.sha256((layout.checkpoint_dir(iteration) / "adapter_model.safetensors").read_bytes()).hexdigest()


# `make test` runs the presets whose engines differ under an adapter: the default (grpo), and a critic that trains
# every weight beside it (ppo). The others differ only in formulas their unit tests check and in stages an adapter
# does not reach (batch; dcpo's per-prompt history, kept by the advantages stage); `make test-all` runs them too
# (about 30 s each on the 2-core machine).
IN_MAKE_TEST = ("grpo", "ppo")


@pytest.mark.parametrize(
    "algo", [a if a in IN_MAKE_TEST else pytest.param(a, marks=pytest.mark.sweep) for a in algorithm_presets()]
)
def test_every_preset_trains_an_adapter_for_two_iterations(tiny_sft, algo):
    workspace, cfg = tiny_sft
    layout = lora_run(workspace, cfg, algo)
    metrics = [read_table(layout, "train_metrics", it).row(0, named=True) for it in (1, 2)]
    for it, m in zip((1, 2), metrics):
        ckpt = layout.checkpoint_dir(it)
        assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
        adapter = json.loads(layout.manifest_path("train_metrics", it).read_text())["extra"]["adapter"]
        assert adapter["rank"] == RANK and adapter["target_modules"] and adapter["adapter_bytes"] > 0
        assert m["trainable_params"] > 0 and 0 < m["adapter_norm"] < float("inf")
        assert m["weight_sync_logprob_gap"] < 1e-3  # vLLM with the adapter against the trainer's probe logprobs
    assert (
        metrics[0]["weight_sync_seconds"] == 0 and metrics[1]["weight_sync_seconds"] > 0
    )  # iteration 2 loaded an adapter
    assert metrics[1]["adapter_norm"] != metrics[0]["adapter_norm"]
    if algo == "ppo":  # the critic trains every weight
        assert (layout.critic_dir(2) / "model.safetensors").exists()


def test_lora_samples_with_its_adapter_and_refers_to_the_adapter_off(tiny_sft):
    """The adapter changes the model (the probe's logprobs move away from the base model's), vLLM samples with it (its
    probe gap is below the tolerance, which the base model's would not be); the reference logprobs are the base model's;
    only the adapter's weights are trained and saved, and they count what a hand count of the model's linear layers
    gives."""
    from tasks.engines.workers.sync_probe import mean_abs_gap, read_probe, trainer_logprobs
    from tasks.engines.workers.torch_logprobs import load_lm

    workspace, cfg = tiny_sft
    layout = lora_run(workspace, cfg, "grpo")
    base = load_lm(str(workspace / "models/sft"), "float32")
    probe = read_probe(layout.checkpoint_dir(2))
    assert mean_abs_gap(trainer_logprobs(base, probe["token_ids"]), probe["logprobs"]) > 1e-2
    m = read_table(layout, "train_metrics", 2).row(0, named=True)
    assert m["weight_sync_logprob_gap"] < 1e-3 and m["kl_ref"] > 0
    linear = [mod for name, mod in base.named_modules() if isinstance(mod, torch.nn.Linear) and "lm_head" not in name]
    assert m["trainable_params"] == sum(RANK * (x.in_features + x.out_features) for x in linear)
    rows = (
        read_table(layout, "logprobs", 2)
        .join(read_table(layout, "rollouts", 2), on=["prompt_id", "sample_idx"])
        .head(4)
    )
    for prompt, response, ref in zip(rows["prompt_token_ids"], rows["token_ids"], rows["ref_logprobs"]):
        ids = list(prompt) + list(response)
        expected = trainer_logprobs(base, [ids])[0][len(prompt) - 1 :]
        assert max(abs(a - b) for a, b in zip(expected, ref, strict=True)) < 1e-4
    state = layout.checkpoint_dir(2) / "ds_state"
    model_bytes = (workspace / "models/sft" / "model.safetensors").stat().st_size
    assert (
        sum(f.stat().st_size for f in state.rglob("*") if f.is_file()) < model_bytes
    )  # no frozen weights in the state


@pytest.mark.long
def test_a_killed_lora_run_resumes_to_the_same_adapter(tiny_sft):
    workspace, cfg = tiny_sft
    whole = lora_run(workspace, cfg, "grpo")
    run_until_killed(workspace, cfg, "lora-crashy", "optimize:2", "run", "--algo", "grpo", *LORA)
    crashy = RunLayout(workspace / "runs", "lora-crashy")
    tmp = crashy.checkpoint_dir(2).with_name(crashy.checkpoint_dir(2).name + ".tmp")
    assert (tmp / "adapter_model.safetensors").exists() and not (tmp / "ds_state").exists()
    rlpipe("run", str(cfg), "--algo", "grpo", "--run-id", "lora-crashy", *LORA, cwd=workspace)
    for it in (1, 2):
        assert adapter_digest(crashy, it) == adapter_digest(whole, it)


def test_export_writes_the_adapter_or_a_merged_model(tiny_sft):
    from transformers import AutoModelForCausalLM

    from tasks.engines.workers.torch_logprobs import load_lm

    workspace, cfg = tiny_sft
    layout = lora_run(workspace, cfg, "grpo")
    root = str(workspace / "runs")
    rlpipe("export", layout.run_id, str(workspace / "exported-adapter"), "--root", root, cwd=workspace)
    assert (workspace / "exported-adapter" / "adapter_config.json").exists()
    assert not (workspace / "exported-adapter" / "ds_state").exists()
    out = rlpipe(
        "export", layout.run_id, str(workspace / "merged"), "--merge", "--iteration", "2", "--root", root, cwd=workspace
    )
    assert "kind=merged" in out.stderr
    merged = workspace / "merged"
    assert not (merged / "adapter_config.json").exists() and (merged / "tokenizer.json").exists()
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
        adapted = load_lm(str(layout.checkpoint_dir(2)), "float32")(input_ids=ids).logits
    assert (plain - adapted).abs().max() < 1e-5


@pytest.mark.long
def test_sft_and_dpo_train_adapters(tiny_sft):
    """`rlpipe sft` and `rlpipe dpo` with lora.rank: the checkpoints are adapters, the exported models merged folders;
    DPO's first loss is log 2 (its reference is the starting model: the adapter starts at zero)."""
    workspace, cfg = tiny_sft
    rlpipe(
        "sft",
        str(cfg),
        "--run-id",
        "sft-lora",
        "--set",
        f"model.path={workspace}/models/sft-lora",
        *LORA,
        cwd=workspace,
    )
    sft = RunLayout(workspace / "runs", "sft-lora")
    assert (sft.sft_checkpoint_dir / "adapter_model.safetensors").exists()
    assert (workspace / "models/sft-lora/model.safetensors").exists() and not (
        workspace / "models/sft-lora/adapter_config.json"
    ).exists()
    data = write_rankings(workspace, 64)
    rlpipe(
        "dpo",
        str(cfg),
        "--run-id",
        "dpo-lora",
        "--set",
        f"preference.data={data}",
        "--set",
        "preference.heldout_fraction=0.25",
        "--set",
        "dpo.steps=4",
        "--set",
        "dpo.batch_size=8",
        "--set",
        f"dpo.out_path={workspace}/models/dpo-lora",
        *LORA,
        cwd=workspace,
    )
    dpo = RunLayout(workspace / "runs", "dpo-lora")
    assert (dpo.checkpoint_dir(1) / "adapter_model.safetensors").exists()
    assert (workspace / "models/dpo-lora/model.safetensors").exists()
    metrics = read_table(dpo, "dpo_metrics", 1)
    assert metrics.height == 4 and metrics["loss"][0] == pytest.approx(0.6931, abs=0.01)


def test_a_target_module_the_model_lacks_is_one_line(tiny_sft):
    workspace, cfg = tiny_sft
    proc = rlpipe(
        "run",
        str(cfg),
        "--run-id",
        "lora-bad",
        "--set",
        "lora.rank=4",
        "--set",
        "lora.target_modules=[qkv_proj]",
        cwd=workspace,
        check=False,
    )
    assert proc.returncode == 1 and "lora.target_modules" in proc.stderr and "qkv_proj" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_two_trainer_ranks_under_zero3_train_the_same_adapter(tiny_sft):
    """Iteration 1's LoRA update redone on 2 trainer ranks with ZeRO-3 (the adapter and its optimizer state partitioned,
    then gathered for the save): the adapter agrees with one rank's within 1e-5."""
    from safetensors.torch import load_file

    workspace, cfg = tiny_sft
    layout = lora_run(workspace, cfg, "grpo")
    rlpipe(
        "rerun",
        layout.run_id,
        "--iteration",
        "1",
        "--stage",
        "optimize",
        "--set",
        "engines.train_ranks=2",
        "--set",
        "optim.zero_stage=3",
        "--fork",
        "lora-zero3",
        "--root",
        str(workspace / "runs"),
        cwd=workspace,
    )
    fork = RunLayout(workspace / "runs", "lora-zero3")
    one, two = (load_file(x.checkpoint_dir(1) / "adapter_model.safetensors") for x in (layout, fork))
    assert one.keys() == two.keys() and max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    assert max(float(v.abs().max()) for k, v in one.items() if "lora_B" in k) > 0  # it did train
