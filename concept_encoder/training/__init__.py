"""The training loops' steps, one module per init-order step or concern: arguments and their checks (`args`,
`preflight`, `plan`), the runtime (`runtime`, `attention_probe`, `deepspeed_setup`), the model and its objective
(`model`, `objective`, `distill`, `optim`, `steps`, `batches`), run folders and resuming (`runs`, `resume`), what a
run records (`tracking`, `logs`), evaluation and decision gates (`evaluation`, `gates`). Checkpoint files and model
folders are `checkpoints/`, fine-tuning's reports and probes `finetuning/`, the machine's facts `machine/`."""
