"""The agent loop on the keyword environment: episode ends (win, loss, turn and context limits),
environment failures (F11), invalid actions, and the per-token bookkeeping the learner relies on."""

from __future__ import annotations

import pytest

from lightning_opd.rollout.agent_loop import AgentLoop, EnvironmentFailureError, EpisodeSpec
from lightning_opd.rollout.chat import ChatFormat, stop_token_ids
from lightning_opd.rollout.generator import GenerationOutput, GenerationRequest, Generator, SamplingParams
from lightning_opd.rollout.scripted import ScriptedGenerator, walkthrough_replies
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory
from tests.helpers import KeywordEnvFactory

SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=8)
TRAIN = ["apple", "cherry", "door", "key"]


def _loop(tokenizer, envs, reply_fn, **kwargs) -> AgentLoop:
    return AgentLoop(envs, ScriptedGenerator(tokenizer, reply_fn), tokenizer, **kwargs)


def _say(word: str):
    return lambda r: word


def _reply_tokens(tokenizer, text: str) -> int:
    """Tokens of one scripted reply: the text's own encoding plus the end-of-turn id."""
    return len(tokenizer.encode(text, add_special_tokens=False)) + 1


# ---------------------------------------------------------------------------------------------- episode ends


def test_winning_script(tokenizer):
    envs = KeywordEnvFactory(need=2)
    loop = _loop(tokenizer, envs, walkthrough_replies({t: envs.expert_actions(t) for t in TRAIN}))
    trajs = loop.run([EpisodeSpec(t, seed=i) for i, t in enumerate(TRAIN)], SAMPLING)
    assert [t.task_id for t in trajs] == TRAIN  # one trajectory per episode, in order
    assert [t.seed for t in trajs] == [0, 1, 2, 3]
    for t in trajs:
        assert (t.success, t.failure, t.truncated, t.truncation_reason, t.env_error) == (True, False, False, "", False)
        assert t.num_turns == 2
        assert t.rewards == [0.0, 1.0] and t.total_reward == 1.0
        assert t.invalid_actions == 0 and t.cut_replies == 0
        assert t.rollout_cap == 8  # the loop's default max_turns


def test_winning_script_needs_exactly_need_turns(tokenizer):
    loop = _loop(tokenizer, KeywordEnvFactory(need=4), lambda r: r.task_id, max_turns=4)
    (t,) = loop.run([EpisodeSpec("door")], SAMPLING)
    assert t.success and not t.truncated  # the win on the last allowed turn is a win, not a truncation
    assert t.num_turns == 4 and t.rewards == [0.0, 0.0, 0.0, 1.0]


def test_wrong_word_is_a_failure(tokenizer):
    loop = _loop(tokenizer, KeywordEnvFactory(need=2), _say("banana"))
    (t,) = loop.run([EpisodeSpec("apple")], SAMPLING)
    assert (t.success, t.failure, t.truncated, t.env_error) == (False, True, False, False)
    assert t.num_turns == 1 and t.rewards == [0.0]
    assert t.invalid_actions == 0  # "banana" is a listed command: a legal move that loses


def test_turn_limit(tokenizer):
    loop = _loop(tokenizer, KeywordEnvFactory(need=5), lambda r: r.task_id, max_turns=3)
    (t,) = loop.run([EpisodeSpec("apple")], SAMPLING)
    assert (t.truncated, t.truncation_reason, t.success, t.failure) == (True, "max_turns", False, False)
    assert t.num_turns == 3 and t.rewards == [0.0, 0.0, 0.0] and t.rollout_cap == 3


def test_episode_max_turns_overrides_the_default(tokenizer):
    loop = _loop(tokenizer, KeywordEnvFactory(need=5), lambda r: r.task_id, max_turns=3)
    short, default = loop.run([EpisodeSpec("apple", max_turns=2), EpisodeSpec("key")], SAMPLING)
    assert (short.num_turns, short.rollout_cap, short.truncation_reason) == (2, 2, "max_turns")
    assert (default.num_turns, default.rollout_cap, default.truncation_reason) == (3, 3, "max_turns")


@pytest.mark.parametrize("limit", [0, -1])
def test_invalid_limits(tokenizer, limit):
    envs, gen = KeywordEnvFactory(), ScriptedGenerator(tokenizer, _say("apple"))
    with pytest.raises(ValueError, match="max_turns"):
        AgentLoop(envs, gen, tokenizer, max_turns=limit)
    with pytest.raises(ValueError, match="max_context_tokens"):
        AgentLoop(envs, gen, tokenizer, max_context_tokens=limit)
    with pytest.raises(ValueError, match="max_env_error_rate"):
        AgentLoop(envs, gen, tokenizer, max_env_error_rate=1.5)


def test_context_limit_boundary(tokenizer):
    """The episode stops as soon as the next prompt plus max_new_tokens would not fit.

    Playing "apple" with need=5: first prompt P tokens, each reply R, each later user turn U (the
    observation "Again. ..." is the same every turn). After turn k the next prompt has
    P + (k+1) * (R + U) tokens. A budget of exactly P + 2(R + U) + max_new_tokens still fits the
    prompt of turn 2 (three turns played, then stop); one token less does not (two turns played).
    """
    envs = KeywordEnvFactory(need=5)
    chat = ChatFormat(tokenizer, envs.system_prompt)
    env = envs.make("apple")
    p = len(chat.first_prompt(env.reset()))
    r = _reply_tokens(tokenizer, "apple")
    u = len(chat.user_turn(env.step("apple").observation))
    fits_two = p + 2 * (r + u) + SAMPLING.max_new_tokens

    (t,) = _loop(tokenizer, envs, _say("apple"), max_context_tokens=fits_two).run([EpisodeSpec("apple")], SAMPLING)
    assert (t.truncated, t.truncation_reason, t.num_turns) == (True, "max_context", 3)
    assert t.num_tokens == p + 2 * (r + u) + r  # the third reply was taken; the next observation was not added

    (t,) = _loop(tokenizer, envs, _say("apple"), max_context_tokens=fits_two - 1).run([EpisodeSpec("apple")], SAMPLING)
    assert (t.truncated, t.truncation_reason, t.num_turns) == (True, "max_context", 2)
    assert t.num_tokens == p + (r + u) + r
    assert not t.success and not t.failure
    # the observation that did not fit is not recorded either
    assert [m["role"] for m in t.messages] == ["user", "assistant", "user", "assistant"]


# ---------------------------------------------------------------------------------- F11: environment errors


def _banana_for(task: str):
    return lambda r: "banana" if r.task_id == task else r.task_id


def test_env_error_ends_only_that_episode(tokenizer):
    loop = _loop(tokenizer, KeywordEnvFactory(need=2, fail_on="banana"), _banana_for("cherry"))
    trajs = loop.run([EpisodeSpec(t) for t in TRAIN], SAMPLING)
    bad = trajs[1]
    assert bad.task_id == "cherry"
    assert bad.env_error and bad.error_message == "RuntimeError: environment crashed on 'banana'"
    assert (bad.success, bad.failure, bad.truncated) == (False, False, False)
    assert bad.num_turns == 1 and bad.rewards == [0.0]  # the crashing turn is recorded, reward 0
    assert bad.messages[-1] == {"role": "assistant", "content": "banana"}
    for t in trajs[:1] + trajs[2:]:
        assert (t.env_error, t.error_message, t.success, t.num_turns, t.total_reward) == (False, "", True, 2, 1.0)


def test_env_error_rate_at_the_limit_does_not_raise(tokenizer):
    """Two of four episodes crash: 0.5 is not *more than* max_env_error_rate=0.5."""
    reply = lambda r: "banana" if r.task_id in ("apple", "door") else r.task_id  # noqa: E731
    loop = _loop(tokenizer, KeywordEnvFactory(need=2, fail_on="banana"), reply, max_env_error_rate=0.5)
    trajs = loop.run([EpisodeSpec(t) for t in TRAIN], SAMPLING)
    assert [t.env_error for t in trajs] == [True, False, True, False]
    assert [t.success for t in trajs] == [False, True, False, True]


def test_env_error_rate_above_the_limit_raises(tokenizer):
    loop = _loop(tokenizer, KeywordEnvFactory(need=2, fail_on="banana"), _banana_for("cherry"),
                 max_env_error_rate=0.2)
    with pytest.raises(EnvironmentFailureError) as info:
        loop.run([EpisodeSpec(t) for t in TRAIN], SAMPLING)  # 1/4 = 0.25 > 0.2
    msg = str(info.value)
    assert "1/4 episodes" in msg and "max_env_error_rate=0.2" in msg
    assert "RuntimeError: environment crashed on 'banana'" in msg


def test_reset_error_every_episode(tokenizer):
    calls = []
    loop = _loop(tokenizer, KeywordEnvFactory(reset_error=True), lambda r: calls.append(r) or "apple",
                 max_env_error_rate=1.0)
    trajs = loop.run([EpisodeSpec(t) for t in TRAIN], SAMPLING)
    assert calls == []  # no episode started, so nothing was generated
    for task, t in zip(TRAIN, trajs):
        assert t.env_error and t.error_message == f"OSError: cannot start task {task}"
        assert (t.num_tokens, t.num_turns, t.token_ids, t.assistant_mask, t.messages) == (0, 0, [], [], [])
        assert t.behaviour_version == -1


def test_reset_error_raises_under_the_default_rate(tokenizer):
    loop = _loop(tokenizer, KeywordEnvFactory(reset_error=True), _say("apple"))
    with pytest.raises(EnvironmentFailureError, match=r"4/4 episodes .*max_env_error_rate=0\.5"):
        loop.run([EpisodeSpec(t) for t in TRAIN], SAMPLING)


# ------------------------------------------------------------------------------------ F11: invalid actions


def test_invalid_actions_counted_per_turn(tokenizer):
    loop = _loop(tokenizer, KeywordEnvFactory(need=2), _say("grape"), max_turns=3)
    (t,) = loop.run([EpisodeSpec("apple")], SAMPLING)
    assert t.invalid_actions == 3 and t.num_turns == 3
    assert (t.truncated, t.truncation_reason, t.success, t.failure, t.env_error) == (True, "max_turns", False, False, False)
    assert t.rewards == [0.0, 0.0, 0.0]
    # the agent is told, as an observation, that its action was invalid
    assert [m["content"] for m in t.messages if m["role"] == "user"][1:] == [
        "Invalid: 'grape'. Commands: apple, banana"] * 2


def test_invalid_then_valid(tokenizer):
    script = {"key": ["grape", "", "key", "key"]}  # an empty reply is an invalid action too
    loop = _loop(tokenizer, KeywordEnvFactory(need=2), walkthrough_replies(script))
    (t,) = loop.run([EpisodeSpec("key")], SAMPLING)
    assert (t.invalid_actions, t.num_turns, t.success, t.rewards) == (2, 4, True, [0.0, 0.0, 0.0, 1.0])


# ------------------------------------------------------------------------------------- per-token bookkeeping


class _VersionedPolicy:
    policy_model = None

    def __init__(self) -> None:
        self.policy_version = 0


def test_per_token_bookkeeping(tokenizer):
    replies = ["door", "the door", "door"]
    versions = [7, 3, 5]
    policy = _VersionedPolicy()

    def reply(r: GenerationRequest) -> str:
        policy.policy_version = versions[r.turn]  # the generator stamps the version it sees now
        return replies[r.turn]

    envs = KeywordEnvFactory(need=2)
    gen = ScriptedGenerator(tokenizer, reply)
    gen.attach(policy, stop_token_ids(tokenizer))
    (t,) = AgentLoop(envs, gen, tokenizer).run([EpisodeSpec("door")], SAMPLING)
    # "door" counts, "the door" is not a command (invalid), "door" wins
    assert (t.success, t.num_turns, t.invalid_actions) == (True, 3, 1)

    lengths = [_reply_tokens(tokenizer, x) for x in replies]
    assert t.num_assistant_tokens == sum(t.assistant_mask) == sum(lengths)
    n = t.num_tokens
    assert len(t.assistant_mask) == len(t.turn_index) == len(t.behaviour_logprobs) == n
    # scripted replies are never cut, so every non-assistant token is prompt/observation (-1)
    assert all((m == 0) == (ti == NON_ASSISTANT) for m, ti in zip(t.assistant_mask, t.turn_index))
    assert [ti for ti in t.turn_index if ti != NON_ASSISTANT] == [k for k, L in enumerate(lengths) for _ in range(L)]
    assert t.behaviour_logprobs == [0.0] * n
    # every reply ends with the end-of-turn id, inside the mask
    ends = [i for i in range(n - 1) if t.assistant_mask[i] == 1 and t.assistant_mask[i + 1] == 0] + [n - 1]
    assert [t.token_ids[i] for i in ends] == [tokenizer.eos_token_id] * 3
    assert t.cut_replies == 0

    assert t.turn_versions == versions and len(t.turn_versions) == t.num_turns
    assert t.behaviour_version == 3 and t.policy_versions == (3, 5, 7)
    assert Trajectory(task_id="x").behaviour_version == -1

    # F08: the ids are a full template render of the same conversation (which adds a trailing "\n")
    chat = ChatFormat(tokenizer, envs.system_prompt)
    full = chat.render([{"role": "system", "content": envs.system_prompt}] + t.messages, add_generation_prompt=False)
    assert full[:n] == t.token_ids and tokenizer.decode(full[n:]) == "\n"
    assert [m["content"] for m in t.messages if m["role"] == "assistant"] == replies


class _CutGenerator(Generator):
    """Always returns the same three tokens, not ending with the end-of-turn id (cut by max_new_tokens)."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids
        self.calls = 0

    @property
    def policy_version(self) -> int:
        return 0

    def _generate(self, requests, sampling):
        self.calls += len(requests)
        return [GenerationOutput(token_ids=list(self.ids), logprobs=[-0.5, -1.0, -1.5], finished=False,
                                 policy_version=0) for _ in requests]


def test_cut_replies_are_closed_and_masked(tokenizer):
    ids = tokenizer.encode("qqq", add_special_tokens=False)
    assert len(ids) == 3 and tokenizer.eos_token_id not in ids
    gen = _CutGenerator(ids)
    gen.attach(_VersionedPolicy(), stop_token_ids(tokenizer))
    envs = KeywordEnvFactory(need=2)
    (t,) = AgentLoop(envs, gen, tokenizer, max_turns=2).run([EpisodeSpec("apple")], SAMPLING)
    assert gen.calls == 2
    assert (t.cut_replies, t.num_turns, t.invalid_actions, t.truncation_reason) == (2, 2, 2, "max_turns")
    assert [m["content"] for m in t.messages if m["role"] == "assistant"] == ["qqq", "qqq"]

    chat = ChatFormat(tokenizer, envs.system_prompt)
    p = len(chat.first_prompt(envs.make("apple").reset()))
    u = len(chat.user_turn("Invalid: 'qqq'. Commands: apple, banana"))
    eos = tokenizer.eos_token_id
    assert t.num_tokens == p + 4 + u + 4
    # turn 0: three sampled tokens (trained on) + the appended end-of-turn (not trained on, turn 0)
    turn0 = slice(p, p + 4)
    assert t.token_ids[turn0] == ids + [eos]
    assert t.assistant_mask[turn0] == [1, 1, 1, 0]
    assert t.turn_index[turn0] == [0, 0, 0, 0]
    assert t.behaviour_logprobs[turn0] == [-0.5, -1.0, -1.5, 0.0]
    # the observation after it is an ordinary user turn
    assert t.assistant_mask[p + 4:p + 4 + u] == [0] * u and t.turn_index[p + 4:p + 4 + u] == [NON_ASSISTANT] * u
    # turn 1 likewise, at the end
    assert t.token_ids[-4:] == ids + [eos]
    assert t.assistant_mask[-4:] == [1, 1, 1, 0] and t.turn_index[-4:] == [1, 1, 1, 1]
    assert t.num_assistant_tokens == 6


def test_first_prompt_longer_than_context_plays_no_turn(tokenizer):
    """An episode whose first prompt plus one reply cannot fit stops before turn 0 (truncated, max_context)."""
    envs = KeywordEnvFactory(need=2)
    gen = ScriptedGenerator(tokenizer, lambda r: r.task_id)
    loop = AgentLoop(envs, gen, tokenizer, max_turns=3, max_context_tokens=40)
    (traj,) = loop.run([EpisodeSpec("apple")], SamplingParams(max_new_tokens=16))
    assert traj.num_turns == 0 and traj.truncated and traj.truncation_reason == "max_context"
    assert traj.num_tokens > 24 and sum(traj.assistant_mask) == 0
