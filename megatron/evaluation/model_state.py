"""The evaluated model: built once, its checkpoint loaded once, re-quantized per arm.

`apply_quantization` can run again on a built model: the quantized classes are already in
place and every GEMM site gets the new arm's configuration, so every arm sees the very same
weights. `SiteSubset` quantizes a chosen set of sites only (the per-site sweep).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import Float16Module

from megatron.quantization.converter import apply_quantization
from megatron.quantization.config import NONE, QuantConfig
from megatron.training import checkpointing
from megatron.training.errors import ConfigError
from megatron.training.model import build_gpt_model, core_transformer_config_from_args

# Sweep labels of the GEMM sites, by the last component of their module name.
SITE_LABELS = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "fc1",
               "linear_fc2": "fc2", "qk": "QK", "pv": "PV", "output_layer": "output",
               "linear_q_proj": "q", "linear_q_down_proj": "q_down", "linear_q_up_proj": "q_up",
               "linear_kv_down_proj": "kv_down", "linear_kv_up_proj": "kv_up"}
SITE_ORDER = ("qkv", "q", "q_down", "q_up", "kv_down", "kv_up", "QK", "PV", "proj", "fc1",
              "fc2", "output")


@dataclass(frozen=True)
class SiteSubset(QuantConfig):
    """`base`'s configuration at the sites whose global paths are in `paths`, high precision
    everywhere else."""

    base: Optional[QuantConfig] = None
    paths: FrozenSet[str] = frozenset()

    def for_site(self, kind, layer_number, path=None):
        if path not in self.paths:
            return NONE
        return self.base.for_site(kind, layer_number, path)

    @property
    def enabled(self) -> bool:
        return bool(self.paths)


def site_label(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    return SITE_LABELS.get(last, last)


def sweep_targets(sites) -> List[Tuple[Optional[int], str, FrozenSet[str]]]:
    """(layer number or None, site label, global paths) per sweep target: one per layer and
    GEMM kind (a MoE layer's experts of one kind together), the output layer last."""
    groups: Dict[Tuple[Optional[int], str], set] = {}
    for site in sites:
        groups.setdefault((site.layer_number, site_label(site.name)), set()).add(site.state.path)
    order = {label: i for i, label in enumerate(SITE_ORDER)}
    keys = sorted(groups, key=lambda k: (k[0] is None, k[0] or 0, order.get(k[1], 99), k[1]))
    return [(layer, label, frozenset(groups[(layer, label)])) for layer, label in keys]


def layer_targets(sites) -> List[Tuple[Optional[int], str, FrozenSet[str]]]:
    """The `--sweep layers` design, for deep models: one layer at a time with all its sites
    (label "all"), then one site kind across all layers (layer None, key "all/LABEL"), the
    output layer last: L + kinds + 1 evaluations instead of L x kinds + 1."""
    per_site = sweep_targets(sites)
    layers: Dict[int, set] = {}
    kinds: Dict[str, set] = {}
    output = []
    for layer, label, paths in per_site:
        if layer is None:
            output.append((None, label, paths))
            continue
        layers.setdefault(layer, set()).update(paths)
        kinds.setdefault(label, set()).update(paths)
    order = {label: i for i, label in enumerate(SITE_ORDER)}
    return ([(layer, "all", frozenset(paths)) for layer, paths in sorted(layers.items())]
            + [(None, label, frozenset(kinds[label]))
               for label in sorted(kinds, key=lambda k: (order.get(k, 99), k))]
            + output)


def target_key(layer: Optional[int], label: str) -> str:
    """A sweep row's key: LAYER/SITE, all/SITE for a kind across layers, -/output."""
    if layer is not None:
        return f"{layer}/{label}"
    return "-/output" if label == "output" else f"all/{label}"


class EvaluatedModel:
    """The raw GPTModel (loaded once) and the module that runs it in the run's precision."""

    def __init__(self, args, raw_model, config, iteration: int):
        self.args = args
        self.raw = raw_model
        self.config = config
        self.iteration = iteration
        self.module = Float16Module(config, raw_model) if (args.bf16 or args.fp16) else raw_model

    def quantize(self, quant: QuantConfig) -> None:
        self.raw.quant_sites = apply_quantization(self.raw, quant)

    @property
    def sites(self):
        return self.raw.quant_sites

    def fp32_copy(self) -> "EvaluatedModel":
        """The same weights in fp32, unquantized (the gradient reference)."""
        args = copy.copy(self.args)
        args.bf16 = args.fp16 = False
        config = core_transformer_config_from_args(args)
        raw = build_gpt_model(args, config, QuantConfig())
        raw.load_state_dict({k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                             for k, v in self.raw.state_dict().items()})
        raw.to(next(self.raw.parameters()).device)
        model = EvaluatedModel(args, raw, config, self.iteration)
        model.quantize(QuantConfig())
        return model


def load_model(args, log=print) -> EvaluatedModel:
    """Build the model (bf16 scheme) and load --load's newest verified checkpoint into it."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ConfigError("evaluation runs without pipeline parallelism: drop "
                          "--pipeline-model-parallel-size (a checkpoint of any layout loads "
                          "into PP=1)")
    found = checkpointing.checkpoint_to_load(args.load, args.load_fallback_to_previous, log=log)
    if found is None:
        raise ConfigError(f"--load {args.load}: no checkpoint there (no tracker file)")
    config = core_transformer_config_from_args(args)
    raw = build_gpt_model(args, config, QuantConfig())
    if torch.cuda.is_available():
        raw.cuda(torch.cuda.current_device())
    args.no_load_optim = args.no_load_rng = True
    iteration, _ = checkpointing.load_checkpoint(args.load, found, raw, None, None, args, log=log)
    return EvaluatedModel(args, raw, config, iteration)
