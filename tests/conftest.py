"""Every test writes its Cache/ relative to its own working folder (usually a tmp dir), never into the
checkout's: `CONCEPT_ENCODER_CACHE=Cache` makes `concept_encoder.paths.cache_root()` the current folder's."""

import pytest


@pytest.fixture(autouse=True)
def cache_in_the_working_folder(monkeypatch):
    monkeypatch.setenv("CONCEPT_ENCODER_CACHE", "Cache")
