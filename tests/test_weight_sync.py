"""In-place weight sync of the resident vLLM engine, checked against the trainer's probe logprobs, for the demo
model with untied and with tied embeddings (vLLM's plain reload was wrong for tied ones)."""

import polars as pl
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from schemas.requests import GenerateRequest, VLLMSettings
from tasks.data.model_recipe import init_model
from tasks.engines.vllm_client import ResidentEngine
from tasks.engines.workers.sync_probe import mean_abs_gap, probe_token_ids, trainer_logprobs, write_probe
from tests.conftest import ROOT, generation_job

pytestmark = pytest.mark.e2e


def _policy_pair(tmp_path, tied: bool):
    """Two checkpoints of one architecture (the second is the first plus noise), each with its probe."""
    recipe = yaml.safe_load((ROOT / "infra/model/demo_llama.yaml").read_text()) | {"tie_word_embeddings": tied}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    before = init_model(tmp_path / "recipe.yaml", tmp_path / "before")
    model = AutoModelForCausalLM.from_pretrained(before)
    tokenizer = AutoTokenizer.from_pretrained(before)
    write_probe(model, tokenizer, str(before))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # a tied embedding is one parameter: perturbed once, as a trainer would
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    after = tmp_path / "after"
    model.save_pretrained(after)
    tokenizer.save_pretrained(after)
    write_probe(model, tokenizer, str(after))
    return before, after


def test_probe_logprobs_differ_between_the_checkpoints(tmp_path):
    """The check below is meaningful only if the two checkpoints are far apart on the probe."""
    before, after = _policy_pair(tmp_path, tied=True)
    old, new = AutoModelForCausalLM.from_pretrained(before), AutoModelForCausalLM.from_pretrained(after)
    ids = probe_token_ids(AutoTokenizer.from_pretrained(before), 64)
    gap = mean_abs_gap(trainer_logprobs(old, ids), trainer_logprobs(new, ids))
    assert gap > 0.1


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sync_in_place_matches_the_trainer_from_files_and_over_a_process_group(tmp_path, tied):
    """The file sync, then the same weights over a process group from a sender that holds them (as trainer rank 0
    does, in 3 buckets): the same probe gap, and the same samples; and back to the first weights over the group, into
    the bucket buffers the first sync left."""
    before, after = _policy_pair(tmp_path, tied)
    prompts = tmp_path / "prompts.parquet"
    pl.DataFrame(
        {"prompt_id": ["a", "b"], "prompt_token_ids": [[1, 7, 8], [1, 9, 10, 11]]},
        schema={"prompt_id": pl.Utf8, "prompt_token_ids": pl.List(pl.Int32)},
    ).write_parquet(prompts)
    job = generation_job(prompts, tmp_path / "out.parquet", n=2)
    engine = ResidentEngine(tmp_path / "vllm.log")
    settings = VLLMSettings(model_path=str(before), dtype="float32", seed=0, kv_cache_gib=1, gpu_memory_utilization=0.5)
    try:
        first = engine.generate(GenerateRequest(model_path=str(before), jobs=(job,)), settings)
        assert first["engine_start_seconds"] > 0 and first["sync_logprob_gap"] < 1e-3
        synced = engine.generate(GenerateRequest(model_path=str(after), jobs=(job,)), settings)
        from_files = pl.read_parquet(job.out_path)
        engine.generate(GenerateRequest(model_path=str(before), jobs=(job,)), settings)  # back, from files
        received = receive_from_a_sender(engine, after, tmp_path, settings)
        again = engine.generate(GenerateRequest(model_path=str(after), jobs=(job,)), settings)
        over_group = pl.read_parquet(job.out_path)
        back = receive_from_a_sender(engine, before, tmp_path, settings)  # into the buffers the first one left
    finally:
        engine.close()
    assert synced["engine_start_seconds"] == 0  # the same engine: synced, not restarted
    assert 0 < synced["sync_seconds"] < 5
    assert synced["sync_logprob_gap"] < 1e-3
    assert received["sync_logprob_gap"] == synced["sync_logprob_gap"]  # bit-identical weights
    params = AutoModelForCausalLM.from_pretrained(after).parameters()
    assert received["sync_bytes"] == sum(p.numel() * 4 for p in params)  # each weight once (a tied one too), fp32
    assert again["sync_seconds"] == 0 and over_group.equals(from_files)
    assert back["sync_logprob_gap"] == first["sync_logprob_gap"]


def receive_from_a_sender(engine, model_dir, tmp_path, settings) -> dict:
    """The engine receives `model_dir`'s weights over a 2-member gloo group whose rank 0 is this process, sending as
    the trainer does (weight_group.policy_tensors of an engine holding the model)."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from schemas.requests import ReceiveWeightsRequest, WeightGroup
    from tasks.engines.workers import weight_group

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    size = sum(p.numel() * 4 for p in model.parameters())
    key = f"{tmp_path.name}-{model_dir.name}"
    group = WeightGroup(
        key=key,
        init_method=f"file://{tmp_path / key}",
        world_size=2,
        backend="gloo",
        timeout_s=60,
        bucket_bytes=size // 3 + 1,
    )
    request = ReceiveWeightsRequest(model_path=str(model_dir), group=group, first_rank=1)
    with ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(engine.call, request, settings)
        named, header = weight_group.policy_tensors(SimpleNamespace(zero_optimization_stage=lambda: 0, module=model))
        try:
            sent = weight_group.send(weight_group.join(group, 0), named, group.bucket_bytes, header)
        finally:
            weight_group.leave()
        answer = receiving.result(timeout=120)
    assert sent == answer["sync_bytes"] and len(weight_group.buckets(named, group.bucket_bytes)) >= 3
    return answer
