"""Every place Fabric works around a bug or limit of torch, by id.

Each is marked where it is done by one comment, ``# torch-workaround(<id>): <what torch does wrong>``, and listed
here with what torch does wrong and the file that holds it. ``tests/utilities/test_torch_workarounds.py``
reproduces each torch behaviour (where that costs too much, it probes it as cheaply as is honest, and says how) and
fails with "torch no longer needs workaround <id>; remove it" once torch behaves; it also checks that the tags in the
source and this list agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The comment that marks a workaround in the source; group 1 is its id.
TAG = re.compile(r"# torch-workaround\(([a-z0-9-]+)\): \S")


@dataclass(frozen=True)
class TorchWorkaround:
    #: The file that holds the workaround and its tag, relative to the repository's root.
    file: str
    #: What torch (2.13) does wrong, that the workaround avoids.
    torch_behaviour: str


TORCH_WORKAROUNDS = {
    "gloo-shutdown-abort": TorchWorkaround(
        "fabric/fabric.py",
        "gloo aborts a rank at interpreter shutdown (SIGABRT, about 1 two-rank job in 8) while a DDP module still "
        "holds the process group",
    ),
    "compile-warns-about-itself": TorchWorkaround(
        "fabric/utilities/compile.py",
        "the first torch.compile warns that torch.jit.script_method is deprecated: torch's own use, not the caller's",
    ),
    "onednn-avx2-strided-1x1-grad": TorchWorkaround(
        "fabric/trainer/algorithms/channels_last.py",
        "oneDNN's AVX2 weight gradient of a strided 1x1 convolution on channels-last data corrupts the heap "
        "(1 thread) or returns wrong gradients (2 threads)",
    ),
    "dcp-single-process-warning": TorchWorkaround(
        "fabric/plugins/io/distributed_checkpoint.py",
        "DCP's save and load warn that they 'assume the intent' to work in one process even when told so "
        "(no_dist=True)",
    ),
    "dcp-load-fills-a-copy": TorchWorkaround(
        "fabric/plugins/io/distributed_checkpoint.py",
        "dcp.load fills a copy of the state dict it is given, so a checkpoint is read whole into an empty one only "
        "through the private _load_state_dict",
    ),
    "rng-state-from-a-view": TorchWorkaround(
        "fabric/trainer/checkpoint/checkpointer.py",
        "torch.set_rng_state given a view at an offset into a larger tensor crashes the process (SIGSEGV)",
    ),
    "transformer-fused-path": TorchWorkaround(
        "fabric/trainer/algorithms/transformer_paths.py",
        "nn.TransformerEncoderLayer's fused inference path reads its submodules' weights directly and skips the "
        "forward of a submodule that surgery replaced",
    ),
    "dtensor-cpu-mesh-rng": TorchWorkaround(
        "fabric/strategies/fsdp/strategy.py",
        "DTensor's random operators on a CPU mesh draw each rank's shard from its own generator: with one seed every "
        "rank's shard holds the same numbers",
    ),
    "torchrun-agent-store-reused": TorchWorkaround(
        "fabric/strategies/parallel.py",
        "env:// under torchrun's agent store joins the store the previous attempt used without a prefix: a restarted "
        "attempt reads that attempt's keys (gloo addresses)",
    ),
    "profiler-cycle-warning": TorchWorkaround(
        "fabric/utilities/profiler.py",
        "torch.profiler warns that it clears events at the end of each cycle, which is what one trace per cycle asks",
    ),
}
