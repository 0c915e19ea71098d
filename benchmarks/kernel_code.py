"""What the Triton kernels cost on an H100/H200, read from their sm_90 code (no GPU needed):
the CPU proxy for their GPU time.

QDQ kernels: each compiled as the launches specialise it (offline.qdq_launches: every format
and layout, float32 and bf16 operands, round to nearest), and its SASS instructions per
element (the kernels have no loops: every thread runs each instruction once, for its share of
the program's elements). A bf16 QDQ moves 4 bytes per element, so on an H200 (4.8 TB/s
datasheet, 132 SMs issuing 128 thread-instructions per clock at 1.98 GHz) a kernel issues
faster than memory feeds it below about 4 * 3.3e13 / 4.8e12 = 28 instructions per element.

Attention kernels: compiled as training launches them (bf16, causal, every tile slot MXFP8
E4M3 with the rceil rule, d = dv = 64 and 128), in every tile configuration autotuning may
pick there. For each one: registers and spills per thread, shared memory, blocks per SM, and
the SASS instructions each tile loop runs per score (per element of its [rows, keys] tile:
the loop's instructions times the threads, over the tile):

    forward   pass 1 (m, l) and pass 2 (P, O), each over unmasked and masked key tiles
    query     the delta pass and the dQ pass, unmasked and masked
    key       the dK/dV kernel, unmasked tiles (a non-causal compilation) and masked ones
              (the causal loop, which holds both bodies, less the unmasked one; kernels
              that mask every tile of a causal call have one body, and it is counted)

and the sum over the five passes on unmasked tiles, which a causal layer at seq 8192 runs on
all but ~1-2% of its tiles. A GPU's time is not proportional to it (tensor-core work, latency
and occupancy count too), but elementwise work per score is what these kernels spend most on.

    python benchmarks/kernel_code.py [--head-dims 64 128] [--repo PATH]

--repo: read the kernels of another checkout (from `git worktree add`), to set two revisions
side by side; from ed1d945 on (the attention kernels' autotuned tile configurations).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import types
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128],
                        help="head dims (d = dv) to compile for (default: 64 128)")
    parser.add_argument("--repo", default=None,
                        help="checkout whose kernels to read (default: this one)")
    return parser.parse_args(argv)


def per_score(loops, config, threads_per_warp=32):
    """Instructions per tile element of each loop."""
    threads = threads_per_warp * config.warps
    return [count * threads / (config.block_m * config.block_n) for count, _ in loops]


def blocks_per_sm(config, registers, shared) -> int:
    """Blocks an H100/H200 SM holds at once: 64 Ki registers (allocated 8 per thread at a
    time), 228 KiB of shared memory (1 KiB of it reserved per block)."""
    by_registers = 65536 // (-(-registers // 8) * 8 * 32 * config.warps)
    return min(by_registers, 233472 // (shared + 1024))


def kernel_rows(name, head_dim, attention, offline):
    """One row per configuration: (config, registers, spill bytes, shared bytes, passes) with
    passes {label: instructions per score}."""
    import torch
    configs = attention.tile_configs(name, (9, 0), torch.bfloat16, head_dim)
    configs = [c for c in configs if c.stages == max(x.stages for x in configs)]
    rows = []
    for config in configs:
        compiled = offline.compile_attention(name, config, head_dim, attention=attention)
        registers, spilled = offline.register_use(compiled)
        loops = per_score(offline.loop_instructions(compiled.asm["cubin"]), config)
        if name == "key":
            unmasked = per_score(offline.loop_instructions(offline.compile_attention(
                name, config, head_dim, causal=False, attention=attention).asm["cubin"]),
                config)[0]
            if loops[0] > 1.5 * unmasked:       # the causal loop holds both bodies
                passes = {"dK/dV": unmasked, "dK/dV masked": loops[0] - unmasked}
            else:                               # (older kernels) it masks every tile
                passes = {"dK/dV (every tile masked)": loops[0]}
        else:
            labels = (("pass 1", "pass 2") if name == "forward" else ("delta", "dQ"))
            passes = {labels[0]: loops[0], f"{labels[0]} masked": loops[1],
                      labels[1]: loops[2], f"{labels[1]} masked": loops[3]}
        rows.append((config, registers, spilled, compiled.metadata.shared, passes))
    return rows


def _other_kernels(repo, ours):
    """The attention kernels module of the checkout `repo`, imported in place of ours (and its
    QDQ kernel modules). One older than attention.specialisation gets ours, run on its own
    module's names (the kernels and their launch helpers have had the same names since the
    kernels were autotuned); older QDQ kernels are found under their private names."""
    specialisation = ours.specialisation
    sys.path.insert(0, os.path.abspath(repo))
    for module in [m for m in sys.modules if m.startswith("megatron.quantization")]:
        if module != "megatron.quantization.kernels.offline":
            del sys.modules[module]
    theirs = importlib.import_module("megatron.quantization.kernels.attention")
    if not hasattr(theirs, "specialisation"):
        names = dict(vars(theirs))
        options = theirs._launch_options
        names["_launch_options"] = lambda dtype, d, dv, scale: options(dtype, d, dv)
        rebound = types.FunctionType(specialisation.__code__, names, "specialisation",
                                     specialisation.__defaults__)

        def legacy(name, config, *args):
            config = ours.TileConfig(*config)           # with our fields' defaults
            kernel, constants, arg_types, options = rebound(name, config, *args)
            return kernel, constants, {**arg_types, "l_ptr": "*fp32"}, options  # row sums

        theirs.specialisation = legacy
    for module, kernel in (("mx", "mx_qdq_kernel"), ("nvfp4", "nvfp4_qdq_kernel"),
                           ("fp8", "fp8_tensor_kernel"), ("fp8", "fp8_block_kernel"),
                           ("hifp8", "hifp8_qdq_kernel"), ("amax", "amax_kernel")):
        module = importlib.import_module(f"megatron.quantization.kernels.{module}")
        if not hasattr(module, kernel):             # named _kernel before 15c8e51
            setattr(module, kernel, getattr(module, "_" + kernel))
    return theirs


def qdq_table(offline) -> None:
    """Instructions per element of every QDQ kernel launch."""
    print("\n| QDQ kernel | instructions per element |")
    print("|---|---:|")
    for name, (*launch, elements) in offline.qdq_launches().items():
        count = offline.instruction_count(offline.compile_for(*launch).asm["cubin"])
        print(f"| {name} | {count * 32 * launch[-1]['num_warps'] / elements:.1f} |", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: the kernels are compiled, not interpreted")
    warnings.filterwarnings("ignore")
    sys.path.insert(0, REPO_ROOT)
    offline = importlib.import_module("megatron.quantization.kernels.offline")
    attention = importlib.import_module("megatron.quantization.kernels.attention")
    if args.repo:
        attention = _other_kernels(args.repo, attention)
    print(f"kernels of {os.path.dirname(os.path.dirname(os.path.dirname(attention.__file__)))}"
          f" compiled for sm_90")
    qdq_table(offline)
    print("\nattention kernels (bf16, causal, MXFP8 E4M3 rceil tiles)")
    for head_dim in args.head_dims:
        start = time.time()
        best = {}
        print(f"\nd = {head_dim}")
        print("| kernel | config (rows, keys, warps, stages, register cap) | registers | "
              "spill bytes | shared KiB | blocks per SM | instructions per score |")
        print("|---|---|---:|---:|---:|---:|---|")
        for name in ("forward", "query", "key"):
            for config, registers, spilled, shared, passes in kernel_rows(
                    name, head_dim, attention, offline):
                text = ", ".join(f"{label} {value:.1f}" for label, value in passes.items())
                print(f"| {name} | {tuple(config)} | {registers} | {spilled} | "
                      f"{shared / 1024:.0f} | {blocks_per_sm(config, registers, shared)} | "
                      f"{text} |", flush=True)
                unmasked = sum(v for label, v in passes.items()
                               if not label.endswith("masked"))
                best[name] = min(best.get(name, unmasked), unmasked)
        total = sum(best.values())
        print(f"unmasked tiles, the fewest per kernel: forward {best['forward']:.1f} + dQ "
              f"kernel {best['query']:.1f} + dK/dV kernel {best['key']:.1f} = {total:.1f} "
              f"instructions per score ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
