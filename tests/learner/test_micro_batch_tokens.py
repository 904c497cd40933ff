"""``micro_batch_tokens``: micro-batches sized by a token budget (F07: the gradient is the one-micro-batch
gradient, whatever the budget; F19: ranks with different micro-batch counts agree before any collective)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_opd.learner import ATODModule, OPDModule
from lightning_opd.losses import FullVocabReverseKL, SampledTokenReverseKL
from lightning_opd.models.fsdp import shard_causal_lm
from tests.helpers import make_tokenizer, spawn_ranks
from tests.learner.test_module import LOSSES, SCHEMES, make_batch, make_module, step_grads, with_scheme

# the 4 scripted episodes of make_batch are 109, 195, 163 and 104 tokens long; per budget, the micro-batches
# (row ranges) hand-worked from rows x longest row <= budget, fewest micro-batches then least padding
LAYOUTS = {1: [1, 1, 1, 1],  # every episode is longer than the budget: one micro-batch each
           400: [2, 2],  # 2 x 195 = 390 and 2 x 163 = 326; no three fit (3 x 195 = 585)
           600: [3, 1],  # 585 + 104 = 689 padded tokens (rows 1-3 first: 109 + 585 = 694)
           800: [4]}  # 4 x 195 = 780


def token_module(model_dirs, loss_cls, budget: int) -> OPDModule:
    m = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=loss_cls(),
                  micro_batch_tokens=budget)
    m.configure_model()
    return m


def test_make_batch_lengths_are_the_hand_worked_ones(tokenizer):
    assert make_batch(tokenizer).lengths == [109, 195, 163, 104]


# every loss without weightings, and each weighting (freshness: M1 weights + M3 ratios; turn blend) with both
# reverse-KL forms
CASES = [pytest.param(p.values[0], "none", id=f"{p.id}-none") for p in LOSSES] + [
    pytest.param(cls, scheme, id=f"{cls.__name__}-{scheme}") for cls in (FullVocabReverseKL, SampledTokenReverseKL)
    for scheme in SCHEMES[1:]]


@pytest.mark.parametrize(("loss_cls", "scheme"), CASES)
def test_f07_token_budget_does_not_change_the_gradient(model_dirs, tokenizer, loss_cls, scheme):
    """Every budget (one micro-batch per episode, pairs, a triple and a single, all four together) gives the
    loss and gradient of the whole batch in one micro-batch (``micro_batch_size=4``)."""
    batch = make_batch(tokenizer)
    reference = make_module(model_dirs, loss_cls, 4)
    sums4, grads4 = step_grads(reference, with_scheme(reference, batch, scheme))
    for budget, sizes in LAYOUTS.items():
        module = token_module(model_dirs, loss_cls, budget)
        b = with_scheme(module, batch, scheme)
        micro, n_real = module.agreed_micro_batches(b)
        assert [mb.size for mb in micro] == sizes and n_real == len(sizes), budget
        sums, grads = step_grads(module, b)
        torch.testing.assert_close(sums["loss"], sums4["loss"])
        for name, g in grads4.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=f"budget {budget}: {name}")


def test_student_logprobs_keep_row_order_under_a_token_budget(model_dirs, tokenizer):
    batch = make_batch(tokenizer)
    lp1 = make_module(model_dirs, FullVocabReverseKL, 1).student_logprobs(batch)
    lp = token_module(model_dirs, FullVocabReverseKL, 600).student_logprobs(batch)
    torch.testing.assert_close(lp, lp1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [OPDModule, ATODModule])
def test_both_knobs_set_is_refused_naming_both_keys(model_dirs, cls):
    with pytest.raises(ValueError, match=r"model.init_args.micro_batch_size=2 and "
                                         r"model.init_args.micro_batch_tokens=512 are both set"):
        cls(student=model_dirs["student"], teacher=model_dirs["teacher"], micro_batch_size=2, micro_batch_tokens=512)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(micro_batch_tokens=0), r"model.init_args.micro_batch_tokens=0 must be >= 1"),
    (dict(micro_batch_size=0), r"model.init_args.micro_batch_size=0 must be >= 1"),
])
def test_bad_micro_batch_values_are_refused(model_dirs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], **kwargs)


def test_neither_knob_means_one_episode_per_micro_batch(model_dirs):
    m = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
    assert (m.micro_batch_size, m.micro_batch_tokens) == (1, None)
    a = ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"], micro_batch_tokens=256)
    assert (a.micro_batch_size, a.micro_batch_tokens) == (None, 256)


# ----------------------------------------------------------------------------- F19 + F07, 2 FSDP2 ranks
def _sharded_worker(rank, port, model_dirs, loss_name, out_dir):
    import os

    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    loss_cls = {"full": FullVocabReverseKL, "sampled": SampledTokenReverseKL}[loss_name]
    module = token_module(model_dirs, loss_cls, 350)
    shard_causal_lm(module.student, init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",)))
    local = make_batch(make_tokenizer()).select(slice(rank * 2, rank * 2 + 2))
    own = len(local.split_tokens(350))  # rank 0: 109 and 195 (2 x 195 > 350): 2; rank 1: 163 and 104: 1
    micro, n_real = module.agreed_micro_batches(local)
    sums, _ = step_grads(module, local, world_size=2)
    grads = {n: p.grad.full_tensor() for n, p in module.student.named_parameters()}
    loss = sums["loss"].clone()
    dist.all_reduce(loss)
    torch.save({"own": own, "agreed": len(micro), "n_real": n_real, "loss": loss, "grads": grads,
                "logprobs": module.student_logprobs(local)}, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_f19_ranks_with_different_micro_batch_counts_give_the_single_process_gradient(model_dirs, tokenizer, tmp_path):
    """Under FSDP2 every forward is a collective: rank 1 (1 micro-batch under the budget) pads to rank 0's 2,
    nothing hangs, and the sharded loss, gradient and log-probs equal the single-process ones."""
    loss_name = "full"
    spawn_ranks(_sharded_worker, (model_dirs, loss_name, str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [(r["own"], r["agreed"], r["n_real"]) for r in ranks] == [(2, 2, 2), (1, 2, 1)]
    loss_cls = {"full": FullVocabReverseKL, "sampled": SampledTokenReverseKL}[loss_name]
    module = make_module(model_dirs, loss_cls, 4)
    batch = make_batch(tokenizer)
    sums, grads = step_grads(module, batch)
    torch.testing.assert_close(ranks[0]["loss"], sums["loss"])
    for name, g in grads.items():
        torch.testing.assert_close(ranks[0]["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)
    torch.testing.assert_close(torch.cat([ranks[0]["logprobs"], ranks[1]["logprobs"]]), module.student_logprobs(batch),
                               atol=1e-5, rtol=1e-5)
