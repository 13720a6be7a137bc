"""A GPT-2 language model in plain torch, the workload of ``fastckpt demo`` and of the benchmarks.

The architecture is GPT-2's (Radford et al. 2019): learned token and position embeddings, ``n_layer``
pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, a final LayerNorm, and an output head whose
weight *is* the token embedding (``lm_head.weight`` and ``transformer.wte.weight`` are one Parameter), so every
checkpoint of this model exercises tied-weight handling. Parameter names follow Hugging Face's ``GPT2LMHeadModel``
(``transformer.h.{i}.attn.c_attn.weight`` ...), but the projections are ``nn.Linear``, whose weights are the
transpose of GPT-2's ``Conv1D`` ones.

Presets (:data:`PRESETS`):

- ``small``: GPT-2 small, 124,439,808 parameters (vocabulary 50,257, context 1,024, 12 layers, 12 heads, width
  768). The demo feeds it byte-level tokens (0..255), a subset of the vocabulary; the other rows still train
  through the tied output head.
- ``tiny``: 120,576 parameters (byte vocabulary 256, context 64, 2 layers, 2 heads, width 64), for tests.
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "PRESETS", "GPTConfig", "num_parameters"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2 model.

    Attributes:
        vocab_size: number of token ids (rows of the tied embedding / output head).
        block_size: longest sequence, in tokens (rows of the position embedding).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: model width.
        dropout: dropout probability on embeddings, attention and residual branches (GPT-2 used 0.1).
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")

    def to_json_string(self) -> str:
        """The config as JSON; ``fastckpt.save_state`` writes it to ``config.json`` beside the weights.

        It names no transformers ``model_type``: this is the GPT-2 architecture in plain torch (``nn.Linear``
        weights, not transformers' ``Conv1D`` orientation), so transformers must not mistake it for its ``gpt2``.
        """
        return json.dumps({"architecture": "fastckpt-demo-gpt2", **dataclasses.asdict(self)}, indent=2,
                          sort_keys=True)


PRESETS: dict[str, GPTConfig] = {
    "small": GPTConfig(),
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; ``c_attn`` projects to queries, keys and values in one matmul."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        # [batch, seq, width] -> [batch, n_head, seq, head_dim]
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(batch, seq, width)))


class MLP(nn.Module):
    """Position-wise feed-forward: width -> 4 x width -> GELU (tanh approximation, as GPT-2) -> width."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 language model with ``lm_head.weight`` tied to ``transformer.wte.weight``.

    Example:
        >>> model = GPT(PRESETS["tiny"])
        >>> logits, loss = model(torch.zeros(2, 8, dtype=torch.long), targets=torch.zeros(2, 8, dtype=torch.long))
        >>> logits.shape
        torch.Size([2, 8, 256])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                "ln_f": nn.LayerNorm(config.n_embd),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        # GPT-2 scales the residual output projections by 1/sqrt(2 * n_layer).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[batch, seq, vocab_size]`` for token ids ``idx`` ``[batch, seq]`` (int64, seq <= block_size),
        and the mean cross-entropy against ``targets`` (same shape as ``idx``) when given."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence of {seq} tokens exceeds block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def num_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements; a tied weight counts once (124,439,808 for ``PRESETS["small"]``)."""
    return sum(p.numel() for p in model.parameters())
