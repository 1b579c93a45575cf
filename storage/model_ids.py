"""Identities of model folders, for stage fingerprints: a model's (its config and weight files) and its tokenizer's.
Below the stages and the reward sources, which both fingerprint the models they read."""

from __future__ import annotations

import hashlib
from pathlib import Path

from schemas.errors import UserError


class ModelPathError(UserError, FileNotFoundError):
    pass


def model_fingerprint(path: str | Path) -> str:
    """Identity of a model folder from its config and weight files' names, sizes and mtimes (cheap for big models)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ModelPathError(f"model path {path} does not exist or has no config.json")
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def tokenizer_fingerprint(path: str | Path) -> str:
    """Identity of a model folder's tokenizer (and chat template): every file but the weights and optimizer state."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ModelPathError(f"model path {path} does not exist or has no config.json")
    h = hashlib.sha256()
    for f in sorted(
        p for p in path.iterdir() if p.is_file() and p.suffix not in (".safetensors", ".bin", ".pt", ".pth")
    ):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:20]
