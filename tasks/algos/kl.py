"""KL estimators, one registry: each entry is the torch form (the loss) with its Polars form as a capability (a KL
penalty placed in the reward, computed by the advantage estimators on the logprobs table). lr = log π − log π_ref.

k1 = lr; k2 = ½·lr²; k3 = exp(−lr) − 1 + lr; k3+ has k3's value and k2's gradient: k2 − sg(k2) + sg(k3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import polars as pl
import torch

from tasks.registry import Registry


@dataclass(frozen=True)
class KLForms:
    polars: Callable[[], pl.Expr]  # the estimator's value per token over old_logprobs and ref_logprobs


KL_ESTIMATORS: Registry = Registry("KL estimator", KLForms)


def _lr_expr() -> pl.Expr:
    """lr per token from the lists exploded (or flattened) into rows: old_logprobs (π) and ref_logprobs (π_ref)."""
    return pl.col("old_logprobs").cast(pl.Float64) - pl.col("ref_logprobs").cast(pl.Float64)


def _k3_expr() -> pl.Expr:
    lr = _lr_expr()
    return (-lr).exp() - 1.0 + lr


@KL_ESTIMATORS.register("k1", polars=_lr_expr)
def kl_k1(logp, ref_logp):
    return logp - ref_logp


@KL_ESTIMATORS.register("k2", polars=lambda: 0.5 * _lr_expr() * _lr_expr())
def kl_k2(logp, ref_logp):
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3", polars=_k3_expr)
def kl_k3(logp, ref_logp):
    lr = logp - ref_logp
    return torch.exp(-lr) - 1 + lr


@KL_ESTIMATORS.register("k3+", polars=_k3_expr)  # a penalty in the reward has no gradient: k3's value
def kl_k3_plus(logp, ref_logp):
    """k3's value with k2's gradient (unbiased gradient of KL), as k2 − sg(k2) + sg(k3)."""
    k2 = kl_k2(logp, ref_logp)
    return k2 - k2.detach() + kl_k3(logp, ref_logp).detach()


def kl_expr(name: str) -> pl.Expr:
    """The estimator's value per token as a Polars expression over old_logprobs and ref_logprobs."""
    return KL_ESTIMATORS.entry(name).polars()
