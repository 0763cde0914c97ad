"""Torch-free arithmetic: the memory model (parameters, optimizer states, activations, ZeRO stages, offload) and
FLOPs per token. The plan checker imports these without torch, so nothing here may import it."""
