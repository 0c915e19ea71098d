"""Names of captured tensors, records, files and runs (see docs/capture-format.md).

Every GEMM report `(site kind, gemm, operand)` maps to one capture *role*: the tensor name
analysis sees (`query`, `grad_input`, ...), the operation (`forward`/`backward`) and phase
(`pre` = an input of the op, `post` = its result). Operands that a later GEMM quantizes again
along another axis (the weight in dgrad, the input and output gradient in wgrad, ...) get their
own names with a `_dgrad` / `_wgrad` suffix, so every quantized operand has a record with its
own format and axis.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Dict, Optional, Tuple

FORMAT_VERSION = 1

# Site kinds (megatron.quantization.schemes.SITE_KINDS) grouped by record component.
COMPONENT_OF_KIND = {"linear": "linear", "output_layer": "linear",
                     "attn_qk": "attention", "attn_pv": "attention"}
LAYER_TYPE = {"linear": "linear", "attention": "attention"}
COMPONENT_TAG = {"linear": "linear", "attention": "FA"}

OPERAND, REQUANT, RESULT = "operand", "requant", "result"


@dataclass(frozen=True)
class Role:
    """What one GEMM report is, as a capture record."""

    tensor_name: str
    operation: str       # forward | backward
    phase: str           # pre | post
    kind: str            # operand (first use) | requant (re-quantized copy) | result
    layout: Optional[str] = None


LINEAR_ROLES: Dict[Tuple[str, str], Role] = {
    ("fprop", "input"): Role("input", "forward", "pre", OPERAND, "[..., in_features]"),
    ("fprop", "weight"): Role("weight", "forward", "pre", OPERAND, "[out_features, in_features]"),
    ("fprop", "output"): Role("output", "forward", "post", RESULT, "[..., out_features]"),
    ("dgrad", "grad_output"): Role("grad_output", "backward", "pre", OPERAND,
                                   "[..., out_features]"),
    ("dgrad", "weight"): Role("weight_dgrad", "backward", "pre", REQUANT,
                              "[out_features, in_features]"),
    ("dgrad", "grad_input"): Role("grad_input", "backward", "post", RESULT, "[..., in_features]"),
    ("wgrad", "grad_output"): Role("grad_output_wgrad", "backward", "pre", REQUANT,
                                   "[tokens, out_features]"),
    ("wgrad", "input"): Role("input_wgrad", "backward", "pre", REQUANT, "[tokens, in_features]"),
    ("wgrad", "grad_weight"): Role("grad_weight", "backward", "post", RESULT,
                                   "[out_features, in_features]"),
}

_Q = "[b*groups, heads_per_group*sq, head_dim]"
_KT = "[b*groups, head_dim, sk]"
_S = "[b*groups, heads_per_group*sq, sk]"
_V = "[b*groups, sk, v_head_dim]"
_O = "[b*groups, heads_per_group*sq, v_head_dim]"
ATTN_QK_ROLES: Dict[Tuple[str, str], Role] = {
    ("fprop", "a"): Role("query", "forward", "pre", OPERAND, _Q),
    ("fprop", "b"): Role("key", "forward", "pre", OPERAND, _KT),
    ("fprop", "output"): Role("scores", "forward", "post", RESULT, _S),
    ("dgrad", "grad_output"): Role("grad_scores", "backward", "pre", OPERAND, _S),
    ("dgrad", "b"): Role("key_dgrad", "backward", "pre", REQUANT, _KT),
    ("dgrad", "grad_a"): Role("grad_query", "backward", "post", RESULT, _Q),
    ("wgrad", "a"): Role("query_wgrad", "backward", "pre", REQUANT, _Q),
    ("wgrad", "grad_output"): Role("grad_scores_wgrad", "backward", "pre", REQUANT, _S),
    ("wgrad", "grad_b"): Role("grad_key", "backward", "post", RESULT, _KT),
}
ATTN_PV_ROLES: Dict[Tuple[str, str], Role] = {
    ("fprop", "a"): Role("probs", "forward", "pre", OPERAND, _S),
    ("fprop", "b"): Role("value", "forward", "pre", OPERAND, _V),
    ("fprop", "output"): Role("output", "forward", "post", RESULT, _O),
    ("dgrad", "grad_output"): Role("grad_output", "backward", "pre", OPERAND, _O),
    ("dgrad", "b"): Role("value_dgrad", "backward", "pre", REQUANT, _V),
    ("dgrad", "grad_a"): Role("grad_probs", "backward", "post", RESULT, _S),
    ("wgrad", "a"): Role("probs_wgrad", "backward", "pre", REQUANT, _S),
    ("wgrad", "grad_output"): Role("grad_output_wgrad", "backward", "pre", REQUANT, _O),
    ("wgrad", "grad_b"): Role("grad_value", "backward", "post", RESULT, _V),
}
ROLES_BY_KIND = {"linear": LINEAR_ROLES, "output_layer": LINEAR_ROLES,
                 "attn_qk": ATTN_QK_ROLES, "attn_pv": ATTN_PV_ROLES}


def role_for(site_kind: str, gemm: str, operand: str) -> Optional[Role]:
    """The capture role of one GEMM report, or None for a report this module does not know."""
    table = ROLES_BY_KIND.get(site_kind)
    return None if table is None else table.get((gemm, operand))


def tensor_names(component: str):
    """Every tensor name a component ('attention' or 'linear') can produce."""
    tables = (LINEAR_ROLES,) if component == "linear" else (ATTN_QK_ROLES, ATTN_PV_ROLES)
    return {role.tensor_name: role for table in tables for role in table.values()}


_EXPERT = re.compile(r"(?:^|\.)experts\.local_experts\.(\d+)\.([^.]+)$")
_SHARED = re.compile(r"(?:^|\.)shared_experts\.([^.]+)$")


def short_module_name(module_path: str, expert_offset: int = 0) -> str:
    """The module field of file names: the last element of the module path.

    Attention sites (`...core_attention.qk` / `.pv`) are named after the attention module;
    routed experts carry their global index (`expert3_linear_fc1`), shared experts a prefix.
    """
    path = module_path
    if path.endswith(".qk") or path.endswith(".pv"):
        path = path[:-3]
    match = _EXPERT.search(path)
    if match:
        return f"expert{int(match.group(1)) + expert_offset}_{match.group(2)}"
    match = _SHARED.search(path)
    if match:
        return f"shared_experts_{match.group(1)}"
    return path.rsplit(".", 1)[-1]


def record_name(layer_type: str, layer: int, operation: str, phase: str, component_tag: str,
                tensor_name: str, module: str) -> str:
    """The name --tensor-save-filter matches: the file name without run, counter, scheme,
    iteration, micro-batch and ranks, e.g. `linear_L2_forward_pre_linear_input_linear_fc1`."""
    return f"{layer_type}_L{layer}_{operation}_{phase}_{component_tag}_{tensor_name}_{module}"


def rank_suffix(world_size: int, tp: int, pp: int, dp: int) -> str:
    return f"_tp{tp}_pp{pp}_dp{dp}" if world_size > 1 else ""


def record_file_name(run_id: str, counter: int, metadata: dict, module: str) -> str:
    """`{run_id}_{counter:06d}_{layer_type}_L{layer}_..._it{i}_mb{m}[_tp_pp_dp].pt`."""
    m = metadata
    return (f"{run_id}_{counter:06d}_{m['layer_type']}_L{m['layer_idx']}_{m['operation']}_"
            f"{m['phase']}_{m['component']}_{m['quant_type']}_{m['tensor_name']}_{module}_"
            f"it{m['iteration']}_mb{m['micro_batch']}"
            f"{rank_suffix(m['world_size'], m['tp_rank'], m['pp_rank'], m['dp_rank'])}.pt")


def run_file(directory: str, run_id: str) -> str:
    return os.path.join(directory, f"run-{run_id}.json")


def manifest_file(directory: str, run_id: str, rank: int) -> str:
    return os.path.join(directory, f"manifest-{run_id}-rank{rank:05d}.jsonl")


def summary_file(directory: str, run_id: str, rank: int) -> str:
    return os.path.join(directory, f"summary-{run_id}-rank{rank:05d}.json")


def base_run_id(now: Optional[datetime] = None) -> str:
    return (now or datetime.now()).strftime("%Y%m%d_%H%M%S")


def claim_run_id(directory: str, base: str,
                 payload: Callable[[str], bytes] = lambda run_id: b"{}\n") -> str:
    """Reserve a run id unique in `directory`: `base`, else `base-2`, `base-3`, ...

    The reservation is the exclusive creation of `run-{id}.json`, so two runs starting in the
    same second never share an id. `payload(run_id)` is written into the claimed file.
    """
    os.makedirs(directory, exist_ok=True)
    suffix = 1
    while True:
        run_id = base if suffix == 1 else f"{base}-{suffix}"
        try:
            fd = os.open(run_file(directory, run_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            suffix += 1
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(payload(run_id))
        return run_id
