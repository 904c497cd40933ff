"""Sequence packing of the learner's passes: a micro-batch's rows as one sequence, without padding.

A micro-batch of ``B`` right-padded rows of lengths ``L_1..L_B`` (``T = max L_b``) costs ``B x T`` tokens in every
layer of a padded forward; packed, its ``sum L_b`` real tokens are laid end to end in one ``(1, sum L_b)`` sequence
whose ``position_ids`` restart at 0 at each row, and no ``attention_mask`` is passed. transformers (5.x,
``masking_utils._preprocess_mask_arguments``) then reads the row boundaries from ``position_ids``
(``find_packed_sequence_indices``: a new row wherever a position is not the previous one + 1) and ``create_causal_mask``
(also the sliding-window and chunked variants) ANDs the causal mask with "same row" (``packed_sequence_mask_function``),
so sdpa, eager and flex attention attend within each row only (flash attention reads the same ``position_ids`` as
varlen boundaries). Rotary embeddings read the restarted positions, so every row sees the positions of its padded
forward. The ``(1, sum L_b, D)`` hidden states are scattered back to ``(B, T, D)`` (zeros at the padding), so every
caller indexes the supervised positions ``(rows, cols)`` exactly as before and every loss runs unchanged.

Where transformers does not support it (a model whose mask ignores ``position_ids``, a recurrent layer that carries
state across the row boundary, an unusual attention implementation), packing would let rows see each other: so every
model is verified once, before its first packed pass, by :func:`check_packing` (two short rows packed against each row
alone, in eval mode; a model that fails stays padded, with the reason logged). An FSDP-sharded model stays padded too
(not verified under sharding; logged). ``OPDModule(pack_sequences=...)``: ``"auto"`` (pack every model that passes
the check), ``True`` (the same, but a model that fails raises), ``False`` (never pack: ``OPDModule``'s default for now;
``auto`` is opt-in, ``--model.init_args.pack_sequences=auto``). A micro-batch of one row is never packed (no padding).

Measured (docs/design.md "Sequence packing"): on a real batch of the peer workload (``benchmarks/peer_trl.py``: 4
first-turn TextWorld prompts, 16 sampled tokens, SmolLM2-135M, ``micro_batch_tokens: 2048``, so one micro-batch), rows
of 238, 158, 199 and 154 tokens: 952 tokens per pass padded against 749 real (21% padding), 749 packed (none), in the
student's forward and backward and the teacher's forward alike. The update of that batch (``backward_step`` over it,
then fused AdamW; fp32, 2 threads, an "AMD EPYC" with 2 cores shared with other jobs, load average 5-10): padded 30.5 /
34.7 / 43.4 s, packed 33.2 / 38.6 / 33.1 s (medians 34.7 vs 33.2 s, alternating): no difference the load lets us see.
On the demo's multi-turn step, alone (``benchmarks/step_vs_main.py``, 2026-12-06, "AMD EPYC", 2 cores, fp32, seed 0,
the same episodes at steps 2-3): the update took 39.4 s (median of steps 2-4) packed against 37.6 s padded, the whole
step 52.7 against 49.7 s. Why packing does not pay there: the demo's episodes average 1,024-1,301 tokens
(``rollout/tokens`` of those steps), so under ``micro_batch_tokens: 2048`` most micro-batches hold one episode and have
no padding to remove; and where two rows do share a pass, CPU sdpa has no variable-length kernel (flash attention's
varlen), so the packed row's attention runs over the dense ``(sum L_b)^2`` score matrix with a block-diagonal mask,
more than the ``B T^2`` of the padded pass when the rows are of similar length. Hence ``pack_sequences: false`` stays the
default; ``auto`` is for a GPU with flash attention (``attn_implementation="flash_attention_2"``), not measured here.
"""

from __future__ import annotations

import logging
import weakref
import torch

from lightning_opd.models.fsdp import is_sharded
from lightning_opd.models.logits import trunk, trunk_hidden_states
from lightning_opd.teachers.in_process import InProcessTeacher

log = logging.getLogger(__name__)

#: values of ``model.init_args.pack_sequences``
PACK_SEQUENCES = ("auto", True, False)

#: the attention implementations whose masks transformers builds from ``position_ids`` when no mask is given
PACKABLE_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")

_PROBE_LENGTHS = (5, 1, 7)
_LEAK_TOLERANCE = 1e-6  # rows of the check: one of length 1, a row boundary between rows of any length


class PackingUnsupportedError(ValueError):
    """``pack_sequences=True`` for a model that transformers cannot run packed (raised at its first pass)."""


def packed_positions(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, cols, position_ids)``, each ``(n,)`` long, of the ``n`` attended tokens of a right-padded
    ``(B, T)`` ``attention_mask``, in packed order (row 0's tokens, then row 1's, ...); ``position_ids`` restart at 0
    at each row (the column, for a right-padded row).

    Raises:
        ValueError: a row whose attended tokens are not a prefix (left padding, holes): packing needs right padding.
    """
    keep = attention_mask.bool()
    lengths = keep.sum(1)
    prefix = torch.arange(keep.shape[1], device=keep.device)[None, :] < lengths[:, None]
    if not torch.equal(keep, prefix):
        raise ValueError("pack_sequences needs right-padded rows (attention_mask a prefix of ones per row): got "
                         f"{attention_mask.tolist()[:4]}; collate with lightning_opd.rollout.batch."
                         "collate_trajectories or set model.init_args.pack_sequences=false")
    rows, cols = keep.nonzero(as_tuple=True)  # row-major: the packed order
    return rows, cols, cols


def packed_trunk_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` right-padded ids and mask -> ``(B, T, D)`` final hidden states of ``trunk(model)``, computed on
    the rows packed into one ``(1, n)`` sequence (``n`` attended tokens, ``position_ids`` restarting at 0 at each row,
    no ``attention_mask``: transformers' block-diagonal causal mask), scattered back to the rows' positions; zeros at
    the padding. Differentiable (the scatter is an ``index_put``). Only for a model :func:`check_packing` accepted.

    Raises:
        ValueError: rows that are not right-padded (:func:`packed_positions`).
    """
    rows, cols, positions = packed_positions(attention_mask)
    hidden = trunk(model)(input_ids=input_ids[rows, cols][None], position_ids=positions[None],
                              attention_mask=None, use_cache=False).last_hidden_state[0]  # (n, D)
    dense = hidden.new_zeros(*input_ids.shape, hidden.shape[-1])
    return dense.index_put((rows, cols), hidden)


def _tolerance(dtype: torch.dtype) -> float:
    """Largest relative difference of the check's hidden states that is rounding (kernel order), not leaked
    attention (which moves them by O(1))."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


@torch.no_grad()
def check_packing(model) -> str | None:
    """Why ``model`` cannot run packed, or ``None`` when it can: its attention implementation is one whose mask
    transformers builds from ``position_ids`` (:data:`PACKABLE_ATTENTION`), it is not FSDP-sharded, and on three short
    rows (lengths 5, 1, 7) the packed hidden states equal each row's own padded forward within rounding (eval mode, no
    autocast; the model's mode is restored). Runs on the model's device, a few dozen tokens."""
    if is_sharded(model):
        return "the model is FSDP-sharded (packing is not verified under sharding)"
    impl = model.config._attn_implementation
    if impl not in PACKABLE_ATTENTION:
        return f"attn_implementation={impl!r} (packing needs one of {PACKABLE_ATTENTION})"
    device = next(model.parameters()).device
    vocab = min(int(model.config.get_text_config().vocab_size), 1000)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (len(_PROBE_LENGTHS), max(_PROBE_LENGTHS)), generator=gen).to(device)
    mask = (torch.arange(ids.shape[1])[None, :] < torch.tensor(_PROBE_LENGTHS)[:, None]).long().to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(device.type, enabled=False):
            packed = packed_trunk_hidden_states(model, ids, mask)
            alone = [trunk_hidden_states(model, ids[b:b + 1, :n], None)[0] for b, n in enumerate(_PROBE_LENGTHS)]
            leak = _leak(model, ids, mask, packed[-1])
    except Exception as err:  # a model whose forward refuses position_ids or a packed layout: stays padded
        return f"its packed forward failed ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    worst = max(float((packed[b, :n] - a).abs().max() / a.abs().max().clamp_min(1e-6))
                for b, (n, a) in enumerate(zip(_PROBE_LENGTHS, alone)))
    if worst > _tolerance(packed.dtype) or leak > _LEAK_TOLERANCE:
        return (f"packed rows differ from each row alone by {worst:.3g} and move with the other rows' tokens by "
                f"{leak:.3g} (relative): this architecture's attention or state is not kept within a row by "
                "position_ids in transformers")
    return None


def _leak(model, ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor) -> float:
    """Relative change of the last row's packed hidden states (``last``, ``(T, D)``) when every other row's tokens
    change (lengths kept): 0 where attention stays within rows (masked keys weigh exactly 0), whatever the dtype."""
    other = ids.clone()
    other[:-1] = (other[:-1] + 1) % max(int(ids.max()) + 1, 2)
    moved = packed_trunk_hidden_states(model, other, mask)[-1]
    return float((moved - last).abs().max() / last.abs().max().clamp_min(1e-6))


class SequencePacking:
    """The learner's choice of padded or packed passes, per model, decided once at each model's first pass.

    Args:
        mode: ``"auto"`` (pack every model :func:`check_packing` accepts; the others stay padded, reason logged),
            ``True`` (pack; a model that fails the check raises), ``False`` (never pack).

    Raises:
        ValueError: another ``mode`` (naming ``model.init_args.pack_sequences``).
    """

    def __init__(self, mode: str | bool = "auto") -> None:
        mode = {"true": True, "false": False}.get(mode.lower(), mode) if isinstance(mode, str) else mode
        if mode is not True and mode is not False and mode != "auto":
            raise ValueError(f"model.init_args.pack_sequences={mode!r}: use auto (pack where transformers supports "
                             "it), true (pack, refuse a model that cannot) or false (pad every micro-batch)")
        self.mode = mode
        self._packs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> bool

    def packs(self, model) -> bool:
        """Whether ``model``'s passes run packed (checked and logged at the first call for each model).

        Raises:
            PackingUnsupportedError: ``mode=True`` and :func:`check_packing` refuses ``model``.
        """
        if self.mode is False:
            return False
        decided = self._packs.get(model)
        if decided is None:
            reason = check_packing(model)
            name = type(model).__name__
            if reason is not None and self.mode is True:
                raise PackingUnsupportedError(f"model.init_args.pack_sequences=true but {name} cannot run packed: "
                                              f"{reason}; set pack_sequences to auto or false")
            if reason is None:
                log.info("sequence packing on for %s: a micro-batch's rows run as one sequence, no padding", name)
            else:
                log.warning("sequence packing off for %s (its micro-batches stay padded): %s", name, reason)
            decided = self._packs[model] = reason is None
        return decided

    def hidden_states(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``(B, T, D)`` final hidden states of ``model`` for ``(B, T)`` ids and mask: packed
        (:func:`packed_trunk_hidden_states`, zeros at the padding) where :meth:`packs`, else
        :func:`~lightning_opd.models.logits.trunk_hidden_states` (padded): the same values at every attended position
        (rounding apart). A single row is never packed (it has no padding)."""
        if attention_mask is not None and input_ids.shape[0] > 1 and self.packs(model):
            return packed_trunk_hidden_states(model, input_ids, attention_mask)
        return trunk_hidden_states(model, input_ids, attention_mask)

    def attach(self, teacher) -> "SequencePacking":
        """Give ``teacher`` (one that runs a transformer in this process and reads its trunk from a ``trunk``
        attribute, :class:`~lightning_opd.teachers.in_process.InProcessTeacher`) :meth:`hidden_states` as that trunk,
        so it scores the same micro-batches packed; any other teacher is left alone. Returns ``self``."""
        if isinstance(teacher, InProcessTeacher):
            teacher.trunk = self.hidden_states
        return self


def padding_stats(lengths_per_micro_batch: list[list[int]]) -> dict[str, int]:
    """Tokens the learner's passes compute for micro-batches of the given row lengths: ``real`` (sum of lengths),
    ``padded`` (rows x longest row, summed: a padded forward) and ``packed`` (``real``: a packed forward has none)."""
    real = sum(sum(lengths) for lengths in lengths_per_micro_batch)
    padded = sum(len(lengths) * max(lengths, default=0) for lengths in lengths_per_micro_batch)
    return {"real": real, "padded": padded, "packed": real}

