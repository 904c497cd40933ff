"""``check_served_tokenizer`` (F32) on a fake served tokenizer: the whole vocabulary's id -> text is compared in
chunks, a differing chunk is bisected to the first differing id (named with both texts), an id beyond the student's
is refused naming both sizes, a server that adds a BOS or tokenizes the vocabulary's text differently is refused,
and the same tokenizer passes."""

from __future__ import annotations

import re

import pytest

from lightning_opd.models.tokenizers import TokenizerMismatchError, check_served_tokenizer


class FakeServed:
    """A server's tokenizer: the student's, except that id ``k`` decodes as id ``remap[k]`` and ids ``V..V+n-1``
    (``extra``, their texts) exist; counts its ``/detokenize`` calls."""

    def __init__(self, tokenizer, remap: dict[int, int] | None = None, extra: tuple[str, ...] = ()) -> None:
        self.tok, self.remap, self.extra, self.detokenize_calls = tokenizer, dict(remap or {}), extra, 0

    def detokenize(self, ids):
        self.detokenize_calls += 1
        size = len(self.tok)
        if any(i >= size + len(self.extra) for i in ids):
            return None  # refused, as vLLM refuses an id beyond its vocabulary
        if any(i >= size for i in ids):
            return "".join(self.extra[i - size] if i >= size else self.tok.decode([i]) for i in ids)
        return self.tok.decode([self.remap.get(i, i) for i in ids])

    def tokenize(self, text, add_special_tokens=False):
        return self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def render(self, messages, add_generation_prompt=True):
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def info(self):
        return None


def test_the_same_tokenizer_passes_in_one_request_per_chunk(tokenizer):
    served = FakeServed(tokenizer)
    check_served_tokenizer(tokenizer, served, "sampler at http://h:1", ids_per_request=64)
    assert len(tokenizer) == 300
    assert served.detokenize_calls == 5 + 1  # ceil(300 / 64) chunks, then id 300 (none)


def test_one_changed_id_is_named_with_both_texts(tokenizer):
    served = FakeServed(tokenizer, remap={137: 201})
    with pytest.raises(TokenizerMismatchError) as e:
        check_served_tokenizer(tokenizer, served, "teacher at http://h:1", ids_per_request=64)
    msg = str(e.value)
    assert msg.startswith(f"teacher at http://h:1 decodes id 137 as {tokenizer.decode([201])!r}, the student's "
                          f"tokenizer as {tokenizer.decode([137])!r}")
    assert served.detokenize_calls <= 3 + 2 * 6 + 1  # chunks up to 137's, two halves per bisection step, the message


def test_the_first_of_two_changed_ids_is_named(tokenizer):
    served = FakeServed(tokenizer, remap={250: 251, 251: 250, 90: 91})
    with pytest.raises(TokenizerMismatchError, match=r"decodes id 90 as "):
        check_served_tokenizer(tokenizer, served, "sampler at http://h:1", ids_per_request=4096)


def test_an_id_beyond_the_students_is_refused_naming_both_sizes(tokenizer):
    served = FakeServed(tokenizer, extra=("zebra",))
    with pytest.raises(TokenizerMismatchError, match=r"at http://h:1 has at least 301 token ids, the student's "
                                                     r"tokenizer 300: id 300 decodes to 'zebra'"):
        check_served_tokenizer(tokenizer, served, "sampler at http://h:1")


class BosServed(FakeServed):
    """Decodes like the student but adds a BOS (id 1) with ``add_special_tokens``, as a Llama-style config would."""

    def tokenize(self, text, add_special_tokens=False):
        return ([1] if add_special_tokens else []) + super().tokenize(text, False)


def test_a_server_that_adds_a_bos_is_refused_naming_both_id_lists(tokenizer):
    ids = tokenizer("take key", add_special_tokens=True)["input_ids"]
    with pytest.raises(TokenizerMismatchError, match=re.escape(f"served {[1] + ids}, student {ids} (a BOS or not")):
        check_served_tokenizer(tokenizer, BosServed(tokenizer), "sampler at http://h:1")


class ProbeServed(FakeServed):
    """Decodes like the student, but tokenizes long text (the vocabulary probe's chunks) with id 7 of it changed."""

    def tokenize(self, text, add_special_tokens=False):
        ids = super().tokenize(text, add_special_tokens)
        return ids[:7] + [(ids[7] + 1) % len(self.tok)] + ids[8:] if len(text) > 200 else ids


def test_text_that_tokenizes_differently_is_refused_at_the_vocabulary_probe(tokenizer):
    with pytest.raises(TokenizerMismatchError, match=r"^sampler at http://h:1 tokenizes differently from the student: "
                                                     r"first difference at token 7 of a vocabulary probe"):
        check_served_tokenizer(tokenizer, ProbeServed(tokenizer), "sampler at http://h:1", chars_per_request=400)
