"""Workloads of the benchmark suite: GPT-style models with AdamW state from about 256 MB to 8 GB of total state,
and a single multi-GB tensor.

A GPT workload is :class:`fastckpt.demo.gpt2.GPT` (GPT-2's architecture, tied embedding / output head) in fp32 with
AdamW after one step, so every parameter has its ``exp_avg`` and ``exp_avg_sq``: the total state is about
3 x 4 bytes per parameter. The step uses a constant gradient instead of a forward / backward pass (same state
tensors, a fraction of the time).
"""

from __future__ import annotations

import dataclasses

import torch

from fastckpt.demo.gpt2 import GPT, GPTConfig

__all__ = ["Workload", "WORKLOADS", "DEFAULT_WORKLOADS", "LARGE_WORKLOADS", "TrainingState", "build_state",
           "state_tensors", "state_bytes", "model_bytes"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What to build.

    Attributes:
        name: ``"gpt-1GB"`` ...; ``"tensor-2GB"`` for the single tensor.
        config: the GPT shape; None for the single-tensor workload.
        tensor_numel: elements (fp32) of the single tensor.
        peers: also measure the peers that are not on every workload (safetensors, torch.save / torch.load,
            fastckpt's lazy and fresh-object loads), to keep the default run short.
    """

    name: str
    config: GPTConfig | None = None
    tensor_numel: int = 0
    peers: bool = False
    llama_layers: int = 0  # Llama-7B-shaped decoder layers (bf16; 4096x4096 attention, 4096x11008 MLP) instead

    @property
    def single_tensor(self) -> bool:
        return self.config is None and not self.llama_layers


def _gpt(n_layer: int, n_embd: int, vocab: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, block_size=1024, n_layer=n_layer, n_head=max(1, n_embd // 64), n_embd=n_embd,
                     dropout=0.0)


#: name -> workload; total state = 12 bytes per parameter (weights + two AdamW moments, fp32).
WORKLOADS: dict[str, Workload] = {
    "gpt-256MB": Workload("gpt-256MB", _gpt(6, 512, 8192)),       # 23.6M params, 0.28 GB of state
    "gpt-1GB": Workload("gpt-1GB", _gpt(6, 1024, 16384), peers=True),  # 93.4M params, 1.12 GB
    "gpt-2GB": Workload("gpt-2GB", _gpt(12, 1024, 32768)),        # 185M params, 2.2 GB
    "gpt-4GB": Workload("gpt-4GB", _gpt(12, 1536, 32768)),        # 392M params, 4.7 GB
    "gpt-8GB": Workload("gpt-8GB", _gpt(12, 2048, 32768)),        # 672M params, 8.1 GB
    # GPT-2 small itself (12 layers, width 768, vocabulary 50257): 124M params, 593 state tensors, 1.5 GB of state
    "gpt2-small": Workload("gpt2-small", _gpt(12, 768, 50257), peers=True),
    "tensor-2GB": Workload("tensor-2GB", tensor_numel=512 << 20, peers=True),  # one fp32 tensor of 2 GiB
    "tensor-1GB": Workload("tensor-1GB", tensor_numel=256 << 20),  # one fp32 tensor of 1 GiB
    "llama-1.2GB": Workload("llama-1.2GB", llama_layers=1),  # 202M bf16 params + AdamW moments: 1.21 GB
}
DEFAULT_WORKLOADS = ["gpt-256MB", "gpt-1GB", "gpt2-small", "gpt-2GB", "tensor-2GB"]
LARGE_WORKLOADS = ["gpt-4GB", "gpt-8GB"]


@dataclasses.dataclass
class TrainingState:
    """A model, its optimizer (None for the single tensor) and a scheduler (None for the single tensor)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None

    @property
    def objects(self) -> tuple:
        """``(model, optimizer, scheduler)`` without the Nones, as ``fastckpt.save_state`` takes them."""
        return tuple(o for o in (self.model, self.optimizer, self.scheduler) if o is not None)


class _LlamaLayer(torch.nn.Module):
    """The weights of one Llama-7B decoder layer (no compute: only their shapes and dtype matter here)."""

    def __init__(self) -> None:
        super().__init__()
        d, f = 4096, 11008
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, torch.nn.Linear(d, d, bias=False, dtype=torch.bfloat16))
        self.gate_proj = torch.nn.Linear(d, f, bias=False, dtype=torch.bfloat16)
        self.up_proj = torch.nn.Linear(d, f, bias=False, dtype=torch.bfloat16)
        self.down_proj = torch.nn.Linear(f, d, bias=False, dtype=torch.bfloat16)
        self.norm = torch.nn.Parameter(torch.ones(d, dtype=torch.bfloat16))


class _OneTensor(torch.nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(numel))


def build_state(workload: Workload, *, seed: int = 0, stepped: bool = True) -> TrainingState:
    """Build the workload's objects; ``stepped``: AdamW has taken one step (its moments exist and are faulted in).

    Args:
        workload: what to build.
        seed: torch seed for the initial weights (two states of one workload with different seeds differ).
        stepped: False gives fresh objects, as a new process has before its first step.

    Returns:
        The training state, every tensor resident in memory.
    """
    torch.manual_seed(seed)
    if workload.single_tensor:
        model = _OneTensor(workload.tensor_numel)
        with torch.no_grad():
            model.weight.uniform_(-1, 1)
        return TrainingState(model, None, None)
    if workload.llama_layers:
        model: torch.nn.Module = torch.nn.Sequential(*(_LlamaLayer() for _ in range(workload.llama_layers)))
    else:
        model = GPT(workload.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=100)
    if stepped:
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return TrainingState(model, optimizer, scheduler)


def state_tensors(state: TrainingState, *, model_only: bool = False) -> list[torch.Tensor]:
    """Every tensor of the state once (tied weights once), model first, then the optimizer's state."""
    seen: set[int] = set()
    out = []
    for t in state.model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    if not model_only and state.optimizer is not None:
        for per_param in state.optimizer.state.values():
            out.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return out


def state_bytes(state: TrainingState, *, model_only: bool = False) -> int:
    """Bytes of :func:`state_tensors`."""
    return sum(t.numel() * t.element_size() for t in state_tensors(state, model_only=model_only))


def model_bytes(state: TrainingState) -> int:
    """Bytes of the model's weights (tied weights once)."""
    return state_bytes(state, model_only=True)
