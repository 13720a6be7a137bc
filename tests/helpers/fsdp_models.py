"""Models and training for the FSDP2 tests (tests/integrations/test_fsdp*.py and tests/helpers/mp_fsdp_worker.py).

Two models: a tiny transformers GPT-2 (``wte`` tied to ``lm_head``, dropout off) and a plain GPT-like model whose
sizes (7, 13, 11 ...) shard unevenly over 2 and 4 ranks. Under FSDP2 (``fully_shard`` per block, then the root)
every rank runs the same batch and only rank 0's loss counts (``loss * world`` on rank 0, ``loss * 0`` elsewhere):
scaling by a power of two and adding zeros are exact, so W-rank training is bit-identical to one plain process and
a test can compare the two with ``torch.equal``.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 37


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + torch.tanh(self.attn(h))
        return x + self.down(torch.relu(self.up(h)))


class TinyGPT(nn.Module):
    """Embedding (VOCAB x 13), three blocks (hidden 11), head: every dim 0 shards unevenly over 2 and 4 ranks."""

    def __init__(self, dim: int = 13, hidden: int = 11, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("scale", torch.tensor([0.5, 2.0, 3.0]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.scale[0]


def build_gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=12, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def build(kind: str, seed: int = 0, **sizes: int) -> nn.Module:
    """A fresh model: ``kind`` is ``"gpt2"`` or ``"tiny"``."""
    if kind == "gpt2":
        return build_gpt2(seed)
    torch.manual_seed(seed)
    return TinyGPT(**sizes)


def blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.transformer.h) if hasattr(model, "transformer") else list(model.blocks)


def shard(model: nn.Module) -> nn.Module:
    """FSDP2: ``fully_shard`` each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for b in blocks(model):
        fully_shard(b)
    fully_shard(model)
    return model


def optimizer_for(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (4, 9), generator=g)


def train_step(model: nn.Module, opt, sched, step: int, *, rank: int = 0, world: int = 1) -> None:
    ids = batch(step)
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    (loss * (world if rank == 0 else 0)).backward()
    opt.step()
    sched.step()


def full_state(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Every model tensor and optimizer state tensor, unsharded, keyed ``model.{fqn}`` / ``optim.{fqn}.{name}``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"model.{k}": full(v) for k, v in get_model_state_dict(model).items()}
    if opt is not None and opt.state:
        for fqn, state in get_optimizer_state_dict(model, opt)["state"].items():
            out.update({f"optim.{fqn}.{n}": full(v) for n, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (or exist on one side only): for messages."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def reference(kind: str, steps: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """The same training in one plain process: ``steps`` steps from seed 0."""
    model = build(kind)
    opt, sched = optimizer_for(model)
    for s in range(steps):
        train_step(model, opt, sched, s)
    return model, opt, sched
