"""The policy's shared-prefix layout (each group's prompt computed once) against the plain padded layout, on a tiny
random Llama: the same logprobs, entropies and gradients; and how micro-batches keep a group's samples together."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.engines.workers.data_parallel import contiguous_micro_batches
from tasks.engines.workers.micro_batches import group_order
from tasks.engines.workers.packing import pack, pack_shared
from tasks.engines.workers.token_batch import align_responses, response_logprobs, token_logprobs


def unalign(grid: torch.Tensor, prompt_lens: list[int], response_lens: list[int]) -> list[list[float]]:
    """Per-response-token values read off the padded layout's (N, L−1) next-token grid."""
    return [grid[i, p - 1 : p - 1 + r].tolist() for i, (p, r) in enumerate(zip(prompt_lens, response_lens))]


def tiny_model(tied: bool = True, config_class=LlamaConfig, model_class=LlamaForCausalLM, **extra):
    torch.manual_seed(0)
    sizes = {"vocab_size": 50, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 32}
    cfg = config_class(**sizes, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied, **extra)
    return model_class(cfg).eval()


def groups(seed: int = 0):
    """Three prompts of different lengths, 1-4 responses each of 1-6 tokens, interleaved as a batch may hold them."""
    rnd = random.Random(seed)
    prompts, responses = [], []
    for _ in range(3):
        p = [rnd.randrange(3, 50) for _ in range(rnd.randint(3, 7))]
        for _ in range(rnd.randint(1, 4)):
            prompts.append(p)
            responses.append([rnd.randrange(3, 50) for _ in range(rnd.randint(1, 6))])
    order = list(range(len(prompts)))
    rnd.shuffle(order)
    return [prompts[i] for i in order], [responses[i] for i in order]


@pytest.mark.parametrize("row_tokens, rows", [(0, 3), (10_000, 1)])
def test_shared_prefix_logprobs_and_entropies_equal_the_padded_layouts(row_tokens, rows):
    model, (prompts, responses) = tiny_model(), groups()
    plen, rlen = [len(p) for p in prompts], [len(r) for r in responses]
    ids, attn, _ = pack(prompts, responses, 0)
    with torch.no_grad():
        lp, ent = token_logprobs(model, ids, attn)
        batch = pack_shared(prompts, responses, 0, row_tokens)
        got_lp, got_ent = response_logprobs(model, batch)
    assert batch.input_ids.shape[0] == rows  # a row per distinct prompt, or every group in one row
    assert batch.input_ids.numel() < ids.numel()
    assert batch.counts(True)["tokens"] == sum(len(p) for p in set(map(tuple, prompts))) + sum(
        rlen
    )  # no padding counted
    for want, got in ((unalign(lp, plen, rlen), got_lp), (unalign(ent, plen, rlen), got_ent)):
        assert torch.allclose(align_responses(want, got.shape[1]), got, atol=1e-5)
    assert torch.equal(batch.mask, align_responses([[1.0] * n for n in rlen], batch.shape[1]))


@pytest.mark.parametrize("row_tokens", [0, 10_000])
def test_shared_prefix_gradients_equal_the_padded_layouts(row_tokens):
    prompts, responses = groups(1)
    plen, rlen = [len(p) for p in prompts], [len(r) for r in responses]
    weights = [
        [0.1 * (j + 1) * (-1) ** i for j in range(n)] for i, n in enumerate(rlen)
    ]  # a different weight per token
    grads = []
    for shared in (False, True):
        model = tiny_model(tied=False)
        if shared:
            batch = pack_shared(prompts, responses, 0, row_tokens)
            logp, _ = response_logprobs(model, batch, with_entropy=False)
            w = align_responses(weights, logp.shape[1])
        else:
            ids, attn, mask = pack(prompts, responses, 0)
            logp, _ = token_logprobs(model, ids, attn, with_entropy=False)
            w = torch.zeros_like(logp)
            for i, (p, v) in enumerate(zip(plen, weights)):
                w[i, p - 1 : p - 1 + len(v)] = torch.tensor(v)
        (logp * w).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_a_model_without_logits_to_keep_gets_every_position():
    class NoKeep(torch.nn.Module):  # the forward of a model that predates `logits_to_keep`
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, use_cache, **kwargs):
            return self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                **kwargs,
            )

    model, (prompts, responses) = tiny_model(), groups(2)
    batch = pack_shared(prompts, responses, 0)
    with torch.no_grad():
        assert torch.allclose(response_logprobs(NoKeep(model), batch)[0], response_logprobs(model, batch)[0], atol=1e-6)


def test_group_order_keeps_groups_together_and_micro_batches_are_contiguous():
    prompts = [[1], [2], [1], [3], [2], [1]]
    assert group_order([0, 1, 2, 3, 4, 5], prompts) == [0, 2, 5, 1, 4, 3]
    assert group_order([4, 3, 5], prompts) == [4, 3, 5]
    rows = list(range(10))
    assert contiguous_micro_batches(rows, 3, 1, 0) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    two = [contiguous_micro_batches(rows, 2, 2, r) for r in (0, 1)]
    assert two == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9]]]
    assert contiguous_micro_batches([0, 1], 2, 2, 1) == [[], []]  # dummy steps keep a short rank in step


@pytest.mark.parametrize("empty_at", [0, 2])
def test_an_empty_response_has_no_tokens(empty_at):
    prompts, responses = [[5, 6, 7]] * 3, [[8, 9], [10], [11, 12, 13]]
    responses[empty_at] = []
    batch = pack_shared(prompts, responses, 0)
    assert batch.mask.sum(1).tolist() == [float(len(r)) for r in responses]


def test_reward_model_scores_and_sequence_logprobs_on_the_shared_layout_equal_the_padded_ones():
    from transformers import LlamaForSequenceClassification

    from tasks.engines.workers.sequence_scores import rm_scores, sequence_logps

    prompts, responses = groups(3)
    torch.manual_seed(0)
    cfg = tiny_model().config
    cfg.num_labels, cfg.pad_token_id = 1, 1
    rm = LlamaForSequenceClassification(cfg).eval()
    ids, attn, mask = pack(prompts, responses, 1)
    with torch.no_grad():
        padded = rm(input_ids=ids, attention_mask=attn).logits[:, 0]  # read at the last non-pad token
        assert torch.allclose(rm_scores(rm, prompts, responses, 1), padded, atol=1e-5)
        lm = tiny_model()
        lp, _ = token_logprobs(lm, ids, attn, with_entropy=False)
        assert torch.allclose(sequence_logps(lm, prompts, responses, 1), (lp * mask).sum(1), atol=1e-5)


def test_balanced_rows_keep_first_fits_row_count_and_even_out_the_rows():
    from tasks.engines.workers.micro_batches import balanced_rows

    sizes = [290, 280, 270, 260]  # first-fit decreasing into 1,024: rows of 840 and 260
    rows = balanced_rows(sizes, 1024)
    assert sorted(sorted(r) for r in rows) == [[0, 3], [1, 2]]  # 550 and 550
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3]
    assert balanced_rows([2000, 10, 10], 1024) == [[0], [1, 2]]  # a group longer than a row gets a row of its own
    assert balanced_rows([100, 200, 300], 10_000) == [[2, 1, 0]]  # one row when everything fits
    uneven = [97, 310, 45, 220, 180, 260, 33, 290, 150]
    rows = balanced_rows(uneven, 512)
    loads = [sum(uneven[i] for i in r) for r in rows]
    assert len(rows) == 4 and max(loads) - min(loads) <= max(uneven)  # first-fit needs 4 rows of 512 here


def gemma2_model():
    """A tiny Gemma 2: its logits are soft-capped, which the chunked path must apply (a cap of 3, so that it changes
    the logits of a random model)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return tiny_model(True, Gemma2Config, Gemma2ForCausalLM, final_logit_softcapping=3.0)


@pytest.mark.parametrize("make", [lambda: tiny_model(True), lambda: tiny_model(False), gemma2_model])
def test_chunked_logits_give_the_whole_passs_logprobs_entropies_and_gradients(make, monkeypatch):
    """Past LOGITS_AT_ONCE_BYTES the output layer runs over chunks of tokens under activation checkpointing: the values
    and the gradients (of the logprobs and, with an entropy bonus, of the entropy) equal the model's own forward."""
    import tasks.engines.workers.token_batch as tb

    prompts, responses = groups(3)
    batch = pack_shared(prompts, responses, 0)
    chunked, calls = tb._chunked_logprobs, []
    monkeypatch.setattr(tb, "_chunked_logprobs", lambda *a: calls.append(a[2]) or chunked(*a))
    results = []
    monkeypatch.setattr(tb, "LOGITS_CHUNK_BYTES", 4 * 50 * 3)  # 3 tokens a chunk
    for at_once in (tb.LOGITS_AT_ONCE_BYTES, 4 * 50 * 3):  # the whole pass; then in chunks
        monkeypatch.setattr(tb, "LOGITS_AT_ONCE_BYTES", at_once)
        model = make()
        logp, ent = response_logprobs(model, batch, with_entropy=True, entropy_grad=True)
        w = torch.linspace(-1, 1, logp.numel()).view_as(logp) * batch.mask
        ((logp * w).sum() - 0.3 * (ent * batch.mask).sum()).backward()
        results.append((logp.detach(), ent.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (lp0, e0, g0), (lp1, e1, g1) = results
    assert calls == [3]  # the second pass only, in chunks of 3 tokens
    assert torch.allclose(lp0, lp1, atol=1e-6) and torch.allclose(e0, e1, atol=1e-6)
    # fp32 sums in another order: up to 1.7e-6 apart on an AMD EPYC (gradients up to 5.4); a missing cap is O(1)
    assert torch.allclose(g0, g1, atol=5e-6, rtol=1e-5) and g0.abs().sum() > 0


def test_gradient_checkpointing_engages_in_eval_mode_without_dropout():
    """model.gradient_checkpointing did nothing: transformers checkpoints a layer only in training mode, and the policy
    trains in eval mode. training.checkpoint_layers switches the checkpointed layers alone: the forward now keeps a
    fraction of the tensors for the backward pass (the layers' are recomputed), the attention dropout (0.5 here) stays
    off, and the gradients equal those of the pass that kept its activations."""
    from tasks.engines.workers.training import checkpoint_layers

    prompts, responses = groups(4)
    batch = pack_shared(prompts, responses, 0)
    grads, calls = [], []
    for checkpointing in (False, True):
        model = tiny_model(tied=False)
        model.config.attention_dropout = 0.5
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.5
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            checkpoint_layers(model)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            logp, _ = response_logprobs(model, batch, with_entropy=False)
        (logp * batch.mask).sum().backward()
        calls.append(sum(saved))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert calls[1] < 0.5 * calls[0]  # what the forward kept for the backward, in elements
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_a_model_whose_logits_are_more_than_its_output_layer_keeps_its_own_forward(monkeypatch):
    """An architecture that changes its logits after the output layer, in a way _output_head does not know of, must not
    get the chunked path's other numbers: the one-time check against its own forward sends it back to that forward."""
    import tasks.engines.workers.token_batch as tb

    class Scaled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    monkeypatch.setattr(tb, "LOGITS_AT_ONCE_BYTES", 0)  # every batch would go in chunks
    monkeypatch.setattr(tb, "_HEAD_CHECKED", {})
    batch = pack_shared(*groups(5), 0)
    scaled = tiny_model(True, LlamaConfig, Scaled)
    with torch.no_grad():
        logp, _ = response_logprobs(scaled, batch, with_entropy=False)
        monkeypatch.setattr(tb, "LOGITS_AT_ONCE_BYTES", 1 << 62)
        own, _ = response_logprobs(scaled, batch, with_entropy=False)
    assert torch.equal(logp, own)
    assert list(tb._HEAD_CHECKED.values()) == [False]


@pytest.mark.parametrize("at_once", [1 << 62, 4 * 50 * 3])  # the whole pass; in chunks of 3 tokens
def test_logprobs_at_a_temperature_are_those_of_the_tempered_softmax(monkeypatch, at_once):
    """A sampler at temperature T draws from softmax(logits / T): the trainer's logprobs and entropies are of that
    distribution, computed here by hand from the plain model's logits, on both the whole and the chunked path."""
    import tasks.engines.workers.token_batch as tb

    monkeypatch.setattr(tb, "LOGITS_AT_ONCE_BYTES", at_once)
    monkeypatch.setattr(tb, "LOGITS_CHUNK_BYTES", 4 * 50 * 3)
    model, (prompts, responses) = tiny_model(), groups(6)
    plen, rlen = [len(p) for p in prompts], [len(r) for r in responses]
    ids, attn, _ = pack(prompts, responses, 0)
    batch = pack_shared(prompts, responses, 0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()  # (N, L-1, V)
        plain, _ = response_logprobs(model, batch, with_entropy=False)
        for t in (0.5, 1.0, 1.7):
            logp_all = torch.log_softmax(logits / t, dim=-1)
            want = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            want_ent = -(logp_all.exp() * logp_all).sum(-1)
            got, ent = response_logprobs(model, batch, with_entropy=True, temperature=t)
            for w, g in ((want, got), (want_ent, ent)):
                assert torch.allclose(align_responses(unalign(w, plen, rlen), g.shape[1]), g, atol=1e-5)
            if t == 1.0:
                assert torch.equal(got, plain)  # T = 1 is the plain softmax, to the bit
            else:
                assert (got - plain).abs().max() > 1e-2  # a temperature that is not applied fails the test
