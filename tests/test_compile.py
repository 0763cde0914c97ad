"""`--torch_compile`: one graph, traced once, whatever the masked count of a batch.

Graphs are counted with dynamo's `CompileCounterWithBackend` over `aot_eager` (dynamo and AOT autograd
trace forward and backward as inductor would see them; inductor's code generation, which neither splits
graphs nor recompiles, is left to the benchmark: benchmarks/compile_speed.py)."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.data.objectives import model_inputs
from concept_encoder.training.runtime import maybe_compile

VOCAB = 300


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def traced_graphs(counter: CompileCounterWithBackend) -> int:
    """Graphs with operations in them (dynamo also counts an empty frame for transformers' forward wrapper)."""
    return sum(1 for graph in counter.graphs if any(node.op == "call_function" for node in graph.graph.nodes))


def masked_batch(masked_per_sample: list[int], seq_len: int = 48, padded: bool = False) -> dict:
    """A batch whose sample i has `masked_per_sample[i]` labelled positions (0 allowed)."""
    generator = torch.Generator().manual_seed(sum(masked_per_sample))
    ids = torch.randint(5, VOCAB, (len(masked_per_sample), seq_len), generator=generator)
    labels = torch.full_like(ids, -100)
    for row, count in enumerate(masked_per_sample):
        positions = torch.randperm(seq_len, generator=generator)[:count]
        labels[row, positions] = ids[row, positions]
        ids[row, positions] = 4  # [MASK]
    mask = torch.ones_like(ids)
    if padded:
        mask[0, seq_len - 8 :] = 0
        labels[0, seq_len - 8 :] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize(("sharing", "padded"), [("none", False), ("all", True)])
def test_five_steps_with_different_masked_counts_compile_once_and_equal_eager(sharing, padded):
    """Padded batches keep their mask (traced, no data-dependent branch); padding-free ones have none."""
    torch.manual_seed(0)
    config = config_from_preset("micro", vocab_size=VOCAB, hidden_dropout_prob=0.0, token_kv_sharing=sharing)
    eager = ConceptEncoderForMaskedLM(config)
    twin = ConceptEncoderForMaskedLM(config)
    twin.load_state_dict(eager.state_dict())
    counter = CompileCounterWithBackend("aot_eager")
    compiled = maybe_compile(twin, True, backend=counter)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, twin)]
    steps = [[7, 3], [12, 9], [1, 0], [20, 15], [5, 5]]  # a different M and L every step, one sample unmasked
    frames = None
    for masked in steps:
        inputs, _, _ = model_inputs(masked_batch(masked, padded=padded))
        assert ("attention_mask" in inputs) == padded
        for net, optimizer in zip((eager, compiled), optimizers, strict=True):
            loss = net(**inputs, return_logits=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(
            compiled(**inputs, return_logits=False).loss, eager(**inputs, return_logits=False).loss
        )
        frames = frames or counter.frame_count
        assert counter.frame_count == frames, f"recompiled at masked counts {masked}"
    assert traced_graphs(counter) == 1
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    for a, b in zip(eager.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_model_inputs_drops_an_all_ones_attention_mask_only():
    inputs, normalizer, tokens = model_inputs(masked_batch([3, 2]))
    assert "attention_mask" not in inputs and int(normalizer) == 5 and int(tokens) == 96
    inputs, _, tokens = model_inputs(masked_batch([3, 2], padded=True))
    assert inputs["attention_mask"].shape == (2, 48) and int(tokens) == 88


def test_a_compiled_model_saves_and_reloads_under_its_plain_names(tmp_path):
    """The loops save through `model_state_dict`/`plain_model`: a compiled model's own state dict names every
    weight `_orig_mod.<name>`, which `save_pretrained` would write as weights no model loads."""
    from accelerate import Accelerator

    from concept_encoder.common.accelerator_state import plain_model
    from concept_encoder.training.runtime import model_state_dict

    torch.manual_seed(0)
    model = ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=VOCAB, hidden_dropout_prob=0.0))
    accelerator = Accelerator(cpu=True)
    compiled = accelerator.prepare(maybe_compile(model, True, backend="eager"))
    assert all(name.startswith("_orig_mod.") for name in accelerator.get_state_dict(compiled))
    state = model_state_dict(accelerator, compiled)
    assert state.keys() == model.state_dict().keys()
    assert type(plain_model(accelerator, compiled)) is ConceptEncoderForMaskedLM
    plain_model(accelerator, compiled).save_pretrained(tmp_path, state_dict=state)
    reloaded = ConceptEncoderForMaskedLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(5, VOCAB, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model.eval()(ids).logits)
