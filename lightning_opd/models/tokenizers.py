"""Tokenizer compatibility between student and teacher (fault F01 in docs/faults.md).

The teacher scores the student's token ids, so both must share one tokenizer. ``vocab_size`` alone is
too weak (different tokenizers can share a size) and too strict (one tokenizer, embedding matrices
padded to different sizes), so the token-to-id maps and special tokens are compared, and logits are
later compared over the shared real vocabulary only.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TokenizerMismatchError(ValueError):
    """Student and teacher tokenizers differ, so the teacher cannot score the student's ids."""


def _special(tok: PreTrainedTokenizerBase) -> dict[str, int | None]:
    return {name: getattr(tok, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}


def check_tokenizers_compatible(
    student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase,
    student_name: str = "student", teacher_name: str = "teacher",
) -> int:
    """Check that ``teacher`` can score ids produced with ``student``'s tokenizer.

    Compares the full token -> id maps (added tokens included) and the bos/eos/unk ids. Padding ids
    are not compared (they never reach the loss: masks come from lengths, F03).

    Returns:
        The real vocabulary size ``V`` (number of distinct ids); logits of both models are compared
        over ``[:V]`` only, so embedding matrices padded to different sizes are fine (F01b).

    Raises:
        TokenizerMismatchError: the maps or special tokens differ; the message names both models and
            the first differing entries. Use a teacher trained with the student's tokenizer.
    """
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        only_s = sorted(set(sv.items()) - set(tv.items()), key=lambda kv: kv[1])[:5]
        only_t = sorted(set(tv.items()) - set(sv.items()), key=lambda kv: kv[1])[:5]
        raise TokenizerMismatchError(
            f"{student_name} and {teacher_name} tokenizers differ ({len(sv)} vs {len(tv)} tokens; "
            f"e.g. only in {student_name}: {only_s}, only in {teacher_name}: {only_t}). The teacher must "
            "score the student's token ids with the same tokenizer; pick a teacher of the student's family."
        )
    ss, ts = _special(student), _special(teacher)
    for name in ("bos", "eos", "unk"):
        if ss[name] != ts[name]:
            raise TokenizerMismatchError(
                f"{student_name} and {teacher_name} tokenizers differ in the {name} token id "
                f"({ss[name]} vs {ts[name]}); both must use one tokenizer."
            )
    return max(sv.values()) + 1
