"""How much of an arm's gradient error comes from a few tokens whose forward is fragile.

For a checkpoint, the first --micro-batches validation micro-batches, and each arm (a
tools/evaluate.py spec, run as given), in the run's precision against the unquantized model in
fp32 (the reference of evaluate.py --gradients):

* tokens are flagged where the reference's residual stream entering the final norm has an RMS
  below --rms-fraction times the micro-batch's median (the final RMSNorm divides by that RMS);
* the relative L2 error of the whole gradient (every parameter) of the mean per-token loss,
  per micro-batch, with every token in the loss and with the flagged tokens' losses masked
  (reference and arm alike; evaluate.py's gradient code);
* the forward's drift: mean |loss_arm - loss_ref| per token, and the relative change of the
  final norm's input ||h_arm - h_ref|| / ||h_ref|| at flagged and at other tokens (median,
  max).

    python benchmarks/gradient_tokens.py --load CKPT --data-path PREFIX --split 98,2,0 \\
        --seq-length 128 --micro-batch-size 2 --bf16 [--micro-batches 4] [--arms SPEC ...]

Every flag besides --arms, --micro-batches, --rms-fraction and --json is pretrain_gpt.py's
(data, batch, tokenizer), as for tools/evaluate.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

DEFAULT_ARMS = ("bf16", "linear_mxfp8", "linear_mxfp8@mx-scale-mode=rceil",
                "linear_fp8@fp8-recipe=tensorwise")


def final_norm_inputs(evaluated, batches):
    """([tokens [b, s] float64 losses], [final-norm input [s, b, h] float64]) per batch."""
    import torch

    from megatron.evaluation.losses import device
    from megatron.training.batches import batch_to_device

    final = [m for n, m in evaluated.raw.named_modules() if n.endswith("final_layernorm")]
    if len(final) != 1:
        raise SystemExit("error: the model has no single final_layernorm")
    seen = []
    handle = final[0].register_forward_hook(
        lambda module, inputs, output: seen.append(inputs[0].detach().double().cpu()))
    losses, hidden = [], []
    try:
        with torch.no_grad():
            for batch in batches:
                tokens, labels, _, attention_mask, position_ids = batch_to_device(batch, device())
                out = evaluated.module(tokens, position_ids, attention_mask, labels=labels)
                losses.append(out.double().cpu().numpy())
                hidden.append(seen.pop())
    finally:
        handle.remove()
    return losses, hidden


def flagged_tokens(hidden, fraction: float):
    """[b, s] bool per batch: final-norm input RMS below `fraction` x the batch's median."""
    out = []
    for h in hidden:
        rms = h.pow(2).mean(-1).sqrt().t().numpy()          # [b, s]
        out.append(rms < fraction * np.median(rms))
    return out


def masked(batches, flags):
    """The batches with the flagged tokens' loss mask set to 0."""
    import torch

    out = []
    for batch, flag in zip(batches, flags):
        copy = dict(batch)
        copy["loss_mask"] = batch["loss_mask"] * torch.from_numpy(~flag).to(
            batch["loss_mask"].dtype)
        out.append(copy)
    return out


def drift(ref_losses, ref_hidden, losses, hidden, flags):
    """Mean |d loss| per token, and the median / max relative change of the final norm's
    input at flagged and at other tokens."""
    dloss = np.concatenate([np.abs(a - r).ravel() for a, r in zip(losses, ref_losses)])
    change, flag_all = [], []
    for r, a, flag in zip(ref_hidden, hidden, flags):
        rel = ((a - r).norm(dim=-1) / r.norm(dim=-1)).t().numpy()     # [b, s]
        change.append(rel.ravel())
        flag_all.append(flag.ravel())
    change, flag_all = np.concatenate(change), np.concatenate(flag_all)

    def stats(values):
        return [float(np.median(values)), float(values.max())] if values.size else None
    return {"mean_abs_dloss": float(dloss.mean()),
            "hidden_change_flagged": stats(change[flag_all]),
            "hidden_change_other": stats(change[~flag_all])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), metavar="SPEC",
                   help="tools/evaluate.py specs, run as given (default: %(default)s).")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="Validation micro-batches (the first ones, as evaluate.py's "
                        "--gradients takes them; default %(default)s).")
    p.add_argument("--rms-fraction", type=float, default=0.5,
                   help="Flag tokens whose final-norm input RMS is below this fraction of the "
                        "micro-batch's median (default %(default)s).")
    p.add_argument("--json", metavar="FILE", help="Also write the results as JSON.")
    own, rest = p.parse_known_args(argv)

    import warnings

    warnings.filterwarnings("ignore")
    from megatron.evaluation import gradients as grads
    from megatron.evaluation.losses import validation_batches
    from megatron.evaluation.model_state import load_model
    from megatron.evaluation.run import _padded_vocab
    from megatron.evaluation.specs import arm_config
    from megatron.training.initialize import destroy_distributed, set_random_seeds
    from megatron.training.tokenizer import build_tokenizer

    from gradient_operands import gradient_step_args

    args = gradient_step_args(rest, own.micro_batches)
    results = {"micro_batches": own.micro_batches, "rms_fraction": own.rms_fraction,
               "arms": {}}
    try:
        set_random_seeds(args.seed)
        tokenizer = build_tokenizer(args)
        args.padded_vocab_size = _padded_vocab(args, tokenizer.vocab_size)
        model = load_model(args, log=lambda *_: None)
        batches = validation_batches(args, tokenizer)[:own.micro_batches]
        fp32 = model.fp32_copy()
        ref_losses, ref_hidden = final_norm_inputs(fp32, batches)
        flags = flagged_tokens(ref_hidden, own.rms_fraction)
        results["flagged"] = [[list(map(int, ij)) for ij in zip(*np.nonzero(f))] for f in flags]
        results["tokens"] = int(sum(f.size for f in flags))
        print(f"flagged tokens (final-norm input RMS < {own.rms_fraction} x median): "
              f"{sum(int(f.sum()) for f in flags)} of {results['tokens']}, per micro-batch "
              f"{[int(f.sum()) for f in flags]}")
        variants = {"all tokens": batches, "flagged masked": masked(batches, flags)}
        references = {name: grads.gradients(fp32.module, grads.unique_parameters(fp32.raw),
                                            bs, args.seed)
                      for name, bs in variants.items()}
        del fp32
        params = grads.unique_parameters(model.raw)
        for spec in own.arms:
            model.quantize(arm_config(spec, args.quant_config.settings, args.num_layers,
                                      args.seed))
            entry = {}
            for name, bs in variants.items():
                g = grads.gradients(model.module, params, bs, args.seed,
                                    against=(references[name],), keep=False)
                entry[name] = grads.compare(g, references[name], streamed=0)
            losses, hidden = final_norm_inputs(model, batches)
            entry["drift"] = drift(ref_losses, ref_hidden, losses, hidden, flags)
            results["arms"][spec] = entry
            print_arm(spec, entry)
    finally:
        destroy_distributed()
    if own.json:
        with open(own.json, "w") as f:
            json.dump(results, f, indent=1)


def print_arm(spec, entry):
    print(f"\n{spec}")
    for name in ("all tokens", "flagged masked"):
        c = entry[name]
        per = ", ".join(f"{v:.3f}" for v in c["per_micro_batch"]["rel_l2"])
        print(f"  gradient rel L2 vs fp32, {name:<15}: total {c['rel_l2']:.4f}   per micro-batch "
              f"{per}")
    d = entry["drift"]

    def show(stats):
        return "-" if stats is None else f"median {stats[0]:.4f}, max {stats[1]:.4f}"
    print(f"  forward drift: mean |d loss| {d['mean_abs_dloss']:.2e} nats/token; final-norm "
          f"input change at flagged tokens {show(d['hidden_change_flagged'])}, at the others "
          f"{show(d['hidden_change_other'])}")


if __name__ == "__main__":
    main()
