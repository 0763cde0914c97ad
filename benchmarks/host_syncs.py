"""Host syncs of the loops' training steps: per micro-batch and per optimizer step, for each loop.

    python benchmarks/host_syncs.py                       # the GPU when there is one, else the CPU; micro preset
    python benchmarks/host_syncs.py --device cpu --json out.json

Counts, not times (`concept_encoder.machine.host_syncs`): each loop's own step (`training.steps`: pretraining's
for the Concept Encoder with the default concept losses and for the BERT twin, fine-tuning's for the Concept
Encoder's classifier) runs on a window of prepared micro-batches as its loop hands them over (prepared and pinned
on the CPU, then placed with `training.batches.placed`), padded and not, after one warm-up step. The count of a
window of two micro-batches less that of a window of one is the count per micro-batch; the rest of a step is
the count per optimizer step. The target: 0 per micro-batch, at most 1 per optimizer step (the update decision,
`optim.finish_step`). fp16's GradScaler and DeepSpeed read values of their own and are not measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VOCAB, BATCH, SEQ_LEN, MASKED = 300, 4, 64, 0.15
LOOPS = ("pretraining", "pretraining_bert", "finetune")


def cpu_batch(seed: int, padded: bool, loop: str) -> dict:
    """A padded CPU batch as the loop's masking (MLM: 15% of the real tokens labelled, one at least per row) or
    fine-tuning's collate (3 classes) makes it; `padded`: the first row's last quarter is padding."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ_LEN), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -SEQ_LEN // 4 :] = 0
    if loop == "finetune":
        return {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.randint(0, 3, (BATCH,))}
    chosen = (torch.rand(ids.shape, generator=generator) < MASKED) & mask.bool()
    chosen[:, 1] = True
    return {"input_ids": torch.where(chosen, 4, ids * mask), "attention_mask": mask,
            "labels": torch.where(chosen, ids, -100)}  # fmt: skip


def loop_parts(loop: str, preset: str, device: torch.device):
    """(model, the loop's step function, the CPU half of a batch's way to the device: prepared and pinned)."""
    from concept_encoder import ConceptEncoderForMaskedLM, ConceptEncoderForSequenceClassification, config_from_preset
    from concept_encoder.concepts.weighting import ConceptRegularizedLoss
    from concept_encoder.data.objectives import prepare_batch
    from concept_encoder.model.bert_baseline import BertForSparseMaskedLM, bert_config
    from concept_encoder.model.presets import PRESETS
    from concept_encoder.training.args import DEFAULT_RECIPE
    from concept_encoder.training.batches import pinned, unpadded_or_marked
    from concept_encoder.training.objective import ConceptObjective
    from concept_encoder.training.steps import finetuning_step, pretraining_step

    torch.manual_seed(0)
    if loop == "finetune":
        model = ConceptEncoderForSequenceClassification(config_from_preset(preset, vocab_size=VOCAB, num_labels=3))
        return model, finetuning_step, lambda b: pinned(unpadded_or_marked(b), device)
    if loop == "pretraining_bert":
        model = BertForSparseMaskedLM(bert_config(PRESETS[preset], VOCAB, pad_token_id=0))
        return model, pretraining_step, lambda b: pinned(prepare_batch(b), device)
    config = config_from_preset(preset, vocab_size=VOCAB, hidden_dropout_prob=DEFAULT_RECIPE["hidden_dropout_prob"])
    losses = ConceptRegularizedLoss(DEFAULT_RECIPE["concept_losses"].split(","), concept_num=config.concept_num,
                                    hidden_size=config.hidden_size, concept_loss_weight=1.0,
                                    warmup_steps=DEFAULT_RECIPE["concept_loss_warmup_steps"])  # fmt: skip
    concept = ConceptObjective(losses, 1e-3, device)

    def step(accelerator, model, optimizer, window, max_grad_norm):
        return pretraining_step(accelerator, model, optimizer, window, max_grad_norm, concept, step=1)

    return ConceptEncoderForMaskedLM(config), step, lambda b: pinned(prepare_batch(b), device)


def count_step(loop: str, preset: str, device: torch.device, accumulation: int, padded: bool, precision: str):
    """The `HostSyncCounter` of the second optimizer step (after a warm-up step) of `loop` over windows of
    `accumulation` micro-batches, counted from their placing on the device to the step's end."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import GradientAccumulationPlugin

    from concept_encoder.machine.host_syncs import HostSyncCounter
    from concept_encoder.training.batches import placed
    from concept_encoder.training.deepspeed_setup import adamw_class
    from concept_encoder.training.optim import build_optimizer

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    model, step, prepare = loop_parts(loop, preset, device)
    plugin = GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=False)
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=precision, gradient_accumulation_plugin=plugin)
    hyper = SimpleNamespace(weight_decay=0.01, learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8)
    optimizer = build_optimizer(model, hyper, adamw=adamw_class(accelerator))  # the loops' optimizer
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    counter = None
    for step_index in range(2):
        window = [prepare(cpu_batch(10 * step_index + i, padded, loop)) for i in range(accumulation)]  # CPU side
        counter = HostSyncCounter(device.type)
        with counter:
            step(accelerator, model, optimizer, [placed(batch, accelerator.device) for batch in window], 1.0)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return counter


def measure_loop(loop: str, preset: str = "micro", device: torch.device | None = None, precision: str = "no") -> dict:
    """One loop's counts (the worse of a padded and a padding-free batch): `per_micro_batch`, `per_optimizer_step`,
    and what was counted by name (`counted`: for a window of two micro-batches, padded and not)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"per_micro_batch": 0, "per_optimizer_step": 0, "counted": {}}
    for padded in (False, True):
        one, two = (count_step(loop, preset, device, k, padded, precision) for k in (1, 2))
        per_micro_batch = two.total - one.total
        result["per_micro_batch"] = max(result["per_micro_batch"], per_micro_batch)
        result["per_optimizer_step"] = max(result["per_optimizer_step"], one.total - per_micro_batch)
        result["counted"]["padded" if padded else "unpadded"] = dict(two.counts)
    return result


def measure_host_syncs(preset: str = "micro", device: torch.device | str | None = None, precision: str = "no") -> dict:
    """`{"host_syncs_per_micro_batch": int, "host_syncs_per_optimizer_step": int, "loops": {loop: measure_loop}}`:
    the worst loop's counts, and each loop's. `device`: default the GPU when there is one, else the CPU;
    `precision`: accelerate's mixed precision (`no`, `bf16`; fp16's GradScaler reads values of its own)."""
    device = torch.device(device) if device is not None else None
    loops = {loop: measure_loop(loop, preset, device, precision) for loop in LOOPS}
    return {
        "host_syncs_per_micro_batch": max(r["per_micro_batch"] for r in loops.values()),
        "host_syncs_per_optimizer_step": max(r["per_optimizer_step"] for r in loops.values()),
        "loops": loops,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="micro")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--precision", default="no", choices=("no", "bf16"))
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = measure_host_syncs(args.preset, args.device, args.precision)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
