"""The per-GPU memory estimate (megatron/training/memory_estimate/) against memory measured on
the CPU: activations against real forwards (one process, and two TP ranks with sequence
parallelism), parameters / gradients / optimizer state and the cached quantized weight copies
against a real training step, parameter accounting against the published totals; the GPU's
attention kernels (the fused quantized-attention kernels against a real CPU run of them under
Triton's interpreter) and fused weight gradient; the launchers' layouts; errors;
train_config.py."""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
import train_config
from megatron.training import experiments as ex
from megatron.training import memory_estimate as me
from megatron.training.arguments import parse_args, validate_args
from megatron.training.initialize import (
    destroy_distributed, initialize_distributed, set_random_seeds)
from megatron.training.model import build_gpt_model, core_transformer_config_from_args
from megatron.training.presets import PUBLISHED_PARAMETER_COUNTS
from megatron.training.training import setup_model_and_optimizer, train_step

from conftest import REPO_ROOT, child_env
from test_distributed import _free_port

# llama-tiny's features (GQA, RoPE, SwiGLU, RMSNorm, tied embeddings) at test size.
TINY = ["--model-preset", "llama-tiny", "--seq-length", "128", "--micro-batch-size", "2",
        "--vocab-size", "512", "--bf16"]
MXFP8_PV = ["--quant-scheme", "FA_linear_mxfp8", "--attn-pv-quant", "mxfp8"]
# MX QK^T with NVFP4 P: the fused attention kernels quantize P in MX formats only.
NVFP4_PV = ["--quant-scheme", "FA_linear_mxfp8", "--attn-pv-quant", "nvfp4"]
# The chunked attention path, as a real CPU forward takes it: estimated as a GPU without
# triton (or under --quant-kernels eager) runs it.
CHUNKED = ["--quant-kernels", "eager"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128",
       "--moe-layer-freq", "[0,1,1]"]


def real_saved_bytes(args, num_layers: int) -> int:
    """Bytes autograd saves in a forward of the real CPU model of `args` with `num_layers`."""
    one = me.single_rank_args(args, num_layers=num_layers,
                              padded_vocab_size=me.padded_vocab_size(args))
    if args.num_experts is not None:
        one.moe_layer_freq = list(args.moe_layer_freq)[:num_layers]
    model = build_gpt_model(one, core_transformer_config_from_args(one), one.quant_config)
    return me.measure_saved(model, one, True, True, "cpu").saved_bytes


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [
    [], MXFP8_PV + CHUNKED, NVFP4_PV, MXFP8_PV + ["--reset-attention-mask"], MOE,
], ids=["bf16", "FA_linear_mxfp8-pv-chunked", "nvfp4-pv", "FA_linear_mxfp8-pv-mask", "moe"])
def test_activations_equal_a_real_cpu_forward(world_size_one, extra):
    """The meta-device measurement (2 layers, extrapolated) equals the bytes saved by a real
    forward of the whole model; MoE: balanced routing saves what real routing saves. The
    quantized attention takes the chunked path of the CPU run: under --quant-kernels eager,
    or where the fused kernels do not cover it (NVFP4 P, an explicit mask), also under the
    default."""
    args = me.parse_estimate_args(TINY + ["--num-layers", "3"] + extra)
    est = me.estimate_memory(args)
    three, two = real_saved_bytes(args, 3), real_saved_bytes(args, 2)
    assert est.activation_bytes_per_micro_batch == three
    assert est.activation_bytes_per_layer == three - two
    quantized_attention = "--attn-pv-quant" in extra
    assert any("quantized attention: the chunked path" in n for n in est.notes) == \
        quantized_attention


@pytest.mark.parametrize("extra", [
    ["--quant-recipe", "nvfp4"],
    ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
    ["--quant-scheme", "FA_linear_mxfp6_e2m3", "--quant-stochastic-rounding", "all",
     "--quant-rht", "32"],
], ids=["nvfp4-recipe", "fp8-delayed", "mxfp6-sr-rht"])
def test_recipes_activations_equal_a_real_cpu_forward(world_size_one, extra):
    """The new formats and settings save what a real forward saves (the quantized GEMMs keep
    their high-precision operands; stochastic rounding works on the meta device), and the
    report names the temporaries they add."""
    args = me.parse_estimate_args(TINY + ["--num-layers", "3"] + extra)
    est = me.estimate_memory(args)
    assert est.activation_bytes_per_micro_batch == real_saved_bytes(args, 3)
    # (The attention's note may name these too, as reasons for the chunked path.)
    notes = " ".join(est.notes)
    assert ("stochastic rounding: each rounded operand" in notes) == ("--fp8-format" not in extra)
    assert ("Hadamard transform: MX and NVFP4 operands" in notes) == ("--fp8-format" not in extra)
    assert ("FP8 delayed scaling:" in notes) == ("--fp8-format" in extra)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp6_e3m2", "fp8_e4m3"])
def test_quantization_temporaries_on_meta_equal_the_real_ones(fmt):
    """A quantized linear with stochastic rounding (a float32 noise tensor per rounded
    operand) and the Hadamard transform on wgrad (float32 rotated copies, the 100 tokens
    zero-padded to 128): the meta device creates the same temporaries as a CPU run."""
    from megatron.quantization.config import (
        Fp8Settings, MatmulQuantConfig, OperandFormats, RhtSettings)
    from megatron.quantization.gemm import SiteState, quantized_linear
    from megatron.training.memory_estimate.kernels import (
        LargestTemporaryMode, stochastic_rounding_on_meta)

    config = MatmulQuantConfig(
        fprop=OperandFormats(fmt, fmt), dgrad=OperandFormats(fmt, fmt),
        wgrad=OperandFormats(fmt, fmt), stochastic=frozenset({"fprop.a", "dgrad.a", "wgrad.b"}),
        rht=RhtSettings(("wgrad",), 32), weight_2d=True, fp8=Fp8Settings(recipe="tensorwise"))

    def temporaries(device):
        x = torch.randn(100, 256, dtype=torch.bfloat16, device=device, requires_grad=True)
        w = torch.randn(384, 256, dtype=torch.bfloat16, device=device, requires_grad=True)
        mode = LargestTemporaryMode()
        with stochastic_rounding_on_meta(), mode:
            y = quantized_linear(x, w, None, config, state=SiteState("site", config))
            y.backward(torch.ones_like(y))
        return sorted(size for size, _ in mode.outputs.values())

    # (the second call of each: the Hadamard matrix is built once per device and cached)
    cpu, meta = [[temporaries(device) for _ in range(2)][1] for device in ("cpu", "meta")]
    assert meta == cpu
    assert 100 * 256 * 4 in meta                  # the noise of the rounded input
    assert 128 * 384 * 4 in meta                  # wgrad's rotated, padded dY in float32


@pytest.mark.parametrize("layers,recompute", [
    (5, ["--recompute-activations"]),
    # megatron-core's uniform method needs the layer count to be a multiple of the unit.
    (6, ["--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "2"]),
    (5, ["--recompute-granularity", "full", "--recompute-method", "block",
         "--recompute-num-layers", "2"]),
], ids=["selective", "uniform-2", "block-2"])
@pytest.mark.filterwarnings("ignore:If you are using transformer_engine")
def test_recompute_activations_equal_a_real_cpu_forward(world_size_one, layers, recompute):
    args = me.parse_estimate_args(TINY + MXFP8_PV + CHUNKED + ["--num-layers", str(layers)]
                                  + recompute)
    est = me.estimate_memory(args)
    assert est.activation_bytes_per_micro_batch == real_saved_bytes(args, layers)
    if "full" in recompute:       # backward re-creates whole layers
        assert est.recompute_bytes >= est.activation_bytes_per_layer > 0


@pytest.mark.parametrize("kernels", ["triton", "compile"])
def test_every_kernel_mode_is_estimated_as_eager_operands_and_the_gpu_attention_path(
        world_size_one, kernels):
    """On the meta device operands are quantized eagerly whatever --quant-kernels says (no
    kernel runs there, and none raises or compiles); the attention still takes the path the
    run's mode takes on a GPU: the fused kernels under triton (as under auto), the chunked
    path under compile (as under eager), with the same bytes."""
    def estimate(mode):
        args = me.parse_estimate_args(TINY + MXFP8_PV + ["--quant-kernels", mode])
        return me.estimate_memory(args)

    est, like = estimate(kernels), estimate("auto" if kernels == "triton" else "eager")
    assert est.activation_bytes_per_micro_batch == like.activation_bytes_per_micro_batch > 0
    assert [n for n in est.notes if "quantized attention" in n] == \
        [n.replace("--quant-kernels eager", f"--quant-kernels {kernels}") if kernels == "compile"
         else n for n in like.notes if "quantized attention" in n]


@pytest.mark.parametrize("kernels", ["eager", "auto"], ids=["chunked", "fused-kernels"])
def test_quantized_attention_is_linear_in_the_sequence(world_size_one, kernels):
    def per_layer(seq, impl):
        args = me.parse_estimate_args(TINY + MXFP8_PV + [
            "--seq-length", str(seq), "--micro-batch-size", "1", "--quant-attention-impl", impl,
            "--quant-kernels", kernels])
        layout = me.Layout.from_args(args)
        return me.measure_activations(args, layout, 0, me.padded_vocab_size(args),
                                      temporary=False)[0]

    linear = [per_layer(s, "auto") for s in (256, 512, 1024)]
    assert linear[1] == 2 * linear[0] and linear[2] == 2 * linear[1]
    unfused = [per_layer(s, "unfused") for s in (256, 1024)]   # full [b, heads, s, s] scores
    assert unfused[1] > 5 * unfused[0]


_TP_WORKER = """
import os, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {repo!r})
from megatron.training import memory_estimate as me
from megatron.training.arguments import parse_args, validate_args
from megatron.training.initialize import (
    destroy_distributed, initialize_distributed, set_random_seeds)
from megatron.training.model import build_gpt_model, core_transformer_config_from_args

args = validate_args(parse_args(sys.argv[1:] + ["--mock-data", "--train-iters", "1", "--lr", "1"]),
                     check_paths=False)
initialize_distributed(args)
set_random_seeds(args.seed)
args.padded_vocab_size = me.padded_vocab_size(args)
model = build_gpt_model(args, core_transformer_config_from_args(args), args.quant_config)
saved = me.measure_saved(model, args, True, True, "cpu").saved_bytes
# One file per rank: two ranks printing to one pipe can interleave their lines.
with open(os.path.join({out!r}, f"saved-{{args.rank}}"), "w") as f:
    f.write(str(saved))
destroy_distributed()
"""


def test_tensor_and_sequence_parallel_ranks_save_what_is_estimated(tmp_path):
    """Two real TP ranks with sequence parallelism against the single-rank measurement with
    per-rank shapes and the SP model. At TP > 1 the vocabulary-parallel embedding also keeps
    its [b, s] boolean mask of out-of-range tokens, which one rank never creates."""
    flags = TINY + MXFP8_PV + CHUNKED + ["--num-layers", "3", "--tensor-model-parallel-size",
                                         "2", "--sequence-parallel"]
    worker = tmp_path / "worker.py"
    worker.write_text(_TP_WORKER.format(repo=REPO_ROOT, out=str(tmp_path)))
    env = child_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_free_port()), str(worker), *flags],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = {rank: int((tmp_path / f"saved-{rank}").read_text()) for rank in (0, 1)}
    assert sorted(saved) == [0, 1] and saved[0] == saved[1]
    est = me.estimate_memory(me.parse_estimate_args(flags + ["--world-size", "2"]))
    embedding_mask = 2 * 128
    assert saved[0] - est.activation_bytes_per_micro_batch == embedding_mask
    # Without sequence parallelism the same model keeps more.
    no_sp = me.estimate_memory(me.parse_estimate_args(
        [f for f in flags if f != "--sequence-parallel"] + ["--world-size", "2"]))
    assert no_sp.activation_bytes_per_micro_batch > est.activation_bytes_per_micro_batch


# ---------------------------------------------------------------------------------------------
# Parameters, gradients, optimizer state
# ---------------------------------------------------------------------------------------------


def _batches(args):
    b, s = args.micro_batch_size, args.seq_length
    while True:
        tokens = torch.randint(0, 500, (b, s + 1))
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(b, s),
               "position_ids": torch.arange(s).expand(b, s)}


@contextlib.contextmanager
def _after_one_training_step(flags, monkeypatch):
    """(DDP model, raw model, optimizer) after a real one-step CPU run of `flags` (weight
    cache as the run sets it: from the model's quantization config, dropped after the run's
    optimizer steps)."""
    from megatron.quantization.runtime import runtime_of

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    args = validate_args(parse_args(flags + ["--mock-data", "--train-iters", "1", "--lr", "1e-3"]),
                         check_paths=False)
    initialize_distributed(args)
    try:
        set_random_seeds(args.seed)
        args.padded_vocab_size = me.padded_vocab_size(args)
        ddp_model, raw_model, optimizer, scheduler, _ = setup_model_and_optimizer(args)
        runtime = runtime_of(raw_model)
        runtime.watch_optimizer(optimizer)
        try:
            train_step(pretrain_gpt.forward_step, _batches(args), ddp_model, optimizer,
                       scheduler, args)
            yield ddp_model, raw_model, optimizer
        finally:
            runtime.close()
    finally:
        destroy_distributed()


def _allocated_by_one_training_step(flags, monkeypatch):
    """(parameter, DDP grad-buffer, optimizer-state bytes) of a real one-step CPU run."""
    with _after_one_training_step(flags, monkeypatch) as (ddp_model, raw_model, optimizer):
        params = {id(p): p for p in raw_model.parameters()}.values()
        param_storages = {p.untyped_storage()._cdata for p in params}
        grad_buffers = list(ddp_model.buffers) + list(ddp_model.expert_parallel_buffers)
        state = 0
        for inner in (o.optimizer for o in optimizer.chained_optimizers):
            # fp32 master weights: the optimizer's own parameters (not the model's storage).
            masters = {id(p): p for group in inner.param_groups for p in group["params"]
                       if p.untyped_storage()._cdata not in param_storages}
            state += sum(p.nbytes for p in masters.values())
            state += sum(v.nbytes for s in inner.state.values() for k, v in s.items()
                         if k in ("exp_avg", "exp_avg_sq"))
        return (sum(p.nbytes for p in params),
                sum(b.grad_data.nbytes for b in grad_buffers), state)


@pytest.mark.parametrize("extra", [
    ["--bf16"],
    ["--bf16", "--use-distributed-optimizer", "--grad-reduce-in-bf16"],
    [],
], ids=["bf16", "bf16-distopt-bf16grads", "fp32"])
def test_parameters_gradients_optimizer_equal_a_real_training_step(monkeypatch, extra):
    """Every size of llama-tiny is a multiple of 128, so megatron's buffers carry no padding."""
    flags = [f for f in TINY if f != "--bf16"] + ["--num-layers", "2"] + extra
    params, grads, state = _allocated_by_one_training_step(flags, monkeypatch)
    est = me.estimate_memory(me.parse_estimate_args(flags))
    assert (est.parameter_bytes, est.gradient_bytes, est.optimizer_state_bytes) == \
        (params, grads, state)


def test_null_tokenizer_vocabulary_includes_its_end_of_document_token():
    """NullTokenizer's vocabulary is --vocab-size + 1 (the eod id is --vocab-size): 512 pads
    to 640 as a run pads it; another tokenizer's --vocab-size 512 stays 512."""
    null = me.parse_estimate_args(TINY + ["--tokenizer-type", "NullTokenizer"])
    assert me.padded_vocab_size(null) == 640
    assert me.padded_vocab_size(me.parse_estimate_args(TINY)) == 512


@pytest.mark.parametrize("name,flags,world,check", [
    ("llama31-8b", ["--pipeline-model-parallel-size", "2"], 2,
     lambda stages, published: sum(s.count for s in stages) == published),
    # Tied embeddings: the last stage keeps its own copy of the word embedding.
    ("llama32-1b", ["--pipeline-model-parallel-size", "2"], 2,
     lambda stages, published: sum(s.count for s in stages) == published + 128256 * 2048),
    # Norm weights (2 per layer + the final one) are replicated over tensor parallelism.
    ("llama31-8b", ["--tensor-model-parallel-size", "2"], 2,
     lambda stages, published: 2 * stages[0].count - 65 * 4096 == published),
    ("deepseek2-lite", ["--expert-model-parallel-size", "8"], 8,
     lambda stages, published: stages[0].dense + 8 * stages[0].expert == published),
], ids=["llama31-8b-pp2", "llama32-1b-pp2", "llama31-8b-tp2", "deepseek2-lite-ep8"])
def test_parameter_accounting_adds_up_to_the_published_totals(name, flags, world, check):
    vocab = "102400" if name == "deepseek2-lite" else "128256"
    args = me.parse_estimate_args(["--model-preset", name, "--micro-batch-size", "1",
                                   "--vocab-size", vocab, "--world-size", str(world), *flags])
    with me.single_rank_process_group():
        stages = me.parameters_per_stage(args, me.Layout.from_args(args),
                                         me.padded_vocab_size(args))
    assert check(stages, PUBLISHED_PARAMETER_COUNTS[name])


# ---------------------------------------------------------------------------------------------
# Quantized weight copies
# ---------------------------------------------------------------------------------------------


def _cached_copy_bytes(model) -> int:
    """Bytes of the tensors the model's GEMM sites keep in their weight caches that are not
    parameters (once per storage)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    copies = {}
    for site in model.quant_sites:
        for entry in site.state.weights.values():
            for item in entry:
                if isinstance(item, torch.Tensor) and \
                        item.untyped_storage()._cdata not in params:
                    copies[item.untyped_storage()._cdata] = item.untyped_storage().nbytes()
    return sum(copies.values())


WEIGHT_CACHE_CASES = {
    "FA_linear_mxfp8": ["--quant-scheme", "FA_linear_mxfp8"],
    "nvfp4-recipe": ["--quant-recipe", "nvfp4"],
    "rht-on-weights": ["--quant-scheme", "linear_mxfp4", "--quant-rht", "32",
                       "--quant-rht-gemms", "fprop", "dgrad"],
    # Weights drawn anew (stochastic) or scaled from a history (delayed) are not kept.
    "stochastic-weights": ["--quant-scheme", "linear_mxfp8", "--quant-stochastic-rounding", "all"],
    "fp8-delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
    "no-cache": ["--quant-scheme", "FA_linear_mxfp8", "--no-quant-weight-cache"],
}


@pytest.mark.parametrize("case", WEIGHT_CACHE_CASES)
def test_quantized_weight_copies_equal_a_real_training_step(monkeypatch, case):
    """What the GEMM sites of a real run still hold after its optimizer step (the copies are
    replaced at the next forward, never freed) against the estimate."""
    flags = TINY + ["--num-layers", "2"] + WEIGHT_CACHE_CASES[case]
    with _after_one_training_step(flags, monkeypatch) as (_, model, _):
        real = _cached_copy_bytes(model)
    est = me.estimate_memory(me.parse_estimate_args(flags))
    assert est.weight_cache_bytes == real
    assert (real == 0) == (case in ("stochastic-weights", "fp8-delayed", "no-cache"))


def test_quantized_weight_copies_are_two_per_quantized_weight_shard():
    """llama-tiny under FA_linear_mxfp8 (hidden 256, 8 heads in 2 groups of head dim 32, gated
    FFN 768; the output layer stays bf16): two bf16 copies of each layer's qkv, proj, fc1 and
    fc2 weight; TP=2 keeps half of each; the total includes them."""
    hidden, kv, ffn = 256, 2 * 32, 768
    weights = hidden * (hidden + 2 * kv) + hidden * hidden + hidden * 2 * ffn + ffn * hidden
    flags = TINY + ["--num-layers", "2"] + ["--quant-scheme", "FA_linear_mxfp8"]
    est = me.estimate_memory(me.parse_estimate_args(flags))
    assert est.weight_cache_bytes == 2 * weights * 2 * 2        # layers x elements x bf16 x copies
    tp2 = me.estimate_memory(me.parse_estimate_args(
        flags + ["--tensor-model-parallel-size", "2", "--world-size", "2"]))
    assert tp2.weight_cache_bytes == est.weight_cache_bytes // 2
    dropped = me.estimate_memory(me.parse_estimate_args(flags + ["--no-quant-weight-cache"]))
    assert dropped.weight_cache_bytes == 0
    assert est.total_bytes - dropped.total_bytes == est.weight_cache_bytes
    assert "quantized weights" in me.format_estimate(est, me.parse_estimate_args(flags))


# ---------------------------------------------------------------------------------------------
# The GPU's fused weight gradient and attention kernels
# ---------------------------------------------------------------------------------------------


def test_largest_temporary_includes_the_fused_weight_gradient(monkeypatch):
    """Gradient-accumulation fusion (the default): llama-tiny's largest linear, fc1 [2 x 768,
    256], gets its weight gradient as an fp32 product beside a bf16 placeholder, 6 bytes per
    element, more than any other temporary at this size. A real CPU step creates that fp32
    product; without fusion the measured temporaries stay below it."""
    from megatron.training.memory_estimate.kernels import LargestTemporaryMode

    flags = TINY + ["--num-layers", "2"]
    fused = me.estimate_memory(me.parse_estimate_args(flags))
    assert fused.largest_temporary_bytes == 1536 * 256 * (4 + 2)
    assert "linear_fc1" in fused.largest_temporary
    assert "float32 [1536, 256]" in fused.largest_temporary
    plain = me.estimate_memory(me.parse_estimate_args(
        flags + ["--no-gradient-accumulation-fusion"]))
    assert plain.largest_temporary_bytes < fused.largest_temporary_bytes
    mode = LargestTemporaryMode()
    with mode, _after_one_training_step(flags, monkeypatch):
        pass
    products = {what for _, what in mode.outputs.values()}
    assert "aten.mm.default -> [1536, 256] float32" in products


SEQ_4096 = ["--num-layers", "2", "--seq-length", "4096", "--micro-batch-size", "1"]


@pytest.mark.parametrize("attention", [MXFP8_PV + CHUNKED, NVFP4_PV],
                         ids=["mxfp8-pv-without-triton", "nvfp4-pv"])
def test_quantized_attention_chunks_are_sized_as_on_the_gpu(attention):
    """llama-tiny at seq 4096 (2 K/V groups of 4 query heads: 16384 rows of 4096 keys per
    group) on the chunked path (a GPU without triton; P in NVFP4, which the fused kernels do
    not cover): on an 80 GiB GPU a chunk holds every row, fp32 scores [2, 16384, 4096] =
    512 MiB; a GPU with 1 GiB leaves the 32 MiB chunks of a CPU, [2, 1024, 4096]."""
    flags = TINY + attention + SEQ_4096
    large = me.estimate_memory(me.parse_estimate_args(flags))
    small = me.estimate_memory(me.parse_estimate_args(flags + ["--gpu-memory-gib", "1"]))
    assert large.largest_temporary_bytes == 2 * 16384 * 4096 * 4
    assert small.largest_temporary_bytes == 2 * 1024 * 4096 * 4
    assert large.activation_bytes == small.activation_bytes
    if attention == NVFP4_PV:
        assert any("chunked path" in n and "'nvfp4'" in n for n in large.notes), large.notes
    else:
        assert "[2, 1, 16384, 4096] float32" in large.largest_temporary


@pytest.mark.parametrize("dtype,masked,expanded", [
    (torch.bfloat16, False, False),   # FlashAttention takes the groups as they are
    (torch.float32, False, True),     # no FlashAttention in fp32
    (torch.bfloat16, True, True),     # nor with a mask
], ids=["bf16", "fp32", "bf16-mask"])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_gqa_attention_saves_what_the_gpu_kernel_keeps(device, dtype, masked, expanded):
    """q, out, K and V (one head per query head where the GPU expands the groups), fp32
    log-sum-exp per row, and a mask as the additive bias of the activations' dtype."""
    from megatron.training.memory_estimate.kernels import GpuKernelsMode

    b, heads, groups, s, d = 2, 8, 2, 64, 32
    q = torch.randn(b, heads, s, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(b, groups, s, d, dtype=dtype, device=device, requires_grad=True)
            for _ in range(2))
    mask = torch.ones(b, 1, s, s, dtype=torch.bool, device=device).tril() if masked else None
    saved = {}

    def pack(t):
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with GpuKernelsMode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked,
                                       enable_gqa=True)
    size = torch.finfo(dtype).bits // 8
    kv_heads = heads if expanded else groups
    expected = b * s * d * size * (2 * heads + 2 * kv_heads) + b * heads * s * 4
    if masked:
        expected += b * s * s * size
    assert sum(saved.values()) == expected


@pytest.mark.parametrize("extra", [[], ["--reset-attention-mask"]], ids=["causal", "mask"])
@pytest.mark.parametrize("precision", [["--bf16"], []], ids=["bf16", "fp32"])
def test_gpu_attention_paths_equal_a_real_cpu_forward(world_size_one, precision, extra):
    """fp32 and masked grouped-query attention (expanded K/V, the mask as a bias per layer)
    save on the meta device what a real CPU forward saves."""
    flags = [f for f in TINY if f != "--bf16"] + precision + extra + ["--num-layers", "3"]
    args = me.parse_estimate_args(flags)
    est = me.estimate_memory(args)
    three, two = real_saved_bytes(args, 3), real_saved_bytes(args, 2)
    assert est.activation_bytes_per_micro_batch == three
    assert est.activation_bytes_per_layer == three - two


# ---------------------------------------------------------------------------------------------
# The fused quantized-attention kernels
# ---------------------------------------------------------------------------------------------

# llama-tiny's attention at TINY's shapes: batch 2, seq 128, 8 query heads in 2 K/V groups of
# head dim 32. The grouped layout stacks a group's heads along the rows: G = batch x groups
# blocks of R = heads per group x seq rows.
BATCH, SEQ, HEADS, GROUPS, HEAD_DIM = 2, 128, 8, 2, 32
G, R = BATCH * GROUPS, HEADS // GROUPS * SEQ


def attention_run(args, device):
    """One QuantDotProductAttention of llama-tiny (QK^T and PV in MXFP8) forward and backward
    on `device` (meta: under the estimate's fused_attention_kernels_on_meta): the sorted bytes
    of the storages saved for backward, and the sorted (bytes, op -> shape dtype) of every
    storage its ops create."""
    import test_attention_paths
    from megatron.training.memory_estimate.kernels import (
        LargestTemporaryMode, fused_attention_kernels_on_meta)

    module = test_attention_paths._module(args, "mxfp8", "mxfp8")
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=generator).bfloat16()
              .to(device).requires_grad_() for heads in (HEADS, GROUPS, GROUPS)]
    saved = {}

    def pack(t):
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    created = LargestTemporaryMode()
    with contextlib.ExitStack() as stack:
        if device == "meta":
            stack.enter_context(fused_attention_kernels_on_meta())
        stack.enter_context(created)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(*inputs, None)
        out.backward(torch.ones_like(out))
    return sorted(saved.values()), sorted(created.outputs.values())


def test_fused_attention_kernels_save_q_k_v_and_two_row_statistics(world_size_one):
    """What the stand-in of the kernels keeps: q [G, R, d], k_t [G, d, s], v [G, s, d] (bf16)
    and two fp32 [G, R] row statistics; what it creates includes those two and delta, fp32
    [G, R], and nothing of a score chunk's size ([G, R, s])."""
    saved, created = attention_run(me.parse_estimate_args(TINY), "meta")
    bf16, fp32 = 2, 4
    q, k, v, statistic = G * R * HEAD_DIM * bf16, G * HEAD_DIM * SEQ * bf16, \
        G * SEQ * HEAD_DIM * bf16, G * R * fp32
    assert saved == sorted([q, k, v, statistic, statistic])
    row_vectors = [what for _, what in created if what.endswith(f"-> [{G}, {R}] float32")]
    assert len(row_vectors) == 3, created
    assert max(size for size, _ in created) < G * R * SEQ * bf16


def test_fused_attention_kernels_add_two_row_statistics_per_layer(world_size_one):
    """A covered config (MX QK^T and PV, bf16) saves per layer what the chunked path saves (q,
    k_t, v) plus two fp32 [G, R] statistics; the report names the path."""
    flags = TINY + MXFP8_PV + ["--num-layers", "3"]
    fused = me.estimate_memory(me.parse_estimate_args(flags))
    chunked = me.estimate_memory(me.parse_estimate_args(flags + CHUNKED))
    assert fused.activation_bytes_per_layer - chunked.activation_bytes_per_layer == 2 * G * R * 4
    assert fused.activation_bytes_per_micro_batch - chunked.activation_bytes_per_micro_batch \
        == 3 * 2 * G * R * 4
    assert any("quantized attention: the fused Triton kernels" in n for n in fused.notes)
    assert any("chunked path" in n and "--quant-kernels eager" in n for n in chunked.notes)


def test_fused_attention_kernels_make_no_score_chunks():
    """At seq 4096 the chunked path's largest temporary is a 512 MiB chunk of fp32 scores
    (test above); the fused kernels create none: the largest temporary stays below the
    smallest chunk any GPU takes (32 MiB)."""
    fused = me.estimate_memory(me.parse_estimate_args(TINY + MXFP8_PV + SEQ_4096))
    assert fused.largest_temporary_bytes < 32 * 2 ** 20, fused.largest_temporary
    assert "4096] float32" not in fused.largest_temporary


def test_without_triton_here_the_estimate_measures_the_chunked_path(monkeypatch):
    """The kernels' coverage check needs triton where the estimate runs: without it the
    quantized attention is measured on the chunked path, and the report says why."""
    from megatron.quantization import kernels

    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    flags = TINY + MXFP8_PV + ["--num-layers", "2"]
    without = me.estimate_memory(me.parse_estimate_args(flags))
    monkeypatch.undo()
    chunked = me.estimate_memory(me.parse_estimate_args(flags + CHUNKED))
    assert without.activation_bytes == chunked.activation_bytes
    assert any("chunked path" in n and "triton is not importable" in n for n in without.notes)


_FUSED_WORKER = """
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path[:0] = [{repo!r}, {tests!r}]
from megatron.quantization import attention
from megatron.training import memory_estimate as me
import test_memory_estimate as t

# The module's own choice under --quant-kernels triton, for attention only: the fused kernels
# on CPU tensors (under Triton's interpreter) where they cover the call; fake quantization
# stays eager, as on the meta device.
attention.QuantDotProductAttention.kernels = property(lambda self: "triton")
fused_calls = []
run_kernels = attention.QuantDotProductAttention._fused_quantized
def counted(self, *args, **kwargs):
    fused_calls.append(1)
    return run_kernels(self, *args, **kwargs)
attention.QuantDotProductAttention._fused_quantized = counted

args = me.parse_estimate_args(t.TINY + t.MXFP8_PV + ["--num-layers", "3"])
with me.single_rank_process_group():
    saved = [t.real_saved_bytes(args, layers) for layers in (3, 2)]
    module_saved, module_created = t.attention_run(me.parse_estimate_args(t.TINY), "cpu")
print(json.dumps(dict(saved=saved, fused_calls=len(fused_calls), module_saved=module_saved,
                      module_created=module_created)))
"""


@pytest.fixture(scope="module")
def kernels_on_the_cpu(tmp_path_factory):
    """A real CPU run of the fused attention kernels under Triton's interpreter (which must be
    set before triton is imported: a process of its own): the saved bytes of llama-tiny
    under FA_linear_mxfp8 + PV with 3 and 2 layers, and one attention module's run."""
    pytest.importorskip("triton")
    worker = tmp_path_factory.mktemp("fused") / "worker.py"
    worker.write_text(_FUSED_WORKER.format(repo=REPO_ROOT,
                                           tests=os.path.join(REPO_ROOT, "tests")))
    env = child_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="2")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fused_attention_estimate_equals_a_real_cpu_forward_through_the_kernels(
        kernels_on_the_cpu):
    """The kernels' own run (5 attention calls: 3 + 2 layers, plus the module's) saves what
    the estimate measures with the stand-in, per micro-batch and per layer."""
    assert kernels_on_the_cpu["fused_calls"] == 3 + 2 + 1
    est = me.estimate_memory(me.parse_estimate_args(TINY + MXFP8_PV + ["--num-layers", "3"]))
    three, two = kernels_on_the_cpu["saved"]
    assert est.activation_bytes_per_micro_batch == three
    assert est.activation_bytes_per_layer == three - two


def test_fused_attention_stand_in_creates_what_the_kernels_create(kernels_on_the_cpu,
                                                                  world_size_one):
    """The same storages saved and the same op outputs (shape, dtype, bytes) on the meta
    device as in the kernels' CPU run, less the launchers' 1-element debug placeholders and
    the empty storages Triton's interpreter makes."""
    saved, created = attention_run(me.parse_estimate_args(TINY), "meta")
    real_created = [(size, what) for size, what in kernels_on_the_cpu["module_created"]
                    if size > 0 and not what.endswith("-> [1] bfloat16")]
    assert saved == kernels_on_the_cpu["module_saved"]
    assert created == real_created


# ---------------------------------------------------------------------------------------------
# The launchers, errors, train_config.py
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ex.MATRIX_MODELS)
def test_launcher_default_layouts_fit_80_gb(model):
    """The examples/llama launchers' layouts (generated from the matrix), 8 GPUs, bf16."""
    exp = ex.Experiment(model=model, dataset="wikipedia", quant_scheme="bf16")
    cmd = ex.build_command(exp, "pretrain_gpt.py")
    args = me.parse_estimate_args(cmd.pretrain_args + ["--world-size", str(exp.world_size)])
    est = me.estimate_memory(args)
    assert est.fits and est.gpu_memory_bytes == 80 * me.GIB
    assert est.total_bytes > est.parameter_bytes + est.activation_bytes > 10 * me.GIB
    assert "fits" in me.format_estimate(est, args)


@pytest.mark.parametrize("argv,message", [
    (["--model-preset", "nope"], "invalid choice: 'nope'"),
    (TINY + ["--tensor-model-parallel-size", "3", "--world-size", "3"],
     "--num-attention-heads 8 is not divisible by --tensor-model-parallel-size 3"),
    (TINY + ["--tensor-model-parallel-size", "2", "--world-size", "3"],
     "world size 3 is not divisible"),
    (TINY + ["--world-size", "0"], "--world-size 0 must be >= 1"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, message):
    assert me.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert captured.out == ""


def test_the_tool_runs_from_anywhere(tmp_path):
    tool = os.path.join(REPO_ROOT, "tools", "estimate_memory.py")
    bad = subprocess.run([sys.executable, tool, "--model-preset", "nope"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    good = subprocess.run([sys.executable, tool, *TINY, "--world-size", "1"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert good.returncode == 0, good.stderr[-2000:]
    assert "Memory per GPU" in good.stdout and "fits" in good.stdout


def test_train_config_estimate_memory(capsys):
    assert train_config.main(["--model", "llama-tiny", "--dataset", "mock", "--quant-scheme",
                              "bf16,FA_linear_mxfp8", "--estimate-memory"]) == 0
    out = capsys.readouterr().out
    assert out.count("Memory per GPU") == 2 and out.count("[train_config] ") == 2
    assert "quant scheme FA_linear_mxfp8" in out and "of 80.00 GiB: fits" in out
