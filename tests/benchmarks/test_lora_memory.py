"""benchmarks/lora_memory.py's child measurement on a tiny model: what it counts as trainable and as saved for backward."""

from __future__ import annotations

from benchmarks.lora_memory import child
from tests.helpers import make_model


def test_child_counts_the_adapter_by_hand_and_leaves_parameters_out_of_the_saved_bytes(model_dirs, tokenizer):
    lora = child(model_dirs["student"], "lora", rank=2, tokens=32)
    full = child(model_dirs["student"], "full", rank=2, tokens=32)
    # the tiny Llama (tests/helpers.make_model): hidden 32, MLP 64, 4 heads of 8 with 2 KV heads, 2 layers. A rank-r
    # adapter on a (in -> out) linear adds r * (in + out): q 32->32, k 32->16, v 32->16, o 32->32, gate 32->64,
    # up 32->64, down 64->32, so r * 512 per layer and r * 1024 in all; rank 2: 2,048
    assert lora["trainable_parameters"] == 2 * 1024
    assert full["trainable_parameters"] == sum(p.numel() for p in make_model(tokenizer).parameters())
    for rec in (lora, full):
        points = list(rec["rss_mb"].values())
        assert points == sorted(points) and rec["peak_rss_mb"] == points[-1]  # a running peak
        # log_softmax's backward keeps its output: 4 rows x 7 positions x V fp32, a lower bound of what is saved
        assert rec["saved_for_backward_mb"] * 2 ** 20 >= 4 * 7 * len(tokenizer) * 4
    assert lora["saved_for_backward_mb"] != full["saved_for_backward_mb"]  # the frozen base saves less for its weights
