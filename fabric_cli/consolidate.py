"""``fabric consolidate CHECKPOINT_DIR [OUTPUT | --output_file OUTPUT]``: turn a sharded checkpoint into one
``torch.save`` file, by default ``CHECKPOINT_DIR.consolidated`` next to the directory (Lightning's form).

Every sharded format is read, on a local disk or at an fsspec URL (``s3://...``): a DCP directory (FSDP,
model parallel) gives full tensors and plain ``optimizer.state_dict()`` optimizer states; a DeepSpeed
directory gives its float32 weights and client entries (DeepSpeed's optimizer shards cannot be rebuilt).
``torch.load(OUTPUT, weights_only=True)`` reads the output and ``fabric.load`` loads it on a single device.
Runs in one process without a process group; it needs memory for the whole checkpoint.
"""

from __future__ import annotations

import os

import click


@click.command("consolidate")
@click.argument("checkpoint_dir")
@click.argument("output", required=False)
@click.option(
    "--output_file",
    "--output-file",
    help="Where to write the file (the same as OUTPUT). Default: CHECKPOINT_DIR.consolidated.",
)
def consolidate_command(checkpoint_dir: str, output: str | None, output_file: str | None) -> None:
    """Write the sharded checkpoint CHECKPOINT_DIR (from fabric.save with FSDP or DeepSpeed; a path or URL)
    as one file OUTPUT (default: CHECKPOINT_DIR.consolidated)."""
    from fabric.plugins.io.formats import CheckpointFormat, recognise
    from fabric.utilities.exceptions import CheckpointError

    if output is not None and output_file is not None and output != output_file:
        raise click.UsageError(f"Two outputs given: OUTPUT={output!r} and --output_file={output_file!r}.")
    output = output or output_file or default_output(checkpoint_dir)
    form = recognise(checkpoint_dir)
    if form not in (CheckpointFormat.DCP, CheckpointFormat.DEEPSPEED):
        raise click.UsageError(
            f"{checkpoint_dir!r} is not a sharded checkpoint directory (no DCP .metadata file, no DeepSpeed "
            "latest file)."
        )
    try:
        entries = consolidate(checkpoint_dir, output)
    except CheckpointError as error:  # corrupt, or holds objects safe loading refuses: one line, exit 1
        click.echo(f"fabric: error: {error}", err=True)
        raise SystemExit(1) from error
    click.echo(f"wrote {output} ({entries} entries)")


def default_output(checkpoint_dir: str) -> str:
    """``CHECKPOINT_DIR.consolidated``, beside the directory."""
    if "://" in checkpoint_dir:
        return checkpoint_dir.rstrip("/") + ".consolidated"
    return os.path.abspath(checkpoint_dir.rstrip(os.sep) or os.sep) + ".consolidated"


def consolidate(checkpoint_dir: str, output: str) -> int:
    """Read ``checkpoint_dir`` whole and save it atomically to ``output``; returns the number of entries."""
    from fabric.plugins.io.formats import read_whole
    from fabric.plugins.io.torch_io import TorchCheckpointIO

    checkpoint_io = TorchCheckpointIO()
    checkpoint = read_whole(checkpoint_dir, checkpoint_io)
    checkpoint_io.save_checkpoint(checkpoint, output)
    return len(checkpoint)
