"""The collective weight sync's pure parts: how tensors are bucketed, which backend a config gets, which stages run one
step ahead, and which weights an iteration samples with. The transfer itself is tests/test_weight_sync.py's."""

import pytest
import torch

from schemas.config import EnginesConfig, RunConfig
from tasks.engines.weight_sync import backend
from tasks.engines.workers.weight_group import buckets
from tasks.stages.graph import GENERATION_TASKS, ITERATION_TASKS, generation
from tasks.stages.spec import StageSpec
from tasks.stages.weights import sampling_version


def test_buckets_keep_the_order_one_dtype_each_and_the_size_bound():
    mb = 2**20
    named = [
        ("a", torch.zeros(mb // 4)),  # 1 MiB fp32
        ("b", torch.zeros(mb // 4)),
        ("c", torch.zeros(mb // 4)),
        ("big", torch.zeros(3 * mb // 4)),  # 3 MiB: a bucket of its own, larger than the bound
        ("h", torch.zeros(mb // 2, dtype=torch.bfloat16)),  # another dtype starts a bucket
        ("d", torch.zeros(mb // 4)),
    ]
    out = buckets(named, bucket_bytes=2 * mb)
    assert [[n for n, _ in b] for b in out] == [["a", "b"], ["c"], ["big"], ["h"], ["d"]]
    assert [n for b in out for n, _ in b] == [n for n, _ in named]  # every tensor once, in order
    assert buckets([], 2 * mb) == []


@pytest.mark.parametrize(
    "engines, expected",
    [
        ({}, "gloo"),  # the CPU path
        ({"trainer_devices": [0, 1], "rollout_devices": [2, 3]}, "nccl"),  # split over one node's GPUs
        ({"trainer_devices": [0, 1], "rollout_devices": [1, 2]}, "gloo"),  # a shared GPU: NCCL refuses it
        ({"trainer_bundle": {"GPU": 1}, "rollout_bundle": {"GPU": 2}}, "nccl"),  # Ray gives each its own GPUs
        ({"trainer_bundle": {"GPU": 0.5}, "rollout_bundle": {"GPU": 0.5}}, "gloo"),  # colocated fractions
        ({"trainer_bundle": {"GPU": 1}}, "gloo"),  # replicas without a GPU bundle: wherever CUDA puts them
    ],
)
def test_the_weight_group_uses_nccl_only_between_gpus_of_their_own(engines, expected):
    assert backend(EnginesConfig(**engines)) == expected


def test_one_step_ahead_runs_the_sampling_stages_and_the_batch_and_nothing_that_trains():
    assert [s.name for s in GENERATION_TASKS] == ["prompts", "rollouts", "scores", "batch"]
    assert set(GENERATION_TASKS) < set(ITERATION_TASKS)
    # A stage that reads the iteration before (as advantages reads DCPO's history) never runs ahead.
    history = StageSpec("x", reads=("prompts",), sections=(), scope="round", reads_previous=("prompt_stats",))
    assert history not in generation((*ITERATION_TASKS, history))


def test_iteration_k_samples_with_update_k_minus_1_or_k_minus_2_one_step_off_policy():
    def versions(staleness: int) -> list[int]:
        cfg = RunConfig.model_validate({"rl": {"max_staleness": staleness}})
        return [sampling_version(cfg, k) for k in range(1, 6)]

    assert versions(0) == [0, 1, 2, 3, 4]
    assert versions(1) == [0, 0, 1, 2, 3]
