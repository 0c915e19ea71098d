"""The evaluation itself: arms, the per-site sweep and gradient fidelity, then the outputs."""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Dict

import numpy as np
import torch

from megatron.evaluation import gradients as grads
from megatron.evaluation import outputs
from megatron.analysis.intervals import paired_delta, token_quantiles
from megatron.evaluation.losses import (
    ArmLosses, arm_losses, first_batch_logits, repeated_sequences, validation_batches,
    warm_up_scaling)
from megatron.evaluation.operand_stats import forward_operand_stats
from megatron.evaluation.model_state import (
    SiteSubset, layer_targets, load_model, sweep_targets, target_key)
from megatron.evaluation.specs import arm_config
from megatron.quantization.config import QuantConfig
from megatron.training.initialize import (
    destroy_distributed, initialize_distributed, set_random_seeds)
from megatron.training.tokenizer import build_tokenizer, vocab_size_with_padding


def _rank_0() -> bool:
    return torch.distributed.get_rank() == 0


def log(message: str) -> None:
    if _rank_0():
        print(f"[{datetime.now().strftime('%H:%M:%S')}] {message}", flush=True)


def _arm_summary(arm: ArmLosses, baseline: ArmLosses = None) -> dict:
    out = {"loss": arm.loss, "perplexity": float(np.exp(arm.loss)), "tokens": arm.tokens,
           "sequences": int(arm.sequence_sums.size), "seconds": round(arm.seconds, 2)}
    if baseline is not None:
        out["delta_vs_baseline"] = paired_delta(arm.sequence_sums, baseline.sequence_sums,
                                                arm.sequence_tokens)
        out["token_delta_quantiles"] = token_quantiles(arm.token_losses - baseline.token_losses)
    return out


def _eta(done: int, total: int, start: float) -> str:
    if done == 0:
        return ""
    return f", about {(time.time() - start) / done * (total - done):.0f} s left"


def _padded_vocab(args, vocab_size: int) -> int:
    """This layout's padded vocabulary, or the checkpoint's where it differs and this layout
    can hold it (a TP=2 import evaluated at TP=1 keeps its padding: the same model, the same
    zero logits in the loss); said in one line."""
    from megatron.training.model_args import read_common_state

    padded = vocab_size_with_padding(vocab_size, args.make_vocab_size_divisible_by,
                                     args.tensor_model_parallel_size)
    common = read_common_state(args.load) or {}
    saved = (common.get("model_shape") or {}).get("padded_vocab_size")
    if isinstance(saved, int) and saved != padded and saved >= vocab_size \
            and saved % args.tensor_model_parallel_size == 0:
        log(f"note: the checkpoint's vocabulary is padded to {saved} (this layout would pad "
            f"{vocab_size} to {padded}): evaluating with the checkpoint's {saved}")
        return saved
    return padded


def evaluate(own, args, start: float) -> Dict:
    initialize_distributed(args)
    try:
        return _evaluate(own, args, start)
    finally:
        destroy_distributed()


def _evaluate(own, args, start: float) -> Dict:
    set_random_seeds(args.seed)
    tokenizer = build_tokenizer(args)
    args.tokenizer_vocab_size = tokenizer.vocab_size       # checked against the checkpoint's
    args.padded_vocab_size = _padded_vocab(args, tokenizer.vocab_size)
    own.draw_seed = args.seed if own.rounding_seed is None else own.rounding_seed
    base = args.quant_config.settings
    arms_config = {spec: arm_config(spec, base, args.num_layers, args.seed)    # fail early
                   for spec in own.schemes}
    sweep_config = arm_config(own.sweep_scheme, base, args.num_layers, args.seed) \
        if own.sweep else None
    if _rank_0():
        os.makedirs(own.output_dir, exist_ok=True)
    model = load_model(args, log=log)
    batches = validation_batches(args, tokenizer)
    log(f"{len(batches)} validation micro-batches of {args.micro_batch_size} x "
        f"{args.seq_length} tokens per data-parallel rank; precision "
        f"{'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}")

    repeats = repeated_sequences(batches)
    if repeats:
        log(f"warning: {repeats} of {len(batches) * args.micro_batch_size} validation sequences "
            "repeat earlier ones (the validation split is smaller than --eval-iters x "
            "--global-batch-size sequences): the intervals count them as independent; lower "
            "--eval-iters or give the validation split a larger share (--split)")
    doc = {"baseline": own.schemes[0], "checkpoint": os.path.abspath(args.load),
           "iteration": model.iteration,
           "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
           "micro_batches_per_rank": len(batches), "repeated_sequences_rank0": repeats, "seq_length": args.seq_length,
           "data": "mock" if args.mock_data else args.data_path, "seed": args.seed,
           "rounding_seed": own.draw_seed,
           "schemes": {}}
    arms: Dict[str, ArmLosses] = {}
    t0 = time.time()
    for i, spec in enumerate(own.schemes):
        model.quantize(arms_config[spec])
        _warm_up(own, model, batches[0], False, spec)
        arms[spec] = arm_losses(model.module, batches, own.draw_seed, log, spec)
        base = arms[own.schemes[0]] if i else None
        doc["schemes"][spec] = _arm_summary(arms[spec], base)
        doc["schemes"][spec]["forward_operands"] = forward_operand_stats(model.module, batches[0])
        log(f"{spec}: loss {arms[spec].loss:.6f} ({i + 1}/{len(own.schemes)} arms"
            f"{_eta(i + 1, len(own.schemes), t0)})")
        if i == 0 and own.dump_logits:
            tokens, logits = first_batch_logits(model.module, batches[0], tokenizer.vocab_size)
            if _rank_0():
                np.savez(own.dump_logits, tokens=tokens, logits=logits)
                log(f"wrote {own.dump_logits} (tokens {tokens.shape}, logits {logits.shape})")
    doc["tokens"] = arms[own.schemes[0]].tokens
    doc["sequences"] = int(arms[own.schemes[0]].sequence_sums.size)

    if own.sweep:
        doc["sweep"], sweep_arms = _sweep(own, model, batches, arms, sweep_config)
        arms.update(sweep_arms)
    if own.gradients:
        doc["gradients"] = _gradients(own, model, batches, arms_config)
    doc["seconds"] = round(time.time() - start, 1)
    if _rank_0():
        written = outputs.write(doc, own.output_dir)
        written.append(outputs.write_sequences(arms, own.output_dir))
        log(f"wrote {', '.join(written)} in {doc['seconds']:.0f} s")
    return doc


def _warm_up(own, model, batch, backward: bool, label: str) -> None:
    """Fill the arm's amax histories from the first micro-batch (losses.warm_up_scaling); said
    once per run."""
    if warm_up_scaling(model, batch, backward) and not getattr(own, "warm_up_said", False):
        own.warm_up_said = True
        log(f"{label}: delayed-scaled operands (amax histories) take their first scales from "
            "a pass over the first micro-batch before each such arm is measured")


def _sweep(own, model, batches, arms, base: QuantConfig) -> dict:
    """One site at a time in --sweep-scheme; deltas against the unquantized model."""
    reference_spec = next((s for s in own.schemes if s == "bf16"), None)
    if reference_spec is None:
        model.quantize(QuantConfig())
        reference = arm_losses(model.module, batches, own.draw_seed, log, "unquantized")
    else:
        reference = arms[reference_spec]
    model.quantize(QuantConfig())
    targets = (layer_targets if own.sweep == "layers" else sweep_targets)(model.sites)
    rows = []
    sweep_arms = {} if reference_spec else {"sweep:reference": reference}
    t0 = time.time()
    for n, (layer, label, paths) in enumerate(targets, 1):
        subset = SiteSubset(scheme=f"sweep {label}", base=base, paths=paths,
                            backend=base.backend, settings=base.settings)
        model.quantize(subset)
        if not any(s.config.enabled for s in model.sites):
            continue       # the sweep scheme keeps this site in high precision
        _warm_up(own, model, batches[0], False, f"site {layer}/{label}")
        arm = arm_losses(model.module, batches, own.draw_seed, log, f"site {layer}/{label}")
        delta = paired_delta(arm.sequence_sums, reference.sequence_sums, arm.sequence_tokens)
        key = target_key(layer, label)
        sweep_arms[f"sweep:{key}"] = arm
        rows.append({"layer": layer, "site": label, "key": key, "paths": sorted(paths),
                     "loss": arm.loss, "delta": delta})
        where = ("output layer" if label == "output" else f"layer {layer} {label}"
                 if layer is not None else f"{label} in every layer")
        log(f"sweep {n}/{len(targets)}: {where}: delta {delta['mean']:+.6f}"
            f"{_eta(n, len(targets), t0)}")
    ranking = sorted(range(len(rows)), key=lambda i: -rows[i]["delta"]["mean"])
    return {"scheme": own.sweep_scheme, "design": own.sweep,
            "reference": reference_spec or "unquantized",
            "reference_loss": reference.loss, "sites": rows,
            "ranking": [rows[i]["key"] for i in ranking]}, sweep_arms


def _gradients(own, model, batches, arms_config) -> dict:
    """Every arm's gradient against the fp32 unquantized model's and the baseline arm's."""
    if torch.distributed.get_world_size() > 1:
        from megatron.training.errors import ConfigError

        raise ConfigError("--gradients runs in one process (no torchrun): the comparison holds "
                          "whole gradients of every parameter")
    gb = batches[:own.gradient_micro_batches]
    fp32 = model.fp32_copy()
    reference = grads.gradients(fp32.module, grads.unique_parameters(fp32.raw), gb,
                                own.draw_seed)
    del fp32
    params = grads.unique_parameters(model.raw)
    out = {"reference": "fp32 unquantized", "micro_batches": len(gb),
           "tokens": int(sum(float(b["loss_mask"].sum()) for b in gb)), "schemes": {}}
    baseline = None
    t0 = time.time()
    for n, spec in enumerate(own.schemes, 1):
        model.quantize(arms_config[spec])
        _warm_up(own, model, gb[0], True, spec)
        # The baseline's rows are kept (every other arm is compared with them); the other
        # arms stream theirs against the two references (one micro-batch's row in memory).
        against = (reference,) if baseline is None else (reference, baseline)
        g = grads.gradients(model.module, params, gb, own.draw_seed, against=against,
                            keep=baseline is None)
        entry = {"vs_fp32": grads.compare(g, reference, streamed=0),
                 "sites_vs_fp32": grads.per_site(g, reference, model.sites)}
        if baseline is None:
            baseline = g
        else:
            entry["vs_baseline"] = grads.compare(g, baseline, streamed=1)
        stochastic = any(s.config.stochastic for s in model.sites if s.config.enabled)
        if stochastic:
            entry["draws"] = grads.draws_curve(model.module, params, gb, own.draw_seed,
                                               own.gradient_draws, reference, log, spec)
        out["schemes"][spec] = entry
        log(f"gradients {n}/{len(own.schemes)} {spec}: rel L2 vs fp32 "
            f"{entry['vs_fp32']['rel_l2']:.4g}, cosine {entry['vs_fp32']['cosine']:.6f}"
            f"{_eta(n, len(own.schemes), t0)}")
    return out
