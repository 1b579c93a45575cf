"""Preference losses, pure torch (docs/algorithms.md): Bradley–Terry over K-wise rankings, and DPO."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def ranking_pair_mask(ranks: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, K, K) bool: [b, i, j] is True when response i is strictly preferred to j (a lower rank), both real."""
    both = valid.unsqueeze(2) & valid.unsqueeze(1)  # (B, K, K)
    return both & (ranks.unsqueeze(2) < ranks.unsqueeze(1))


def kwise_bradley_terry(scores: torch.Tensor, ranks: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-element loss (B,): the mean over the ranking's C(K,2) ordered pairs (ties excluded) of
    −log σ(s_better − s_worse). One ranking is ONE element, whatever its number of pairs (InstructGPT).

    scores, ranks: (B, K); valid: (B, K) bool, False for padding (rankings of different K in one batch).
    """
    pairs = ranking_pair_mask(ranks, valid)  # (B, K, K)
    margins = scores.unsqueeze(2) - scores.unsqueeze(1)  # (B, K, K): s_i − s_j
    losses = -F.logsigmoid(margins) * pairs
    return losses.sum(dim=(1, 2)) / pairs.sum(dim=(1, 2)).clamp(min=1)


def pairwise_accuracy(scores: torch.Tensor, ranks: torch.Tensor, valid: torch.Tensor) -> tuple[float, int]:
    """(correctly ordered pairs, pairs): a pair counts as correct when the better response scores higher."""
    pairs = ranking_pair_mask(ranks, valid)
    correct = ((scores.unsqueeze(2) - scores.unsqueeze(1)) > 0) & pairs
    return float(correct.sum()), int(pairs.sum())


@dataclass(frozen=True)
class DPOStats:
    loss: torch.Tensor  # scalar, mean over the pairs
    chosen_rewards: torch.Tensor  # (B,) β·(log π − log π_ref) of the chosen response
    rejected_rewards: torch.Tensor  # (B,)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> DPOStats:
    """L = −log σ(β·[(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))]); every input is a (B,)
    sequence logprob, the sum over response tokens."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    loss = -F.logsigmoid(chosen - rejected).mean()
    return DPOStats(loss, chosen.detach(), rejected.detach())


def chosen_nll(chosen_logps: torch.Tensor, chosen_lengths: torch.Tensor) -> torch.Tensor:
    """Mean over pairs of the chosen response's per-token NLL, −log π(y_w)/|y_w|: the term RPO (Pang et al.
    2024) adds to DPO so that the chosen response's likelihood is not pushed down along with the rejected."""
    return -(chosen_logps / chosen_lengths.clamp(min=1)).mean()


def step_label_loss(logits: list[torch.Tensor], labels: list[torch.Tensor]) -> torch.Tensor:
    """(N,) a process reward model's loss per response: the mean over its steps of the binary cross-entropy of the
    step's label y ∈ {0, 1} under p = σ(logit at the step's last token), −[y·log p + (1 − y)·log(1 − p)]; 0 for a
    response with no step."""
    return torch.stack(
        [
            F.binary_cross_entropy_with_logits(x, y, reduction="mean") if len(y) else x.sum() * 0.0
            for x, y in zip(logits, labels)
        ]
    )
