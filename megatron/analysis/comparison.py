"""Like-for-like comparisons across schemes.

Schemes capture different sets of tensors: a quantized scheme also records the copies its
backward GEMMs re-quantize (`input_wgrad`, `weight_dgrad`, ...), which bf16 never has, and
`linear_*` schemes quantize no attention operand. Statistics that put schemes side by side are
therefore taken over the tensors every compared scheme captured, identified by (layer, module,
tensor name); what is left out is listed so that nothing disappears silently.

- x statistics (magnitudes, distributions, HiF8 regions): tensors present in every scheme;
- error statistics: operands quantized in every quantized scheme.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Tuple

from megatron.analysis.accumulators import Stats
from megatron.analysis.workers import GroupKey

TensorId = Tuple[int, str, str]          # (layer, module, tensor name)


def tensor_id(key: GroupKey) -> TensorId:
    return (key.layer, key.module, key.tensor_name)


def is_quantized(key: GroupKey) -> bool:
    return key.format != "none"


@dataclass(frozen=True)
class Common:
    """The tensors shared by the compared schemes."""

    schemes: Tuple[str, ...]
    tensors: FrozenSet[TensorId]              # captured by every scheme
    quantized_schemes: Tuple[str, ...]
    quantized: FrozenSet[TensorId]            # quantized by every quantized scheme

    def all_schemes(self, groups: Dict[GroupKey, Stats]) -> Dict[GroupKey, Stats]:
        """Groups of the tensors every scheme captured."""
        return {k: v for k, v in groups.items() if tensor_id(k) in self.tensors}

    def quantized_operands(self, groups: Dict[GroupKey, Stats]) -> Dict[GroupKey, Stats]:
        """Quantized groups of the operands every quantized scheme quantized."""
        return {k: v for k, v in groups.items()
                if is_quantized(k) and tensor_id(k) in self.quantized}


def _ids(groups, scheme: str, where=lambda k: True) -> set:
    return {tensor_id(k) for k in groups if k.quant_scheme == scheme and where(k)}


def _intersection(sets: List[set]) -> FrozenSet[TensorId]:
    return frozenset(set.intersection(*sets)) if sets else frozenset()


def common_tensors(groups: Dict[GroupKey, Stats]) -> Common:
    schemes = tuple(sorted({k.quant_scheme for k in groups}))
    quantized_schemes = tuple(s for s in schemes
                              if any(is_quantized(k) for k in groups if k.quant_scheme == s))
    return Common(
        schemes=schemes,
        tensors=_intersection([_ids(groups, s) for s in schemes]),
        quantized_schemes=quantized_schemes,
        quantized=_intersection([_ids(groups, s, is_quantized) for s in quantized_schemes]))


def _left_out(groups, schemes, keep) -> Dict[str, dict]:
    """Per scheme: records and tensor names outside the compared set."""
    records: Dict[str, int] = defaultdict(int)
    names: Dict[str, set] = defaultdict(set)
    for key, stats in groups.items():
        if key.quant_scheme in schemes and not keep(key):
            records[key.quant_scheme] += stats.records
            names[key.quant_scheme].add(key.tensor_name)
    return {s: {"records": records[s], "tensor_names": sorted(names[s])}
            for s in schemes if records[s]}


def comparison_section(groups: Dict[GroupKey, Stats], common: Common) -> dict:
    """statistics.json `comparison`: what cross-scheme statistics are taken over."""
    per_scheme = {}
    shared = common.all_schemes(groups)
    for scheme in common.schemes:
        merged = Stats()
        for key, stats in shared.items():
            if key.quant_scheme == scheme:
                merged.merge(stats)
        per_scheme[scheme] = merged.metrics() if merged.records else None
    in_all = lambda k: tensor_id(k) in common.tensors  # noqa: E731
    quantized_in_all = lambda k: is_quantized(k) and tensor_id(k) in common.quantized  # noqa: E731
    quantized_groups = {k: v for k, v in groups.items() if is_quantized(k)}
    return {
        "schemes": list(common.schemes),
        "tensors_in_every_scheme": len(common.tensors),
        "left_out": _left_out(groups, common.schemes, in_all),
        "quantized_schemes": list(common.quantized_schemes),
        "quantized_operands_in_every_quantized_scheme": len(common.quantized),
        "left_out_quantized": _left_out(quantized_groups, common.quantized_schemes,
                                        quantized_in_all),
        "per_scheme": per_scheme,
    }
