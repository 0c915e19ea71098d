"""Tensor-parallel communication inside the linear GEMM's autograd function (tp_comm.py).

Two gloo ranks run a column-parallel then a row-parallel linear (megatron-core's layers with
the quantized GEMM), with and without sequence parallelism, in fp32 and with MXFP8 operands,
and compare the output, the input gradient and the weight gradients of their shards with one
process computing the same two GEMMs on whole tensors. Under sequence parallelism the column
layer must keep only its input shard for backward ([s/tp, b, h]), not the gathered input.
"""

import json
import subprocess
import sys

import pytest
import torch

from megatron.quantization.tp_comm import TensorParallelComm

from conftest import REPO_ROOT, child_env
from test_distributed import _free_port

SEQ, BATCH, HIDDEN, FFN = 64, 2, 64, 192

_WORKER = r"""
import json, os, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.quantization.config import MatmulQuantConfig, OperandFormats
from megatron.quantization.gemm import SiteState, quantized_linear
from megatron.quantization.layers import QuantColumnParallelLinear, QuantRowParallelLinear
from megatron.quantization.observers import GemmSite
from megatron.training.arguments import parse_args, validate_args
from megatron.training.initialize import destroy_distributed, initialize_distributed

S, B, H, F = {seq}, {batch}, {hidden}, {ffn}
sp, fmt = sys.argv[1] == "sp", sys.argv[2]
args = validate_args(parse_args(["--model-preset", "llama-tiny", "--mock-data", "--train-iters",
                                 "1", "--lr", "1", "--micro-batch-size", "1",
                                 "--tensor-model-parallel-size", "2"]),
                     check_paths=False)
initialize_distributed(args)
rank, tp = dist.get_rank(), 2
ops = OperandFormats(fmt, fmt)
quant = MatmulQuantConfig(fprop=ops, dgrad=ops, wgrad=ops)
config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2,
                           tensor_model_parallel_size=tp, sequence_parallel=sp,
                           use_cpu_initialization=True)
torch.manual_seed(5)
column = QuantColumnParallelLinear(H, F, config=config, init_method=torch.nn.init.normal_,
                                   bias=False, gather_output=False)
row = QuantRowParallelLinear(F, H, config=config, init_method=torch.nn.init.normal_, bias=False,
                             input_is_parallel=True, skip_bias_add=True)
for name, layer in (("column", column), ("row", row)):
    layer.quant_site = GemmSite(name, "linear", 1, quant, SiteState(name, quant))

g = torch.Generator().manual_seed(11)
x = torch.randn(S, B, H, generator=g)
r = torch.randn(S, B, H, generator=g)
shard = slice(rank * S // tp, (rank + 1) * S // tp)
x_in = (x[shard] if sp else x).clone().requires_grad_()

saved = []
def pack(t):
    saved.append(list(t.shape))
    return t
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    out = row(column(x_in)[0])[0]
(out * (r[shard] if sp else r)).sum().backward()

# The whole weights, and the same two GEMMs in one process.
def gather(t, dim):
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)
w1, w2 = gather(column.weight.detach(), 0), gather(row.weight.detach(), 1)
xr = x.clone().requires_grad_()
w1r, w2r = w1.clone().requires_grad_(), w2.clone().requires_grad_()
ref = quantized_linear(quantized_linear(xr, w1r, None, quant), w2r, None, quant)
(ref * r).sum().backward()
rows = slice(rank * F // tp, (rank + 1) * F // tp)
def err(a, b):
    return float((a - b).abs().max() / b.abs().max())
result = dict(
    saved=saved,
    out=err(out.detach(), ref.detach()[shard] if sp else ref.detach()),
    grad_x=err(x_in.grad, xr.grad[shard] if sp else xr.grad),
    grad_w1=err(column.weight.grad, w1r.grad[rows]),
    grad_w2=err(row.weight.grad, w2r.grad[:, rows]))
with open(os.path.join({out!r}, f"result-{{sys.argv[1]}}-{{fmt}}-{{rank}}.json"), "w") as f:
    json.dump(result, f)
destroy_distributed()
"""


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_comm")
    worker = out / "worker.py"
    worker.write_text(_WORKER.format(repo=REPO_ROOT, out=str(out), seq=SEQ, batch=BATCH,
                                     hidden=HIDDEN, ffn=FFN))
    env = child_env(OMP_NUM_THREADS="1")
    results = {}
    for mode in ("sp", "tp"):
        for fmt in ("none", "mxfp8_e4m3"):
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(_free_port()), str(worker), mode, fmt],
                capture_output=True, text=True, env=env, timeout=600)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            results[mode, fmt] = [json.loads((out / f"result-{mode}-{fmt}-{rank}.json").read_text())
                                  for rank in (0, 1)]
    return results


@pytest.mark.parametrize("mode", ["sp", "tp"])
@pytest.mark.parametrize("fmt", ["none", "mxfp8_e4m3"])
def test_two_ranks_compute_the_single_process_gemms(two_rank_results, mode, fmt):
    """Outputs and gradients of each rank's shards equal one process's up to fp32 summation
    order (the row layer's partial sums are added across ranks)."""
    for result in two_rank_results[mode, fmt]:
        for key in ("out", "grad_x", "grad_w1", "grad_w2"):
            assert result[key] < 1e-5, (key, result[key])


@pytest.mark.parametrize("fmt", ["none", "mxfp8_e4m3"])
def test_sequence_parallel_saves_the_input_shard(two_rank_results, fmt):
    """The column layer keeps its input shard [s/2, b, h] for backward, never the gathered
    [s, b, h] input (whatever else the layers keep)."""
    for result in two_rank_results["sp", fmt]:
        assert [SEQ // 2, BATCH, HIDDEN] in result["saved"]
        assert [SEQ, BATCH, HIDDEN] not in result["saved"]


def test_without_sequence_parallelism_the_input_is_whole(two_rank_results):
    for result in two_rank_results["tp", "none"]:
        assert [SEQ, BATCH, HIDDEN] in result["saved"]


def test_one_rank_needs_no_communication():
    comm = TensorParallelComm(None, sequence_parallel=True)
    x = torch.randn(4, 3)
    full, wait = comm.gather_input(x, async_op=True)
    wait()
    assert full is x and comm.reduce_input_grad(x)[0] is x


def test_sequence_parallel_and_allreduce_exclude_each_other():
    with pytest.raises(ValueError, match="cannot also all-reduce"):
        TensorParallelComm(None, sequence_parallel=True, allreduce_dgrad=True)
