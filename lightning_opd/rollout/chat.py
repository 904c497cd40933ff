"""Token-in, token-out chat rendering for multi-turn episodes (fault F08).

A conversation is never decoded and re-tokenised. The first prompt is one render of the chat template
with the generation prompt; each later user turn appends the *token difference* between two renders of
a fixed reference conversation (with and without the new user turn), so no special token is
hard-coded and the result matches what the template would produce for the whole conversation.

For ChatML (SmolLM2) the pieces are::

    first prompt : <|im_start|>system\\n{sys}<|im_end|>\\n<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n
    reply        : {sampled ids ... <|im_end|>}          (end-of-turn id appended if the reply was cut)
    user turn    : \\n<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n

A reply may end on any stop id (:func:`stop_token_ids`, e.g. a second EOS of the generation config);
the next user turn follows it as it is.
"""

from __future__ import annotations

from transformers import GenerationConfig, PreTrainedTokenizerBase

_REF_USER, _REF_REPLY = "ref-user", "ref-reply"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be rendered incrementally."""


def stop_token_ids(tokenizer: PreTrainedTokenizerBase,
                   generation_config: GenerationConfig | None = None) -> frozenset[int]:
    """Every id that ends a reply (F23), the one set shared by the generators, the agent loop and collate:
    the tokenizer's EOS (the chat template's end-of-turn token, :attr:`ChatFormat.end_of_turn_id`) and
    every ``eos_token_id`` of the model's generation config (an int or a list, e.g. ``[2, 0]``).

    Args:
        tokenizer: the policy's tokenizer.
        generation_config: the policy model's generation config (see
            :func:`lightning_opd.rollout.generator.policy_configs`); ``None``: the tokenizer's EOS only.

    Raises:
        ChatTemplateError: the tokenizer has no EOS token.
    """
    if tokenizer.eos_token_id is None:
        raise ChatTemplateError("tokenizer has no eos token; cannot tell where a reply ends")
    ids = {int(tokenizer.eos_token_id)}
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(int(i) for i in ([eos] if isinstance(eos, int) else eos))
    return frozenset(ids)


class ChatFormat:
    """Incremental, token-exact rendering of a multi-turn conversation with a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        system_prompt: content of the system message (``None``: the template's default, if any).

    Raises:
        ChatTemplateError: the template's renders are not prefix-consistent, or the end-of-turn
            token cannot be found after an assistant message; the message says which.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        eot = tokenizer.eos_token_id
        if eot is None:
            raise ChatTemplateError("tokenizer has no eos token; cannot close a reply cut by max_new_tokens")
        self.end_of_turn_id: int = int(eot)
        ref = self._messages(_REF_USER) + [{"role": "assistant", "content": _REF_REPLY}]
        ref_ids = self.render(ref, add_generation_prompt=False)
        if self.end_of_turn_id not in ref_ids:
            raise ChatTemplateError(
                f"the chat template does not close an assistant message with eos id {self.end_of_turn_id}"
            )
        # position right after the reference reply's end-of-turn token
        cut = len(ref_ids) - ref_ids[::-1].index(self.end_of_turn_id)
        self._ref_prefix = ref_ids[:cut]
        self._ref_len = cut
        self._ref = ref

    def _messages(self, first_user: str) -> list[dict[str, str]]:
        msgs = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        return msgs + [{"role": "user", "content": first_user}]

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """Token ids of one full template render of ``messages`` (the reference for tests)."""
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        if hasattr(out, "keys"):  # some tokenizers return a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def first_prompt(self, user_text: str) -> list[int]:
        """Ids of the system message (if any) + first user message + the generation prompt."""
        return self.render(self._messages(user_text), add_generation_prompt=True)

    def user_turn(self, user_text: str) -> list[int]:
        """Ids to append after a reply that ended with the end-of-turn token: the template's text
        between that token and the next generation prompt, including the new user message."""
        full = self.render(self._ref + [{"role": "user", "content": user_text}], add_generation_prompt=True)
        if full[: self._ref_len] != self._ref_prefix:
            raise ChatTemplateError(
                "the chat template re-renders earlier turns differently when a user turn is added; "
                "token-exact multi-turn rendering is impossible with this template"
            )
        return full[self._ref_len:]
