"""Checkpoint-loading flags beyond Megatron-LM's own (added to its "checkpointing" group)."""

from __future__ import annotations


def add_checkpoint_load_args(parser):
    """--load-fallback-to-previous, shown in --help beside --load."""
    group = next((g for g in parser._action_groups if g.title == "checkpointing"), None) or \
        parser.add_argument_group(title="checkpointing")
    group.add_argument("--load-fallback-to-previous", action="store_true",
                       help="When the checkpoint --load would read (the tracker's iteration) "
                            "is incomplete or damaged, load the newest intact earlier "
                            "iter_* checkpoint instead, saying so in one line. Without it such "
                            "a checkpoint stops the run with one error line.")
    return parser
