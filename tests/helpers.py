"""Tiny fakes shared by the tests: a byte-level BPE tokenizer with a ChatML template, a 2-layer
Llama, and a keyword environment. Everything is built locally in well under a second."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lightning_opd.envs.base import EnvFactory, StepResult

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


def free_port() -> int:
    """A free TCP port on the loopback interface (process-group rendezvous in multi-process tests)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
