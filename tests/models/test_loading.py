"""Safe files (F15, F16) and the Hugging Face export: a pickle payload is refused, shipped modelling code
does not run unless asked, a crash mid-export keeps the previous export, and the exported student
reproduces the trained model's log-probs in plain transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_opd.data import RolloutDataModule
from lightning_opd.models.loading import load_causal_lm, save_hf_atomic
from lightning_opd.learner import OPDModule
from tests.helpers import KeywordEnvFactory, make_model

MARKER = "payload_ran.txt"


class Payload:
    """Unpickling this would create ``MARKER`` (what a malicious checkpoint does)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


def _bin_model_dir(src: str, dst: Path) -> Path:
    """A copy of a model directory whose weights are a pickle ``pytorch_model.bin`` carrying ``Payload``."""
    dst.mkdir()
    for name in Path(src).iterdir():
        if not name.name.startswith("model") or not name.name.endswith(".safetensors"):
            shutil.copy(name, dst / name.name)
    state = load_causal_lm(src).state_dict()
    state["payload"] = Payload(str(dst / MARKER))
    torch.save(state, dst / "pytorch_model.bin")
    return dst


def test_a_pickle_checkpoint_with_a_payload_is_refused(model_dirs, tmp_path):
    path = _bin_model_dir(model_dirs["student"], tmp_path / "evil")
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|payload|not an allowed"):
        load_causal_lm(path)
    assert not (path / MARKER).exists()


def test_shipped_modelling_code_does_not_run_by_default(model_dirs, tmp_path):
    path = tmp_path / "remote"
    shutil.copytree(model_dirs["student"], path)
    (path / "modeling_evil.py").write_text(f"open({str(path / MARKER)!r}, 'w').write('pwned')\n")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="evil-llama", auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
                                                     "AutoConfig": "modeling_evil.EvilConfig"})
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="(?i)trust_remote_code|evil-llama"):
        load_causal_lm(path)  # trust_remote_code defaults to False
    assert not (path / MARKER).exists()


def test_a_crash_mid_export_keeps_the_previous_export(tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "export"
    first = make_model(tokenizer, seed=0)
    save_hf_atomic(first, tokenizer, out)
    second = make_model(tokenizer, seed=1)
    real_save = type(second).save_pretrained

    def crash_after_writing(self, path, **kw):
        real_save(self, path, **kw)  # the weights are written, the tokenizer is not yet: then the crash
        raise OSError("killed mid-export (simulated)")

    monkeypatch.setattr(type(second), "save_pretrained", crash_after_writing)
    with pytest.raises(OSError, match="simulated"):
        save_hf_atomic(second, tokenizer, out)
    monkeypatch.undo()
    reloaded = load_causal_lm(out)
    for p, q in zip(first.state_dict().values(), reloaded.state_dict().values()):
        torch.testing.assert_close(q, p)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary folder left
    assert AutoTokenizer.from_pretrained(str(out)).chat_template


def test_export_at_the_end_of_fit_reproduces_the_trained_log_probs(model_dirs, tmp_path):
    out = tmp_path / "student-opd"
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], export_dir=str(out),
                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                           eval_batch_size=2, seed=0)
    L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0).fit(model, datamodule=dm)
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()  # plain transformers, safetensors
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == model.tokenizer.chat_template and (out / "model.safetensors").exists()
    ids = tok.apply_chat_template([{"role": "user", "content": "open the chest"}], add_generation_prompt=True,
                                  return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    original = load_causal_lm(model_dirs["student"]).eval()
    with torch.no_grad():
        trained = torch.log_softmax(model.student.eval()(ids).logits, -1)
        got = torch.log_softmax(exported(ids).logits, -1)
        before = torch.log_softmax(original(ids).logits, -1)
    torch.testing.assert_close(got, trained, rtol=1e-5, atol=1e-5)
    assert (got - before).abs().max() > 1e-3  # the export holds the trained weights, not the initial ones
