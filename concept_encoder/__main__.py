"""`python -m concept_encoder [--vocab_size V]`: list the size presets with exact parameter counts."""

import argparse

from .summary import format_preset_table

parser = argparse.ArgumentParser(prog="python -m concept_encoder", description=__doc__)
parser.add_argument("--vocab_size", type=int, default=30522, help="vocabulary size to count embeddings with")
print(format_preset_table(parser.parse_args().vocab_size))
