"""Where an Accelerator's checkpoints go on local disk: its project folder and automatic naming (the sharded FSDP2
save's; every other save and load resolves a storage: :mod:`fastckpt.accelerate.location`)
(accelerate's ``ProjectConfiguration`` rules; model-only snapshots numbered apart, see :mod:`fastckpt._io.storage.local.layout`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastckpt._io.storage.local.numbering import checkpoint_numbers, next_checkpoint_dir

__all__ = ["project_root", "choose_target"]


def project_root(accelerator: Any) -> Path:
    """The Accelerator's ``project_dir`` (the working directory without one), absolute."""
    return Path(accelerator.project_dir if accelerator.project_dir is not None else os.getcwd()).absolute()


def choose_target(accelerator: Any, output_dir: Any, model_only: bool) -> tuple[Path, int | None]:
    """(target folder, automatic number or None). Runs on the main process.

    An explicit ``output_dir`` is always used; otherwise automatic naming puts a full save in
    ``checkpoints/checkpoint_{n}`` (n = max(iteration, largest committed + 1)) and a model-only save in
    ``model_only/checkpoint_{n}`` (its own numbering, see :mod:`fastckpt._io.storage.local.layout`).
    """
    config = accelerator.project_configuration
    if output_dir is not None:
        return Path(output_dir).expanduser().absolute(), None
    if not config.automatic_checkpoint_naming:
        raise ValueError("output_dir is required unless the Accelerator's ProjectConfiguration has "
                         "automatic_checkpoint_naming=True")
    root = project_root(accelerator)
    if model_only:
        target = next_checkpoint_dir(root, model_only=True)
        return target, int(target.name.rsplit("_", 1)[1])
    numbers = checkpoint_numbers(root)
    n = max(int(config.iteration), max(numbers) + 1 if numbers else 0)
    return root / "checkpoints" / f"checkpoint_{n}", n
