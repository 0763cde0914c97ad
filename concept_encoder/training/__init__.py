"""Helpers of the training loops: init-order steps, arguments, optimisation, checkpoints, tracking."""
