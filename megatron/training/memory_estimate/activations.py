"""Activations: what autograd saves for backward in a forward of one rank's model on the meta
device (per storage, sequence parallelism applied), per layer and per stage, and what recompute
re-creates."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Dict, List, Tuple

import torch

from megatron.training.memory_estimate.kernels import (
    AttentionPaths, BalancedRoutingMode, GpuKernelsMode, LargestTemporaryMode, build_meta_model,
    cuda_to_meta, fused_attention_kernels_on_meta, gpu_free_memory_on_meta,
    stochastic_rounding_on_meta)
from megatron.training.memory_estimate.layout import (
    Layout, moe_layers, per_rank_shapes, single_rank_args)

# ---------------------------------------------------------------------------------------------
# Activations: what autograd saves
# ---------------------------------------------------------------------------------------------

# Modules that run on the sequence slice [s/TP, b, h] under sequence parallelism: the norms
# around attention and MLP, the MoE router, the layers and the block (residual stream, recompute
# inputs). The column-parallel linears also save the slice (saves_sequence_shard).
_SEQUENCE_PARALLEL_MODULE = re.compile(
    r"(^|\.)(input_layernorm|pre_mlp_layernorm|pre_cross_attn_layernorm|final_layernorm|router"
    r"|decoder|layers\.\d+)$")


@dataclasses.dataclass
class SavedStorage:
    nbytes: int
    by_sequence_slice: bool = False   # saved by a module on the sequence slice
    by_full_sequence: bool = False    # saved by any other module (full sequence on each rank)

    def bytes_per_rank(self, tp: int, sequence_parallel: bool) -> int:
        if not sequence_parallel:
            return self.nbytes
        # Under SP the two savers hold different tensors: the slice and its gathered copy.
        return (self.nbytes if self.by_full_sequence else 0) + \
            (self.nbytes // tp if self.by_sequence_slice else 0)


def saves_sequence_shard(module: torch.nn.Module) -> bool:
    """Whether a module keeps only this rank's sequence slice for backward under sequence
    parallelism although it computes on the gathered sequence: a column-parallel linear
    all-gathers its input [s/TP, b, h] for the GEMM and saves the shard, gathering it again in
    backward (megatron-core's linear and the quantized one alike). Expert linears receive
    their tokens from the dispatcher, not by that gather."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return isinstance(module, ColumnParallelLinear) and not getattr(module, "is_expert", False)


class SavedTensorMeter:
    """Counts, once per storage, the tensors autograd saves for backward (parameters excluded),
    remembering which module saved them (for sequence parallelism)."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.saved: Dict[int, SavedStorage] = {}
        self._keep: List[torch.Tensor] = []   # referenced, so storage ids are never reused
        self._modules: List[str] = []
        self._handles = []
        self._shard_savers = {name for name, module in model.named_modules()
                              if saves_sequence_shard(module)}
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, _a, name=name: self._modules.append(name)))
            self._handles.append(module.register_forward_hook(self._leave))

    def _leave(self, _module, _args, _output) -> None:
        self._modules.pop()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in self.params:
            entry = self.saved.setdefault(storage._cdata, SavedStorage(storage.nbytes()))
            module = self._modules[-1] if self._modules else ""
            if _SEQUENCE_PARALLEL_MODULE.search(module) or module in self._shard_savers:
                entry.by_sequence_slice = True
            else:
                entry.by_full_sequence = True
            self._keep.append(tensor)
        return tensor

    @contextlib.contextmanager
    def recording(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield self

    def bytes(self, tp: int = 1, sequence_parallel: bool = False) -> int:
        return sum(s.bytes_per_rank(tp, sequence_parallel) for s in self.saved.values())

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@dataclasses.dataclass
class StageMeasurement:
    saved_bytes: int                 # one micro-batch, one rank (sequence parallelism applied)
    temporary_bytes: int = 0
    temporary: str = "none"
    # The quantized attention's path (meta device only: a CPU run takes its own).
    attention: AttentionPaths = dataclasses.field(default_factory=AttentionPaths)


def model_inputs(args, device):
    """tokens, position ids, attention mask (None unless --reset-attention-mask), loss mask."""
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.zeros(b, s, dtype=torch.long, device=device)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool, device=device) \
        if args.reset_attention_mask else None
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=device)
    return tokens, positions, mask, loss_mask


def run_forward(model, args, pre_process: bool, post_process: bool, device):
    """One micro-batch through a pipeline stage. Returns what backward starts from -- the loss
    of pretrain_gpt.py's loss_func on the last stage, else the stage's output -- and its grad."""
    tokens, positions, mask, loss_mask = model_inputs(args, device)
    if not pre_process:
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
        received = torch.zeros(args.seq_length, args.micro_batch_size, args.hidden_size,
                               dtype=dtype, device=device, requires_grad=True)
        model.set_input_tensor(received)
    if post_process:
        losses = model(tokens, positions, mask, labels=tokens, loss_mask=loss_mask)
        return torch.sum(losses.float().view(-1) * loss_mask.view(-1)), None
    output = model(tokens, positions, mask)
    return output, torch.ones_like(output)


@contextlib.contextmanager
def _own_moe_loss_tracker():
    """megatron-core logs MoE auxiliary losses in a process-wide dict sized by the first model
    that logs, and keeps the aux-loss backward scale in a class attribute created on the
    device of the first backward: each measured model gets its own, and the caller's come
    back after (a meta-device scale left behind would break the next real training run)."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker)

    tracker = get_moe_layer_wise_logging_tracker()
    kept = dict(tracker)
    kept_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    tracker.clear()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        yield
    finally:
        tracker.clear()
        tracker.update(kept)
        MoEAuxLossAutoScaler.main_loss_backward_scale = kept_scale


def measure_saved(model, args, pre_process: bool, post_process: bool, device, tp: int = 1,
                  sequence_parallel: bool = False, backward: bool = False,
                  routing: bool = False, gpu_free_bytes=None) -> StageMeasurement:
    """Saved bytes of one micro-batch through `model` (as one rank of a TP group with sequence
    parallelism when asked, see SavedStorage); with `backward` also the largest temporary of
    forward and backward. `gpu_free_bytes`: the GPU memory free for the quantized attention's
    chunks (gpu_free_memory_on_meta), on the meta device, where the quantized attention takes
    the path a GPU with triton takes under the run's --quant-kernels
    (fused_attention_kernels_on_meta).

    Works on the meta device and on real CPU models alike (the tests compare the two; a CPU
    run takes the chunked attention path unless it runs the kernels under Triton's
    interpreter).
    """
    meter = SavedTensorMeter(model)
    temporaries = LargestTemporaryMode()
    attention = AttentionPaths()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_own_moe_loss_tracker())
            stack.enter_context(GpuKernelsMode())
            if torch.device(device).type == "meta":
                stack.enter_context(cuda_to_meta())
                stack.enter_context(stochastic_rounding_on_meta())
                stack.enter_context(gpu_free_memory_on_meta(gpu_free_bytes))
                attention = stack.enter_context(
                    fused_attention_kernels_on_meta(args.quant_config.backend.kernels))
            if routing:
                stack.enter_context(BalancedRoutingMode())
            if backward:
                stack.enter_context(temporaries)
            with meter.recording():
                output, grad = run_forward(model, args, pre_process, post_process, device)
            saved = meter.bytes(tp, sequence_parallel)
            if not backward:
                return StageMeasurement(saved, attention=attention)
            kept = set(meter.saved) | meter.params
            output.backward(grad)
            size, what = temporaries.largest(kept)
            return StageMeasurement(saved, size, what, attention)
    finally:
        meter.close()


def fused_wgrad_transient(model: torch.nn.Module) -> Tuple[int, str]:
    """(bytes, what) of the largest weight-gradient transient of gradient-accumulation fusion:
    a linear that fuses (QuantizedLinearMixin.fuse_wgrad_accumulation) computes its weight
    gradient as an fp32 [N, K] product, adds it to the fp32 main gradient and hands autograd
    a placeholder of the weight's shape and dtype while the product is still referenced. The
    measurement cannot run that path (the model has no main gradients), so it is sized from
    the weights: 4 N K + N K x the weight's element size, at the largest linear."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    largest = (0, "none")
    for name, module in model.named_modules():
        if not (isinstance(module, (ColumnParallelLinear, RowParallelLinear))
                and getattr(module, "fuse_wgrad_accumulation", False)):
            continue
        weight = module.weight
        if weight is None:               # the output layer of tied embeddings
            weight = model.shared_embedding_or_output_weight()
        n, k = weight.shape
        dtype = str(weight.dtype).replace("torch.", "")
        size = n * k * (4 + weight.element_size())
        largest = max(largest, (size, f"fused wgrad of {name}: float32 [{n}, {k}] product + "
                                      f"{dtype} placeholder"))
    return largest


def with_fused_wgrad(measured: StageMeasurement, model: torch.nn.Module) -> StageMeasurement:
    """The measurement with the fused weight-gradient transient as its largest temporary when
    that is larger."""
    size, what = fused_wgrad_transient(model)
    if size <= measured.temporary_bytes:
        return measured
    return dataclasses.replace(measured, temporary_bytes=size, temporary=what)


def _period_and_prefix(args, kinds: List[bool], recompute: bool) -> Tuple[int, int]:
    """(p, a): from layer a on, the stage repeats every p layers. p is the unit of uniform full
    recompute, else 1; a >= 1 lies past a recomputed block and past the last change of layer
    kind (DeepSeek's dense first layer)."""
    full = recompute and args.recompute_granularity == "full"
    period = args.recompute_num_layers if full and args.recompute_method == "uniform" else 1
    prefix = period
    if full and args.recompute_method == "block":
        prefix = max(prefix, args.recompute_num_layers)
    last_change = max((i for i in range(1, len(kinds)) if kinds[i] != kinds[i - 1]), default=0)
    return period, max(prefix, math.ceil(last_change / period) * period)


def measure_activations(args, layout: Layout, stage: int, padded_vocab: int,
                        recompute: bool = True, temporary: bool = True, gpu_free_bytes=None):
    """(bytes per layer, bytes of the stage per micro-batch, StageMeasurement with the
    largest temporary) of one rank of `stage`.

    saved(n layers) is affine in n past a short prefix a: measured at a and a + p layers and
    extrapolated to the stage's layer count. `recompute=False` measures as without --recompute-*.
    `gpu_free_bytes` sizes the quantized attention's chunks as on a GPU with that much free
    memory (None: the fixed CPU chunks; saved bytes do not depend on it).
    """
    count = layout.layers_per_stage
    kinds = moe_layers(args)[stage * count:(stage + 1) * count]
    period, prefix = _period_and_prefix(args, kinds, recompute)
    pre, post = stage == 0, stage == layout.pp - 1
    changes = per_rank_shapes(args, layout, padded_vocab)
    if not recompute:
        changes.update(recompute_granularity=None, recompute_method=None,
                       recompute_num_layers=None)

    def measure(layers: int, backward: bool) -> StageMeasurement:
        layer_args = single_rank_args(args, num_layers=layers, **changes)
        if args.num_experts is not None:
            layer_args.moe_layer_freq = [int(k) for k in kinds[:layers]]
        if layer_args.recompute_method == "block":
            layer_args.recompute_num_layers = min(layer_args.recompute_num_layers, layers)
        model = build_meta_model(layer_args, pre_process=pre, post_process=post)
        measured = measure_saved(model, layer_args, pre, post, "meta", layout.tp,
                                 layout.sequence_parallel, backward=backward,
                                 routing=args.num_experts is not None,
                                 gpu_free_bytes=gpu_free_bytes)
        return with_fused_wgrad(measured, model) if backward else measured

    if prefix + period > count:            # a short stage: measure all of it
        whole = measure(count, backward=temporary)
        if count <= period:
            return whole.saved_bytes, whole.saved_bytes, whole
        rest = measure(count - period, backward=False)
        return (whole.saved_bytes - rest.saved_bytes) // period, whole.saved_bytes, whole
    small = measure(prefix, backward=False)
    large = measure(prefix + period, backward=temporary)   # holds every kind of layer
    unit = large.saved_bytes - small.saved_bytes
    total = small.saved_bytes + math.ceil((count - prefix) / period) * unit
    return unit // period, total, large


def recompute_bytes(args, layout: Layout, stage: int, padded_vocab: int,
                    per_layer: int) -> int:
    """What backward re-creates at once: one recompute unit of layers (full), or one layer's
    recomputed core attention (selective)."""
    if args.recompute_granularity is None:
        return 0
    plain, _, _ = measure_activations(args, layout, stage, padded_vocab, recompute=False,
                                      temporary=False)
    if args.recompute_granularity == "full":
        unit = args.recompute_num_layers if args.recompute_method == "uniform" else 1
        return plain * unit
    return max(0, plain - per_layer)
