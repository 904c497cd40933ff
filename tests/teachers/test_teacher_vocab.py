"""F36: vocabulary rows beyond the tokenizer and non-finite teacher scores.

* A served teacher whose embedding has padded rows (``vocab_size`` = ``len(tokenizer) + 64``) normalises over all
  rows while the in-process teacher and the student normalise over the tokenizer's ``V``: measured apart on a real
  ``vllm serve``, and refused at :meth:`RemoteTeacher.load` naming both sizes.
* ``-inf``/NaN log-probs and top-k ids ``>= V`` in a server's answer (a local HTTP server answering in vLLM's
  ``prompt_logprobs`` format) are errors naming the URL, the batch row and the position. (The in-process teacher's
  own non-finite scores, an overflow, are F28's: the step is skipped and counted, ``max_nonfinite_steps`` in a row
  raise; tests/learner/test_nonfinite.py.)
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_opd.losses import TeacherSignal
from lightning_opd.models.tokenizers import TokenizerMismatchError
from lightning_opd.serving import ServerError
from lightning_opd.teachers import InProcessTeacher, RemoteTeacher
from tests.helpers import make_model
from tests.learner.test_module import make_batch
from tests.servers import ModelServer, http_server, served

S, K = TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K
PADDED_ROWS = 64


def positions(batch):
    return (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory, tokenizer):
    """The tiny served teacher's shape (head size 64 for vLLM's CPU attention) with 64 padded embedding rows."""
    path = tmp_path_factory.mktemp("padded") / "teacher"
    model = make_model(tokenizer, seed=1, hidden=128, heads=2, kv_heads=1, vocab_size=len(tokenizer) + PADDED_ROWS)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_served_teacher_with_padded_vocabulary_rows_is_refused_naming_both_sizes(padded_dir, tokenizer):
    """Unchecked, the served log-probs are off the in-process teacher's (normalised over ``V``) by the padded rows'
    mass (0.57 nats here: the 64 padded rows are as large as the real ones); checked, :meth:`load` refuses the pair naming both sizes and what to do."""
    server = served(padded_dir)
    v = len(tokenizer)
    batch = make_batch(tokenizer, 1.0)
    rows, cols = positions(batch)
    unchecked = RemoteTeacher(server.url, heartbeat_s=0, check_tokenizer=False)
    unchecked.bind(tokenizer, v)
    unchecked.load()
    local = InProcessTeacher(padded_dir, vocab_size=v)
    local.load()
    gap = (unchecked.score(batch, rows, cols, (S,)).sampled_logprobs
           - local.score(batch, rows, cols, (S,)).sampled_logprobs).abs().max().item()
    assert gap > 1e-4  # what the refusal guards against: two normalisations (vLLM vs torch agree to ~4e-5 otherwise)
    unchecked.close()

    teacher = RemoteTeacher(server.url, heartbeat_s=0)
    teacher.bind(tokenizer, v)
    with pytest.raises(TokenizerMismatchError) as err:
        teacher.load()
    msg = str(err.value)
    assert f"{v + PADDED_ROWS} vocabulary rows" in msg and f"V={v}" in msg and server.url in msg
    assert "resize_token_embeddings" in msg and "in-process teacher" in msg
    teacher.close()


# ------------------------------------------------------------------------- a server's answer, recorded and altered
class _Recorded(ModelServer):
    """Answers ``/v1/completions`` in vLLM's ``prompt_logprobs`` format (the prompt's own token at rank 1, then ids
    0, 1, ... at ranks 2, 3, ...; log-probs ``-1 - rank / 10``), with ``bad`` written into position ``at`` of the
    first prompt: ``("sampled", value)`` as the prompt token's log-prob, ``("top_id", id)`` as its rank-2 id."""

    bad: tuple = ()
    at = 3

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        k = max(int(req["prompt_logprobs"]), 1)
        choices = []
        for n, prompt in enumerate(req["prompt"]):
            lps = [None]
            for t, tok in enumerate(prompt[1:], start=1):
                others = [i for i in range(k + 1) if i != tok][:k - 1]
                entry = {str(i): {"logprob": -1.0 - r / 10, "rank": r, "decoded_token": "x"}
                         for r, i in enumerate([tok] + others, start=1)}
                if n == 0 and t == self.at and self.bad:
                    kind, value = self.bad
                    if kind == "sampled":
                        entry[str(tok)]["logprob"] = value
                    else:
                        second = next(i for i, v in entry.items() if v["rank"] == 2)
                        entry[str(value)] = entry.pop(second)
                lps.append(entry)
            choices.append({"index": n, "text": "x", "prompt_logprobs": lps})
        body = json.dumps({"choices": choices}).encode()  # json writes -inf/NaN as -Infinity/NaN, as vLLM's does
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def recorded():
    with http_server(_Recorded) as url:
        yield url
    _Recorded.bad, _Recorded.at = (), 3


@pytest.mark.parametrize("bad, what", [(("sampled", -math.inf), "non-finite teacher log-prob -inf"),
                                       (("sampled", math.nan), "non-finite teacher log-prob nan"),
                                       (("top_id", "OOV"), "beyond the vocabulary")])
def test_non_finite_scores_and_ids_beyond_the_vocabulary_are_refused_naming_row_position_and_url(
        recorded, tokenizer, bad, what):
    v = len(tokenizer)
    _Recorded.bad = (bad[0], v + 3 if bad[1] == "OOV" else bad[1])
    teacher = RemoteTeacher(recorded, check_tokenizer=False, heartbeat_s=0, sequences_per_request=1)
    teacher.bind(tokenizer, v)
    teacher.load()
    batch = make_batch(tokenizer, 1.0)
    rows, cols = positions(batch)
    _Recorded.at = int(cols[0]) + 1  # the first scored position (one row per request: each row's is altered)
    with pytest.raises(ServerError) as err:
        teacher.score(batch, rows, cols, (S, K), 1.0, top_k=4)
    msg = str(err.value)
    assert what in msg and recorded in msg and f"position {_Recorded.at} of batch row {int(rows[0])}" in msg
    _Recorded.bad = ()  # the same answer unaltered is accepted
    out = teacher.score(batch, rows, cols, (S, K), 1.0, top_k=4)
    assert torch.isfinite(out.sampled_logprobs).all() and (out.topk_ids < v).all()
    teacher.close()

