"""Named size presets, as plain data (no imports: the launch plan checker reads this file alone)."""

# Presets as data: shape only. Vocabulary and special ids come from the tokenizer at run time.
# Gated-GELU FFNs use I ≈ 8/3·H so their weights match a classic 4·H GELU FFN.
PRESETS = {
    "micro": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        concept_num=16,
        max_position_embeddings=512,
    ),
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=384,
        concept_num=32,
        max_position_embeddings=512,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=704,
        concept_num=64,
        max_position_embeddings=512,
    ),
    "base": dict(
        hidden_size=768,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=2048,
        concept_num=128,
        max_position_embeddings=512,
    ),
    "base_4k": dict(
        hidden_size=768,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=2048,
        concept_num=128,
        max_position_embeddings=4096,
    ),
    "large": dict(
        hidden_size=1024,
        num_hidden_layers=12,
        num_attention_heads=16,
        intermediate_size=2752,
        concept_num=256,
        max_position_embeddings=1024,
    ),
    "xl": dict(
        hidden_size=1536,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        concept_num=256,
        max_position_embeddings=2048,
    ),
    # About 3.1B parameters (vocabulary 30,522): a model for one 10 GB card under ZeRO-3 with parameters and
    # optimizer offloaded to the CPU (docs/scaling.md: "A 3B model on a 10 GB card", estimates until measured).
    "3b": dict(
        hidden_size=2560,
        num_hidden_layers=28,
        num_attention_heads=20,
        intermediate_size=6848,
        concept_num=256,
        max_position_embeddings=2048,
    ),
}
