"""Pretrain a GPT model (Llama 3 / DeepSeek-V2 style) on megatron-core.

    torchrun --nproc-per-node N pretrain_gpt.py <Megatron-LM flags>

Single process without torchrun works too (world size 1). See README.md for the flags.
"""

import os
import sys

# Make the repository importable when run as a script from a checkout.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from functools import partial  # noqa: E402

import torch  # noqa: E402

from megatron.training.batches import batch_to_device  # noqa: E402


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of per-token losses over unmasked tokens, their count, and the value to report.

    Returned as (loss, num_tokens, {"lm loss": [loss, num_tokens]}): megatron-core's schedules
    then average per token across micro-batches and data-parallel ranks.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach().double(), num_tokens.double()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One micro-batch: read it, run the model to per-token losses, return the loss function."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    tokens, labels, loss_mask, attention_mask, position_ids = batch_to_device(
        next(data_iterator), device)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def code_version() -> str:
    """`git describe` of this checkout (recorded in the log and capture run files), or
    "unknown" outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)),
                              "describe", "--always", "--dirty", "--tags"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


if __name__ == "__main__":
    from megatron.training.cli import main

    sys.exit(main(forward_step, code_version=code_version()))
