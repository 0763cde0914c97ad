"""A memory model of Concept Encoder training: parameters, ZeRO model states, activations.

Pure arithmetic on config fields, importing neither torch nor DeepSpeed, so the launch plan
checker answers in about a second. The ZeRO-2/ZeRO-3 model-state formulas are DeepSpeed's own
estimators (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`),
restated here and tested equal to them; stages 0 and 1, which DeepSpeed has no estimator for,
follow the same byte accounting. Parameter counts are tested equal to the built models.

Beyond the estimators, the ZeRO buffers the ds config sets (`zero_buffers.py`: gradient buckets, ZeRO-3's
gathered parameters and fp32 gradient partition); the CUDA context outside the caching allocator (`CUDA_CONTEXT_BYTES`, what an emulated
cap must leave out: `allocator_budget_bytes`); and the host: a process baseline, the fp32 model built before
`prepare` and the offloaded states (`MemoryEstimate.host_peak`, `describe_host`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..model.constants import VOCAB_CHUNK_ELEMENTS, local_mixer_count, refining_layers, token_kv_groups
from .zero_buffers import zero_buffer_bytes
from .zero_buffers import zero_settings as zero_settings  # re-exported: the project imports it from here

GIB = 2**30
ADDITIONAL_BUFFER_FACTOR = 1.5  # DeepSpeed's default for host-side buffers
# Bytes per parameter under mixed precision with Adam: 16-bit params (2) and grads (2), fp32 grads (4),
# fp32 master params (4) and Adam moments (8). DeepSpeed's estimators count "2 + 18".
PARAM16, STATE_BYTES = 2, 18
# The CUDA context, outside torch's caching allocator (not in `max_memory_reserved`, not under
# `set_per_process_memory_fraction`): 287 MB for a torch process with lazy module loading, 667 MB without
# (pytorch/pytorch#86509, which made CUDA_MODULE_LOADING=LAZY torch's default), plus the cuBLAS/cuDNN/NCCL kernels
# loaded on first use; their workspaces come from the caching allocator. 0.5 GiB, an estimate until a GPU run
# measures it (`nvidia-smi` used minus `max_memory_reserved`).
CUDA_CONTEXT_BYTES = GIB // 2
ALLOCATOR_SLACK_BYTES = GIB // 4  # the caching allocator's fragmentation: workspace = context + slack (0.75 GiB)
# A training process before its model: Python, torch, transformers, accelerate, DeepSpeed, the loop's modules,
# its data and tokenizer. Measured: 0.61 GiB RSS per rank of a 2-process CPU ZeRO-3 run of the `micro` preset
# (model states ~10 MB), 0.53 GiB at `build_model` (docs/results.md, "Host memory, estimated and measured").
PROCESS_BASELINE_BYTES = int(0.6 * GIB)


def parse_size_gb(text: str) -> float:
    """`10GB`, `10`, `24GiB`, `512MB` → GiB as a float; ValueError naming the text otherwise (no size, or 0:
    every use divides by it or budgets with it)."""
    match = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*(GB|GIB|G|MB|MIB|M)?\s*", str(text).upper())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"memory size {text!r}: use a size above 0, e.g. 10GB or 512MB")
    value = float(match.group(1))
    return value / 1024 if (match.group(2) or "GB").startswith("M") else value


def parameter_count(
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    intermediate_size: int,
    concept_num: int,
    max_position_embeddings: int,
    decoder_type: str = "perceiver",
    num_decoder_layers: int = 1,
    tie_word_embeddings: bool = True,
    token_kv_sharing: str = "none",
    token_refinement: bool = False,
    local_mixer: str = "none",
    local_mixer_width: int = 3,
    local_mixer_placement: str = "first",
    **_ignored,
) -> dict[str, int]:
    """Exact parameter counts of `ConceptEncoderForMaskedLM` from its config fields (with shared token
    keys/values, the encoder's cross-attentions keep their queries, output and query norm; each group's
    `TokenKeyValue` holds the context norm and key/value projection; `token_refinement` adds a reading layer,
    cross-attention + FFN, to every encoder layer but the last: its update nothing in the MLM model reads;
    `local_mixer` conv adds its depthwise filters H·w, their biases H and a LayerNorm 2·H: once, or per layer
    under `local_mixer_placement` every)."""
    V, H, L, I, C, P = (  # noqa: E741 (I: FFN width, as in the config docs)
        vocab_size,
        hidden_size,
        num_hidden_layers,
        intermediate_size,
        concept_num,
        max_position_embeddings,
    )
    attention = 4 * H * H + 4 * H  # q (H×H), kv (H×2H), o (H×H), with biases
    cross_block = attention + 4 * H  # + query norm + context norm
    self_block = attention + 2 * H
    ffn_block = 3 * H * I + 2 * I + H + 2 * H  # w_in (H×2I), w_out (I×H), biases, norm
    token_kv = 2 * H + 2 * H * H + 2 * H  # context norm + key/value projection (H×2H, bias)
    groups = token_kv_groups(token_kv_sharing, L)
    encoder_cross = cross_block if token_kv_sharing == "none" else cross_block - token_kv
    layer = encoder_cross + self_block + ffn_block
    refinement = refining_layers(token_refinement, L, returns_tokens=False) * (cross_block + ffn_block)
    if decoder_type == "weighted":
        decoder = P * C
    else:
        decoder = num_decoder_layers * (cross_block + ffn_block) + 2 * H
    head = H * H + H + 2 * H + V + (0 if tie_word_embeddings else V * H)
    counts = {
        "embeddings": V * H + P * H + 2 * H,
        "local_mixer": local_mixer_count(local_mixer, local_mixer_placement, L) * (H * local_mixer_width + 3 * H),
        "concepts": C * H,
        "layers": L * layer,
        "token_kv": 0 if token_kv_sharing == "none" else groups * token_kv,
        "token_refinement": refinement,
        "final_norm": 2 * H,
        "decoder": decoder,
        "lm_head": head,
    }
    counts["total"] = sum(counts.values())
    counts["largest_layer"] = max(layer + (cross_block + ffn_block if token_refinement else 0), V * H)
    return counts


def bert_parameter_count(
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    intermediate_size: int,
    max_position_embeddings: int,
    type_vocab_size: int = 2,
    **_ignored,
) -> dict[str, int]:
    """Exact parameter counts of transformers' `BertForMaskedLM` (tied decoder) from its config fields."""
    V, H, L, I, P = vocab_size, hidden_size, num_hidden_layers, intermediate_size, max_position_embeddings  # noqa: E741
    layer = (4 * H * H + 4 * H + 2 * H) + (2 * H * I + I + H + 2 * H)  # attention + norm, FFN + norm
    counts = {
        "embeddings": (V + P + type_vocab_size) * H + 2 * H,
        "layers": L * layer,
        "lm_head": H * H + H + 2 * H + V,  # transform + norm, decoder bias (weight tied)
    }
    counts["total"] = sum(counts.values())
    counts["largest_layer"] = max(layer, V * H)
    return counts


def model_parameter_count(model_config: dict) -> dict[str, int]:
    """`parameter_count` or `bert_parameter_count`, by the config's `model_type`."""
    count = bert_parameter_count if model_config.get("model_type") == "bert" else parameter_count
    return count(**model_config)


def zero2_model_states(params: int, gpus_per_node: int, nodes: int, cpu_offload: bool) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes) per DeepSpeed's ZeRO-2 estimator."""
    total_gpus = nodes * gpus_per_node
    if cpu_offload:
        gpu = PARAM16 * params
        cpu = params * max(4 * total_gpus, 16) * ADDITIONAL_BUFFER_FACTOR
    else:
        gpu = PARAM16 * params + int(STATE_BYTES * params / total_gpus)
        cpu = params * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR
    return int(cpu), int(gpu)


def zero3_model_states(
    params: int,
    largest_layer: int,
    gpus_per_node: int,
    nodes: int,
    cpu_offload: bool,
    cpu_offload_params: bool,
    zero_init: bool = True,
) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes) per DeepSpeed's ZeRO-3 estimator; `zero_init` as the loop builds a ZeRO-3
    model: partitioned by `deepspeed.zero.Init` (training/model.py:construct), never whole on one process."""
    total_gpus = nodes * gpus_per_node
    gpus_factor = 1 / nodes
    largest = 4 * largest_layer
    if cpu_offload:
        if cpu_offload_params:
            gpu = largest
            per_param = 18 * gpus_factor if zero_init else max(4 * gpus_per_node, 18 * gpus_factor)
        else:
            gpu = largest + int(2 * params / total_gpus)
            per_param = 16 * gpus_factor if zero_init else max(4 * gpus_per_node, 16 * gpus_factor)
        cpu = params * per_param * ADDITIONAL_BUFFER_FACTOR
    else:
        gpu = largest + int(STATE_BYTES * params / total_gpus)
        cpu = (largest_layer if zero_init else params) * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR
    return int(cpu), int(gpu)


def model_state_bytes(
    stage: int,
    params: int,
    largest_layer: int,
    gpus_per_node: int = 1,
    nodes: int = 1,
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes) of parameters, gradients and Adam states for a ZeRO stage.

    Stage 0 keeps everything on every GPU (2 + 18 bytes/param); stage 1 partitions the fp32
    master weights and Adam moments (4 + 8 of the 18) across GPUs; stages 2 and 3 are DeepSpeed's
    estimators. On one GPU, stages 1-3 without offload partition over a world of one and save nothing.
    """
    total_gpus = gpus_per_node * nodes
    host_baseline = int(params * 4 * gpus_per_node * ADDITIONAL_BUFFER_FACTOR)  # fp32 copy while loading
    if stage == 0:
        return host_baseline, (PARAM16 + STATE_BYTES) * params
    if stage == 1:
        return host_baseline, (PARAM16 + 6) * params + int(12 * params / total_gpus)
    if stage == 2:
        return zero2_model_states(params, gpus_per_node, nodes, offload_optimizer)
    if stage == 3:
        return zero3_model_states(params, largest_layer, gpus_per_node, nodes, offload_optimizer, offload_params)
    raise ValueError(f"ZeRO stage {stage} does not exist; use 0, 1, 2 or 3")


def nvme_offloaded(ds_config: dict | None) -> bool:
    zero = (ds_config or {}).get("zero_optimization", {}) or {}
    return any((zero.get(key) or {}).get("device") == "nvme" for key in ("offload_optimizer", "offload_param"))


def host_and_nvme_bytes(ds_config: dict | None, cpu_model_states: int, params: int) -> tuple[int, int]:
    """(host RAM, NVMe) bytes for the offloaded model states. With NVMe offload the states DeepSpeed's
    estimator puts in host RAM live on the NVMe, and the host holds DeepSpeed's pinned swap buffers instead:
    parameters `buffer_count × buffer_size` 16-bit elements (defaults 5 × 1e8), optimizer
    `buffer_count × min(sub_group_size, params)` fp32 elements (defaults 4 × 1e9). Our estimate, not DeepSpeed's."""
    if not nvme_offloaded(ds_config):
        return cpu_model_states, 0
    zero = ds_config["zero_optimization"]
    host = 0
    param = zero.get("offload_param") or {}
    if param.get("device") == "nvme":
        host += int(param.get("buffer_count", 5) * param.get("buffer_size", 1e8) * PARAM16)
    optimizer = zero.get("offload_optimizer") or {}
    if optimizer.get("device") == "nvme":
        host += int(optimizer.get("buffer_count", 4) * min(zero.get("sub_group_size", 1e9), params) * 4)
    return host, cpu_model_states


def allocator_budget_bytes(card_bytes: float) -> int:
    """What torch's caching allocator may hold on a card of `card_bytes`: the CUDA context lives outside it, so a
    cap that emulates a smaller card on a larger one (`set_per_process_memory_fraction`) leaves it out."""
    return int(card_bytes) - CUDA_CONTEXT_BYTES


def activation_bytes(
    micro_batch: int,
    seq_len: int,
    hidden_size: int,
    num_hidden_layers: int,
    intermediate_size: int,
    vocab_size: int,
    num_attention_heads: int,
    concept_num: int = 0,
    model_type: str = "concept_encoder",
    token_kv_sharing: str = "none",
    token_refinement: bool = False,
    local_mixer: str = "none",
    local_mixer_placement: str = "first",
    mlm_probability: float = 0.15,
    bytes_per_element: int = 2,
    fused_attention: bool = True,
    gradient_checkpointing: bool = False,
    num_decoder_layers: int = 1,
    **_ignored,
) -> int:
    """Activations kept for backward in one training micro-step of our architecture, or of the BERT
    baseline (`model_type` "bert").

    Token side (the part linear in N): embeddings (~4·B·N·H: sum, norm, dropout) and, per layer,
    the normed tokens and their key/value projection (3·B·N·H); with the math SDPA kernel (no fused
    kernel) also the attention probabilities B·heads·C·N, and the concepts' own B·heads·C·C. Concept side per layer, per concept, in
    the accounting of Korthikanti et al. (2022) for 16-bit activations: two attention blocks
    (~11·H bytes each) and the gated FFN (~5·H + 8·I bytes), i.e. ~(14·H + 4·I) elements. Decoder
    at the M = p·N decoded positions (`mlm_probability` p: 1 for objectives that decode every
    position or may mask all of them): ~(12·H + 4·I) per query. BERT instead keeps ~(10·H + 2·I)
    elements per token and layer (the same accounting with its FFN width as a parameter), with the
    math kernel also its heads·N attention probabilities per token, and ~3·H per masked position in
    its head's transform. The loss (`vocab_projection.linear_cross_entropy`, the loop's path, for both)
    keeps only its gradients, `[M,H]` in the compute dtype and `[V,H]` + `[V]` in float32, and works on
    one chunk of at most `VOCAB_CHUNK_ELEMENTS` logits at a time (compute dtype, plus a float32 copy
    for 16-bit compute). Gradient checkpointing keeps only each layer's input and recomputes the rest
    (one layer live at a time). `token_refinement` adds, per layer, the tokens' reading layer in the same
    accounting as a decoder query (~(12·H + 4·I) per token, with the math kernel also B·heads·N·C
    probabilities; all layers counted, an upper bound for the MLM step whose last layer skips it), and each
    layer's input then holds the tokens too. `local_mixer` conv keeps ~3·B·N·H more per mixer: the padding-zeroed
    input the convolution's weight gradient needs, the residual sum its LayerNorm normalises, and the output; once
    (`local_mixer_placement` first) or for each of the L layers (every: the mixers sit outside the checkpointed
    layers, so gradient checkpointing keeps them all).
    """
    B, N, H, I, C, V = micro_batch, seq_len, hidden_size, intermediate_size, concept_num, vocab_size  # noqa: E741
    masked = max(1, round(mlm_probability * N)) * B
    if model_type == "bert":
        per_layer = B * N * (10 * H + 2 * I) + (0 if fused_attention else B * num_attention_heads * N * N)
        layer_input, decoder, shared = B * N * H, 3 * masked * H, 0
    else:
        groups = token_kv_groups(token_kv_sharing, num_hidden_layers)
        token_side = 3 * B * N * H  # normed tokens and their keys/values, per layer or per shared group
        probabilities = B * num_attention_heads * (C * N + C * C)  # cross-attention and concept self-attention
        per_layer = (0 if fused_attention else probabilities) + B * C * (14 * H + 4 * I)
        per_layer += token_side if token_kv_sharing == "none" else 0
        layer_input, decoder = B * C * H, num_decoder_layers * masked * (12 * H + 4 * I)
        if token_refinement:
            per_layer += B * N * (12 * H + 4 * I) + (0 if fused_attention else B * num_attention_heads * N * C)
            layer_input += B * N * H
        shared = 0 if token_kv_sharing == "none" else groups * token_side
    layers = (num_hidden_layers * layer_input + per_layer) if gradient_checkpointing else num_hidden_layers * per_layer
    layers += shared
    mixers = 0 if model_type == "bert" else local_mixer_count(local_mixer, local_mixer_placement, num_hidden_layers)
    mixer = mixers * 3 * B * N * H
    elements = 4 * B * N * H + mixer + layers + decoder
    return int(elements * bytes_per_element + loss_bytes(masked, H, V, bytes_per_element))


def loss_bytes(rows: int, hidden_size: int, vocab_size: int, bytes_per_element: int) -> int:
    """Peak bytes of `linear_cross_entropy` on `rows` rows: its kept gradients plus one working chunk."""
    chunk = min(rows * vocab_size, VOCAB_CHUNK_ELEMENTS)
    chunk_bytes = chunk * bytes_per_element + (0 if bytes_per_element >= 4 else 4 * chunk)
    return rows * hidden_size * bytes_per_element + 4 * (vocab_size * hidden_size + vocab_size) + chunk_bytes


@dataclass
class MemoryEstimate:
    gpu_model_states: int
    cpu_model_states: int  # DeepSpeed's estimator, per machine
    activations: int
    workspace: int  # CUDA context (`CUDA_CONTEXT_BYTES`) + allocator slack
    parameters: int = 0  # the model's parameter count the states were estimated for
    largest_layer: int = 0  # its largest layer's (what ZeRO-3 gathers at once)
    zero_buffers: int = 0  # gradient buckets, ZeRO-3's gathered parameters and fp32 gradient partition
    processes: int = 1  # per machine
    host_baseline: int = 0  # per process: `PROCESS_BASELINE_BYTES`
    host_fp32_model: int = 0  # per process: the fp32 model built before `prepare`
    host_device: int = 0  # per process, on a CPU run: what a GPU would hold (states, buffers, activations)
    host_offloaded: int = 0  # per machine: offloaded model states in host RAM (NVMe offload: its swap buffers)
    cuda_context: int = CUDA_CONTEXT_BYTES  # part of `workspace`

    @property
    def gpu_peak(self) -> int:
        return self.gpu_model_states + self.activations + self.workspace + self.zero_buffers

    @property
    def allocator_peak(self) -> int:
        """The caching allocator's share of `gpu_peak` (what `max_memory_reserved` measures, what a cap limits)."""
        return self.gpu_peak - self.cuda_context

    @property
    def host_per_process(self) -> int:
        return self.host_baseline + self.host_fp32_model + self.host_device

    @property
    def host_peak(self) -> int:
        """Host RAM per machine: every process's baseline, fp32 model and (CPU run) device side, plus the
        offloaded states. Summed: the fp32 model's tensors below glibc's mmap threshold stay in the heap after
        `prepare` moves or flattens them (measured on the CPU: the build's 4 bytes per parameter stayed resident)."""
        return self.processes * self.host_per_process + self.host_offloaded

    def as_gib(self) -> dict[str, float]:
        gib = {
            name: round(getattr(self, name) / GIB, 3)
            for name in ("gpu_model_states", "cpu_model_states", "activations", "workspace", "zero_buffers",
                         "cuda_context", "gpu_peak", "allocator_peak", "host_baseline", "host_fp32_model",
                         "host_device", "host_offloaded", "host_per_process", "host_peak")
        }  # fmt: skip
        return {
            **{f"{name}_gib": value for name, value in gib.items()},
            "parameters": self.parameters,
            "largest_layer": self.largest_layer,
            "processes": self.processes,
        }


def describe_host(estimate: MemoryEstimate) -> str:
    """`~25.6 GiB host RAM (1 process × (0.6 baseline + 3.7 fp32 model) + 21.3 offloaded states)`."""
    per_process = f"{estimate.host_baseline / GIB:.1f} baseline + {estimate.host_fp32_model / GIB:.1f} fp32 model"
    if estimate.host_device:
        per_process += f" + {estimate.host_device / GIB:.1f} device side"
    offloaded = f" + {estimate.host_offloaded / GIB:.1f} offloaded states" if estimate.host_offloaded else ""
    plural = "es" if estimate.processes != 1 else ""
    return (
        f"~{estimate.host_peak / GIB:.1f} GiB host RAM ({estimate.processes} process{plural} × ({per_process})"
        f"{offloaded})"
    )


def estimate_training_memory(
    model_config: dict,
    micro_batch: int,
    seq_len: int,
    zero_stage: int = 0,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    gpus_per_node: int = 1,
    nodes: int = 1,
    mixed_precision: str = "bf16",
    gradient_checkpointing: bool = False,
    mlm_probability: float = 0.15,
    fused_attention: bool = True,
    ds_config: dict | None = None,
    cpu_run: bool = False,
) -> MemoryEstimate:
    """Estimated per-GPU peak of a training step: model states + activations + a fixed workspace + the ZeRO
    buffers `ds_config` sets (`fused_attention=False`: the attention probabilities are kept, as the math kernel
    does, e.g. on CPU), and the host RAM per machine (`gpus_per_node` processes).

    The host holds, per process, `PROCESS_BASELINE_BYTES` and the fp32 model built before `prepare` (4 bytes per
    parameter; none on a GPU under ZeRO-3, whose `deepspeed.zero.Init` builds each module on the GPU), and per
    machine the offloaded states (DeepSpeed's estimator; its NVMe swap buffers under NVMe offload). A `cpu_run`
    adds what a GPU would hold: on the CPU it is host memory too."""
    counts = model_parameter_count(model_config)
    params, largest = counts["total"], counts["largest_layer"]
    cpu_states, gpu_states = model_state_bytes(
        zero_stage, params, largest, gpus_per_node, nodes, offload_optimizer, offload_params
    )
    sixteen_bit = mixed_precision in ("bf16", "fp16")
    activations = activation_bytes(
        micro_batch,
        seq_len,
        bytes_per_element=2 if sixteen_bit else 4,
        gradient_checkpointing=gradient_checkpointing,
        mlm_probability=mlm_probability,
        fused_attention=fused_attention,
        **model_config,
    )
    world = gpus_per_node * nodes
    buffers = zero_buffer_bytes(ds_config, model_config["hidden_size"], params, largest, world, sixteen_bit, cpu_run)
    offloaded = host_and_nvme_bytes(ds_config, cpu_states, params)[0] if offload_optimizer or offload_params else 0
    return MemoryEstimate(
        gpu_states, cpu_states, activations, CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK_BYTES, params, largest, buffers,
        processes=gpus_per_node, host_baseline=PROCESS_BASELINE_BYTES,
        host_fp32_model=0 if zero_stage == 3 and not cpu_run else 4 * params,
        host_device=gpu_states + buffers + activations if cpu_run else 0, host_offloaded=offloaded,
    )  # fmt: skip
