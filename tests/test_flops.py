"""The analytic FLOP formula equals PyTorch's own count of the model's training step (and of a token encoder's
classifier), and an architecture it does not model is named, not guessed."""

import pytest
import torch
from token_encoders import tiny_config
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.accounting.architectures import UnmodelledArchitecture
from concept_encoder.accounting.flops import classifier_forward_flops, mlm_training_flops


@pytest.mark.parametrize(
    ("decoder", "decoder_layers"), [("perceiver", 1), ("perceiver", 2), ("posonly", 1), ("weighted", 1)]
)
def test_formula_equals_flop_counter_of_a_training_step(decoder, decoder_layers):
    config = config_from_preset("micro", vocab_size=500, decoder_type=decoder, num_decoder_layers=decoder_layers)
    model = ConceptEncoderForMaskedLM(config)
    batch, seq_len, masked = 2, 100, 10
    ids = torch.randint(5, 500, (batch, seq_len))
    labels = torch.full_like(ids, -100)
    labels[:, :masked] = ids[:, :masked]  # exactly p·N labelled positions per sequence
    # The math SDPA backend runs attention as matmuls the counter sees (fused kernels are opaque to it).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, labels=labels, return_logits=False).loss.backward()
    assert counter.get_total_flops() == mlm_training_flops(config.to_dict(), batch, seq_len, masked / seq_len)


def test_flops_are_affine_in_sequence_length():
    config = config_from_preset("small", vocab_size=30522).to_dict()
    f1, f2, f3 = (mlm_training_flops(config, 1, n) for n in (1024, 2048, 3072))
    assert f3 - f2 == pytest.approx(f2 - f1) and f2 > f1  # no N² term


@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert", "mpnet"])
def test_token_encoder_classifier_flops_equal_the_flop_counter(kind):
    """BERT's count holds for every modelled token encoder, each read under its own config names."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_config(tiny_config(kind, vocab_size=100, num_labels=3)).eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(5, 100, (2, 20)))
    assert counter.get_total_flops() == 2 * classifier_forward_flops(model.config.to_dict(), 20)


def test_what_the_accounting_does_not_model_is_named_not_guessed():
    from transformers import ElectraConfig

    with pytest.raises(UnmodelledArchitecture, match="the FLOPs of model_type 'electra' are not modelled"):
        classifier_forward_flops(ElectraConfig().to_dict(), 20)
    with pytest.raises(UnmodelledArchitecture, match="the MLM FLOPs of model_type 'roberta' are not modelled"):
        mlm_training_flops(tiny_config("roberta", vocab_size=100).to_dict(), 1, 20)
