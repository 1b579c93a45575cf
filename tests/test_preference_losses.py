"""Bradley–Terry (pairwise and K-wise) and DPO against hand-computed values and plain loops."""

import itertools
import math

import pytest
import torch

from tasks.algos.preference_losses import dpo_loss, kwise_bradley_terry, pairwise_accuracy


def bt(margin: float) -> float:
    return -math.log(1 / (1 + math.exp(-margin)))


def test_pairwise_is_the_bradley_terry_loss_by_hand():
    scores, ranks = torch.tensor([[2.0, 0.5]]), torch.tensor([[1, 2]])
    loss = kwise_bradley_terry(scores, ranks, torch.ones(1, 2, dtype=torch.bool))
    assert loss.item() == pytest.approx(bt(1.5))  # −log σ(2.0 − 0.5) = 0.2014
    assert loss.item() == pytest.approx(0.201413, abs=1e-6)


def test_kwise_element_is_the_mean_of_its_pairs_and_ties_give_no_pair():
    # K = 4 with ranks 1, 2, 2, 3: the pairs are (0,1) (0,2) (0,3) (1,3) (2,3); (1,2) is a tie.
    s = [1.0, 0.2, -0.3, -1.0]
    ranks = [1, 2, 2, 3]
    pairs = [(i, j) for i, j in itertools.permutations(range(4), 2) if ranks[i] < ranks[j]]
    assert len(pairs) == 5
    want = sum(bt(s[i] - s[j]) for i, j in pairs) / len(pairs)
    got = kwise_bradley_terry(torch.tensor([s]), torch.tensor([ranks]), torch.ones(1, 4, dtype=torch.bool))
    assert got.item() == pytest.approx(want)


def test_padding_is_ignored():
    full = kwise_bradley_terry(
        torch.tensor([[1.0, 0.0, 0.5]]), torch.tensor([[1, 3, 2]]), torch.ones(1, 3, dtype=torch.bool)
    )
    padded = kwise_bradley_terry(
        torch.tensor([[1.0, 0.0, 0.5, 9.0]]), torch.tensor([[1, 3, 2, 1]]), torch.tensor([[True, True, True, False]])
    )
    assert padded.item() == pytest.approx(full.item())


def test_kwise_gradient_differs_from_separate_pairs_only_by_the_weighting():
    """Two rankings (K = 4 with 6 pairs, K = 3 with 2 pairs, one tie). As ONE element each, a pair of
    ranking b weighs 1/(B·P_b); as separate elements every pair weighs 1/P. So the gradients wrt the scores
    are equal after scaling each ranking's by P/(B·P_b)."""
    torch.manual_seed(0)
    scores = torch.randn(2, 4)
    ranks = torch.tensor([[1, 2, 3, 4], [1, 2, 2, 9]])
    valid = torch.tensor([[True] * 4, [True, True, True, False]])
    s1 = scores.clone().requires_grad_(True)
    kwise_bradley_terry(s1, ranks, valid).mean().backward()

    s2 = scores.clone().requires_grad_(True)
    pair_losses, per_ranking = [], []
    for b in range(2):
        k = int(valid[b].sum())
        pairs = [(i, j) for i, j in itertools.permutations(range(k), 2) if ranks[b, i] < ranks[b, j]]
        per_ranking.append(len(pairs))
        pair_losses += [-torch.nn.functional.logsigmoid(s2[b, i] - s2[b, j]) for i, j in pairs]
    torch.stack(pair_losses).mean().backward()

    assert per_ranking == [6, 2]
    total, batch = sum(per_ranking), 2
    for b in range(2):
        assert torch.allclose(s1.grad[b], s2.grad[b] * total / (batch * per_ranking[b]), atol=1e-7)
    assert not torch.allclose(s1.grad, s2.grad)  # and the weighting does differ


def test_pairwise_accuracy_counts_ordered_pairs():
    correct, n = pairwise_accuracy(
        torch.tensor([[0.1, 0.9, 0.5]]), torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.bool)
    )
    assert (correct, n) == (1.0, 3)  # only (1 over 3): 0.9 > 0.5 is right; 0.1 < 0.9 and 0.1 < 0.5 are wrong


def test_dpo_by_hand():
    # policy − ref: chosen +1.0, rejected −0.5; β = 0.1 → margin 0.15; loss −log σ(0.15) = 0.62096.
    stats = dpo_loss(torch.tensor([-3.0]), torch.tensor([-5.5]), torch.tensor([-4.0]), torch.tensor([-5.0]), 0.1)
    assert stats.loss.item() == pytest.approx(bt(0.15))
    assert stats.loss.item() == pytest.approx(0.620957, abs=1e-6)
    assert stats.chosen_rewards.item() == pytest.approx(0.1) and stats.rejected_rewards.item() == pytest.approx(-0.05)


def test_dpo_at_the_reference_is_log2():
    x = torch.tensor([-2.0, -7.0])
    assert dpo_loss(x, x - 1, x, x - 1, 0.1).loss.item() == pytest.approx(math.log(2))


def test_chosen_nll_is_the_mean_per_token_nll():
    from tasks.algos.preference_losses import chosen_nll

    # −(−3/3 + −1/2)/2 = (1 + 0.5)/2 = 0.75
    assert chosen_nll(torch.tensor([-3.0, -1.0]), torch.tensor([3.0, 2.0])).item() == pytest.approx(0.75)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_trainable_layers_train_only_the_top_blocks_the_final_norm_and_the_head(arch):
    from transformers import GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    from tasks.engines.workers.sequence_scores import train_top_layers

    torch.manual_seed(0)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=2, num_labels=1, pad_token_id=0,
        )  # fmt: skip
        model, blocks, top_names = LlamaForSequenceClassification(config), "model.layers", ("model.norm", "score")
    else:
        config = GPT2Config(vocab_size=40, n_embd=16, n_layer=3, n_head=2, num_labels=1, pad_token_id=0)
        model, blocks, top_names = GPT2ForSequenceClassification(config), "transformer.h", ("transformer.ln_f", "score")
    train_top_layers(model, 1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    want = {n for n, _ in model.named_parameters() if n.startswith((f"{blocks}.2.", *top_names))}
    assert trainable == want and any(n.startswith(f"{blocks}.2.") for n in want)
    model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
    assert all((p.grad is None) != p.requires_grad for p in model.parameters())  # frozen ones got no gradient
    with pytest.raises(ValueError, match="has 3 transformer blocks"):
        train_top_layers(model, 4)


def test_preflight_refuses_more_trainable_layers_than_the_model_has(tmp_path):
    from transformers import LlamaConfig

    from tasks.stages.preflight import ContextLengthError, check_trainable_layers

    LlamaConfig(num_hidden_layers=3).save_pretrained(tmp_path)
    check_trainable_layers(str(tmp_path), 3)
    check_trainable_layers(str(tmp_path), None)
    with pytest.raises(ContextLengthError, match=r"reward_model.trainable_layers=4 exceeds the 3 transformer blocks"):
        check_trainable_layers(str(tmp_path), 4)
