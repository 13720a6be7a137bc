"""The files of one checkpoint folder, as the writer takes them: :class:`FilePart` (one safetensors file) and
:class:`SavePlan` (every file of a folder). The plan layer (:mod:`fastckpt._plan.save`) builds them; the commit
(:mod:`fastckpt._io.storage.local.commit`), the snapshot and the async writer consume them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FilePart", "SavePlan"]


@dataclass
class FilePart:
    """One safetensors file of a checkpoint: ``name`` in the folder, ``{tensor_name: tensor}``, metadata; ``dtype``
    (a safetensors name such as ``"BF16"``) stores its floating tensors in that dtype, converted while written."""

    name: str
    tensors: dict[str, torch.Tensor]
    metadata: list[tuple[str, str]] | None
    dtype: str | None = None


@dataclass
class SavePlan:
    """Everything one checkpoint folder will hold, before anything is written."""

    mode: str  # "full" or "model_only"
    step: int
    counts: dict[str, Any]  # part counts, plus manifest facts such as "layout": "accelerate"
    parts: list[FilePart] = field(default_factory=list)
    texts: dict[str, str | bytes] = field(default_factory=dict)  # small files: JSON text, or bytes (compat pickles)
    links: dict[str, Any] = field(default_factory=dict)  # files hard-linked from the previous checkpoint (sharing)

    @property
    def nbytes(self) -> int:
        """Tensor bytes in the plan (what the writer streams)."""
        return sum(t.numel() * t.element_size() for p in self.parts for t in p.tensors.values())
