"""Loading Hugging Face causal LMs, the tokenizer compatibility check (F01), the OPD head path check (F20)
and the SmolLM2 import."""

from lightning_opd.models.loading import load_causal_lm, load_tokenizer
from lightning_opd.models.logits import UnsupportedArchitectureError, check_head_path
from lightning_opd.models.tokenizers import TokenizerMismatchError, check_tokenizers_compatible

__all__ = ["load_causal_lm", "load_tokenizer", "check_tokenizers_compatible", "TokenizerMismatchError",
           "check_head_path", "UnsupportedArchitectureError"]
