"""TRL's side of ``benchmarks/peer_trl.py``: run in TRL's own venv (it imports ``trl``, never ``lightning_opd``).

One ``trl.DistillationTrainer`` fit (TRL 1.16: on-policy generalised-JSD distillation, arXiv 2306.13649) of the student
on the prompts file ``peer_trl.py`` wrote, with the workload fixed there (batch, new tokens, beta, lr, steps) and the
row's precision: ``bf16`` (TRL's ``bf16`` flag) and the student's / teacher's ``from_pretrained`` keyword arguments
(``model_init_kwargs`` / ``teacher_model_init_kwargs``; ``None``: TRL's default); fp32 throughout when absent,
timing every optimizer step with a ``TrainerCallback``: the wall clock (``time.perf_counter``, seconds) at each
``on_step_end``. Writes ``{"step_end_s": [...], "torch_threads": n, "trl": version, "config": {...}}`` to ``--out``.

Run (by peer_trl.py): ``<trl venv>/bin/python benchmarks/peer_trl_child.py --args '<json>' --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--args", required=True, help="JSON: student, teacher, prompts, steps, batch, max_new_tokens, "
                    "beta, lr, temperature, seed, gradient_checkpointing, output_dir; optional bf16, "
                    "model_init_kwargs, teacher_model_init_kwargs (default: fp32)")
    ap.add_argument("--out", required=True)
    a = json.loads(ap.parse_args().args)
    out = ap.parse_args().out

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    with open(a["prompts"]) as f:
        rows = [json.loads(line) for line in f]
    dataset = Dataset.from_list(rows)  # conversational: {"prompt": [{"role": ..., "content": ...}, ...]}

    class StepClock(TrainerCallback):
        """Wall clock (s) at the end of every optimizer step."""

        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):  # noqa: D102
            self.ends.append(time.perf_counter())

    fp32 = {"dtype": "float32"}
    config = DistillationConfig(
        output_dir=a["output_dir"], max_steps=a["steps"], per_device_train_batch_size=a["batch"],
        gradient_accumulation_steps=1, max_completion_length=a["max_new_tokens"], temperature=a["temperature"],
        beta=a["beta"], learning_rate=a["lr"], weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, bf16=a.get("bf16", False), fp16=False, gradient_checkpointing=a["gradient_checkpointing"],
        model_init_kwargs=a.get("model_init_kwargs", fp32),
        teacher_model_init_kwargs=a.get("teacher_model_init_kwargs", fp32),
        logging_steps=1, report_to="none", save_strategy="no", seed=a["seed"], use_cpu=True,
        dataloader_num_workers=0)
    tokenizer = AutoTokenizer.from_pretrained(a["student"], padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    clock = StepClock()
    trainer = DistillationTrainer(model=a["student"], teacher_model=a["teacher"], args=config, train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    with open(out, "w") as f:
        json.dump({"step_end_s": clock.ends, "torch_threads": torch.get_num_threads(), "trl": trl.__version__,
                   "torch": torch.__version__, "config": a}, f, indent=1)


if __name__ == "__main__":
    main()
