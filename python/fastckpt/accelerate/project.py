"""An Accelerator's project folder on local disk (``share_unchanged`` looks there for the previous checkpoint; every
save and load resolves a storage: :mod:`fastckpt.accelerate.location`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["project_root"]


def project_root(accelerator: Any) -> Path:
    """The Accelerator's ``project_dir`` (the working directory without one), absolute."""
    return Path(accelerator.project_dir if accelerator.project_dir is not None else os.getcwd()).absolute()
