"""One RL update's policy loss, micro-batch by micro-batch (`PolicyUpdate`): the training frame as Python lists, a
minibatch's normalizers, this rank's micro-batches, and the forward and backward of one micro-batch through the
objective (tasks/algos/losses.py), with the running sums of its metrics. The loop around it (epochs, minibatches, the
engines, the critic, PPO-ptx, the checkpoint) is tasks/engines/workers/deepspeed_train.py's; the device check
(infra/gpu_check_steps.py) and tests/test_token_budget_update.py drive it alone.
No Prefect import: this runs in the trainer's processes.
"""

from __future__ import annotations

import time

import torch

from schemas.requests import UpdateRequest
from tasks.algos.losses import MinibatchNorm, policy_loss, rollout_correction
from tasks.data.formatting import pad_id
from tasks.engines.workers import data_parallel
from tasks.engines.workers.micro_batches import token_micro_batches
from tasks.engines.workers.packing import pack_shared
from tasks.engines.workers.token_batch import align_responses, count_into, response_logprobs
from tasks.engines.workers.training import unreported_grad_norm


class PolicyUpdate:
    """One RL update's state: the training frame as Python lists, the minibatch loop's running sums."""

    def __init__(self, request: UpdateRequest, tokenizer, data):
        self.request, self.pad = request, pad_id(tokenizer)
        self.prompts, self.responses = data["prompt_token_ids"].to_list(), data["token_ids"].to_list()
        columns = ("old_logprobs", "ref_logprobs", "token_advantages") + (
            ("sampler_logprobs",) if request.loss.loss.reads_sampler else ()
        )
        self.lists = {c: data[c].to_list() for c in columns}
        self.loss_mask = data["loss_mask"].to_list()
        # Multi-turn trajectories: 1 on the model's own tokens, 0 on tool results and environment messages, which are
        # context the model read, never actions it took: they get no loss (absent for single-turn samples).
        actions = data["action_mask"].to_list() if "action_mask" in data.columns else [None] * data.height
        self.action_mask = [
            [1.0] * len(r) if a is None else [float(x) for x in a] for a, r in zip(actions, self.responses)
        ]
        self.settings = request.loss
        self.totals: dict[str, float] = {}
        self.counts: dict[str, float] = {}  # what the forward passes computed (token_batch.count_into), summed
        self.seconds = dict.fromkeys(("forward", "backward", "step"), 0.0)  # this rank's, for the per-rank timings
        self.grad_norm: float | None = None  # the last step's, where DeepSpeed reports none (unreported_grad_norm)

    def add(self, key: str, value) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + float(value)

    def norm(self, minibatch: list[int]):
        """The minibatch's normalizers, before it is split: accumulation never changes the loss."""

        return MinibatchNorm(
            tokens=float(sum(sum(self.action_mask[i]) * self.loss_mask[i] for i in minibatch)),
            sequences=float(sum(1 for i in minibatch if self.loss_mask[i] and any(self.action_mask[i]))),
            max_len=float(self.request.loss.max_tokens),
        )

    def micro_batches(self, minibatch: list[int], gas: int) -> list[list[int]]:
        """This rank's micro-batches of `minibatch` (whole groups, next to each other): `gas` pieces of near-equal
        sample counts, or with engine.micro_batch_tokens packed to that token budget and balanced over the ranks by
        tokens (micro_batches.token_micro_batches)."""
        budget = self.request.engine.micro_batch_tokens
        if budget is None:
            return data_parallel.contiguous_micro_batches(minibatch, gas, data_parallel.world(), data_parallel.rank())
        every_rank = token_micro_batches(minibatch, self.prompts, self.responses, budget, data_parallel.world())
        return every_rank[data_parallel.rank()]

    def token_mask(self, idx: list[int], width: int):
        """(B, width) on the response grid: 1 where a token gets loss (the model's own, in a sample not masked)."""
        actions = align_responses([self.action_mask[i] for i in idx], width)
        return actions * torch.tensor([float(self.loss_mask[i]) for i in idx]).unsqueeze(1)

    def micro_step(self, engine, idx: list[int], norm, extra_loss=None, scale: float = 1.0) -> None:
        """Forward and backward of one micro-batch, its loss × `scale` (data_parallel.micro_steps: the world size, or 0
        for a dummy step, whose sums are left out). The micro-batch is packed with shared prompts
        (packing.pack_shared): every tensor below is on its (B, R) response grid."""

        add = self.add if scale else (lambda key, value: None)
        batch = pack_shared([self.prompts[i] for i in idx], [self.responses[i] for i in idx], self.pad)
        if scale:
            count_into(self.counts, engine, batch, "update")
        width = batch.shape[1]
        mask = self.token_mask(idx, width)  # (B, R)
        old, adv = (
            align_responses([self.lists[c][i] for i in idx], width) for c in ("old_logprobs", "token_advantages")
        )
        # No reference pass ran (π_old from the sampler, no KL: LogprobsRequest.with_ref): nothing reads it but the
        # kl_ref metric, which is then left out.
        has_ref = self.lists["ref_logprobs"][idx[0]] is not None
        ref = align_responses([self.lists["ref_logprobs"][i] for i in idx], width) if has_ref else old
        weights = sampler = None
        if self.settings.loss.reads_sampler:
            sampler = align_responses([self.lists["sampler_logprobs"][i] for i in idx], width)
        if self.settings.loss.corrects_rollout:
            weights, correction = rollout_correction(old, sampler, mask, self.settings.loss)  # (B, R)
            for key, value in correction.items():
                add(key, value)
        t0 = time.time()
        logp, ent = response_logprobs(
            engine,
            batch,
            with_entropy=True,
            entropy_grad=bool(self.settings.entropy_coef),
            temperature=self.settings.temperature,
        )  # (B, R) each, on the model's device: the rest of the loss's inputs follow it there
        old, ref, adv, mask, weights, sampler = (
            None if t is None else t.to(logp.device) for t in (old, ref, adv, mask, weights, sampler)
        )
        loss, sums = policy_loss(
            logp, old, ref, adv, mask, norm, self.settings, entropy=ent, token_weights=weights, sampler_logp=sampler
        )
        total = loss * scale
        if extra_loss is not None:  # PPO-ptx, once per optimizer step, the same batch on every rank (not scaled)
            ptx_loss = extra_loss(engine)
            total = total + ptx_loss
            if data_parallel.rank() == 0:
                self.add("ptx_loss", ptx_loss.detach())
                self.add("loss", ptx_loss.detach())
        t1 = time.time()
        engine.backward(total, scale_wrt_gas=False)
        t2 = time.time()
        if engine.is_gradient_accumulation_boundary():
            self.grad_norm = unreported_grad_norm(engine)
        engine.step()
        self._time(forward=t1 - t0, backward=t2 - t1, step=time.time() - t2)
        for key, v in sums.items():
            if has_ref or key != "kl_ref":
                add(key, v)
        add("loss", loss.detach())
        add("entropy", (ent.detach() * mask).sum())

    def _time(self, **seconds: float) -> None:
        for key, value in seconds.items():
            self.seconds[key] += value

    def rank_timings(self, wait_seconds: float) -> dict[str, list[float]]:
        """Per-rank seconds (lists indexed by rank): forward, backward (DeepSpeed's gradient reduction runs inside it),
        optimizer step, and waiting for the slowest rank at the end of the update."""
        mine = {**self.seconds, "wait": wait_seconds}
        every = data_parallel.all_gather(mine)
        return {f"rank_seconds_{k}": [r[k] for r in every] for k in mine}
