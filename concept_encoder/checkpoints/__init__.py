"""Checkpoints and model folders: how a checkpoint is written, checked, found and loaded (`checkpoint`), moved to
another process count (`reshard`), what a saved model folder must hold to be what it claims (`model_folder`), and
how a run becomes a model folder of its own (`export`, with its `model_card`). Below the loop: `training/` uses
these; nothing here reads the loop's arguments (what a resume must keep is `training/resume.py`)."""
