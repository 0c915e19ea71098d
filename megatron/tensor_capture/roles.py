"""Which capture record each GEMM report is: its tensor name, operation and phase.

File names, versions and the manifest schema live in format.py (docs/capture-format.md).

Every GEMM report `(site kind, gemm, operand)` maps to one capture *role*: the tensor name
analysis sees (`query`, `grad_input`, ...), the operation (`forward`/`backward`) and phase
(`pre` = an input of the op, `post` = its result). Operands that a later GEMM quantizes again
along another axis (the weight in dgrad, the input and output gradient in wgrad, ...) get their
own names with a `_dgrad` / `_wgrad` suffix, so every quantized operand has a record with its
own format and axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

# Site kinds (megatron.quantization.config.SITE_KINDS) grouped by record component.
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
