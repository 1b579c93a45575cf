"""LoRA without engines: the adapter a config asks for, one update by the trainer's own optimizer against the update
computed by hand, the reference as the adapter switched off, the merge, and the one-line errors. (Runs with vLLM and
DeepSpeed: tests/test_e2e.py.)"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from schemas.config import ConfigError, build_config
from schemas.requests import LoraSettings
from tasks.engines.workers.lora import LoraError, check_targets, load_causal_lm, merge_into_folder, save_adapter
from tasks.engines.workers.training import adamw

RANK, ALPHA, LR = 2, 8.0, 1e-2


@pytest.fixture
def tiny_model(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    path = tmp_path / "base"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def lora(targets=("q_proj", "v_proj"), seed=0) -> LoraSettings:
    return LoraSettings(rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=targets, modules_to_save=(), seed=seed)


def test_only_the_adapter_trains_and_one_update_equals_the_hand_computed_one(tiny_model):
    """Loss = Σ token logprobs of a fixed sequence through the whole model. For one adapted layer y = W x + s·B A x
    (s = alpha / rank), with g = dL/dy taken at that layer: dL/dB = s·gᵀ(A x), dL/dA = s·(g B)ᵀ x; the first AdamW step
    moves each weight by −lr·ĝ/(|ĝ| + ε) (bias-corrected moments m̂ = g, v̂ = g²). The base weights do not move."""
    model = load_causal_lm(str(tiny_model), lora=lora(), trainable=True)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"q_proj", "v_proj"}
    assert all(
        float(p.detach().abs().sum()) == 0 for n, p in trainable.items() if ".lora_B." in n
    )  # starts as the base model
    with torch.no_grad():  # a non-zero B, so that A gets a gradient as well
        for n, p in trainable.items():
            if ".lora_B." in n:
                p.copy_(torch.randn_like(p) * 0.1)
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    seen = {}

    def keep(module, args, out):
        out.retain_grad()
        seen["x"], seen["y"] = args[0].detach(), out

    handle = layer.register_forward_hook(keep)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    optimizer = adamw(model, LR, 0.0)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in trainable.values()}
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8]])
    logits = model(input_ids=ids).logits[0, :-1]
    loss = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).sum()
    loss.backward()
    handle.remove()
    x, g = (
        seen["x"].reshape(-1, seen["x"].shape[-1]),
        seen["y"].grad.reshape(-1, seen["y"].shape[-1]),
    )  # (T, in), (T, out)
    a, b, s = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach(), ALPHA / RANK
    grad_b = s * g.T @ (x @ a.T)  # (out, r)
    grad_a = s * (g @ b).T @ x  # (r, in)
    assert torch.allclose(layer.lora_B["default"].weight.grad, grad_b, atol=1e-6)
    assert torch.allclose(layer.lora_A["default"].weight.grad, grad_a, atol=1e-6)
    optimizer.step()
    for name, grad in (("lora_A", grad_a), ("lora_B", grad_b)):
        key = f"base_model.model.model.layers.1.self_attn.q_proj.{name}.default.weight"
        expected = before[key] - LR * grad / (grad.abs() + 1e-8)
        assert torch.allclose(trainable[key].detach(), expected, atol=1e-6)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_the_adapter_init_follows_its_seed_only(tiny_model):
    torch.manual_seed(123)  # whatever ran before
    first = {
        n: p.clone()
        for n, p in load_causal_lm(str(tiny_model), lora=lora(seed=5), trainable=True).named_parameters()
        if p.requires_grad
    }
    torch.manual_seed(456)
    again = dict(load_causal_lm(str(tiny_model), lora=lora(seed=5), trainable=True).named_parameters())
    other = dict(load_causal_lm(str(tiny_model), lora=lora(seed=6), trainable=True).named_parameters())
    assert all(torch.equal(p, again[n]) for n, p in first.items())
    assert not all(torch.equal(p, other[n]) for n, p in first.items())


def test_adapter_off_is_the_base_model_and_the_merge_equals_the_adapter_model(tiny_model, tmp_path):
    model = load_causal_lm(str(tiny_model), lora=lora(), trainable=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn_like(p) * 0.1)
    ckpt = tmp_path / "ckpt"
    save_adapter(model, str(ckpt))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    base = LlamaForCausalLM.from_pretrained(tiny_model).eval()
    adapted = load_causal_lm(str(ckpt)).eval()  # an adapter checkpoint loads on its base model
    with torch.no_grad():
        with adapted.disable_adapter():
            assert torch.allclose(adapted(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-6)
        with_adapter = adapted(input_ids=ids).logits
        assert (with_adapter - base(input_ids=ids).logits).abs().max() > 1e-3
    # the checkpoint's own tokenizer is what a merged folder carries: give it one
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    ).save_pretrained(ckpt)
    merged = tmp_path / "merged"
    merge_into_folder(str(ckpt), str(merged))
    assert not (merged / "adapter_config.json").exists() and (merged / "model.safetensors").exists()
    with torch.no_grad():
        plain = LlamaForCausalLM.from_pretrained(merged).eval()
        assert torch.allclose(plain(input_ids=ids).logits, with_adapter, atol=1e-5)


def test_lora_config_errors_are_one_line(tiny_model):
    for sets, needle in (
        (["lora.rank=0"], "lora.rank"),
        (["lora.rank=4", "lora.target_modules=[]"], "target_modules"),
        (["lora.rank=1024"], "lora.rank"),
        (["lora.rank=4", "lora.dropout=1.5"], "lora.dropout"),
    ):
        with pytest.raises(ConfigError, match=needle):
            build_config({}, sets)
    assert build_config({}, ["lora.rank=4"]).lora.target_modules == "all-linear"
    cfg = build_config({}, ["lora.rank=4", "lora.target_modules=[q_proj, qkv_proj]"])
    with pytest.raises(LoraError, match="no linear module named 'qkv_proj'.*q_proj") as err:
        check_targets(str(tiny_model), cfg.lora)
    assert "\n" not in str(err.value)
    with pytest.raises(LoraError, match="modules_to_save.*'score'"):
        check_targets(str(tiny_model), build_config({}, ["lora.rank=4", "lora.modules_to_save=[score]"]).lora)
    check_targets(str(tiny_model), build_config({}, ["lora.rank=4", "lora.target_modules=[q_proj, down_proj]"]).lora)


def test_a_config_without_lora_keeps_its_fingerprints():
    plain, off = build_config({}), build_config({}, ["lora.alpha=32"])  # lora at its defaults
    assert plain.section_hash("optim", "lora") == off.section_hash("optim") == plain.section_hash("optim")
    assert build_config({}, ["lora.rank=8"]).section_hash("optim", "lora") != plain.section_hash("optim", "lora")


def test_grouped_lora_products_equal_vllm_cpu_ones():
    """tasks/engines/workers/vllm_cpu_lora.py against vLLM's own torch ops (the reference loop: one matrix copy per
    token): mixed adapter indices (-1 included, as vLLM passes them), 4-D stacked weights, add or set, a slice."""
    from vllm.lora.ops.torch_ops import lora_ops

    from tasks.engines.workers.vllm_cpu_lora import make_ops

    names = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
    original = {n: getattr(lora_ops, n) for n in names}
    ops = make_ops(original)
    torch.manual_seed(0)
    x, idx = torch.randn(7, 12), torch.tensor([0, 1, 1, -1, 0, 2, 1])
    a = torch.randn(3, 1, 4, 12)  # (adapters, 1, rank, in)
    b = torch.randn(3, 1, 10, 4)  # (adapters, 1, out, rank)
    want, got = torch.zeros(7, 4), torch.zeros(7, 4)
    original["bgmv_shrink"](x, a, want, idx, 0.5)
    ops["bgmv_shrink"](x, a, got, idx, 0.5)
    assert torch.allclose(want, got, atol=1e-5) and want.abs().sum() > 0
    h = torch.randn(7, 4)
    for add in (True, False):
        base = torch.randn(7, 10)
        want, got = base.clone(), base.clone()
        original["bgmv_expand"](h, b, want, idx, add)
        ops["bgmv_expand"](h, b, got, idx, add)
        assert torch.allclose(want, got, atol=1e-5)
        base = torch.randn(7, 16)
        want, got = base.clone(), base.clone()
        original["bgmv_expand_slice"](h, b, want, idx, 3, 10, add)
        ops["bgmv_expand_slice"](h, b, got, idx, 3, 10, add)
        assert torch.allclose(want, got, atol=1e-5)
    one = torch.zeros(7, dtype=torch.long)  # one adapter for every token: a single matmul
    want, got = torch.zeros(7, 4), torch.zeros(7, 4)
    original["bgmv_shrink"](x, a, want, one, 1.0)
    ops["bgmv_shrink"](x, a, got, one, 1.0)
    assert torch.allclose(want, got, atol=1e-5)
