"""The step benchmark's update accounting: which tokens of a collated batch it counts (no timing asserted)."""

from benchmarks.step_throughput import episode_sizes
from lightning_opd.rollout.batch import collate_trajectories
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory


def _episode(prompt: int, replies: list[int], observation: int) -> Trajectory:
    t = Trajectory(task_id="t")
    t.append([5] * prompt, assistant=False, turn=NON_ASSISTANT)
    for k, n in enumerate(replies):
        if k:
            t.append([6] * observation, assistant=False, turn=NON_ASSISTANT)
        t.append([7] * (n - 1) + [2], assistant=True, turn=k, logprobs=[-0.5] * n)
        t.turn_versions.append(0)
    return t


def test_episode_sizes_count_real_tokens_and_supervised_positions():
    """Episode 0: 6 prompt + 3 reply tokens = 9, 3 supervised; episode 1: 4 + 2 + 5 observation + 3 = 14,
    5 supervised; padding (episode 0 is padded to 14) is not counted."""
    batch = collate_trajectories([_episode(6, [3], 5), _episode(4, [2, 3], 5)], SamplingParams(), pad_id=0,
                                 stop_ids={2})
    assert batch.input_ids.shape == (2, 14)
    assert episode_sizes(batch) == [(9, 3), (14, 5)]


def test_run_records_every_timed_step_s_batch_and_generate_calls(model_dirs, tmp_path):
    """One warm-up and one timed single-turn step of the tiny models on the quest-3 games (HF sampler): the timed step
    is counted with its batch (2 episodes, each a prompt plus a reply) and its generate calls; nothing is timed."""
    import argparse
    from pathlib import Path

    from benchmarks.roofline import Machine
    from benchmarks.step_throughput import run

    games = Path(__file__).resolve().parents[2] / "artifacts/games/quest3"
    args = argparse.Namespace(model=model_dirs["student"], teacher=model_dirs["teacher"], games=str(games),
                              micro_batch_size=None, micro_batch_tokens=None, backend="hf", vllm_block_size=None,
                              episodes=2, max_new_tokens=4, turns=1, warmup=1, steps=1)
    out = run("single", args, Machine(matmul_flops=1e11, bandwidth=1e10))
    assert out["steps"] == 1
    assert out["train_tokens"] > out["sampled_tokens"] > 0 and out["passes"] > 0
    assert out["update_flops"] > 0 and out["rollout_roofline_s"] > 0
