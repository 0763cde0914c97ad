"""Torch-free arithmetic: the memory model (parameters, optimizer states, activations, ZeRO stages, offload) and
FLOPs per token, and which architectures they model. The plan checker imports these without torch, so nothing here
may import it."""
