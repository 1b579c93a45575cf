"""The packed attention (tasks/engines/workers/packed_attention.py) against the dense-mask reference: the same model
with transformers' SDPA attention given the (L, L) mask of the shared-prefix layout. Logprobs, a loss and its gradients
agree within 1e-5 in fp32, on one process and summed over two gloo ranks; the layout counts the pairs the mask allows
and computes no (L, L) tensor."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.engines.workers.packed_attention import ATTENTION, packed_layout
from tasks.engines.workers.packing import pack_shared
from tasks.engines.workers.token_batch import response_logprobs

CAP = 9  # the longest response: "a response at the cap"


def tiny(config_class=LlamaConfig, model_class=LlamaForCausalLM, **extra):
    torch.manual_seed(0)
    sizes = {"vocab_size": 50, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 32}
    cfg = config_class(**sizes, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **extra)
    cfg._attn_implementation = "sdpa"
    return model_class(cfg).eval()


def samples(seed: int):
    """Four groups: prompts of 2-9 tokens, 1-5 responses of 0-CAP tokens, with an empty response and one at the cap,
    interleaved as a batch may hold them."""
    rnd = random.Random(seed)
    prompts, responses = [], []
    for _ in range(4):
        p = [rnd.randrange(3, 50) for _ in range(rnd.randint(2, 9))]
        for _ in range(rnd.randint(1, 5)):
            prompts.append(p)
            responses.append([rnd.randrange(3, 50) for _ in range(rnd.randint(0, CAP))])
    responses[0], responses[-1] = [], [rnd.randrange(3, 50) for _ in range(CAP)]
    order = list(range(len(prompts)))
    rnd.shuffle(order)
    return [prompts[i] for i in order], [responses[i] for i in order]


def dense_logprobs(model, batch):
    """The reference: the model's SDPA attention under the layout's dense (G, 1, L, L) mask; for a model with
    sliding-window layers (Gemma 3), those layers' mask also keeps keys less than the window back in the sequence as
    it would be alone (its position ids)."""
    mask = batch.dense_mask()
    window = getattr(model.config, "sliding_window", None)
    if window is not None and "sliding_attention" in getattr(model.config, "layer_types", []):
        back = batch.position_ids.unsqueeze(2) - batch.position_ids.unsqueeze(1)  # (G, L, L)
        mask = {"full_attention": mask, "sliding_attention": mask & (back < window).unsqueeze(1)}
    logits = model(
        input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids, use_cache=False
    ).logits  # (G, L, V)
    logp = logits[batch.rows, batch.positions].float().log_softmax(-1)  # (T, V)
    return batch.on_grid(logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1))  # (N, R)


def weighted(logp, seed: int = 0):
    """A loss with a different weight on every token (so that a token read from the wrong place shows)."""
    w = torch.linspace(-1.0, 1.0, logp.numel(), dtype=logp.dtype).view_as(logp)
    return (logp * w.roll(seed)).sum()


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return tiny(
        Gemma3TextConfig, Gemma3ForCausalLM, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return tiny(Qwen2Config, Qwen2ForCausalLM)


@pytest.mark.parametrize("make", [tiny, qwen2, gemma3], ids=["llama", "qwen2", "gemma3-sliding-window-4"])
@pytest.mark.parametrize("row_tokens", [None, 12, 30], ids=["one-row", "a-group-longer-than-a-row", "rows-of-groups"])
def test_logprobs_loss_and_gradients_equal_the_dense_mask(make, row_tokens):
    prompts, responses = samples(1)
    batch = pack_shared(prompts, responses, 0, row_tokens)
    if row_tokens == 12:  # some group is longer than a row and gets a row of its own
        assert batch.input_ids.shape[1] > 12 and batch.input_ids.shape[0] > 1
    if row_tokens == 30:
        assert batch.input_ids.shape[0] > 1 and (batch.group.max(dim=1).values >= 1).any()  # a row with several groups
    dense, packed = make(), make()
    want = dense_logprobs(dense, batch)
    got, _ = response_logprobs(packed, batch, with_entropy=False)
    assert packed.config._attn_implementation == ATTENTION and dense.config._attn_implementation == "sdpa"
    assert torch.allclose(got, want, atol=1e-5)
    weighted(want).backward()
    weighted(got).backward()
    assert torch.allclose(grads(packed), grads(dense), atol=1e-5)
    assert grads(packed).abs().sum() > 0


def test_a_wrong_pair_fails_the_comparison():
    """The comparison can fail: a response that also sees the other responses of its group (plain causal attention
    over the row) gives other logprobs."""
    prompts, responses = samples(2)
    batch = pack_shared(prompts, responses, 0)
    model = tiny()
    with torch.no_grad():
        want = dense_logprobs(model, batch)
        causal = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        logp = causal[batch.rows, batch.positions].float().log_softmax(-1)
        wrong = batch.on_grid(logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1))
    assert (wrong - want).abs().max() > 1e-2


def test_the_sum_of_two_ranks_gradients_equals_the_dense_whole(tmp_path):
    """Two gloo ranks each take half the groups on the packed path; their gradients, summed, are the dense-mask
    gradient of the whole batch (as the trainer's data parallelism sums them)."""
    import torch.multiprocessing as mp

    prompts, responses = samples(3)
    dense = tiny()
    weighted(dense_logprobs(dense, pack_shared(prompts, responses, 0))).backward()
    keys = sorted({tuple(p) for p in prompts})
    halves = [[i for i, p in enumerate(prompts) if keys.index(tuple(p)) % 2 == r] for r in (0, 1)]
    port = random.Random().randrange(20000, 40000)
    mp.spawn(_rank, args=(port, prompts, responses, halves, str(tmp_path)), nprocs=2, join=True)
    assert torch.allclose(torch.load(tmp_path / "summed.pt"), grads(dense), atol=1e-5)


def _rank(rank, port, prompts, responses, halves, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        # Each rank's half, its loss weights those the whole batch's loss gives the same samples.
        mine = halves[rank]
        whole = pack_shared(prompts, responses, 0)
        w = torch.linspace(-1.0, 1.0, whole.shape[0] * whole.shape[1]).view(whole.shape)[mine]
        batch = pack_shared([prompts[i] for i in mine], [responses[i] for i in mine], 0)
        model = tiny()
        logp, _ = response_logprobs(model, batch, with_entropy=False)
        (logp * w[:, : logp.shape[1]]).sum().backward()
        g = grads(model)
        dist.all_reduce(g)  # the sum over ranks, as the trainer's data parallelism takes it
        if rank == 0:
            torch.save(g, f"{out}/summed.pt")
    finally:
        dist.destroy_process_group()


def test_the_layout_counts_the_masks_pairs_and_computes_few_more():
    prompts, responses = samples(4)
    for row_tokens in (None, 12):
        batch = pack_shared(prompts, responses, 0, row_tokens)
        allowed = (batch.dense_mask()[:, 0] & batch.real.unsqueeze(-1)).sum()
        assert batch.layout.allowed_pairs == int(allowed)
        assert batch.layout.allowed_pairs <= batch.layout.computed_pairs


@pytest.mark.parametrize("length, ratio", [(256, 1.156), (1024, 1.017), (4096, 1.001)])
def test_long_groups_compute_near_the_allowed_pairs_without_an_l_by_l_tensor(length, ratio):
    """8 responses after a 150-token prompt (the bench's shape): the pairs computed per pair allowed, by hand:
    computed = 150·151/2 + 8·(150 + n)(151 + n)/2, allowed = 150·151/2 + 8·(150·n + n(n + 1)/2). Every tensor of the
    layout is linear in the row's length (at 4,096 a dense mask would hold 1.1 G entries)."""
    prompt = list(range(3, 153))
    batch = pack_shared([prompt] * 8, [[5] * length] * 8, 0)
    computed = 150 * 151 // 2 + 8 * (150 + length) * (151 + length) // 2
    allowed = 150 * 151 // 2 + 8 * (150 * length + length * (length + 1) // 2)
    assert (batch.layout.computed_pairs, batch.layout.allowed_pairs) == (computed, allowed)
    assert computed / allowed == pytest.approx(ratio, abs=0.01)
    row = batch.input_ids.numel()
    assert all(t.numel() <= 2 * row for t in (*batch.layout.gathers, batch.layout.source))


def test_buckets_pad_segments_of_similar_length_together():
    from tasks.engines.workers.packed_attention import _buckets

    assert _buckets([100, 98, 60, 59, 10]) == [[0, 1], [2, 3], [4]]  # within 10% of the pairs: one call
    assert _buckets([5]) == [[0]]
    layout = packed_layout(torch.tensor([[0, 0, 0, 0, 0, -1]]), torch.tensor([[0, 0, 1, 1, 2, -1]]))
    # segments: the prompt (2 tokens), response 1 (2 + 2), response 2 (2 + 1): too unlike to share a call
    assert [g.tolist() for g in layout.gathers] == [[[0, 1, 2, 3]], [[0, 1, 4]], [[0, 1]]]
    assert layout.source.tolist() == [7, 8, 2, 3, 6, 9]  # the prompt's outputs from its own segment; padding: 4 + 3 + 2


def test_a_model_outside_transformers_attention_interface_is_refused_in_one_line():
    from tasks.engines.workers.packed_attention import install

    with pytest.raises(ValueError, match="holds no transformers model"):
        install(torch.nn.Linear(2, 2))


def test_a_plain_forward_after_a_packed_one_is_transformers_own():
    """The attention is installed on the model at its first packed batch; a padded or plain forward afterwards runs
    transformers' SDPA as before."""
    prompts, responses = samples(5)
    model, plain = tiny(), tiny()
    ids = torch.tensor([prompts[0] + responses[1]])
    with torch.no_grad():
        response_logprobs(model, pack_shared(prompts, responses, 0), with_entropy=False)
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
