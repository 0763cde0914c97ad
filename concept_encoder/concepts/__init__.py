"""What reads the `[B,C,H]` concept tensor: the concept regularisers (losses), how they are weighted against the
task loss (fixed with warm-up, learnable, Kendall-Gal), and the concept-health metrics the loops log and the
decision gates read. Depends on the model's outputs only, never on training, tasks or the tools.
"""
