"""Names and numbers of the model itself, torch-free.

This file is copied beside the weights of every saved model (with the modeling files that import it), so a
checkpoint loads with `trust_remote_code=True` without this package: it imports nothing, and the model files
import it, and each other, with single-dot imports only (transformers copies those, and only those).
"""

IGNORE_INDEX = -100  # label of positions that are not predicted (transformers' and torch's convention)

# Rows of the vocabulary projection are processed in chunks whose float32 working copy stays under
# this many elements (16-bit compute only); the memory model counts the same chunk.
VOCAB_CHUNK_ELEMENTS = 2**24

DECODER_TYPES = ("perceiver", "mixed", "posonly", "weighted")
# Decoders whose query at a position holds the token there (`[MASK]` at a masked one), not only its position:
# `perceiver` its embedding, `mixed` its state after the local mixer (it sees its neighbours; heads.py)
TOKEN_QUERY_DECODERS = ("perceiver", "mixed")
CLASSIFIER_POOLINGS = ("weighted", "mean", "cls")  # cls: the [CLS] token's refined state (token_refinement)
LOCAL_MIXERS = ("none", "conv")  # conv: a residual depthwise convolution over the token embeddings (modeling.py)
# Where the mixer acts: `first`, once on the embeddings before the first layer; `every`, a mixer of its own before
# each layer, on the tokens that layer reads (modeling.py)
LOCAL_MIXER_PLACEMENTS = ("first", "every")
POSITION_EXTENSIONS = ("no", "copy")  # a saved model read past its position table: refused, or copied (positions.py)


def token_kv_groups(sharing: str, num_layers: int) -> int:
    """How many token key/value projections an encoder of `num_layers` layers has under `token_kv_sharing`:
    one per layer (`none`), one for all (`all`), or K (`groups:K`, contiguous groups of layers); ValueError otherwise."""
    if sharing == "none":
        return num_layers
    if sharing == "all":
        return 1
    count = sharing[len("groups:") :] if isinstance(sharing, str) and sharing.startswith("groups:") else ""
    if count.isdigit() and 1 <= int(count) <= num_layers:
        return int(count)
    raise ValueError(
        f"token_kv_sharing={sharing!r}: use none, all, or groups:K with 1 <= K <= num_hidden_layers={num_layers}"
    )


def token_kv_group(layer: int, groups: int, num_layers: int) -> int:
    """The key/value group of encoder layer `layer` (0-based): contiguous, as even as the division allows."""
    return layer * groups // num_layers


def refining_layers(token_refinement: bool, num_layers: int, returns_tokens: bool) -> int:
    """How many encoder layers update the tokens: none without `token_refinement`; else every layer when the
    refined tokens are an output (`cls` pooling), all but the last when only the concepts are (its update would
    be unread)."""
    if not token_refinement:
        return 0
    return num_layers if returns_tokens else num_layers - 1


def token_refinement_problem(token_refinement, token_kv_sharing: str) -> str | None:
    """Why `token_refinement` cannot be set beside `token_kv_sharing`, else None."""
    if not isinstance(token_refinement, bool):
        return f"token_refinement={token_refinement!r} must be true or false"
    if token_refinement and token_kv_sharing != "none":
        return (
            f"token_refinement updates the tokens in every layer, so token_kv_sharing={token_kv_sharing!r} "
            "(keys/values computed once) cannot hold; use token_kv_sharing none with token_refinement"
        )
    return None


def local_mixer_count(local_mixer: str, local_mixer_placement: str, num_layers: int) -> int:
    """How many `LocalMixer`s an encoder of `num_layers` layers holds: none (`local_mixer` none), one (placement
    `first`) or one per layer (placement `every`)."""
    if local_mixer != "conv":
        return 0
    return num_layers if local_mixer_placement == "every" else 1


def mixed_decoder_problem(decoder_type: str, local_mixer: str) -> str | None:
    """Why `decoder_type` cannot go with `local_mixer`, else None: the `mixed` decoder's queries are the tokens
    after the local mixer, so it needs one."""
    if decoder_type == "mixed" and local_mixer != "conv":
        return (
            f"decoder_type=mixed queries the tokens after the local mixer, and local_mixer={local_mixer!r} has none; "
            "set local_mixer conv, or use decoder_type perceiver (queries the unmixed embeddings)"
        )
    return None


def local_mixer_problem(
    local_mixer, local_mixer_width, local_mixer_placement="first", token_kv_sharing: str = "none"
) -> str | None:
    """Why `local_mixer` with `local_mixer_width`, `local_mixer_placement` (and `token_kv_sharing`) cannot be
    built, else None. The width must be odd so the convolution is centred (a token sees (w-1)/2 neighbours on each
    side) and keeps the sequence length. Placement `every` needs a mixer to place, and needs token_kv_sharing none:
    shared keys/values are computed once per group of layers from one token state, while under `every` each layer
    reads its own (mixed once more); reading a group's first state would leave the other layers' mixers without
    effect or gradient."""
    if local_mixer not in LOCAL_MIXERS:
        return f"local_mixer={local_mixer!r} is unknown; choose one of {LOCAL_MIXERS}"
    width = local_mixer_width
    if not isinstance(width, int) or isinstance(width, bool) or width < 1 or width % 2 == 0:
        return f"local_mixer_width={width!r} must be an odd positive integer (a centred window: 3, 5, 7, ...)"
    if local_mixer_placement not in LOCAL_MIXER_PLACEMENTS:
        return f"local_mixer_placement={local_mixer_placement!r} is unknown; choose one of {LOCAL_MIXER_PLACEMENTS}"
    if local_mixer_placement == "every" and local_mixer == "none":
        return "local_mixer_placement=every needs local_mixer=conv (with none there is no mixer to place)"
    if local_mixer_placement == "every" and token_kv_sharing != "none":
        return (
            f"local_mixer_placement=every mixes the tokens again before every layer, so token_kv_sharing="
            f"{token_kv_sharing!r} (keys/values computed once per group from one token state) cannot hold; use "
            "token_kv_sharing none with placement every, or local_mixer_placement first"
        )
    return None
