"""The kernels compiled for a GPU that is not here, and what their code says.

Triton compiles for any NVIDIA target without a GPU (PTX, then ptxas to a cubin), so a CPU
machine can check what the interpreter cannot show: vector accesses, wgmma instructions, shared
memory, registers and spills, flush-to-zero, and how many instructions each loop of a kernel
runs (the CPU proxy for the kernels' GPU time). Used by the CPU tests and by
benchmarks/kernel_code.py. Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import Dict, List, Tuple

import torch
import triton

SM90 = ("cuda", 90, 32)        # an H100 / H200: backend, compute capability, warp size


def compile_for(kernel, constants: Dict[str, object], types: Dict[str, str],
                options: Dict[str, object], target: Tuple[str, int, int] = SM90):
    """`kernel` (a JITFunction, or an autotuner's) compiled for `target`: `constants` are its
    constexprs, `types` the Triton types of its other arguments ("i32" where not named; the
    key "*_ptr" types every pointer argument, named ..._ptr, that is not named itself).
    Pointers and integers are taken as divisible by 16, as Triton specialises them for aligned
    tensors and shapes. Returns Triton's CompiledKernel (asm["ptx"], asm["cubin"], metadata)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn                          # an autotuner's
    signature = {a: "constexpr" if a in constants else types.get(
        a, types.get("*_ptr", "i32") if a.endswith("_ptr") else "i32") for a in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
               if signature[a][0] == "*" or signature[a] == "i32"}
    return triton.compile(ASTSource(kernel, signature, constants, aligned),
                          target=GPUTarget(*target), options=options)


def qdq_launches() -> Dict[str, tuple]:
    """Every QDQ kernel as the launches specialise it, for float32 and bf16 operands and both
    memory layouts where it has them (MXFP8 E4M3 floor, NVFP4 with and without a 16-point
    Hadamard transform and 16x16 tiles, FP8 E4M3 per tensor and 1x128, HiFP8, the amax kernel;
    round to nearest): {name: (kernel, constexprs, argument types, compile options, elements
    per program)}. The group sizes and warps are one choice each that autotuning may make."""
    from megatron.quantization.kernels import amax, fp8, hifp8, mx, nvfp4
    from megatron.quantization.kernels.bits import COLUMNS, FLAT, ROWS, element_constants

    mx_fmt = mx.format_constants("mxfp8_e4m3", "floor")
    fp8_fmt = element_constants("fp8_e4m3")
    options = {"enable_fp_fusion": False, "num_warps": 4}
    launches = {}
    for dname, bf16 in (("float32", False), ("bfloat16", True)):
        types = {"*_ptr": "*bf16" if bf16 else "*fp32", "scaled_max": "fp32",
                 **dict.fromkeys(("noise_ptr", "signs_ptr", "out_ptr", "amax_ptr",
                                  "imposed_ptr"), "*fp32")}
        for lname, layout in (("flat", FLAT), ("columns", COLUMNS)):
            launches[f"mx {lname} {dname}"] = (mx.mx_qdq_kernel, dict(
                STOCHASTIC=False, IS_BF16=bf16, RHT=0, INV_SQRT=1.0, WIDTH=32, LAYOUT=layout,
                GROUP_=64, **mx_fmt), types, options, 64 * 32)
            launches[f"nvfp4 rht16 {lname} {dname}"] = (nvfp4.nvfp4_qdq_kernel, dict(
                IMPOSED=False, TILE_2D=False, STOCHASTIC=False, IS_BF16=bf16, RHT=16,
                INV_SQRT=0.25, WIDTH=16, LAYOUT=layout, GROUP_=128), types, options, 128 * 16)
            launches[f"fp8 1x128 {lname} {dname}"] = (fp8.fp8_block_kernel, dict(
                VALUE_FOR_INF=3.0e38, TILE_2D=False, POW2=False, STOCHASTIC=False,
                IS_BF16=bf16, LAYOUT=layout, GROUP_=16, **fp8_fmt), types, options, 16 * 128)
        launches[f"nvfp4 16x16 {dname}"] = (nvfp4.nvfp4_qdq_kernel, dict(
            IMPOSED=False, TILE_2D=True, STOCHASTIC=False, IS_BF16=bf16, RHT=0, INV_SQRT=1.0,
            WIDTH=256, LAYOUT=ROWS, GROUP_=8), types, options, 8 * 256)
        launches[f"fp8 tensor {dname}"] = (fp8.fp8_tensor_kernel, dict(
            DELAYED=False, POW2=False, STOCHASTIC=False, IS_BF16=bf16, BLOCK_=2048,
            **fp8_fmt), types, options, 2048)
        launches[f"hifp8 {dname}"] = (hifp8.hifp8_qdq_kernel, dict(
            SATURATE=False, IS_BF16=bf16, BLOCK_=2048), types, options, 2048)
        launches[f"amax {dname}"] = (amax.amax_kernel, dict(IS_BF16=bf16, BLOCK_=4096), types,
                                     options, 4096)
    return launches


def compile_attention(name: str, config, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                      causal: bool = True, fmt: Tuple[str, str] = ("mxfp8_e4m3", "rceil"),
                      attention=None):
    """The attention kernel `name` ("forward", "query" or "key") compiled for sm_90 as
    training launches it (attention.specialisation: tile configuration `config`, d = dv =
    head_dim, every tile slot in MX format `fmt`). `attention`: the kernels module (default:
    this checkout's)."""
    if attention is None:
        from megatron.quantization.kernels import attention

    return compile_for(*attention.specialisation(name, config, head_dim, dtype, causal, fmt))


def _nvdisasm() -> str:
    from triton import knobs

    return knobs.nvidia.nvdisasm.path       # the one that ships with Triton's CUDA backend


def _disassembly(cubin: bytes) -> Tuple[List[Tuple[int, str]], Dict[str, int]]:
    """A cubin's SASS: [(address, instruction)] and its branch labels {label: address}."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    labels, instructions, pending = {}, [], []
    for line in text.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        code = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if code:
            address = int(code.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            instructions.append((address, code.group(2)))
    return instructions, labels


def instruction_count(cubin: bytes) -> int:
    """How many SASS instructions a cubin holds (a kernel without loops runs each at most
    once per thread)."""
    return len(_disassembly(cubin)[0])


def loop_instructions(cubin: bytes) -> List[Tuple[int, collections.Counter]]:
    """Each loop of a cubin's SASS (a backward branch and the instructions from its target to
    it), in program order: (instruction count, opcode histogram). Loops nested in another are
    listed with it; the kernels' tile loops hold none."""
    instructions, labels = _disassembly(cubin)
    loops = []
    for address, text in instructions:
        branch = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        if branch and labels.get(branch.group(1), address) < address:
            body = [t for a, t in instructions if labels[branch.group(1)] <= a <= address]
            opcodes = collections.Counter(
                re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            loops.append((len(body), opcodes))
    return loops


def register_use(compiled) -> Tuple[int, int]:
    """(registers per thread, bytes spilled per thread) of a compiled kernel, as the ptxas that
    ships with Triton reports them for its PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = compiled.metadata.target.arch
    ptxas = get_ptxas(arch).path      # the one Triton itself runs for this target
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", source, "-o",
                                 os.path.join(folder, "kernel.cubin")],
                                capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spilled = re.search(r"(\d+) bytes spill stores", report)
    return int(registers.group(1)), int(spilled.group(1)) if spilled else 0
