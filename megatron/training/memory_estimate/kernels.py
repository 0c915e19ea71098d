"""Running megatron on the meta device as a GPU would: a single-rank process group, CUDA
placements kept on the meta device, the single-rank model built there, and the torch function /
dispatch modes of a measurement -- the GPU's fused attention and RMSNorm kernels, the fused
quantized-attention kernels, the largest temporary, and a balanced MoE routing (see the package
docstring)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# ---------------------------------------------------------------------------------------------
# The meta device
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def single_rank_process_group():
    """A world-size-1 gloo group with TP=PP=EP=1 (an existing one is reused), torn down after."""
    from megatron.core import parallel_state

    from megatron.training.initialize import destroy_distributed, initialize_distributed

    if parallel_state.model_parallel_is_initialized():
        sizes = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_pipeline_model_parallel_world_size(),
                 parallel_state.get_expert_model_parallel_world_size())
        if sizes != (1, 1, 1):
            raise RuntimeError(f"the memory estimate builds single-rank models; this process "
                               f"already has (TP, PP, EP) = {sizes}")
        _seed_rng_tracker()
        yield
        return
    if torch.distributed.is_initialized():
        raise RuntimeError("torch.distributed is initialized without megatron's parallel "
                           "state; estimate before or after a run, not inside one")
    one = argparse.Namespace(rank=0, world_size=1, distributed_backend="gloo",
                             tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                             expert_model_parallel_size=1, distributed_timeout_minutes=10)
    initialize_distributed(one)
    _seed_rng_tracker()
    try:
        yield
    finally:
        destroy_distributed()


def _seed_rng_tracker(seed: int = 1234) -> None:
    """megatron's model-parallel RNG tracker needs its states for the attention dropout fork
    (the unfused attention path); a process that has none gets them."""
    from megatron.core import tensor_parallel

    if not tensor_parallel.get_cuda_rng_tracker().is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToMetaMode(TorchFunctionMode):
    """Literal CUDA placements ("cuda", device=0, .to("cuda"), .cuda()) stay on the meta
    device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "meta"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "meta", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_meta():
    """During a measurement every CUDA placement lands on the meta device.

    megatron-core places tensors on `torch.cuda.current_device()` (rotary embeddings move
    `inv_freq` there on every forward) and on literal "cuda" devices; on a CPU machine cpu_compat
    sends both to the CPU, where they would meet meta tensors, and on a GPU machine they would
    allocate. Restored on exit.
    """
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("meta")
    try:
        with _CudaToMetaMode():
            yield
    finally:
        torch.cuda.current_device = current_device


@contextlib.contextmanager
def stochastic_rounding_on_meta():
    """Stochastic rounding on the meta device, with the memory it takes on a GPU.

    A stochastically rounded operand (megatron.quantization.gemm.quantize_operand with a seed)
    draws one uniform float32 number per element from a torch.Generator on the operand's
    device (randomness.generator, formats' uniform_noise); the meta device has no generator.
    During a measurement a meta operand gets a CPU generator and, for its noise, a float32 meta
    tensor of its own shape: the temporary a GPU allocates for the draws, without values (the
    rounding that reads them has none either). Restored on exit.
    """
    from megatron.quantization import formats, randomness

    make_generator, draw = randomness.generator, formats.uniform_noise

    def generator(seed: int, device) -> torch.Generator:
        if torch.device(device).type == "meta":
            return torch.Generator().manual_seed(int(seed))
        return make_generator(seed, device)

    def uniform_noise(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if x.is_meta:
            return torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return draw(x, gen)

    randomness.generator, formats.uniform_noise = generator, uniform_noise
    try:
        yield
    finally:
        randomness.generator, formats.uniform_noise = make_generator, draw


@contextlib.contextmanager
def gpu_free_memory_on_meta(free_bytes: Optional[int]):
    """The GPU's free memory as the quantized attention sees it during a measurement.

    The chunked attention sizes its chunks from the free memory of the device it runs on
    (megatron.quantization.attention.free_device_bytes: a share of it on a GPU, a fixed
    CHUNK_BYTES where there is no such figure); meta tensors answer `free_bytes`, so the
    measured chunks and their temporaries are the GPU's. None keeps the fixed chunks.
    Restored on exit.
    """
    from megatron.quantization import attention

    device_free = attention.free_device_bytes

    def free(device) -> Optional[int]:
        if free_bytes is not None and torch.device(device).type == "meta":
            return free_bytes
        return device_free(device)

    attention.free_device_bytes = free
    try:
        yield
    finally:
        attention.free_device_bytes = device_free


@dataclasses.dataclass
class AttentionPaths:
    """The path each quantized attention call of a measurement took: how many ran the fused
    Triton kernels, and why the others stayed on the chunked path (reason -> calls)."""

    fused: int = 0
    chunked: Dict[str, int] = dataclasses.field(default_factory=dict)


def _kernel_forward_on_meta(q, k_t, v, formats, softmax_scale, causal, sq,
                            skip_masked_tiles=True, debug=False):
    """kernels.attention.attention_forward's allocations on meta operands: the output and
    the two fp32 row statistics (plus any contiguous copy of an operand); no launch."""
    from megatron.quantization.kernels import attention as fused

    q, k_t, v = fused.operands(sq, q=q, k_t=k_t, v=v)
    groups, rows, _ = q.shape
    out = torch.empty(groups, rows, v.size(2), dtype=q.dtype, device=q.device)
    row_max = torch.empty(groups, rows, dtype=torch.float32, device=q.device)
    return fused.ForwardResult(out, row_max, torch.empty_like(row_max), {})


def _kernel_backward_on_meta(grad_out_dgrad, grad_out_wgrad, q, q_wgrad, k_t, k_t_dgrad,
                             v_dgrad, row_max, inv_row_sum, formats, softmax_scale, causal, sq,
                             skip_masked_tiles=True, debug=False):
    """kernels.attention.attention_backward's allocations on meta operands: delta (fp32 per
    row), dQ, dK^T and dV (plus any contiguous copy of an operand); no launch."""
    from megatron.quantization.kernels import attention as fused

    q, k_t, _, _, v_dgrad, _, _ = fused.operands(
        sq, q=q, k_t=k_t, q_wgrad=q_wgrad, k_t_dgrad=k_t_dgrad, v_dgrad=v_dgrad,
        grad_out_dgrad=grad_out_dgrad, grad_out_wgrad=grad_out_wgrad)
    delta = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return fused.BackwardResult(torch.empty_like(q), torch.empty_like(k_t),
                                torch.empty_like(v_dgrad), delta, {})


def _on_meta(stand_in, launcher):
    """`stand_in` for meta operands, the real `launcher` for any other."""

    def dispatch(first, *args, **kwargs):
        return (stand_in if first.is_meta else launcher)(first, *args, **kwargs)

    return dispatch


@contextlib.contextmanager
def fused_attention_kernels_on_meta(mode: str = "auto"):
    """The quantized attention's path as a GPU with triton takes it under --quant-kernels
    `mode` (the run's; the meta model itself quantizes eagerly); yields the AttentionPaths the
    calls took.

    The one rule decides (dispatch.attention_path), asked about meta operands as about CUDA
    ones, so it picks the fused Triton kernels wherever they cover the call on a GPU and the
    chunked path elsewhere. The kernels' autograd function then runs as it is -- its operand
    quantizations, what it saves (q, k_t, v and two fp32 [G, R] row statistics) -- and only
    the two kernel launches are replaced by the allocations they make. Without triton here
    nothing can be decided: every call stays chunked, and the reason says so. Restored on
    exit.
    """
    from megatron.quantization import dispatch
    from megatron.quantization.kernels import triton_available

    paths = AttentionPaths()
    decide = dispatch.attention_path

    def attention_path(call, model_mode):
        if call.device.type != "meta":
            return decide(call, model_mode)
        path = decide(dataclasses.replace(call, device=torch.device("cuda")), mode)
        if path.name == "triton":
            paths.fused += 1
        elif path.name == "chunked":
            paths.chunked[path.reason] = paths.chunked.get(path.reason, 0) + 1
        return path

    patches = [(dispatch, "attention_path", attention_path)]
    if triton_available():
        from megatron.quantization.kernels import attention as fused
        patches += [(fused, "attention_forward",
                     _on_meta(_kernel_forward_on_meta, fused.attention_forward)),
                    (fused, "attention_backward",
                     _on_meta(_kernel_backward_on_meta, fused.attention_backward))]
    kept = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield paths
    finally:
        for owner, name, value in kept:
            setattr(owner, name, value)


def build_meta_model(args, pre_process: bool = True, post_process: bool = True,
                     expert_parallel: int = 1):
    """GPTModel of single-rank `args` on the meta device, quantized as `args` says.

    Weights take megatron's CPU-initialisation path, which costs nothing on the meta device and
    sets the tensor-parallel attributes the parameter count reads. `expert_parallel` > 1 only
    marks expert parameters (allreduce=False) as expert parallelism does; every expert is built.
    """
    from megatron.training.model import build_gpt_model, core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    config.use_cpu_initialization = True
    config.perform_initialization = True   # a no-op on meta that sets tensor_model_parallel
    config.expert_model_parallel_size = expert_parallel
    # Operands on the meta device are quantized eagerly whatever --quant-kernels says (no
    # kernel runs there); the attention's path is decided with the run's mode all the same
    # (fused_attention_kernels_on_meta).
    quant = args.quant_config
    quant = quant.replace(backend=quant.backend.replace(kernels="eager"))
    with cuda_to_meta(), torch.device("meta"):
        return build_gpt_model(args, config, quant,
                               pre_process=pre_process, post_process=post_process)


# ---------------------------------------------------------------------------------------------
# GPU kernels and the modes of a measurement
# ---------------------------------------------------------------------------------------------


class _FusedRMSNorm(torch.autograd.Function):
    """aten._fused_rms_norm (what torch.nn.RMSNorm runs on a GPU) as autograd sees it there:
    its derivative formula keeps the input, the weight and rstd (fp32, one per row)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        dims = tuple(range(-len(normalized_shape), 0))
        eps = torch.finfo(torch.float32).eps if eps is None else eps
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(dims, keepdim=True) + eps)
        out = x32 * rstd
        if weight is not None:
            out = out * weight
        ctx.save_for_backward(x, weight, rstd)
        ctx.dims = dims
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x_hat, grad32 = x.float() * rstd, grad.float()
        grad_x_hat = grad32 * weight if weight is not None else grad32
        width = math.prod(x.shape[d] for d in ctx.dims)
        grad_x = (grad_x_hat - x_hat * (grad_x_hat * x_hat).sum(ctx.dims, keepdim=True) / width) \
            * rstd
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[2]:
            rows = tuple(range(x.dim() - len(ctx.dims)))
            grad_weight = (grad32 * x_hat).sum(rows).to(weight.dtype)
        return grad_x.to(x.dtype), None, grad_weight, None


_SDPA_OPTIONS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _gpu_expands_groups(q, k, v, mask) -> bool:
    """Whether the fused attention path gives grouped-query attention one K/V head per query
    head before SDPA on a GPU (megatron.quantization.attention.sdpa_needs_expanded_kv: where
    FlashAttention cannot run -- fp32, an explicit mask, large or unequal head dims -- the
    memory-efficient kernel runs instead, and it needs the heads expanded). The expanded K and
    V are what that kernel saves for backward."""
    from megatron.quantization.attention import sdpa_needs_expanded_kv

    return sdpa_needs_expanded_kv("cuda", q.dtype, mask is not None, k.size(1) != q.size(1),
                                  q.size(-1), v.size(-1))


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, s, d] -> [b, heads, s, d], each group's K/V repeated for its query heads."""
    return t.repeat_interleave(heads // t.size(1), dim=1)


def _additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean SDPA mask (True = attend) as the additive bias of `dtype` (0 / -inf) that a
    GPU's SDPA converts it to for the kernels that take a mask, and that they keep."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf"))


def _fused_attention(q, k, v, mask, dropout_p, is_causal, scale):
    """Attention through an aten fused-attention operator, which saves for backward what the
    GPU's kernel saves: flash attention for one head size (the CPU operator has the CUDA one's
    autograd formula, less 24 bytes of RNG state), the memory-efficient kernel on the meta
    device for another value head size (MLA). A mask goes in as the additive bias a GPU makes
    of a boolean one; grouped-query attention with a mask or in fp32 saves K and V expanded to
    every query head (_gpu_expands_groups). None: no such operator here (a CPU run with MLA
    keeps PyTorch's math path)."""
    if _gpu_expands_groups(q, k, v, mask):
        k, v = _expand_groups(k, q.size(1)), _expand_groups(v, q.size(1))
    if mask is not None and mask.dtype == torch.bool:
        mask = _additive_bias(mask, q.dtype)
    if v.size(-1) == q.size(-1):
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale)
        return out
    if q.is_meta and k.size(1) == q.size(1):
        # FlashAttention needs one head size for q, k and v; with another value head size
        # (MLA) the GPU runs the memory-efficient kernel.
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, dropout_p, is_causal, scale=scale)[0]
    return None


class GpuKernelsMode(TorchFunctionMode):
    """scaled_dot_product_attention and rms_norm as a GPU runs them (see the module docstring):
    aten's fused attention operators and the fused RMSNorm."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, *rest = args
            options = dict(zip(_SDPA_OPTIONS, rest), **kwargs)
            out = _fused_attention(q, k, v, options.get("attn_mask"),
                                   options.get("dropout_p", 0.0), options.get("is_causal", False),
                                   options.get("scale"))
            if out is not None:
                return out
        if func is F.rms_norm:
            x, shape, *rest = args
            options = dict(zip(("weight", "eps"), rest), **kwargs)
            weight = options.get("weight")
            if weight is None or weight.dtype == x.dtype:    # else torch stays composite
                return _FusedRMSNorm.apply(x, tuple(shape), weight, options.get("eps"))
        return func(*args, **kwargs)


class LargestTemporaryMode(TorchDispatchMode):
    """Records every op output that is a new storage; `largest(kept)` is the biggest of them
    not in `kept` (the storages saved for backward, the parameters)."""

    def __init__(self):
        super().__init__()
        self.outputs: Dict[int, Tuple[int, str]] = {}
        # The storages themselves, so their ids are never reused: a tensor may move to
        # another storage (set_, as Triton's interpreter does), freeing the one recorded.
        self._keep: List[torch.UntypedStorage] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key not in inputs and key not in self.outputs:
                    dtype = str(t.dtype).replace("torch.", "")
                    self.outputs[key] = (t.untyped_storage().nbytes(),
                                         f"{func} -> {list(t.shape)} {dtype}")
                    self._keep.append(t.untyped_storage())
        return out

    def largest(self, kept: Iterable[int]) -> Tuple[int, str]:
        kept = set(kept)
        return max((v for k, v in self.outputs.items() if k not in kept), default=(0, "none"))


class BalancedRoutingMode(TorchDispatchMode):
    """Gives the meta tensors of MoE routing the values of a balanced routing.

    top-k indices get the values token t -> experts t*k + j (mod E). Every op whose meta inputs
    all have values (or that reads only their shapes, like zeros_like) gets a recipe for its
    values; a recipe is computed on the CPU only when an op reads values -- a copy off the meta
    device (megatron's `tokens_per_expert.cpu()`), .item(), nonzero, masked_select -- so only
    the small routing tensors are ever computed. A read of values without a recipe fails naming
    the op.
    """

    _SHAPE_ONLY = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros",
                   "new_ones", "new_empty", "new_full"}

    def __init__(self):
        super().__init__()
        self._recipes: Dict[int, Tuple[torch.Tensor, object]] = {}   # id -> (tensor, thunk)

    def value(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The CPU value of a meta tensor (computed now), the tensor itself if it is not meta,
        None if it has no recipe."""
        if not t.is_meta:
            return t
        entry = self._recipes.get(id(t))
        return entry[1]() if entry is not None and entry[0] is t else None

    def _known(self, t: torch.Tensor) -> bool:
        entry = self._recipes.get(id(t))
        return not t.is_meta or (entry is not None and entry[0] is t)

    def _remember(self, outputs: List[torch.Tensor], compute) -> None:
        """Recipes for `outputs`: `compute()` returns all their values, computed once."""
        cache: List[List[torch.Tensor]] = []

        def values() -> List[torch.Tensor]:
            if not cache:
                cache.append(compute())
            return cache[0]

        for i, t in enumerate(outputs):
            self._recipes[id(t)] = (t, lambda i=i: values()[i])

    def _on_values(self, func, args, kwargs):
        def to_value(x):
            if isinstance(x, torch.Tensor):
                return self.value(x)
            return torch.device("cpu") if isinstance(x, torch.device) and x.type == "meta" else x

        return func(*tree_map(to_value, args), **tree_map(to_value, kwargs))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta = [t for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor) and t.is_meta]
        if not meta:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        known = all(self._known(t) for t in meta)
        if name == "masked_select":
            return self._masked_select(*args)
        if _reads_values(name, args, kwargs):
            if not known:
                raise NotImplementedError(
                    f"memory estimate: {func} reads tensor values, which the meta device does "
                    "not have (only MoE routing tensors are given values)")
            result = self._on_values(func, args, kwargs)
            if name == "nonzero":
                # A meta result of the value's shape keeps the graph on the meta device.
                out = torch.empty(result.shape, dtype=result.dtype, device="meta")
                self._remember([out], lambda: [result])
                return out
            return result
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_meta]
        if name == "topk":
            self._remember([outputs[1]], lambda: [_balanced_topk(outputs[1].shape,
                                                                 meta[0].shape[-1])])
        elif name in self._SHAPE_ONLY:
            self._remember(outputs, lambda: [torch.zeros(t.shape, dtype=t.dtype)
                                             for t in outputs])
        elif name.endswith("_"):
            # In place (zeros_like is empty_like + zero_): a new recipe for the target, applying
            # the op to a copy of its previous value, or none when an input has none.
            target = args[0]
            if known and self._known(target):
                self._remember([target], self._in_place_recipe(func, args, kwargs))
            else:
                self._recipes.pop(id(target), None)
        elif known and outputs:
            self._remember(outputs, lambda: [t for t in tree_flatten(
                self._on_values(func, args, kwargs))[0] if isinstance(t, torch.Tensor)])
        return out

    def _in_place_recipe(self, func, args, kwargs):
        target, rest = args[0], args[1:]
        before = self._recipes[id(target)][1]

        def compute() -> List[torch.Tensor]:
            value = before().clone()
            self._on_values(func, (value, *rest), kwargs)
            return [value]

        return compute

    def _masked_select(self, source: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The output's size comes from the mask's values; the source needs none."""
        mask_value = self.value(mask)
        if mask_value is None:
            raise NotImplementedError("memory estimate: masked_select with a mask that has no "
                                      "values on the meta device")
        shape = torch.broadcast_shapes(source.shape, mask.shape)
        out = torch.empty(int(mask_value.expand(shape).sum()), dtype=source.dtype,
                          device="meta")
        if self._known(source):
            self._remember([out], lambda: [self.value(source).masked_select(mask_value)])
        return out


def _reads_values(name: str, args, kwargs) -> bool:
    """Whether an op on meta tensors reads their values: .item(), nonzero, or a copy off the
    meta device (megatron's `tokens_per_expert.cpu()`)."""
    if name in ("_local_scalar_dense", "nonzero"):
        return True
    if name == "_to_copy":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type != "meta"
    if name == "copy_":
        return not args[0].is_meta
    return False


def _balanced_topk(shape, num_experts: int) -> torch.Tensor:
    """Top-k indices [tokens, k]: token t -> experts t*k .. t*k+k-1 (mod E), all distinct."""
    tokens, k = shape
    return (torch.arange(tokens)[:, None] * k + torch.arange(k)[None, :]) % num_experts
