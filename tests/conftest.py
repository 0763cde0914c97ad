"""Every test writes its Cache/ relative to its own working folder (usually a tmp dir), never into the
checkout's: `CONCEPT_ENCODER_CACHE=Cache` makes `concept_encoder.common.paths.cache_root()` the current folder's.
Set at import, before any fixture (module-scoped ones included) runs a loop; subprocesses inherit it."""

import os

os.environ["CONCEPT_ENCODER_CACHE"] = "Cache"
