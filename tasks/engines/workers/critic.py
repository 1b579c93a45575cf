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

HEAD_FILE = "value_head.safetensors"


class ValueModel(torch.nn.Module):
    def __init__(self, backbone, head: torch.nn.Linear):
        super().__init__()
        self.backbone, self.head = backbone, head
        self.config = backbone.config

    def forward(self, input_ids, attention_mask):
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state  # (B, L, H)
        return self.head(hidden).squeeze(-1)  # (B, L)

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


def token_values(critic, input_ids, attention_mask):
    """V of the state before each next token, on the (B, L−1) next-token grid of token_batch.pack."""
    return critic(input_ids=input_ids, attention_mask=attention_mask)[:, :-1].float()
