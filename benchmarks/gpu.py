"""Training step time on one GPU: raw PyTorch vs this project's Fabric vs Lightning Fabric vs Accelerate.

What is measured
----------------
Every framework that is installed trains its own copy of one model (identical initial weights) on one fixed
batch that already lives on the device, with AdamW, in bf16-mixed precision (``torch.autocast`` to bfloat16,
float32 parameters, outputs cast back to float32 before the loss, which is what all three frameworks do):

* **torch**: the plain loop: ``with torch.autocast(...): out = model(x)``; ``loss(out.float())``;
  ``loss.backward()``; ``optimizer.step()``; ``optimizer.zero_grad(set_to_none=True)``.
* **fabric**: this project: ``fabric.setup(model, optimizer)`` and ``fabric.backward(loss)``.
* **fabric-fp8**: the same loop in ``precision="fp8-mixed"`` (torchao's float8 matmuls in every Linear layer but the
  output head), where torchao is installed: the float8 speed-up over the bf16 rows (its weights differ by float8's
  rounding, not by a different loop).
* **lightning**: Lightning Fabric (``lightning.fabric`` or ``lightning_fabric``), the same calls.
* **accelerate**: Hugging Face Accelerate: ``accelerator.prepare(model, optimizer)``, ``accelerator.backward``.

Workloads: ``mlp``, a tiny MLP (32-64-10, batch 64) whose step is pure launch and framework overhead; and
``gpt``, a GPT-style decoder of about 355 M parameters (24 layers, d_model 1024, 16 heads, MLP 4x, causal
``F.scaled_dot_product_attention``, tied LM head, vocabulary 50,304) on sequences of 1,024 tokens, batch 8.
Each runs eager and compiled (``torch.compile``; Fabric with ``setup(compile=True)``, Lightning and Accelerate
given the compiled module), unless ``--no-compile``.

How it is measured
------------------
Each phase (workload x eager/compiled) builds every framework's copy, warms each up (compilation happens
there), then times ``steps`` steps per framework in interleaved rounds whose order rotates, so drifts of the
machine hit every framework alike; the GPU is synchronised before and after each timed run. The table gives
the median time per step, its ratio to raw PyTorch's, and the median of the per-round ratios with their range
(the robust figure). tokens/s (samples/s for the MLP), MFU = 6 * parameters * tokens per step / step time /
the device's peak dense bf16 FLOP/s (``fabric.utilities.throughput.PEAK_FLOPS``; "n/a" for a device not in it),
and the peak memory of each framework's run: its own parameters and optimizer state plus the largest allocation above
what was resident when its run started (``torch.cuda.max_memory_allocated``). Every framework takes the same
number of steps on the same batch, so the final weights are compared with raw PyTorch's (``max |dw|``): 0 or
rounding-sized differences show that the loops did the same work.

Usage::

    python benchmarks/gpu.py                  # the full run on a GPU (a few minutes)
    python benchmarks/gpu.py --only gpt --no-compile
    python benchmarks/gpu.py --cpu-smoke      # a tiny configuration on the CPU, to check the script itself
    python benchmarks/gpu.py --only gpt --no-eager --gpt-width 4096 --gpt-layers 4 \
        --frameworks torch,fabric,fabric-fp8   # float8 against bf16 on layers wide enough for float8 to pay

The exit status is 1 when raw PyTorch or this project's Fabric failed, 0 otherwise (another framework's
failure is reported in its row).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import importlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer

import fabric
from fabric import Fabric
from fabric.utilities.throughput import device_peak_flops

SEED = 1234
FRAMEWORKS = ("torch", "fabric", "fabric-fp8", "lightning", "accelerate")

# --- the models ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50304
    layers: int = 24
    d_model: int = 1024
    heads: int = 16
    seq: int = 1024


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each on a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.heads = config.heads
        self.ln_attention = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.projection = nn.Linear(d, d)
        self.ln_mlp = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        q, k, v = (
            t.view(batch, seq, self.heads, d // self.heads).transpose(1, 2)
            for t in self.qkv(self.ln_attention(x)).split(d, dim=2)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, seq, d))
        output: torch.Tensor = x + self.down(F.gelu(self.up(self.ln_mlp(x))))
        return output


class GPT(nn.Module):
    """A GPT-2-style decoder with learned positions and an LM head tied to the token embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.d_model)
        self.positions = nn.Embedding(config.seq, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        self.head.weight = self.tokens.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_final(x))
        return logits


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def parameter_count(model: nn.Module) -> int:
    """Parameters, each shared tensor (the tied head) once."""
    return sum(parameter.numel() for parameter in model.parameters())


# --- workloads ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    inputs: torch.Tensor
    targets: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    items_per_step: int
    item_name: str
    flops_per_step: float | None
    steps: int
    warmup: int


def classification_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


def mlp_workload(device: torch.device, steps: int, warmup: int) -> Workload:
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(64, 32, generator=generator).to(device)
    targets = torch.randint(0, 10, (64,), generator=generator).to(device)
    return Workload(
        name="mlp",
        description="MLP 32-64-10, batch 64",
        build=make_mlp,
        inputs=inputs,
        targets=targets,
        loss=classification_loss,
        items_per_step=64,
        item_name="samples",
        flops_per_step=None,
        steps=steps,
        warmup=warmup,
    )


def gpt_workload(device: torch.device, config: GPTConfig, batch: int, steps: int, warmup: int) -> Workload:
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, config.vocab, (batch, config.seq + 1), generator=generator).to(device)
    with torch.device("meta"):
        parameters = parameter_count(GPT(config))
    description = (
        f"GPT {parameters / 1e6:,.1f}M parameters ({config.layers} layers, d_model {config.d_model}, "
        f"{config.heads} heads, vocabulary {config.vocab}), sequence {config.seq}, batch {batch}"
    )
    tokens_per_step = batch * config.seq
    return Workload(
        name="gpt",
        description=description,
        build=lambda: GPT(config),
        inputs=tokens[:, :-1].contiguous(),
        targets=tokens[:, 1:].contiguous(),
        loss=classification_loss,
        items_per_step=tokens_per_step,
        item_name="tokens",
        flops_per_step=6.0 * parameters * tokens_per_step,
        steps=steps,
        warmup=warmup,
    )


# --- the frameworks ----------------------------------------------------------------------------------------


@dataclass
class Runner:
    """One framework's training step over its own copy of the model."""

    name: str
    model: nn.Module  # the module whose parameters train (the framework's wrapper forwards to it)
    optimizer: Optimizer  # the optimizer holding the state (the framework's wrapper steps it)
    step: Callable[[], torch.Tensor]  # one training step; returns the loss, detached (no device sync)


def make_optimizer(model: nn.Module) -> Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def optional_module(*names: str) -> Any:
    """The first of ``names`` that imports, or None."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def framework_versions() -> dict[str, str | None]:
    """Each framework's version, None for one that is not installed."""
    lightning = optional_module("lightning", "lightning_fabric")
    accelerate = optional_module("accelerate")
    torchao = optional_module("torchao")
    return {
        "torch": torch.__version__,
        "fabric": fabric.__version__,
        "fabric-fp8": None if torchao is None else f"{fabric.__version__}, torchao {torchao.__version__}",
        "lightning": None if lightning is None else f"{lightning.__name__} {lightning.__version__}",
        "accelerate": None if accelerate is None else str(accelerate.__version__),
    }


def build_torch(model: nn.Module, work: Workload, device: torch.device, compile_args: dict[str, Any] | None) -> Runner:
    optimizer = make_optimizer(model)
    forward: Callable[[torch.Tensor], torch.Tensor] = (
        model if compile_args is None else torch.compile(model, **compile_args)
    )

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            output = forward(work.inputs)
        loss = work.loss(output.float(), work.targets)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Runner("torch", model, optimizer, step)


def fabric_api_step(runtime: Any, wrapped: Any, wrapped_optimizer: Any, work: Workload) -> Callable[[], torch.Tensor]:
    """One training step through a Fabric-style API (ours and Lightning's share it): forward, ``backward``, step."""

    def step() -> torch.Tensor:
        loss = work.loss(wrapped(work.inputs), work.targets)
        runtime.backward(loss)
        wrapped_optimizer.step()
        wrapped_optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build_fabric(
    model: nn.Module,
    work: Workload,
    device: torch.device,
    compile_args: dict[str, Any] | None,
    precision: str = "bf16-mixed",
    name: str = "fabric",
) -> Runner:
    runtime = Fabric(accelerator=device.type, devices=1, precision=precision)
    optimizer = make_optimizer(model)
    wrapped, wrapped_optimizer = runtime.setup(model, optimizer, compile=compile_args)

    step = fabric_api_step(runtime, wrapped, wrapped_optimizer, work)

    return Runner(name, model, optimizer, step)


def build_lightning(
    model: nn.Module, work: Workload, device: torch.device, compile_args: dict[str, Any] | None
) -> Runner:
    module = optional_module("lightning.fabric", "lightning_fabric")
    runtime = module.Fabric(accelerator=device.type, devices=1, precision="bf16-mixed")
    optimizer = make_optimizer(model)
    given = model if compile_args is None else torch.compile(model, **compile_args)  # Lightning re-applies it
    wrapped, wrapped_optimizer = runtime.setup(given, optimizer)

    step = fabric_api_step(runtime, wrapped, wrapped_optimizer, work)

    return Runner("lightning", model, optimizer, step)


def build_accelerate(
    model: nn.Module, work: Workload, device: torch.device, compile_args: dict[str, Any] | None
) -> Runner:
    module = optional_module("accelerate")
    # One mixed precision for every workload: Accelerate's state is a process-wide singleton.
    accelerator = module.Accelerator(mixed_precision="bf16", cpu=device.type == "cpu")
    optimizer = make_optimizer(model)
    given = model if compile_args is None else torch.compile(model, **compile_args)
    wrapped, wrapped_optimizer = accelerator.prepare(given, optimizer)

    def step() -> torch.Tensor:
        loss = work.loss(wrapped(work.inputs), work.targets)
        accelerator.backward(loss)
        wrapped_optimizer.step()
        wrapped_optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Runner("accelerate", model, optimizer, step)


Builder = Callable[[nn.Module, Workload, torch.device, "dict[str, Any] | None"], Runner]
BUILDERS: dict[str, Builder] = {
    "torch": build_torch,
    "fabric": build_fabric,
    "fabric-fp8": functools.partial(build_fabric, precision="fp8-mixed", name="fabric-fp8"),
    "lightning": build_lightning,
    "accelerate": build_accelerate,
}


# --- measuring ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One framework's result in one phase (workload x mode)."""

    workload: Workload
    mode: str
    framework: str
    version: str | None
    times: list[float] = field(default_factory=list)  # seconds per step, one per round
    peak_bytes: int | None = None
    max_weight_diff: float | None = None
    final_loss: float | None = None
    error: str | None = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resident_bytes(runner: Runner) -> int:
    """Bytes of the runner's parameters, gradients and optimizer state (each storage once)."""
    tensors: dict[int, int] = {}
    for parameter in runner.model.parameters():
        for tensor in (parameter, parameter.grad):
            if tensor is not None:
                tensors[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    for state in runner.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                tensors[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(tensors.values())


def describe(error: BaseException) -> str:
    message = " ".join(str(error).split())
    return f"failed: {type(error).__name__}: {message[:120]}"


def timed_run(runner: Runner, steps: int, device: torch.device) -> tuple[float, int | None, torch.Tensor]:
    """Seconds per step over ``steps`` steps, the peak bytes of the run (CUDA only) and the last loss."""
    peak_base = None
    if device.type == "cuda":
        resident = resident_bytes(runner)
        peak_base = torch.cuda.memory_allocated(device) - resident
        torch.cuda.reset_peak_memory_stats(device)
    loss = torch.zeros(())
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        loss = runner.step()
    synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    peak = None if peak_base is None else torch.cuda.max_memory_allocated(device) - peak_base
    return seconds, peak, loss


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_phase(
    work: Workload,
    compile_args: dict[str, Any] | None,
    versions: dict[str, str | None],
    repeats: int,
    device: torch.device,
) -> list[Row]:
    """Build every installed framework's copy of the model, warm each up, then time them in interleaved rounds."""
    mode = "eager" if compile_args is None else "compiled"
    rows = {name: Row(work, mode, name, versions[name]) for name in FRAMEWORKS}
    torch.manual_seed(SEED)
    with torch.device(device):
        base = work.build()
    runners: list[Runner] = []
    losses: dict[str, torch.Tensor] = {}
    for name in FRAMEWORKS:
        if versions[name] is None:
            continue
        try:
            runner = BUILDERS[name](copy.deepcopy(base), work, device, compile_args)
            for _ in range(work.warmup):  # compilation happens here
                losses[name] = runner.step()
            synchronize(device)
            runners.append(runner)
        except Exception as error:  # one framework's failure (e.g. out of memory) is reported in its row
            rows[name].error = describe(error)
            free_memory(device)
        print(f"  {work.name} {mode}: {name} {'ready' if rows[name].error is None else rows[name].error}", flush=True)
    del base
    for round_index in range(repeats):
        shift = round_index % max(1, len(runners))
        for runner in runners[shift:] + runners[:shift]:
            row = rows[runner.name]
            if row.error is not None:
                continue
            try:
                seconds, peak, losses[runner.name] = timed_run(runner, work.steps, device)
            except Exception as error:
                row.error = describe(error)
                free_memory(device)
                continue
            row.times.append(seconds)
            if peak is not None:
                row.peak_bytes = max(peak, row.peak_bytes or 0)
    reference = next((runner for runner in runners if runner.name == "torch" and rows["torch"].error is None), None)
    for runner in runners:
        row = rows[runner.name]
        if row.error is not None:
            continue
        row.final_loss = float(losses[runner.name])
        if reference is not None:
            with torch.no_grad():
                row.max_weight_diff = max(
                    (ours.float() - theirs.float()).abs().max().item()
                    for ours, theirs in zip(runner.model.parameters(), reference.model.parameters(), strict=True)
                )
    runners.clear()
    if compile_args is not None:
        importlib.import_module("torch._dynamo").reset()  # drops the compiled graphs and what they hold
    free_memory(device)
    return list(rows.values())


# --- the report --------------------------------------------------------------------------------------------


def format_table(rows: Sequence[Row], peak: float | None) -> str:
    header = (
        "| workload | mode | framework | version | ms/step | vs torch | paired vs torch [min-max] | items/s "
        "| MFU | peak memory GiB | max abs dw vs torch | final loss |"
    )
    lines = [header, "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        work = row.workload
        prefix = f"| {work.name} | {row.mode} | {row.framework} | {row.version or 'not installed'} "
        if row.version is None or row.error is not None or not row.times:
            status = "not installed" if row.version is None else (row.error or "no timed run")
            lines.append(prefix + f"| {status} | - | - | - | - | - | - | - |")
            continue
        seconds = statistics.median(row.times)
        torch_row = next(r for r in rows if r.workload is work and r.mode == row.mode and r.framework == "torch")
        if torch_row.times and torch_row.error is None:
            paired = [ours / theirs for ours, theirs in zip(row.times, torch_row.times, strict=False)]
            ratio = f"{seconds / statistics.median(torch_row.times):.3f}"
            paired_text = f"{statistics.median(paired):.3f} [{min(paired):.3f}-{max(paired):.3f}]"
        else:
            ratio, paired_text = "-", "-"
        rate = f"{work.items_per_step / seconds:,.0f} {work.item_name}/s"
        mfu = "n/a" if work.flops_per_step is None or peak is None else f"{work.flops_per_step / seconds / peak:.1%}"
        memory = "-" if row.peak_bytes is None else f"{row.peak_bytes / 2**30:.2f}"
        diff = "-" if row.max_weight_diff is None else f"{row.max_weight_diff:.3g}"
        loss = "-" if row.final_loss is None else f"{row.final_loss:.4f}"
        lines.append(
            prefix + f"| {seconds * 1e3:,.2f} | {ratio} | {paired_text} | {rate} | {mfu} | {memory} | {diff} | {loss} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, help="steps per timed run (default: mlp 200, gpt 10; smoke 3)")
    parser.add_argument("--warmup", type=int, help="untimed steps first, compilation included (mlp 20, gpt 3)")
    parser.add_argument("--repeats", type=int, help="interleaved timed rounds (default 5; smoke 2)")
    parser.add_argument("--only", choices=("mlp", "gpt"), help="run one workload only")
    parser.add_argument("--gpt-batch-size", type=int, default=8, help="sequences per GPT step (default 8)")
    parser.add_argument("--gpt-layers", type=int, default=24, help="GPT layers (default 24)")
    parser.add_argument("--gpt-width", type=int, default=1024, help="GPT d_model, 64 per head (default 1024)")
    parser.add_argument("--no-compile", action="store_true", help="eager only (no torch.compile phases)")
    parser.add_argument("--no-eager", action="store_true", help="compiled only (no eager phases)")
    parser.add_argument(
        "--frameworks",
        type=lambda text: text.split(","),
        help=f"comma-separated subset of {','.join(FRAMEWORKS)} to run (torch is the reference; default: all)",
    )
    parser.add_argument(
        "--compile-backend",
        help="torch.compile backend (default inductor; smoke: aot_eager, which traces without a C++ build)",
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="a tiny configuration on the CPU (GPT of 2 layers, d_model 64, sequence 32), to check the script",
    )
    args = parser.parse_args(argv)
    if args.no_eager and args.no_compile:
        parser.error("--no-eager and --no-compile together leave nothing to run")
    unknown = sorted(set(args.frameworks or ()) - set(FRAMEWORKS))
    if unknown:
        parser.error(f"--frameworks: {unknown} are not frameworks here; accepted: {list(FRAMEWORKS)}")
    if args.frameworks is not None and "torch" not in args.frameworks:
        parser.error(f"--frameworks={','.join(args.frameworks)}: include torch, the reference of every ratio")
    if args.compile_backend is None:
        args.compile_backend = "aot_eager" if args.cpu_smoke else "inductor"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
        config, batch = GPTConfig(vocab=256, layers=2, d_model=64, heads=4, seq=32), 2
        steps = {"mlp": args.steps or 3, "gpt": args.steps or 3}
        warmup = {"mlp": args.warmup or 1, "gpt": args.warmup or 1}
        repeats = args.repeats or 2
    else:
        if not torch.cuda.is_available():
            print("no CUDA GPU here: run on a GPU machine, or pass --cpu-smoke for a tiny run on the CPU")
            return 2
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        config = GPTConfig(layers=args.gpt_layers, d_model=args.gpt_width, heads=args.gpt_width // 64)
        batch = args.gpt_batch_size
        steps = {"mlp": args.steps or 200, "gpt": args.steps or 10}
        warmup = {"mlp": args.warmup or 20, "gpt": args.warmup or 3}
        repeats = args.repeats or 5
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run)"
    peak = device_peak_flops(device_name, torch.bfloat16) if device.type == "cuda" else None
    versions = framework_versions()
    if args.frameworks is not None:  # the others are left out of the run and the table
        versions = {name: version if name in args.frameworks else None for name, version in versions.items()}
    workloads = [
        mlp_workload(device, steps["mlp"], warmup["mlp"]),
        gpt_workload(device, config, batch, steps["gpt"], warmup["gpt"]),
    ]
    workloads = [work for work in workloads if args.only in (None, work.name)]
    compile_modes: list[dict[str, Any] | None] = [] if args.no_eager else [None]
    if not args.no_compile:
        compile_modes.append({"backend": args.compile_backend})
        dynamo_config = importlib.import_module("torch._dynamo").config
        for limit in ("cache_size_limit", "recompile_limit"):  # one entry per framework's copy of the model
            if hasattr(dynamo_config, limit):
                setattr(dynamo_config, limit, max(64, getattr(dynamo_config, limit)))

    cuda = f" (CUDA {torch.version.cuda})" if device.type == "cuda" else ""
    peak_text = "unknown (MFU n/a)" if peak is None else f"{peak / 1e12:,.1f} TFLOP/s"
    print(f"# device: {device_name} | torch {torch.__version__}{cuda} | peak dense bf16: {peak_text}")
    print("# frameworks: " + ", ".join(f"{name} {version or 'not installed'}" for name, version in versions.items()))
    for work in workloads:
        print(f"# {work.name}: {work.description}; bf16-mixed, AdamW; {work.steps} steps x {repeats} rounds")
    rows: list[Row] = []
    for work in workloads:
        for compile_args in compile_modes:
            rows.extend(measure_phase(work, compile_args, versions, repeats, device))
    print(f"\n## Training step time on {device_name}\n")
    print(format_table([row for row in rows if args.frameworks is None or row.framework in args.frameworks], peak))
    print(
        "\nms/step: median over the rounds; vs torch: ratio of the medians; paired: the per-round ratios (median "
        "[min-max]); MFU: 6 x parameters x tokens / step time / peak; peak memory: the framework's own parameters "
        "and optimizer state plus its run's largest allocation above what was resident."
    )
    failed = [row for row in rows if row.framework in ("torch", "fabric") and row.error is not None]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
