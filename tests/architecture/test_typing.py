"""The public calls are typed as they behave: ``save_state(..., async_save=False)`` is a ``Path``,
``async_save=True`` / ``"snapshot"`` an ``AsyncSave``, ``remote=`` a ``TieredSave``, a ``bool`` known only at run time either (checked by mypy's
``reveal_type`` on the source tree)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[2]

# Only the modules that define the public signatures are analyzed; torch and the rest are Any (fast, no torch stubs).
CONFIG = f"""
[mypy]
mypy_path = {ROOT / "python"}
follow_imports = skip
ignore_missing_imports = True
[mypy-fastckpt]
follow_imports = normal
[mypy-fastckpt.checkpoint]
follow_imports = normal
[mypy-fastckpt.accelerate]
follow_imports = normal
[mypy-fastckpt._io.async_save.writer]
follow_imports = normal
[mypy-fastckpt._io.storage.tiered.upload]
follow_imports = normal
"""

SNIPPET = """
import fastckpt, fastckpt.accelerate
def f(model, accelerator, flag: bool) -> None:
    reveal_type(fastckpt.save_state(model, output_dir="c"))
    reveal_type(fastckpt.save_state(model, output_dir="c", async_save=False))
    reveal_type(fastckpt.save_state(model, output_dir="c", async_save=True))
    reveal_type(fastckpt.save_state(model, output_dir="c", async_save="snapshot"))
    reveal_type(fastckpt.save_state(model, output_dir="c", async_save=flag))
    reveal_type(fastckpt.save_state(model, output_dir="c", remote="s3://b/c"))
    reveal_type(fastckpt.save_state(model, output_dir="c", async_save=True, remote="s3://b/c"))
    reveal_type(fastckpt.accelerate.save_state(accelerator, "c"))
    reveal_type(fastckpt.accelerate.save_state(accelerator, "c", async_save=True))
    reveal_type(fastckpt.accelerate.save_state(accelerator, "c", async_save="snapshot"))
    reveal_type(fastckpt.accelerate.save_state(accelerator, "c", async_save=flag))
"""

PATH, HANDLE, TIERED = "pathlib.Path", "fastckpt._io.async_save.writer.AsyncSave", "fastckpt._io.storage.tiered.upload.TieredSave"
EITHER = f"{PATH} | {HANDLE}"


@pytest.mark.slow
def test_save_state_return_type_follows_async_save(tmp_path):
    (tmp_path / "mypy.ini").write_text(CONFIG)
    (tmp_path / "snippet.py").write_text(SNIPPET)
    stdout, stderr, _ = mypy_api.run(["--config-file", str(tmp_path / "mypy.ini"), "--cache-dir", str(tmp_path / "c"),
                                      "--no-error-summary", "--hide-error-context", str(tmp_path / "snippet.py")])
    revealed = re.findall(r'snippet\.py:\d+: note: Revealed type is "([^"]+)"', stdout)
    assert revealed == [PATH, PATH, HANDLE, HANDLE, EITHER, TIERED, TIERED, PATH, HANDLE, HANDLE, EITHER], stdout + stderr
    errors = [line for line in stdout.splitlines() if "snippet.py" in line and ": error:" in line]
    assert errors == [], errors
