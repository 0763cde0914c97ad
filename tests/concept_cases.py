"""Constructed concept tensors with known answers, shared by the loss and metric tests."""

import torch


def orthonormal(batch: int, concept_num: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """`[B,C,H]`: each sample's C rows are a random orthonormal set (needs C <= H)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(batch, hidden, concept_num, generator=g)).Q  # [B,H,C]
    return q.transpose(1, 2).contiguous()


def identical(batch: int, concept_num: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """`[B,C,H]`: within each sample all C rows are the same random vector."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, hidden, generator=g).expand(batch, concept_num, hidden).clone()
