"""PPO's critic: a separate value model for any causal LM, the policy's backbone (`AutoModel`, the transformer
without its LM head) plus a linear value head (one scalar per token).

It starts from the policy checkpoint's backbone with a zeroed head, so its first values are 0 and its
initialisation needs no random state: the logprobs worker and the trainer build the same model. Its checkpoint
(`checkpoints/iter=k/critic/`) is the backbone's Hugging Face folder plus `value_head.safetensors` (and its own
DeepSpeed state). Not every architecture has a token-classification head in transformers; every one has a backbone.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from tasks.engines.workers.packing import SharedPrefixBatch

HEAD_FILE = "value_head.safetensors"


class ValueModel(torch.nn.Module):
    def __init__(self, backbone, head: torch.nn.Linear):
        super().__init__()
        self.backbone, self.head = backbone, head
        self.config = backbone.config

    def forward(self, batch: SharedPrefixBatch):
        """V of the state before each response token, (N, R) on the batch's response grid: read where the token is
        predicted (its prompt's last position for the first), on the shared-prefix layout."""
        batch = batch.to(self.head.weight.device)
        hidden = self.backbone(**batch.model_inputs(self.backbone)).last_hidden_state  # (G, L, H)
        return batch.on_grid(self.head(hidden[batch.rows, batch.positions]).squeeze(-1))  # (N, R)

    def gradient_checkpointing_enable(self, **kwargs):
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def save_pretrained(self, out_dir: str, state_dict: dict | None = None, **kwargs) -> None:
        """`state_dict`: the whole model's weights when they do not live in its parameters (ZeRO-3 gathers them)."""

        def part(prefix: str) -> dict | None:
            return (
                None
                if state_dict is None
                else {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
            )

        self.backbone.save_pretrained(out_dir, state_dict=part("backbone."), **kwargs)
        head = part("head.") if state_dict is not None else self.head.state_dict()
        save_file({k: v.detach().contiguous() for k, v in head.items()}, os.path.join(out_dir, HEAD_FILE))


def load_critic(path: str, fresh: bool, dtype: str = "float32") -> ValueModel:
    """From a policy checkpoint (`fresh`: its backbone, a zeroed head) or from a critic checkpoint."""

    backbone = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype))
    backbone.config.use_cache = False
    # Dropout would make the values noisy; the policy trains without it too.
    head = torch.nn.Linear(backbone.config.hidden_size, 1, dtype=getattr(torch, dtype))
    with torch.no_grad():
        if fresh:
            head.weight.zero_()
            head.bias.zero_()
        else:
            head.load_state_dict(load_file(os.path.join(path, HEAD_FILE)))
    return ValueModel(backbone, head)


def token_values(critic, batch: SharedPrefixBatch):
    """V of the state before each response token, (N, R) on the response grid of packing.pack_shared."""
    return critic(batch).float()
