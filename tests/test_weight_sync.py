"""In-place weight sync of the resident vLLM engine, checked against the trainer's probe logprobs, for the demo
model with untied and with tied embeddings (vLLM's plain reload was wrong for tied ones): from files, and through vLLM's
weight-transfer API over rlpipe's gloo engine, driven from this process as trainer rank 0 drives it; a failed or
partial send names the replica."""

import itertools
import time

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
    """The file sync, then the same weights through vLLM's weight-transfer API from a sender that holds them (as
    trainer rank 0 does, in 3 packed chunks): the same probe gap, and the same samples; and back to the first weights
    over the same group, into the chunk buffers the first sync left."""
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
        assert first.engine_start_seconds > 0 and first.sync_logprob_gap < 1e-3
        synced = engine.generate(GenerateRequest(model_path=str(after), jobs=(job,)), settings)
        from_files = pl.read_parquet(job.out_path)
        engine.generate(GenerateRequest(model_path=str(before), jobs=(job,)), settings)  # back, from files
        received, sender = receive_from_a_sender(engine, after, tmp_path, settings)
        again = engine.generate(GenerateRequest(model_path=str(after), jobs=(job,)), settings)
        over_group = pl.read_parquet(job.out_path)
        back, _ = receive_from_a_sender(engine, before, tmp_path, settings, sender)  # the same group and buffers
    finally:
        engine.close()
    assert synced.engine_start_seconds == 0  # the same engine: synced, not restarted
    assert 0 < synced.sync_seconds < 5
    assert synced.sync_logprob_gap < 1e-3
    assert received["sync_logprob_gap"] == synced.sync_logprob_gap  # bit-identical weights
    params = AutoModelForCausalLM.from_pretrained(after).parameters()
    assert received["sync_bytes"] == sum(p.numel() * 4 for p in params)  # each weight once (a tied one too), fp32
    assert again.sync_seconds == 0 and over_group.equals(from_files)
    assert back["sync_logprob_gap"] == first.sync_logprob_gap


_GROUPS = itertools.count()


def _sender(engine, tmp_path, bucket_bytes: int, source):
    """Trainer rank 0's engine (vLLM's trainer_init over the registered rlpipe_gloo) for a 2-member group of this
    process and the replica, and its client."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from tasks.engines.workers.weight_transfer import register
    from tasks.engines.workers.weight_transfer_trainer import GlooTrainerInitInfo, ReplicaClient

    register()
    client = ReplicaClient([(f"replica 0 (actor {engine.actors[0]._actor_id.hex()[:12]})", engine.actors[0])], 1)
    key = f"{tmp_path.name}-{next(_GROUPS)}"
    info = GlooTrainerInitInfo(
        init_method=f"file://{tmp_path / f'group-{key}'}",
        key=key,
        world_size=2,
        timeout_s=60,
        buffer_size_bytes=bucket_bytes,
        rank=0,
    )
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source), client


def receive_from_a_sender(engine, model_dir, tmp_path, settings, sender=None):
    """The engine receives `model_dir`'s weights through vLLM's API, sent as the trainer sends them
    (weight_transfer_trainer.policy_tensors of an engine holding the model); (its answer, the sender kept for the
    next)."""
    from types import SimpleNamespace

    from tasks.engines.workers.weight_transfer import chunks, tensor_bytes
    from tasks.engines.workers.weight_transfer_trainer import PolicySource, policy_tensors

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    size = sum(p.numel() * 4 for p in model.parameters())
    engine.start(settings)
    if sender is None:
        sender = _sender(engine, tmp_path, size // 3 + 1, PolicySource())
    trainer, client = sender
    trainer.source.hold(policy_tensors(SimpleNamespace(zero_optimization_stage=lambda: 0, module=model)))
    client.model_path = str(model_dir)
    trainer.send_weights()
    answer = client.finished[0]
    meta = trainer.source.metadata()
    sizes = tensor_bytes([str(m.dtype).removeprefix("torch.") for m in meta], [list(m.shape) for m in meta])
    assert sum(sizes) == answer["sync_bytes"] and len(chunks(sizes, size // 3 + 1)) >= 3
    return answer, sender


class _Partial:
    """A weight source whose iteration stops after `n` tensors while its metadata declares them all."""

    def __init__(self, named, n: int):
        from tasks.engines.workers.weight_transfer_trainer import PolicySource

        self.whole = PolicySource()
        self.whole.hold(named)
        self.n = n

    def metadata(self):
        return self.whole.metadata()

    def __iter__(self):
        return iter(list(self.whole)[: self.n])


def test_a_partial_or_failed_send_names_the_replica_and_a_partial_one_leaves_the_engine_to_sync_again(tmp_path):
    """A trainer whose source stops halfway leaves the group: the replica fails at once (not at its 60 s timeout),
    and the error names it and the trainer's cause; the replica had received but not loaded, so a new group then
    brings it to the weights, probe gap as from files. A replica that cannot load what it is sent (an embedding of the
    wrong shape, declared so) fails with its own error, named."""
    from types import SimpleNamespace

    from tasks.engines.workers.weight_transfer_trainer import PolicySource, policy_tensors

    before, after = _policy_pair(tmp_path, tied=True)
    settings = VLLMSettings(model_path=str(before), dtype="float32", seed=0, kv_cache_gib=1, gpu_memory_utilization=0.5)
    engine = ResidentEngine(tmp_path / "vllm.log")
    model = AutoModelForCausalLM.from_pretrained(after)
    named = policy_tensors(SimpleNamespace(zero_optimization_stage=lambda: 0, module=model))
    try:
        engine.start(settings)
        trainer, client = _sender(engine, tmp_path, 2**20, _Partial(named, len(named) // 2))
        client.model_path = str(after)
        t0 = time.time()
        with pytest.raises(RuntimeError) as partial:
            trainer.send_weights()
        assert time.time() - t0 < 30
        message = str(partial.value)
        assert message.startswith("replica 0 (actor ") and "failed in the weight sync (update)" in message
        assert f"the weight source yielded {len(named) // 2} tensors, its metadata declared {len(named)}" in message
        assert "\n" not in message

        synced, _ = receive_from_a_sender(engine, after, tmp_path, settings)

        embedding = dict(named)["model.embed_tokens.weight"]
        wrong = PolicySource()
        wrong.hold([(n, embedding.T.contiguous() if t is embedding else t) for n, t in named])
        trainer, client = _sender(engine, tmp_path, 2**20, wrong)
        client.model_path = str(after)
        with pytest.raises(RuntimeError, match=r"^replica 0 \(actor \w+\) failed in the weight sync \(update\): "):
            trainer.send_weights()
        trainer.shutdown()
    finally:
        engine.close()
    assert synced["sync_logprob_gap"] < 1e-3
