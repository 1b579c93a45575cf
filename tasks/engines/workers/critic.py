"""PPO's critic: a separate value model, LlamaForTokenClassification with one label (a scalar per token).

It starts from the policy checkpoint (same backbone) with a zeroed `score` head, so its first values are 0
and its initialisation needs no random state: the logprobs worker and the trainer build the same model.
Later iterations load it from `checkpoints/iter=k/critic/` (HF weights + its own DeepSpeed state).
"""

from __future__ import annotations


def load_critic(path: str, fresh: bool):
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path)
    config.num_labels, config.classifier_dropout = 1, 0.0  # dropout would make the values noisy
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)
    if fresh:
        with torch.no_grad():
            model.score.weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
    model.config.use_cache = False
    return model


def token_values(critic, input_ids, attention_mask):
    """V of the state before each next token, on the (B, L−1) next-token grid of token_batch.pack."""
    return critic(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1, 0].float()
