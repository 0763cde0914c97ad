"""What the training loops share, one module per init-order step or concern: arguments and their checks
(`args`, `preflight`, `plan`, `machine_checks`), the runtime (`runtime`, `attention_probe`, `deepspeed_setup`,
`extension_locks`, `cpu_info`), the model and its objective (`model`, `objective`, `optim`, `batches`), run
folders, checkpoints and their faults (`runs`, `checkpoint`, `faults`), what a run records (`metrics_log`,
`tracking`, `logs`, `model_card`), evaluation and decision gates (`evaluation`, `gates`, `selection`, `probe`,
`finetune_report`)."""
