"""Optional Weights & Biases logging (--wandb-project), as in Megatron-LM.

wandb is not a dependency: without it a run given --wandb-project prints one warning and
trains on with TensorBoard and the log only.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional


def wandb_problem(args) -> Optional[str]:
    """The warning to print before training when W&B was asked for but cannot be used."""
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        return (f"warning: --wandb-project {args.wandb_project}: the wandb package is not "
                "installed (pip install wandb); logging to TensorBoard and the log only")
    return None


def open_wandb(args):
    """A W&B run (last rank only, by the caller), or None when not asked for or unavailable."""
    if not args.wandb_project or wandb_problem(args) is not None:
        return None
    import wandb

    config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))
              or v is None}
    kwargs = {"project": args.wandb_project, "name": args.wandb_exp_name, "config": config}
    if args.wandb_save_dir:
        os.makedirs(args.wandb_save_dir, exist_ok=True)
        kwargs["dir"] = args.wandb_save_dir
    return wandb.init(**kwargs)


def wandb_write_errors() -> tuple:
    """What W&B raises when it cannot write or send: OSError (its run directory), and
    wandb's own errors (a lost connection, a run that ended)."""
    errors = [OSError]
    try:
        import wandb
        errors.append(wandb.errors.Error)
    except Exception:   # noqa: BLE001 - wandb missing or without an errors module
        pass
    return tuple(errors)


def wandb_failure(args, when: str, reason: str) -> str:
    """The text of the one warning printed when W&B logging fails during a run."""
    where = args.wandb_save_dir or f"project {args.wandb_project}"
    return (f"writing W&B scalars to {where} failed {when} ({reason}): training goes on "
            "without them")
