"""``fabric consolidate CHECKPOINT_DIR [OUTPUT | --output_file OUTPUT]``: turn a sharded checkpoint into one
``torch.save`` file, by default ``CHECKPOINT_DIR.consolidated`` next to the directory (Lightning's form).
``--format huggingface`` writes the checkpoint's model instead as a Hugging Face folder (safetensors files and
their index; a Trainer ``HuggingFaceModel``'s config and tokenizer files beside them), by default
``CHECKPOINT.huggingface``; it also takes a one-file checkpoint.

Every sharded format is read, on a local disk or at an fsspec URL (``s3://...``): a DCP directory (FSDP,
model parallel) gives full tensors and plain ``optimizer.state_dict()`` optimizer states; a DeepSpeed
directory gives its float32 weights and client entries (DeepSpeed's optimizer shards cannot be rebuilt).
``torch.load(OUTPUT, weights_only=True)`` reads the output and ``fabric.load`` loads it on a single device.
Runs in one process without a process group; it needs memory for the whole checkpoint.
"""

from __future__ import annotations

import os

import click

#: ``--format``: one ``torch.save`` file, or a Hugging Face folder of the model's weights.
OUTPUT_FORMATS = ("torch", "huggingface")


@click.command("consolidate")
@click.argument("checkpoint_dir")
@click.argument("output", required=False)
@click.option(
    "--output_file",
    "--output-file",
    help="Where to write (the same as OUTPUT). Default: CHECKPOINT_DIR.consolidated (.huggingface with --format).",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(OUTPUT_FORMATS),
    default="torch",
    show_default=True,
    help="torch: one torch.save file of the whole checkpoint; huggingface: the model's weights as a Hugging Face "
    "folder that from_pretrained reads.",
)
@click.option(
    "--max-file-bytes",
    type=click.IntRange(min=1),
    help="With --format huggingface: the largest safetensors file in bytes (default: 5e9, save_pretrained's 5GB).",
)
def consolidate_command(
    checkpoint_dir: str, output: str | None, output_file: str | None, output_format: str, max_file_bytes: int | None
) -> None:
    """Write the sharded checkpoint CHECKPOINT_DIR (from fabric.save with FSDP or DeepSpeed; a path or URL)
    as one file OUTPUT (default: CHECKPOINT_DIR.consolidated), or with --format huggingface its model as a
    Hugging Face folder (default: CHECKPOINT_DIR.huggingface)."""
    from fabric.plugins.io.formats import CheckpointFormat, recognise
    from fabric.utilities.exceptions import CheckpointError

    if output is not None and output_file is not None and output != output_file:
        raise click.UsageError(f"Two outputs given: OUTPUT={output!r} and --output_file={output_file!r}.")
    output = output or output_file or default_output(checkpoint_dir, output_format)
    form = recognise(checkpoint_dir)
    accepted = {CheckpointFormat.DCP, CheckpointFormat.DEEPSPEED}
    if output_format == "huggingface":
        accepted.add(CheckpointFormat.FILE)
    elif max_file_bytes is not None:
        raise click.UsageError("--max-file-bytes sizes the files of --format huggingface only.")
    if form not in accepted:
        raise click.UsageError(
            f"{checkpoint_dir!r} is not a sharded checkpoint directory (no DCP .metadata file, no DeepSpeed "
            "latest file)."
        )
    try:
        if output_format == "huggingface":
            written = to_huggingface(checkpoint_dir, output, max_file_bytes)
        else:
            written = f"{consolidate(checkpoint_dir, output)} entries"
    except (CheckpointError, ValueError) as error:  # corrupt, or refused: one line, exit 1
        click.echo(f"fabric: error: {error}", err=True)
        raise SystemExit(1) from error
    click.echo(f"wrote {output} ({written})")


def default_output(checkpoint_dir: str, output_format: str = "torch") -> str:
    """``CHECKPOINT_DIR.consolidated`` (``.huggingface`` for that format), beside the directory."""
    suffix = ".huggingface" if output_format == "huggingface" else ".consolidated"
    if "://" in checkpoint_dir:
        return checkpoint_dir.rstrip("/") + suffix
    return os.path.abspath(checkpoint_dir.rstrip(os.sep) or os.sep) + suffix


def consolidate(checkpoint_dir: str, output: str) -> int:
    """Read ``checkpoint_dir`` whole and save it atomically to ``output``; returns the number of entries."""
    from fabric.plugins.io.formats import read_whole
    from fabric.plugins.io.torch_io import TorchCheckpointIO

    checkpoint_io = TorchCheckpointIO()
    checkpoint = read_whole(checkpoint_dir, checkpoint_io)
    checkpoint_io.save_checkpoint(checkpoint, output)
    return len(checkpoint)


def to_huggingface(checkpoint: str, output: str, max_file_bytes: int | None) -> str:
    """Read ``checkpoint`` whole and write its model entry as the Hugging Face folder ``output``, atomically;
    returns what was written, in words."""
    import tempfile
    from pathlib import Path

    from fabric.plugins.io.formats import read_whole
    from fabric.plugins.io.huggingface import (
        DEFAULT_MAX_FILE_BYTES,
        check_upload_target,
        write_huggingface_folder,
        write_huggingface_to_url,
    )
    from fabric.plugins.io.storage import is_remote
    from fabric.plugins.io.torch_io import TorchCheckpointIO
    from fabric.trainer.huggingface import huggingface_folder_contents

    remote = is_remote(output)
    if remote:
        check_upload_target(output)
    model = read_whole(checkpoint, TorchCheckpointIO()).get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{checkpoint!r} has no 'model' entry of weights to write as a Hugging Face folder.")
    # file names are checked against the file system they are first written to: the local one for a URL
    weights, files = huggingface_folder_contents(model, Path(tempfile.gettempdir()) if remote else Path(output))
    max_file_bytes = max_file_bytes or DEFAULT_MAX_FILE_BYTES
    if remote:
        write_huggingface_to_url(weights, output, max_file_bytes, files)
    else:
        write_huggingface_folder(weights, Path(output), max_file_bytes, files)
    return f"{len(weights)} tensors" + (f" and {', '.join(sorted(files))}" if files else "")
