"""Tiny fakes shared by the tests: a byte-level BPE tokenizer with a ChatML template, a 2-layer
Llama, and a keyword environment. Everything is built locally in well under a second."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lightning_opd.envs.base import EnvFactory, StepResult
from lightning_opd.rollout.generator import SamplingParams

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = ["apple", "banana", "cherry", "door", "key", "north", "south", "east", "west", "take", "open", "close",
         "box", "table", "chest", "go", "the", "a", "room", "goal", "say", "commands", "observation"]


def make_tokenizer(vocab_size: int = 300, seed: int = 0, extra_words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text encodes) with ChatML specials; pad == eos (the F03 case)."""
    rng = random.Random(seed)
    words = WORDS + list(extra_words)
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


def make_model(tokenizer, seed: int = 0, vocab_size: int | None = None, layers: int = 2, hidden: int = 32,
               heads: int = 4, kv_heads: int = 2) -> LlamaForCausalLM:
    """A random 2-layer Llama over ``tokenizer`` (``vocab_size`` > len(tokenizer): padded embeddings)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size or len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits with std ~1.7: neither flat nor one-hot, so sampling matters
        model.model.embed_tokens.weight.normal_(0, 0.5)
        model.lm_head.weight.normal_(0, 0.3)
    return model.float().eval()


def save_model_dir(path: Path, tokenizer, seed: int = 0, vocab_size: int | None = None) -> Path:
    """Write a tiny model + tokenizer as a Hugging Face directory; returns ``path``."""
    model = make_model(tokenizer, seed=seed, vocab_size=vocab_size)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


class KeywordEnv:
    """Say the task's keyword ``need`` times in a row to win; any other listed word loses."""

    def __init__(self, word: str, need: int = 2, fail_on: str | None = None) -> None:
        self.word, self.need, self.fail_on, self.count = word, need, fail_on, 0
        self.options = sorted({word, "banana" if word != "banana" else "cherry"})

    def reset(self) -> str:
        return f"Goal: say {self.word} {self.need} times.\nCommands: {', '.join(self.options)}"

    def parse_action(self, reply: str) -> str:
        lines = [ln.strip().lower() for ln in reply.splitlines() if ln.strip()]
        return lines[0] if lines else ""

    def step(self, action: str) -> StepResult:
        if self.fail_on is not None and action == self.fail_on:
            raise RuntimeError(f"environment crashed on {action!r}")
        if action not in self.options:
            return StepResult(f"Invalid: {action[:40]!r}. Commands: {', '.join(self.options)}", invalid_action=True)
        if action != self.word:
            return StepResult("Wrong word.", lost=True)
        self.count += 1
        if self.count >= self.need:
            return StepResult("You win.", reward=1.0, won=True)
        return StepResult(f"Again. Commands: {', '.join(self.options)}", reward=0.0)

    def close(self) -> None:
        pass


class KeywordEnvFactory(EnvFactory):
    """Train tasks ``apple``/``cherry``/``door``/``key``, held-out ``north``/``south``."""

    system_prompt = "Reply with one word."

    def __init__(self, need: int = 2, fail_on: str | None = None, reset_error: bool = False) -> None:
        self.need, self.fail_on, self.reset_error = need, fail_on, reset_error

    def train_tasks(self) -> list[str]:
        return ["apple", "cherry", "door", "key"]

    def eval_tasks(self) -> list[str]:
        return ["north", "south"]

    def make(self, task_id: str) -> KeywordEnv:
        if self.reset_error:
            raise OSError(f"cannot start task {task_id}")
        return KeywordEnv(task_id, self.need, self.fail_on)

    def expert_actions(self, task_id: str) -> list[str]:
        return [task_id] * self.need


class StaticPolicy:
    """A ``PolicySource`` around a fixed model (version settable by tests)."""

    def __init__(self, model, tokenizer, version: int = 0) -> None:
        self.policy_model, self.tokenizer, self.policy_version = model, tokenizer, version


def sampling_log_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The test oracle of F02/F26: log-probs of the distribution a generator samples from, recomputed from its
    model's logits; ``(..., V)`` logits -> ``(..., V)`` fp32, ``-inf`` outside the top-k / top-p support. fp32
    upcast, then temperature, then top-k, then top-p (nucleus) truncation with renormalisation, in the order
    Hugging Face's and vLLM's samplers apply them. Greedy (temperature 0) is scored at temperature 1.

    A token is kept by top-p if the probability mass of the tokens strictly more likely than it is
    below ``top_p`` (the most likely token is always kept).
    """
    t = sampling.temperature if sampling.temperature > 0 else 1.0
    scores = logits.float() / t
    if sampling.temperature > 0 and sampling.top_k > 0 and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.temperature > 0 and sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= sampling.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def free_port() -> int:
    """A free TCP port on the loopback interface (process-group rendezvous in multi-process tests)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_second_eos_model(tokenizer, word: str = "key", hidden: int = 128, heads: int = 2, kv_heads: int = 1):
    """A tiny Llama whose generation config lists two EOS ids, ``[tokenizer EOS, 0]``, and that replies
    ``word`` (one token) then id 0, whatever the prompt, each by a margin of about 40 nats (F23).

    Every token's embedding has 10 in dimension 1, which the head reads as ``word``; ``word``'s embedding
    also has 40 in dimension 0, which the head reads as id 0. Head size 64 (vLLM's CPU attention needs it).
    """
    (word_id,) = tokenizer.encode(word, add_special_tokens=False)
    model = make_model(tokenizer, hidden=hidden, heads=heads, kv_heads=kv_heads)
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, 1] = 10.0
        emb[word_id, 0] = 40.0
        head[:, :2] = 0.0
        head[word_id, 1] = 5.0
        head[0, 0] = 5.0
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 0]
    return model


class LongObservationEnvFactory(KeywordEnvFactory):
    """Keyword tasks, except that task ``apple`` answers its first action with an observation of about
    ``words * 3`` tokens (F24: longer than an engine's limit)."""

    def __init__(self, words: int = 400, **kwargs) -> None:
        super().__init__(**kwargs)
        self.words = words

    def make(self, task_id: str) -> KeywordEnv:
        env = super().make(task_id)
        if task_id == "apple":
            env.step = lambda action: StepResult("Again. " + "door " * self.words)
        return env


def assert_replies_end_on_the_second_eos(batch, tokenizer, envs: KeywordEnvFactory, word: str = "key") -> None:
    """Every episode of ``batch`` (2 turns, played by :func:`make_second_eos_model`) replied ``[word, 0]``
    twice: finished at id 0, no end-of-turn id appended, nothing cut, only those 4 tokens trained on (F23)."""
    from lightning_opd.rollout.batch import rollout_stats
    from lightning_opd.rollout.chat import ChatFormat

    (word_id,) = tokenizer.encode(word, add_special_tokens=False)
    chat = ChatFormat(tokenizer, envs.system_prompt)
    assert batch.size == len(batch.trajectories) > 0
    for row, t in enumerate(batch.trajectories):
        env = envs.make(t.task_id)
        first = chat.first_prompt(env.reset())
        user = chat.user_turn(env.step(word).observation)
        assert t.token_ids == first + [word_id, 0] + user + [word_id, 0], t.task_id
        assert (t.num_turns, t.cut_replies, t.success) == (2, 0, t.task_id == word)
        a, b = len(first), len(first) + 2 + len(user)
        assert batch.loss_mask[row].nonzero().flatten().tolist() == [a, a + 1, b, b + 1]
    assert rollout_stats(batch.trajectories)["cut_replies"] == 0


def assert_only_the_long_episode_truncated(batch, limit: int) -> None:
    """Of a batch of :class:`LongObservationEnvFactory` episodes (2 turns, replies "key"), ``apple``
    ended as truncated by the context limit after one turn; the others played on (F24)."""
    by_task = {t.task_id: t for t in batch.trajectories}
    long = by_task.pop("apple")
    assert (long.truncated, long.truncation_reason, long.num_turns, long.env_error) == (True, "max_context", 1, False)
    assert long.num_tokens <= limit
    assert by_task["key"].success and by_task["key"].num_turns == 2
    for task in ("cherry", "door"):
        assert (by_task[task].truncation_reason, by_task[task].num_turns) == ("max_turns", 2)


def spawn_ranks(target, args, timeout: float = 240, world: int = 2) -> None:
    """Run ``target(rank, port, *args)`` in ``world`` spawned processes (gloo tests); a rank still running
    after ``timeout`` seconds is killed and the test fails with "a rank hung" instead of blocking."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    assert [p.exitcode for p in procs] == [0] * world


class LoRAPolicy(StaticPolicy):
    """A policy whose student is a peft model, as ``PolicyModule`` with ``lora`` (issue 65's generator tests)."""

    def __init__(self, model, tokenizer, lora, path: str | None = None) -> None:
        super().__init__(model, tokenizer)
        self.lora, self.student_path = lora, path


def reply_logprobs(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """``(len(ids),)`` log-probs of a reply's ``ids`` after ``prompt`` under ``model`` at temperature 1 (the F02 oracle,
    :func:`sampling_log_probs`)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    return sampling_log_probs(logits, SamplingParams(temperature=1.0)).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def move_adapter(model, seed: int, std: float = 0.2) -> None:
    """Draw every ``lora_B`` of a peft model from N(0, std^2) (seeded), so its adapter changes the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def assert_scored_as_the_adapter(student, prompts, outs, atol: float = 1e-3, control: float = 1e-2) -> None:
    """Each reply's behaviour log-probs equal ``student``'s (a peft model: base + adapter) within ``atol`` nats, and
    the base alone (adapter disabled) scores some reply's tokens more than ``control`` nats differently."""
    for p, o in zip(prompts, outs):
        torch.testing.assert_close(torch.tensor(o.logprobs), reply_logprobs(student, p, o.token_ids), atol=atol, rtol=0)
    with student.disable_adapter():
        gaps = [(torch.tensor(o.logprobs) - reply_logprobs(student, p, o.token_ids)).abs().max()
                for p, o in zip(prompts, outs)]
    assert max(gaps) > control
