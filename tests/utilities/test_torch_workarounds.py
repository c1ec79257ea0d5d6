"""Each bug or limit of torch that Fabric works around (fabric/utilities/torch_workarounds.py), reproduced.

A test here passes while torch still behaves as the workaround assumes, and fails with "torch no longer needs
workaround <id>; remove it" once torch does not: then remove the workaround, its tag, its registry entry and its test.
The last tests check that the tags in the source and the registry agree, and that every workaround has its test here.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from packaging.version import Version
from strided_pointwise import strided_pointwise_gradients
from torch import nn
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

from fabric.plugins.environments import find_free_port
from fabric.utilities.torch_workarounds import TAG, TORCH_WORKAROUNDS

ROOT = Path(__file__).resolve().parents[2]


def no_longer_needed(workaround: str) -> str:
    """What a probe says once torch no longer does what ``workaround`` is for."""
    return f"torch no longer needs workaround {workaround}; remove it"


def _python(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter: for probes whose torch behaviour shows once per process, or crashes it."""
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120)


#: The newest torch release on which ``benchmarks/ddp_exit_codes.py`` saw raw two-rank gloo DDP jobs abort at exit.
GLOO_ABORT_SEEN_ON = (2, 13)


def test_gloo_aborted_at_shutdown_on_this_torch_release() -> None:
    """gloo-shutdown-abort. It hits about 1 two-rank job in 8, so reproducing it takes dozens of real DDP jobs (the
    benchmark: minutes). The cheapest honest probe is the release: on a torch newer than the last one seen to abort,
    this fails until the benchmark has been run on it."""
    release = Version(torch.__version__).release[:2]
    if_gone = no_longer_needed("gloo-shutdown-abort")
    assert release <= GLOO_ABORT_SEEN_ON, (
        f"torch {torch.__version__} is newer than the last release seen to abort: run `python "
        f"benchmarks/ddp_exit_codes.py --variants raw-none`; if no job aborts, {if_gone}; else raise GLOO_ABORT_SEEN_ON"
    )


def test_the_first_torch_compile_warns_about_its_own_use_of_torch_jit() -> None:
    """compile-warns-about-itself, in a fresh interpreter: the warning comes when torch.compile first loads."""
    result = _python("import torch; torch.compile(torch.nn.Linear(2, 2))", "-W", "always::DeprecationWarning")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "`torch.jit.script_method` is deprecated" in result.stderr, no_longer_needed("compile-warns-about-itself")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN's AVX2 kernels are x86 kernels")
def test_onednn_avx2_gets_the_weight_gradient_of_strided_1x1_convolutions_wrong() -> None:
    """onednn-avx2-strided-1x1-grad, with a bare ``.to(memory_format=torch.channels_last)``: on two threads the
    gradients come out wrong in every run (on one thread the heap corruption crashes only some runs)."""
    result = strided_pointwise_gradients(threads=2, routed=False)
    crashed = result.returncode != 0
    assert crashed or float(result.stdout) > 1e-3, no_longer_needed("onednn-avx2-strided-1x1-grad")


def test_dcp_warns_about_one_process_even_when_told_so(tmp_path: Path) -> None:
    """dcp-single-process-warning: ``no_dist=True`` is saying so, and both save and load still warn."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save({"weight": torch.arange(4.0)}, checkpoint_id=tmp_path, no_dist=True)
        dcp.load({"weight": torch.zeros(4)}, checkpoint_id=tmp_path, no_dist=True)
    assumed = [str(warning.message) for warning in caught if "assuming the intent" in str(warning.message)]
    assert len(assumed) == 2, no_longer_needed("dcp-single-process-warning")


def test_dcp_load_fills_a_copy_of_an_empty_state_dict(tmp_path: Path) -> None:
    """dcp-load-fills-a-copy: with the planner that reads every key, the dict given to ``dcp.load`` stays empty."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp-single-process-warning
        dcp.save({"weight": torch.arange(4.0)}, checkpoint_id=tmp_path, no_dist=True)
        checkpoint: dict[str, torch.Tensor] = {}
        dcp.load(checkpoint, checkpoint_id=tmp_path, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert checkpoint == {}, no_longer_needed("dcp-load-fills-a-copy")


def test_set_rng_state_from_a_view_at_an_offset_crashes() -> None:
    """rng-state-from-a-view, in a child process: it dies of SIGSEGV (a state read right would draw as the clone)."""
    result = _python(
        "import torch\n"
        "state = torch.get_rng_state()\n"
        "torch.set_rng_state(torch.stack([state, state])[1])\n"
        "drawn = torch.rand(4)\n"
        "torch.set_rng_state(state)\n"
        "print(torch.equal(drawn, torch.rand(4)))\n"
    )
    assert result.returncode != 0 or result.stdout.strip() != "True", no_longer_needed("rng-state-from-a-view")


class _Zeros(nn.Module):
    """A replacement of a ``Linear`` that keeps its weights (so the fused path can still read them) and returns 0."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.new_zeros(*features.shape[:-1], self.weight.shape[0])


def test_the_fused_encoder_path_skips_the_forward_of_a_replaced_submodule() -> None:
    """transformer-fused-path: in evaluation without gradients, a layer whose ``linear2`` returns zeros computes
    exactly what it computed with the original ``linear2``."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    source = torch.randn(2, 3, 8)
    with torch.no_grad():
        expected = layer(source)
        layer.linear2 = _Zeros(layer.linear2)
        assert torch.equal(layer(source), expected), no_longer_needed("transformer-fused-path")


_RANK_ONES_SHARD = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
torch.manual_seed(0)
full = torch.empty(8, 4).normal_()
torch.manual_seed(0)
sharded = distribute_tensor(torch.empty(8, 4), init_device_mesh("cpu", (2,)), [Shard(0)], src_data_rank=None)
torch.nn.init.normal_(sharded)
print(torch.equal(sharded.to_local(), full[:4]))
"""


def test_dtensor_draws_the_same_shard_on_every_rank_of_a_cpu_mesh() -> None:
    """dtensor-cpu-mesh-rng, as rank 1 of a two-rank world in one child process (torch's fake process group, which
    needs no peer): its shard of a seeded ``normal_`` holds rows 0..3 of the full draw, rank 0's numbers."""
    result = _python(_RANK_ONES_SHARD)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True", no_longer_needed("dtensor-cpu-mesh-rng")


def test_a_restarted_attempt_under_torchruns_agent_store_writes_over_the_previous_attempts_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun-agent-store-reused: two attempts of a one-rank world join the process group by env:// on a store
    hosted as torchrun's agent hosts it; the second adds no key of its own: it wrote over the first attempt's."""
    port = find_free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30))
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    keys = []
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        dist.init_process_group("gloo", init_method="env://")
        dist.destroy_process_group()
        keys.append(agent_store.num_keys())
    assert keys[0] > 0 and keys[1] == keys[0], no_longer_needed("torchrun-agent-store-reused")


_TWO_PROFILER_CYCLES = """
import torch
from torch.profiler import ProfilerActivity, profile, schedule

cycles = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=0, active=1, repeat=2),
                 on_trace_ready=lambda _: None)
with cycles:
    for _ in range(3):
        torch.ones(2).sum()
        cycles.step()
"""


def test_the_profiler_warns_that_it_clears_each_cycles_events() -> None:
    """profiler-cycle-warning, in a fresh interpreter (torch warns once per process): two cycles of one step."""
    result = _python(_TWO_PROFILER_CYCLES)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Profiler clears events at the end of each cycle" in result.stderr, no_longer_needed(
        "profiler-cycle-warning"
    )


def _tags() -> list[tuple[str, str]]:
    """``(id, file)`` of every workaround tag in fabric/ and fabric_cli/."""
    files = sorted([*ROOT.glob("fabric/**/*.py"), *ROOT.glob("fabric_cli/**/*.py")])
    return [
        (tag.group(1), path.relative_to(ROOT).as_posix()) for path in files for tag in TAG.finditer(path.read_text())
    ]


def test_every_workaround_is_tagged_once_in_the_file_the_registry_names() -> None:
    tags = _tags()
    assert sorted(workaround for workaround, _ in tags) == sorted(TORCH_WORKAROUNDS), "a tag without an entry, or twice"
    assert dict(tags) == {workaround: entry.file for workaround, entry in TORCH_WORKAROUNDS.items()}


def test_every_workaround_has_its_probe_here() -> None:
    probed = re.findall(r'no_longer_needed\(\s*"([a-z0-9-]+)"\s*\)', Path(__file__).read_text())
    assert sorted(set(probed)) == sorted(TORCH_WORKAROUNDS)
