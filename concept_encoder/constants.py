"""Names and numbers the library shares with its torch-free tools (plan checker, argument parsing).

The model's own names (decoder types, poolings, token key/value sharing, the ignored label, the vocabulary
chunk) are in `concept_encoder/model/constants.py`, which every saved model carries beside its weights.

Plain data, no imports: the argument dataclasses validate against these tuples without importing
torch, and the modules that implement each option key their tables by the same names (each such
table checks at import that it covers its tuple, so a name cannot be added here without code).
"""

EMBEDDED_DATASET = "embedded"  # the offline built-in corpus
DOCSTRINGS_DATASET = "docstrings"  # offline: docstrings of the installed third-party packages
LICENSES_DATASET = "licenses"  # offline: license texts of the installed packages (held-out English)
MODULES_DATASET = "modules"  # offline, long documents: each installed module file's docstrings and comments
MASKING_STRATEGIES = ("mlm", "whole_word", "span", "query_values")  # query_values: recall (tasks/recall.py)
CONCEPT_LOSS_NAMES = (
    "orthogonality",
    "soft_orthogonality",
    "uniformity",
    "variance",
    "covariance",
    "vicreg",
    "nn_spread",
)
LOSS_WEIGHTING_NAMES = ("fixed", "learnable", "kendall_gal")

# Pretraining (`loops/mlm.py`): what the model learns from and which network learns it.
OBJECTIVES = ("mlm", "diffusion", "tsdae", "distill")  # distill: MLM + a teacher's embeddings
DIFFUSION_WEIGHTINGS = ("elbo", "none")
DISTILL_LOSSES = ("cosine", "mse")  # distill: 1 - cos, or mean squared error, to the teacher's embedding
EVAL_MASK_RATES = (0.15, 0.5, 0.9)  # masked diffusion is also evaluated at these fixed masking rates
ARCHITECTURES = ("concept", "bert")
LOSS_NORMALIZER = "loss_normalizer"  # batch key: the token count a step's summed loss is divided by

# What the loops evaluate (the keys decision gates may name).
EVAL_KEYS = ("eval_loss", "eval_perplexity", "eval_accuracy", "eval_masked_tokens")
HEALTH_KEYS = (
    "effective_rank",
    "effective_rank_fraction",
    "batch_mean_effective_rank",
    "participation_ratio",
    "mean_cosine",
    "max_cosine",
    "collapsed_dims",
)
TASK_METRIC_NAMES = (
    "accuracy",
    "macro_f1",
    "f1",
    "matthews",
    "pearson",
    "spearman",
    "mse",
    "micro_f1",
    "subset_accuracy",
)


def eval_suffixes(objective: str) -> tuple[str, ...]:
    """The suffixes of an objective's own evaluations (`eval_loss_<suffix>`, ...), beside the 15% MLM one."""
    if objective == "diffusion":
        return tuple(f"t{rate:.2f}" for rate in EVAL_MASK_RATES)
    return ("tsdae",) if objective == "tsdae" else ()


def pretraining_metric_names(objective: str, architecture: str) -> tuple[str, ...]:
    """Every key an evaluation of `loops/mlm.py` reports for this objective and architecture."""
    extras = tuple(f"{key}_{suffix}" for suffix in eval_suffixes(objective) for key in EVAL_KEYS)
    if objective == "distill":
        extras += ("eval_distill_cosine",)
    health = tuple(f"health/{key}" for key in HEALTH_KEYS) if architecture == "concept" else ()
    return EVAL_KEYS + health + extras


def check_table_covers(table, names: tuple[str, ...], what: str) -> None:
    """Raise if the implementation table `table` (keyed by option name) and `names` differ."""
    if tuple(table) != names:
        raise RuntimeError(f"{what}: implemented {tuple(table)} but constants.py names {names}")


def check_concept_loss_settings(names: list[str], weighting: str, weight: float, warmup_steps: int) -> None:
    """ValueError naming what is wrong with a choice of concept losses and their weighting.

    Shared by the argument dataclass (checked at parse time, without torch) and the loss module.
    """
    unknown = [name for name in names if name not in CONCEPT_LOSS_NAMES]
    if unknown:
        raise ValueError(f"unknown concept loss(es) {unknown}; valid names: {', '.join(CONCEPT_LOSS_NAMES)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"concept loss(es) {repeated} listed more than once; list each loss once")
    if weighting not in LOSS_WEIGHTING_NAMES:
        raise ValueError(f"unknown weighting {weighting!r}; valid modes: {', '.join(LOSS_WEIGHTING_NAMES)}")
    if weight < 0:
        raise ValueError(f"concept_loss_weight={weight} must be >= 0")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 (0 = full concept loss weight from step 0)")
    if warmup_steps > 0 and weighting != "fixed":
        raise ValueError(
            f"warmup_steps={warmup_steps} applies to weighting='fixed' only; with weighting={weighting!r} "
            "the weights are learned, so set warmup_steps=0"
        )


# Saved models and run folders.
SAVE_DTYPES = ("float32", "bfloat16", "float16")  # --save_dtype: float32 unless the user asks for smaller files
RUN_TOKENIZER = "tokenizer"  # <run>/tokenizer: the tokenizer the run started with
