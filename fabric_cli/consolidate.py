"""``fabric consolidate CHECKPOINT_DIR [OUTPUT | --output_file OUTPUT]``: turn a sharded checkpoint into one
``torch.save`` file, by default ``CHECKPOINT_DIR.consolidated`` next to the directory (Lightning's form).

The output holds full tensors and plain ``optimizer.state_dict()`` optimizer states, so
``torch.load(OUTPUT, weights_only=True)`` reads it and ``fabric.load`` loads it on a single device.
Runs in one process without a process group; it needs memory for the whole checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("consolidate")
@click.argument("checkpoint_dir", type=click.Path(path_type=Path))
@click.argument("output", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--output_file",
    "--output-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the file (the same as OUTPUT). Default: CHECKPOINT_DIR.consolidated.",
)
def consolidate_command(checkpoint_dir: Path, output: Path | None, output_file: Path | None) -> None:
    """Write the sharded checkpoint CHECKPOINT_DIR (from fabric.save with FSDP) as one file OUTPUT
    (default: CHECKPOINT_DIR.consolidated)."""
    from fabric.plugins.io.distributed_checkpoint import is_distributed_checkpoint

    if output is not None and output_file is not None and output != output_file:
        raise click.UsageError(f"Two outputs given: OUTPUT={str(output)!r} and --output_file={str(output_file)!r}.")
    output = output or output_file or default_output(checkpoint_dir)

    if not is_distributed_checkpoint(checkpoint_dir):
        raise click.UsageError(f"{str(checkpoint_dir)!r} is not a sharded checkpoint directory (no .metadata file).")
    from fabric.utilities.exceptions import CheckpointError

    try:
        entries = consolidate(checkpoint_dir, output)
    except CheckpointError as error:  # corrupt, or holds objects safe loading refuses: one line, exit 1
        click.echo(f"fabric: error: {error}", err=True)
        raise SystemExit(1) from error
    click.echo(f"wrote {output} ({entries} entries)")


def default_output(checkpoint_dir: Path) -> Path:
    """``CHECKPOINT_DIR.consolidated``, beside the directory."""
    directory = checkpoint_dir.resolve()
    return directory.with_name(directory.name + ".consolidated")


def consolidate(checkpoint_dir: Path, output: Path) -> int:
    """Read ``checkpoint_dir`` whole and save it atomically to ``output``; returns the number of entries."""
    from fabric.plugins.io.distributed_checkpoint import read_whole
    from fabric.plugins.io.torch_io import TorchCheckpointIO

    checkpoint = read_whole(checkpoint_dir)
    TorchCheckpointIO().save_checkpoint(checkpoint, output)
    return len(checkpoint)
