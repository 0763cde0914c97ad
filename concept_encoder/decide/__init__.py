"""The tools that run and judge experiments: `compare` (runs side by side), `ablate` (one setting, several values,
a deciding metric), `curve` (downstream score against pretraining tokens, beside from-scratch twins),
`check_health` (a saved model's concept health and held-out language) and `reference` (the positive control);
the drivers `curve`, `long_context`, `recipes`, `listops` and `recall` share one engine, `experiments` (planning
points and pretraining runs, running and reusing them, writing reports).

Run them as `python -m concept_encoder <tool>`; they sit above `training/`, `data/`, `tasks/` and `model/`, and
nothing in the library imports them.
"""
