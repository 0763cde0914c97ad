"""No host sync in a training micro-batch, at most one per optimizer step, and an encoder that runs on the
`meta` device (issue 53): counted with `machine.host_syncs.HostSyncCounter` over the loops' own steps."""

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import send_to_device
from loop_runs import fresh_accelerate, workdir  # noqa: F401 (fixtures)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import loops.finetune as finetune
import loops.mlm as mlm
from benchmarks.host_syncs import LOOPS, cpu_batch, measure_loop
from concept_encoder import ConceptEncoderForMaskedLM, ConceptEncoderForSequenceClassification, config_from_preset
from concept_encoder.data.objectives import model_inputs, prepare_batch
from concept_encoder.machine.host_syncs import HostSyncCounter, count_host_syncs
from concept_encoder.model.bert_baseline import BertForSparseMaskedLM, bert_config
from concept_encoder.model.presets import PRESETS
from concept_encoder.training.batches import placed
from concept_encoder.training.steps import finetuning_step, pretraining_step
from concept_encoder.training.tracking import any_rank

VOCAB = 300


def test_the_counter_counts_each_kind_of_sync_once_and_nothing_else():
    x = torch.randn(6, requires_grad=True)
    keep = x.detach() > 0
    with HostSyncCounter("cpu") as counter:
        x[keep].sum().backward()  # index with a boolean index, and index_put in its backward
        x.detach().sum().item()
        bool(keep.any())
        keep.nonzero()
        torch.masked_select(x.detach(), keep)
        x.detach().tolist()
        x.detach().index_select(0, torch.tensor([0, 2]))  # an index tensor: no sync
        x.detach()[torch.tensor([1, 3])]
    assert dict(counter.counts) == {
        "index (boolean index)": 1, "index_put (boolean index)": 1, "_local_scalar_dense": 2, "nonzero": 1,
        "masked_select": 1, "Tensor.tolist": 1,
    }  # fmt: skip
    host = torch.ones(3)
    with HostSyncCounter("meta") as counter:  # a device of its own: the copies to it are counted
        host.to("meta")  # blocking: torch waits for the stream after it
        host.to("meta", non_blocking=True)
        torch.tensor([1.0, 2.0], device="meta")  # made on the host, copied
        torch.full((2,), 1.0, device="meta")  # a kernel argument: no copy
        host.sum().item()  # a host tensor's value: no device involved
    assert dict(counter.counts) == {"_to_copy (cpu to meta)": 1, "torch.tensor (host data to meta)": 1}
    flags, counter = count_host_syncs(any_rank, SimpleNamespace(num_processes=1), True, False)  # the loops' stop
    assert flags == [True, False] and counter.total == 0  # one process: no device tensor, nothing read back


@pytest.mark.parametrize("loop", LOOPS)
def test_no_host_sync_in_a_micro_batch_and_one_per_optimizer_step(loop):
    """Each loop's own step (pretraining: the Concept Encoder with the default concept losses and the BERT twin;
    fine-tuning: the classifier), over windows of one and two prepared micro-batches, padded and not."""
    assert mlm.train_step is pretraining_step and finetune.train_step is finetuning_step  # what the loops run
    counts = measure_loop(loop)
    assert counts["per_micro_batch"] == 0, counts
    assert counts["per_optimizer_step"] == 1, counts  # the update decision, logged values read with it
    assert all(c == {"Tensor.tolist": 1} for c in counts["counted"].values()), counts


def test_a_batch_not_prepared_on_the_cpu_costs_syncs_in_every_micro_batch():
    """What the step would cost if the loop handed over batches as they come from masking: the counter sees it."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=VOCAB))
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = cpu_batch(0, padded=True, loop="mlm")
    ready = prepare_batch(batch)
    with HostSyncCounter() as raw:
        pretraining_step(accelerator, model, optimizer, [batch], 1.0)
    with HostSyncCounter() as prepared:
        pretraining_step(accelerator, model, optimizer, [ready], 1.0)
    assert dict(prepared.counts) == {"Tensor.tolist": 1}
    assert dict(raw.counts) == {"_local_scalar_dense": 3, "nonzero": 1, "Tensor.tolist": 1}  # M, padding, tokens, L


def test_placing_a_prepared_batch_queues_its_copies_without_a_sync():
    batch = prepare_batch(cpu_batch(0, padded=True, loop="mlm"))
    meta = torch.device("meta")  # stands for an accelerator: copies to it reach the dispatcher as they would
    _, counter = count_host_syncs(placed, batch, meta, device_type="meta")
    assert counter.total == 0
    _, blocking = count_host_syncs(send_to_device, batch, meta, device_type="meta")
    assert blocking.total == sum(isinstance(v, torch.Tensor) for v in batch.values())


@pytest.mark.parametrize("decoder", ["perceiver", "posonly"])
def test_the_prepared_slots_give_the_same_loss_and_gradients_bit_for_bit(decoder):
    torch.manual_seed(0)
    batch = cpu_batch(3, padded=True, loop="mlm")
    batch["label_weights"] = torch.rand(batch["labels"].shape)
    models = [ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=VOCAB, decoder_type=decoder)),
              BertForSparseMaskedLM(bert_config(PRESETS["micro"], VOCAB, pad_token_id=0))]  # fmt: skip
    for model in models:
        model.eval()  # no dropout: the two calls see the same network
        runs = []
        for inputs in (model_inputs(batch)[0], {k: batch[k] for k in ("input_ids", "attention_mask", "labels",
                                                                       "label_weights")}):  # fmt: skip
            model.zero_grad()
            out = model(**inputs, return_logits=False)
            out.loss.backward()
            runs.append((out.loss_sum, out.num_labelled, [p.grad.clone() for p in model.parameters()]))
        (loss_a, count_a, grads_a), (loss_b, count_b, grads_b) = runs
        assert torch.equal(loss_a, loss_b) and count_a == count_b == (batch["labels"] != -100).sum()
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


class NoHostTensors(TorchDispatchMode):
    """Records every operation that reads or makes a tensor on the CPU."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" for t in tensors):
            self.seen.append(str(func))
        return out


def test_the_encoder_runs_on_the_meta_device_without_a_host_tensor():
    """The forward pass, model and inputs on `meta`: a `.item()` or a tensor made on the CPU inside it would
    raise or be recorded. The labelled slots and the padding come from the CPU batch, as the loops pass them."""
    host = prepare_batch(cpu_batch(1, padded=True, loop="mlm"))
    inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in model_inputs(host)[0].items()}
    assert inputs["padded"] is True
    with torch.device("meta"):
        mlm_model = ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=VOCAB))
        classifier = ConceptEncoderForSequenceClassification(
            config_from_preset("micro", vocab_size=VOCAB, num_labels=3, classifier_pooling="cls", token_refinement=True)
        )
    with NoHostTensors() as watch:
        out = mlm_model(**inputs, return_logits=False)
        logits = mlm_model(**inputs).logits
        classified = classifier(inputs["input_ids"], inputs["attention_mask"], padded=True).logits
    assert not watch.seen, watch.seen
    assert out.loss.device.type == "meta" and out.concepts.shape == (4, 16, 64)
    assert logits.shape == (len(host["labelled_rows"]), VOCAB) and classified.shape == (4, 3)
    with pytest.raises(RuntimeError, match="item"):  # without `padded` the model tests the mask itself: a host read
        mlm_model.encoder(inputs["input_ids"], inputs["attention_mask"])
