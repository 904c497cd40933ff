"""The privileged-context self-distillation teacher (PROPOSED, docs/algorithms.md §6.3) on tiny models.

* The teacher's view: the first prompt re-rendered with the privileged text (system message or before the first
  observation), every later id unchanged and shifted by one offset: checked token for token with a template that adds
  BOS and one that does not, replies ending on each stop id and a cut reply; a first prompt that is not the
  template's render is refused naming the task and the position.
* The scores: equal a hand-built forward of the student model on the hand-built view at the shifted positions; no
  graph, no gradient, the optimizer state untouched; ``frozen`` / ``live`` / ``ema`` after one optimizer step.
* The environments: TextWorld's walkthrough, Search-QA's gold documents and answer; an environment without
  privileged context is refused at setup naming it and the teacher; a short OPD fit with it.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from lightning_opd.losses import TeacherSignal
from lightning_opd.rollout.batch import collate_trajectories
from lightning_opd.rollout.chat import ChatFormat
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory
from lightning_opd.teachers import PrivilegedTeacher
from lightning_opd.teachers.privileged_views import TeacherViewError, privileged_messages, teacher_view
from tests.helpers import CHATML, KeywordEnvFactory, make_model, make_tokenizer

S, K, F = TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K, TeacherSignal.FULL_VOCAB
SYSTEM = "Reply with one word."


def _hint(task_id: str) -> str:
    return f"The word to say is {task_id}."


class HintedKeywordEnvFactory(KeywordEnvFactory):
    """The keyword environment with a privileged hint per task (its word)."""

    provides_privileged_context = True

    def privileged_context(self, task_id: str) -> str | None:
        return _hint(task_id)


def bos_tokenizer():
    """The test tokenizer with a BOS token of its own that the chat template writes first (the Llama/Gemma kind)."""
    tok = make_tokenizer()
    tok.add_special_tokens({"bos_token": "<s>"})
    tok.chat_template = "{{ bos_token }}" + CHATML
    return tok


TOKENIZERS = {"no_bos": make_tokenizer, "bos": bos_tokenizer}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


def episode(tok, task: str = "key", system: str | None = SYSTEM, second_stop: int = 0, seed: int = 0) -> Trajectory:
    """A 3-turn episode rendered like the agent loop: reply 0 ends on EOS, reply 1 on a second stop id
    (``second_stop``), reply 2 is cut by max_new_tokens (end-of-turn appended, not sampled)."""
    chat = ChatFormat(tok, system)
    g = torch.Generator().manual_seed(seed)
    traj = Trajectory(task_id=task, seed=seed)
    first = f"Goal: say {task} 2 times.\nCommands: banana, {task}"
    traj.messages.append({"role": "user", "content": first})
    traj.append(chat.first_prompt(first), assistant=False, turn=NON_ASSISTANT)
    eos = tok.eos_token_id
    for turn, end in enumerate([[eos], [second_stop], []]):
        reply = torch.randint(3, 250, (3 + turn,), generator=g).tolist() + end
        traj.append(reply, assistant=True, turn=turn, logprobs=[-1.0] * len(reply))
        traj.turn_versions.append(0)
        if not end:
            traj.append([chat.end_of_turn_id], assistant=False, turn=turn)
        traj.messages.append({"role": "assistant", "content": tok.decode(reply)})
        if turn < 2:
            obs = f"Again. Commands: banana, {task}"
            traj.append(chat.user_turn(obs), assistant=False, turn=NON_ASSISTANT)
            traj.messages.append({"role": "user", "content": obs})
    return traj


# ------------------------------------------------------------------------------------------------ the view
@pytest.mark.parametrize("placement", ["system", "before_observation"])
@pytest.mark.parametrize("system", [SYSTEM, None])
def test_view_keeps_every_later_id_at_a_constant_shift(tok, placement, system):
    traj = episode(tok, system=system)
    chat = ChatFormat(tok, system)
    view, offset = teacher_view(traj, _hint("key"), chat, placement)
    n = len(chat.first_prompt(traj.messages[0]["content"]))
    expected_prompt = tok.apply_chat_template(privileged_messages(system, traj.messages[0]["content"], _hint("key"),
                                                                  placement), add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
    assert view[:n + offset] == list(expected_prompt)
    assert offset == len(expected_prompt) - n != 0  # < 0 when the hint replaces the template's longer default system
    assert len(view) == traj.num_tokens + offset
    assert view[n + offset:] == traj.token_ids[n:]  # every id after the first prompt, token for token
    replies = [j for j, m in enumerate(traj.assistant_mask) if m]
    assert replies and min(replies) == n
    assert all(view[j + offset] == traj.token_ids[j] for j in replies)
    # the replies end on each stop id (EOS, the second stop id) and a cut reply's appended end-of-turn id
    last = [max(j for j, k in enumerate(traj.turn_index) if k == turn) for turn in range(3)]
    assert [traj.token_ids[j] for j in last] == [tok.eos_token_id, 0, tok.eos_token_id]
    assert [view[j + offset] for j in last] == [traj.token_ids[j] for j in last]
    assert [traj.assistant_mask[j] for j in last] == [1, 1, 0]  # the cut reply's end-of-turn is not sampled
    # the privileged text is in the teacher's prompt only; with a BOS template, BOS comes once, first
    assert _hint("key") in tok.decode(view[:n + offset]) and _hint("key") not in tok.decode(traj.token_ids)
    if tok.bos_token == "<s>":
        assert view[0] == traj.token_ids[0] == tok.bos_token_id and view.count(tok.bos_token_id) == 1
    text = tok.decode(view[:n + offset])
    if placement == "before_observation":
        assert f"{_hint('key')}\n\nGoal: say key" in text
    else:
        assert (f"{SYSTEM}\n\n{_hint('key')}" if system else f"system\n{_hint('key')}<|im_end|>") in text


def test_view_refuses_ids_that_are_not_the_first_prompt_render(tok):
    traj = episode(tok, task="door")
    traj.token_ids[3] = (traj.token_ids[3] + 1) % 250
    with pytest.raises(TeacherViewError, match=r"task 'door'.*position 3"):
        teacher_view(traj, _hint("door"), ChatFormat(tok, SYSTEM))
    with pytest.raises(ValueError, match="placement='middle'"):
        teacher_view(episode(tok), _hint("key"), ChatFormat(tok, SYSTEM), "middle")


# ---------------------------------------------------------------------------------------------- the scores
def _batch(tok, temperature: float = 0.7):
    trajs = [episode(tok, task="key", seed=1), episode(tok, task="apple", seed=2)]
    trajs[1].append([7, 8], assistant=True, turn=3, logprobs=[-1.0, -1.0])  # rows of different lengths
    return collate_trajectories(trajs, SamplingParams(temperature=temperature), pad_id=tok.pad_token_id), trajs


def _teacher(tok, model, weights: str = "frozen", **kw) -> PrivilegedTeacher:
    t = PrivilegedTeacher(weights, **kw)
    t.bind(tok, len(tok))
    t.attach_envs(HintedKeywordEnvFactory())
    t.attach_student(model)
    return t


def _by_hand(tok, model, traj: Trajectory, cols: torch.Tensor, temperature: float):
    """``(n, V)`` fp32 log-probs and ``(n, D)`` hidden states of ``model`` on the hand-built view, at ``cols``
    shifted by the offset."""
    chat = ChatFormat(tok, SYSTEM)
    prompt = tok.apply_chat_template(privileged_messages(SYSTEM, traj.messages[0]["content"], _hint(traj.task_id),
                                                         "system"), add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    n = len(chat.first_prompt(traj.messages[0]["content"]))
    ids = torch.tensor([list(prompt) + traj.token_ids[n:]])
    offset = len(prompt) - n
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logits = out.logits[0, cols + offset].float()
    return torch.log_softmax(logits / temperature, -1), out.hidden_states[-1][0, cols + offset]


def test_scores_equal_a_hand_built_forward_on_the_view_at_the_shifted_positions(tok):
    model = make_model(tok, seed=3)
    batch, trajs = _batch(tok)
    t = _teacher(tok, model)
    for part in (batch, batch.rows(1, 2)):  # a micro-batch: rows matched to their trajectories by task and ids
        rows, cols = (part.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
        got = t.score(part, rows, cols, (S, K, F), temperature=0.7, top_k=5, chunk_size=4)
        for r in range(part.size):
            sel = rows == r
            traj = next(x for x in trajs if x.task_id == part.task_ids[r])
            lp, hidden = _by_hand(tok, model, traj, cols[sel], 0.7)
            targets = part.input_ids[r, 1:][cols[sel]]
            torch.testing.assert_close(got.sampled_logprobs[sel], lp.gather(-1, targets[:, None])[:, 0],
                                       atol=1e-5, rtol=0)
            top = lp.topk(5, -1)
            assert torch.equal(got.topk_ids[sel], top.indices)
            torch.testing.assert_close(got.topk_logprobs[sel], top.values, atol=1e-5, rtol=0)
            torch.testing.assert_close(got.hidden[sel], hidden, atol=1e-5, rtol=0)
    # the student's own ids (no privileged text) give other numbers
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    got = t.score(batch, rows, cols, (S,), temperature=0.7).sampled_logprobs
    with torch.no_grad():
        plain = torch.log_softmax(model(input_ids=batch.input_ids).logits[:, :-1][rows, cols].float() / 0.7, -1)
    assert (plain.gather(-1, batch.input_ids[:, 1:][rows, cols][:, None])[:, 0] - got).abs().max() > 1e-3


def test_padding_rows_and_prompt_positions_score_finite(tok):
    model = make_model(tok, seed=3)
    batch, _ = _batch(tok)
    pad = batch.masked_rows(1)  # no task id: kept as it is
    t = _teacher(tok, model)
    zero = torch.zeros(1, dtype=torch.long)
    for part in (pad, batch):  # (0, 0): what an all-masked micro-batch asks for
        out = t.score(part, zero, zero, (S,), temperature=1.0)
        assert torch.isfinite(out.sampled_logprobs).all()


def test_live_teacher_pass_builds_no_graph_and_leaves_the_optimizer_alone(tok):
    student = make_model(tok, seed=3).train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    batch, _ = _batch(tok)
    student(input_ids=batch.input_ids).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in opt.state.items()}
    t = _teacher(tok, student, "live")
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    with torch.enable_grad():
        out = t.score(batch, rows, cols, (S, K, F), temperature=1.0, top_k=3)
        logits = out.head(out.hidden)
    for x in (out.sampled_logprobs, out.topk_logprobs, out.hidden, logits):
        assert not x.requires_grad and x.grad_fn is None
    assert all(p.grad is None for p in student.parameters())
    assert student.training  # eval mode only for the teacher pass
    for k, s in opt.state.items():
        for n, v in s.items():
            assert torch.equal(v, state[k][n]) if torch.is_tensor(v) else v == state[k][n]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_frozen_live_and_ema_after_one_optimizer_step(tok, lora):
    student = make_model(tok, seed=3).train()
    if lora:  # a LoRA student (issue 65): base frozen, the adapter trains; the copies are of base + adapter
        from lightning_opd.models.lora import LoRAConfig, apply_lora

        student = apply_lora(student, LoRAConfig(rank=4))
        with torch.no_grad():  # A trains only once B is non-zero
            for n, p in student.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0, 0.1)
    start = {n: p.detach().clone() for n, p in student.named_parameters()}
    teachers = {w: _teacher(tok, student, w, ema_decay=0.75) for w in ("frozen", "live", "ema")}
    opt = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.5)
    batch, _ = _batch(tok)
    student(input_ids=batch.input_ids).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    for t in teachers.values():  # what OPDModule.apply_update calls after each optimizer step
        t.on_optimizer_step()
    frozen = dict(teachers["frozen"].model.named_parameters())
    ema = dict(teachers["ema"].model.named_parameters())
    assert teachers["live"].model is student
    moved = 0
    for n, p in student.named_parameters():
        assert torch.equal(frozen[n], start[n])
        torch.testing.assert_close(ema[n], 0.75 * start[n] + 0.25 * p.detach(), atol=1e-6, rtol=0)
        moved += not torch.equal(p, start[n])
    assert moved > 0
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    lp = {w: t.score(batch, rows, cols, (S,)).sampled_logprobs for w, t in teachers.items()}
    assert (lp["live"] - lp["frozen"]).abs().max() > 1e-4
    # ema's scores lie between frozen's and live's for most tokens (they are not linear in the weights)
    between = ((lp["ema"] - lp["frozen"]) * (lp["live"] - lp["ema"]) >= 0).float().mean()
    assert between > 0.5


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="weights='base'"):
        PrivilegedTeacher("base")
    with pytest.raises(ValueError, match="ema_decay=1.0"):
        PrivilegedTeacher("ema", ema_decay=1.0)
    with pytest.raises(ValueError, match="placement='user'"):
        PrivilegedTeacher(placement="user")
    from lightning_opd.teachers.in_process import InProcessTeacher

    with pytest.raises(ValueError, match="weights='live' with server=InProcessTeacher: pushing weights needs"):
        PrivilegedTeacher("live", server=InProcessTeacher("unused", vocab_size=8))  # only a served teacher can take pushes


# ------------------------------------------------------------------------------------------ environments
def test_textworld_gives_the_walkthrough(tmp_path):
    from lightning_opd.envs.textworld_env import TextWorldEnvFactory

    games = [{"task_id": "t0", "split": "train", "file": "train/t0.z8", "hash": "a", "walkthrough": ["open box",
                                                                                                      "take key"]},
             {"task_id": "e0", "split": "eval", "file": "eval/e0.z8", "hash": "b", "walkthrough": ["go north"]}]
    (tmp_path / "manifest.json").write_text(json.dumps({"games": games}))
    f = TextWorldEnvFactory(str(tmp_path))
    assert f.provides_privileged_context
    assert f.privileged_context("t0") == "A walkthrough that wins this game: open box; take key"
    assert f.privileged_context("e0") == "A walkthrough that wins this game: go north"
    with pytest.raises(KeyError, match="'nope'"):
        f.privileged_context("nope")


def test_search_qa_gives_the_gold_documents_and_answer(tmp_path):
    from lightning_opd.envs.search_qa import SearchQAEnvFactory

    corpus = [{"id": "person:Ann", "text": "Ann. Ann works at Blue Corp."},
              {"id": "org:Blue Corp", "text": "Blue Corp. Blue Corp is based in Oslo."},
              {"id": "city:Rome", "text": "Rome. Rome is a city."}]
    questions = [{"id": "train-0000", "split": "train", "question": "Where is Ann's employer based?", "answer": "Oslo",
                  "hops": ["Ann", "Blue Corp"], "gold_docs": ["person:Ann", "org:Blue Corp"]},
                 {"id": "eval-0000", "split": "eval", "question": "What is Rome?", "answer": "a city"}]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    f = SearchQAEnvFactory(str(tmp_path))
    assert f.provides_privileged_context
    assert f.privileged_context("train-0000") == ("Documents that answer this question:\n"
                                                  "1. Ann. Ann works at Blue Corp.\n"
                                                  "2. Blue Corp. Blue Corp is based in Oslo.\n"
                                                  "Answer: Oslo")
    assert f.privileged_context("eval-0000") == "Answer: a city"
    # the student's view of the episode never holds it
    assert "Oslo" not in f.make("train-0000").reset()


def _datamodule(env):
    return RolloutDataModule(env=env, episodes_per_step=2, max_turns=2, max_new_tokens=4, eval_batch_size=2, seed=0)


def _trainer(max_steps: int):
    return L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     num_sanity_val_steps=0)


def test_an_environment_without_privileged_context_is_refused_at_setup(model_dirs):
    model = OPDModule(student=model_dirs["student"], teacher=PrivilegedTeacher("frozen"))
    with pytest.raises(ValueError, match=r"PrivilegedTeacher\(weights=frozen.*KeywordEnvFactory provides none"):
        _trainer(1).fit(model, datamodule=_datamodule(KeywordEnvFactory()))


@pytest.mark.parametrize("weights", ["live", "ema"])
def test_short_opd_fit_with_the_privileged_teacher(model_dirs, weights):
    teacher = PrivilegedTeacher(weights, ema_decay=0.5)
    model = OPDModule(student=model_dirs["student"], teacher=teacher)
    model.configure_model()
    start = {n: p.detach().clone() for n, p in model.student.named_parameters()}
    _trainer(2).fit(model, datamodule=_datamodule(HintedKeywordEnvFactory()))
    assert model.policy_version == 2
    assert teacher.envs is not None and teacher.model is not None
    now = dict(model.student.named_parameters())
    assert any(not torch.equal(now[n], start[n]) for n in start)
    if weights == "live":
        assert teacher.model is model.student
    else:
        assert teacher.model is not model.student and not any(p.requires_grad for p in teacher.model.parameters())
        ema = dict(teacher.model.named_parameters())
        assert any(not torch.equal(ema[n], start[n]) for n in start)  # moved towards the student
        assert any(not torch.equal(ema[n], now[n]) for n in start)  # but not onto it


def test_the_ema_is_saved_in_the_checkpoint_and_a_resumed_run_continues_it(model_dirs, tmp_path):
    """2 steps with ``ema`` and a checkpoint, then a new module resumed from it for 1 more step: at load the EMA
    copy equals the saved one (not the starting weights), and the checkpoint holds it under ``teacher_state``."""
    teacher = PrivilegedTeacher("ema", ema_decay=0.5)
    model = OPDModule(student=model_dirs["student"], teacher=teacher)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        default_root_dir=str(tmp_path), callbacks=[])
    trainer.fit(model, datamodule=_datamodule(HintedKeywordEnvFactory()))
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = {k: v.clone() for k, v in teacher.model.state_dict().items()}
    assert set(torch.load(ckpt, weights_only=False)["teacher_state"]["ema"]) == set(saved)

    resumed_teacher = PrivilegedTeacher("ema", ema_decay=0.5)
    resumed = OPDModule(student=model_dirs["student"], teacher=resumed_teacher)
    loaded = {}
    original = resumed_teacher.load_state_dict
    resumed_teacher.load_state_dict = lambda st: (original(st), loaded.update(
        {k: v.clone() for k, v in resumed_teacher.model.state_dict().items()}))
    _trainer(3).fit(resumed, datamodule=_datamodule(HintedKeywordEnvFactory()), ckpt_path=str(ckpt))
    assert resumed.policy_version == 3 and loaded
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)  # continued from the saved EMA
    start = OPDModule(student=model_dirs["student"], teacher=PrivilegedTeacher("frozen"))
    start.configure_model()
    starting = dict(start.student.named_parameters())
    assert any(not torch.equal(loaded[k], starting[k]) for k in starting if k in loaded)


def test_expert_next_actions_advance_when_the_student_takes_them():
    traj = Trajectory(task_id="t", seed=0)
    for reply in ("open door", "Look", "  Open  Door\nextra", "go east", "take key"):
        traj.messages.append({"role": "user", "content": "obs"})
        traj.messages.append({"role": "assistant", "content": reply})
    from lightning_opd.teachers.privileged_views import expert_next_actions

    # "open door" taken at turn 0 -> next is "go east"; "Look" and a second "Open Door" are not it; "go east" taken
    # at turn 3 -> "take key" at turn 4, taken: the expert's actions end there
    assert expert_next_actions(traj, ["open door", "go east", "take key"]) == {
        0: "open door", 1: "go east", 2: "go east", 3: "go east", 4: "take key"}


def test_hint_use_counts_the_teachers_top1_against_the_experts_next_action(tok):
    """The keyword environment's expert says the task word each turn; hint_use compares the teacher's top-1 at each
    turn's first reply position with the word's first token: forced hits on the turns given the right top-1."""
    model = make_model(tok, seed=3)
    batch, trajs = _batch(tok)
    t = _teacher(tok, model)
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    # the positions predicting each turn's first reply token
    firsts = []
    for r, traj in enumerate(trajs):
        seen = set()
        replies = sum(m["role"] == "assistant" for m in traj.messages)  # _batch's extra turn 3 has no message
        for j, (m, k) in enumerate(zip(traj.assistant_mask, traj.turn_index)):
            if m and k not in seen and k < replies:
                seen.add(k)
                firsts.append((r, j - 1, traj.task_id))
    expert = {task: HintedKeywordEnvFactory().expert_actions(task) for task in ("key", "apple")}
    top1 = torch.zeros(rows.numel(), dtype=torch.long)
    index = {(int(r), int(c)): i for i, (r, c) in enumerate(zip(rows.tolist(), cols.tolist()))}
    word_id = {task: tok(expert[task][0], add_special_tokens=False)["input_ids"][0] for task in expert}
    right = [f for f in firsts[::2]]  # every other turn gets the word's first token as top-1
    for r, c, task in right:
        top1[index[(r, c)]] = word_id[task]
    turns, hits = t.hint_use(batch, rows, cols, top1)
    assert turns == len(firsts) and hits == len(right)
    stats = t.stats
    assert stats["hint_turns"] == turns and stats["hint_top1"] == pytest.approx(hits / turns)
    assert t.stats["hint_turns"] == 0  # a new window after each read
    # the in-process score path counts them too (with the model's real top-1)
    t.score(batch, rows, cols, (S,), temperature=1.0)
    assert t.hint_totals["turns"] == 2 * turns
