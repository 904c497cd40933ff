"""A generator that replies with scripted text: expert walkthroughs for the teacher recipe, and tests.

Replies are the tokenizer's own encoding of the text followed by the end-of-turn id, so an episode
played with it equals a full chat-template render of the same conversation (the F08 reference).
"""

from __future__ import annotations

from typing import Callable

from transformers import PreTrainedTokenizerBase

from lightning_opd.rollout.generator import GenerationOutput, GenerationRequest, Generator, SamplingParams


class ScriptedGenerator(Generator):
    """Replies with ``reply_fn(request)`` encoded by ``tokenizer`` (+ end-of-turn id).

    Args:
        tokenizer: the policy tokenizer (encodes the replies, no special tokens added).
        reply_fn: text of the reply to a request (has ``task_id`` and ``turn``).
        policy_version: version stamped on every output (when not attached to a policy).

    The behaviour log-probs are 0 (a scripted reply is deterministic). ``max_new_tokens`` is ignored.
    Its stop ids are the tokenizer's EOS until :meth:`attach` gives the policy's set; a reply is cut
    after the first stop id it contains, like every backend's (F23).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, reply_fn: Callable[[GenerationRequest], str],
                 policy_version: int = 0) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.reply_fn = reply_fn
        self._fixed_version = policy_version
        self.end_of_turn_id = int(tokenizer.eos_token_id)
        self.stop_ids = frozenset({self.end_of_turn_id})

    @property
    def policy_version(self) -> int:
        return int(self._policy.policy_version) if self._policy is not None else self._fixed_version

    def _generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationOutput]:
        outs = []
        for r in requests:
            ids = self.tokenizer.encode(self.reply_fn(r), add_special_tokens=False) + [self.end_of_turn_id]
            outs.append(GenerationOutput(token_ids=ids, logprobs=[0.0] * len(ids), finished=True,
                                         policy_version=self.policy_version))
        return outs


def walkthrough_replies(actions: dict[str, list[str]]) -> Callable[[GenerationRequest], str]:
    """``reply_fn`` that plays ``actions[task_id][turn]`` (the expert's command for that turn)."""

    def reply(r: GenerationRequest) -> str:
        seq = actions[r.task_id]
        return seq[r.turn] if r.turn < len(seq) else seq[-1]

    return reply
