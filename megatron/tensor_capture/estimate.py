"""How many bytes a capture will write, estimated before its first iteration.

The model's GEMM sites give each record's shape (the layout strings of roles.py evaluated
with the site's sizes), the policy says which records are captured, in which mode and at how
many iterations. Full mode writes the tensor (and its quantized copy) plus a manifest line,
stats mode only the line. Good enough to warn that a capture will not fit on its disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from megatron.quantization.formats import format_info
from megatron.tensor_capture.records import SiteInfo, site_info
from megatron.tensor_capture.roles import RESULT, ROLES_BY_KIND, Role

MANIFEST_LINE_BYTES = 2048      # a manifest line with its statistics (measured: 1-2 KiB)
RECORD_FILE_OVERHEAD = 4096     # zip headers and pickled metadata of a record file

# Which operand of the GEMM's quantization config each (gemm, operand) report is.
OPERAND_SLOT = {
    ("fprop", "input"): "a", ("fprop", "weight"): "b", ("fprop", "a"): "a", ("fprop", "b"): "b",
    ("dgrad", "grad_output"): "a", ("dgrad", "weight"): "b", ("dgrad", "b"): "b",
    ("wgrad", "input"): "a", ("wgrad", "a"): "a", ("wgrad", "grad_output"): "b",
}


@dataclass(frozen=True)
class SiteShape:
    """A GEMM site, its quantization config and the sizes its layouts name."""

    info: SiteInfo
    config: object                   # megatron.quantization MatmulQuantConfig
    dims: Dict[str, int]

    def records(self) -> Iterable[Tuple[Role, bool, int]]:
        """(role, quantized, elements) of every record this site can produce."""
        for role, quantized, numel, _ in self.records_with_scales():
            yield role, quantized, numel

    def records_with_scales(self) -> Iterable[Tuple[Role, bool, int, int]]:
        """(role, quantized, elements, bytes of the scales its record file keeps) of every
        record this site can produce."""
        for (gemm, operand), role in ROLES_BY_KIND[self.info.kind].items():
            slot = OPERAND_SLOT.get((gemm, operand))
            fmt = getattr(getattr(self.config, gemm), slot) if slot is not None else "none"
            quantized = role.kind != RESULT and fmt != "none"
            numel = layout_numel(role.layout, self.dims)
            yield role, quantized, numel, scale_bytes(self.config, fmt, numel) if quantized \
                else 0


def scale_bytes(config, fmt: str, numel: int) -> int:
    """float32 scales a record of `numel` elements keeps: NVFP4 one per 16, FP8 blockwise one
    per 128 (per tensor: 4 bytes); none for MX and HiFP8 (their statistics only)."""
    kind = format_info(fmt).kind
    if kind == "nvfp4":
        return 4 * -(-numel // 16)
    if kind == "fp8":
        return 4 * -(-numel // 128) if config.fp8.scaling == "blockwise" else 4
    return 0


def layout_numel(layout: Optional[str], dims: Dict[str, int]) -> int:
    """Elements of a layout such as `[b*groups, heads_per_group*sq, head_dim]` (0 if a size
    is unknown)."""
    if not layout:
        return 0
    total = 1
    for part in layout.strip("[]").split(","):
        for name in part.strip().split("*"):
            size = dims.get(name.strip())
            if size is None:
                return 0
            total *= size
    return total


def site_shapes(model_chunks, micro_batch_size: int, seq_length: int) -> List[SiteShape]:
    """The SiteShape of every GEMM site in the model chunks (sizes on this rank)."""
    tokens = micro_batch_size * seq_length
    shapes = []
    for chunk in model_chunks:
        for module in chunk.modules():
            site = getattr(module, "quant_site", None)
            weight = getattr(module, "weight", None)
            if site is not None and weight is not None and weight.dim() == 2:
                out_features, in_features = weight.shape
                shapes.append(SiteShape(site_info(site), site.config, {
                    "...": tokens, "tokens": tokens, "in_features": in_features,
                    "out_features": out_features}))
            groups = getattr(module, "num_query_groups_per_partition", None)
            heads = getattr(module, "num_attention_heads_per_partition", None)
            if not groups or not heads:
                continue
            v_head_dim = getattr(module, "hidden_size_per_attention_head", 0)
            dims = {"b": micro_batch_size, "groups": groups, "heads_per_group": heads // groups,
                    "sq": seq_length, "sk": seq_length, "v_head_dim": v_head_dim,
                    "head_dim": getattr(module, "k_channels", None) or v_head_dim}
            for attr in ("qk_site", "pv_site"):
                site = getattr(module, attr, None)
                if site is not None:
                    shapes.append(SiteShape(site_info(site), site.config, dims))
    return shapes


# plan(info, role, quantized) -> (mode, captured iterations), or None when not captured.
Plan = Callable[[SiteInfo, Role, bool], Optional[Tuple[str, int]]]


def estimate_bytes(shapes: Iterable[SiteShape], plan: Plan, micro_batches: int,
                   element_bytes: int) -> int:
    """Bytes the capture writes (record files and manifest lines) on this rank."""
    total = 0
    for shape in shapes:
        for role, quantized, numel, scales in shape.records_with_scales():
            decided = plan(shape.info, role, quantized)
            if decided is None:
                continue
            mode, iterations = decided
            per_record = MANIFEST_LINE_BYTES
            if mode == "full":
                copies = 2 if quantized else 1
                per_record += numel * element_bytes * copies + scales + RECORD_FILE_OVERHEAD
            total += per_record * iterations * micro_batches
    return total
