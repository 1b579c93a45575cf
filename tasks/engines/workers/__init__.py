"""Worker modules: vLLM, DeepSpeed and torch, each run in Ray actors of its own (tasks/engines/resident.py), never
inside the Prefect process, and never importing Prefect. The clients in `tasks/engines/` start them by these module
paths: a server defines `make_answer(settings)` (and `warm()`), a one-shot worker `handle(request)`."""

VLLM_SERVER = "tasks.engines.workers.vllm_generate"
TRAINER_SERVER = "tasks.engines.workers.trainer_server"
LOGPROBS_WORKER = "tasks.engines.workers.torch_logprobs"
TRAIN_WORKER = "tasks.engines.workers.deepspeed_train"
PREFERENCE_WORKER = "tasks.engines.workers.preference_train"
SCORE_WORKER = "tasks.engines.workers.sequence_scores"
