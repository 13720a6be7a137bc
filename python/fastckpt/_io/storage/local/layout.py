"""The checkpoint folder: file names (accelerate's), the manifest, automatic naming and rotation.

A fastckpt checkpoint folder holds, for ``n`` models / optimizers / schedulers (accelerate's suffix rule: the
first has none, then ``_1``, ``_2``...):

=====================================  ==============================================================
``model.safetensors``, ``model_1...``  model state dicts (Hugging Face compatible)
``optimizer.safetensors``, ...         optimizer state keyed by fqn (see :mod:`fastckpt._state.optimizer`)
``scheduler.json``, ...                scheduler state dicts (see :mod:`fastckpt._format.codec`)
``random_states_{rank}.safetensors``   RNG streams (see :mod:`fastckpt._state.rng`)
``config.json``                        the first model's config, when it has one (transformers)
``fastckpt.json``                      the manifest, written last: a folder without it is unfinished
=====================================  ==============================================================

A plain checkpoint dict (``fastckpt.save(obj, path)``, see :mod:`fastckpt._plan.dict_save`) is a folder of its
own layout (manifest ``"layout": "dict"``, ``"mode": "dict"``): ``state.safetensors`` (every tensor),
``state.json`` (the rest of the structure, exact JSON), ``state.pkl`` only when saved with ``trust_pickle=True``
and a value needed pickle, and ``fastckpt.json``.

With ``max_shard_size`` a model or optimizer file over the limit becomes ``{base}-0000k-of-0000N.safetensors`` plus
``{base}.safetensors.index.json`` (see :mod:`fastckpt._io.storage.local.shards`); ``fastckpt.accelerate`` adds the Accelerator's
other objects (see :mod:`fastckpt.accelerate.tracked_objects`); ``compat="accelerate"`` writes accelerate's own files (see
:mod:`fastckpt._plan.accelerate_format`) and records ``"layout": "accelerate"`` in the manifest.

Automatic naming follows accelerate's ``ProjectConfiguration``: full checkpoints go to
``{project_dir}/checkpoints/checkpoint_{n}``; model-only snapshots to ``{project_dir}/model_only/checkpoint_{n}``,
numbered and rotated on their own (``total_limit`` keeps the newest N of each kind), so frequent model-only
snapshots never push a resumable checkpoint out, and ``load_state(input_dir=None)`` (a full load) always finds the
newest *full* checkpoint (a model-only folder found under ``checkpoints/``, e.g. from an older fastckpt, is skipped
by full loads and by the rotation of full checkpoints).

Which layout a folder holds (:func:`checkpoint_layout`): a folder with ``fastckpt.json`` is fastckpt's (its
``layout`` entry says ``"accelerate"`` for a ``compat="accelerate"`` save); a folder without it is accelerate's when
it holds accelerate's files and none of the files only fastckpt writes (``random_states_*.safetensors``,
``optimizer*.safetensors``, ``scheduler*.json``). A folder with fastckpt-only files and no manifest is an unfinished
save: it is never loaded and never counts as a committed checkpoint. Stock accelerate checkpoints count as
committed when they hold ``random_states_0.pkl`` (the last file ``Accelerator.save_state`` writes for rank 0).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from fastckpt._format.json_input import load_json
from fastckpt._io.storage.local.file_size import recorded_size_problem
from fastckpt._version import __version__
from fastckpt.errors import CheckpointChangedError, HeaderError, IntegrityError, MissingStateError

__all__ = [
    "MANIFEST", "FORMAT_VERSION", "part_name", "random_states_name", "read_manifest", "manifest_dict",
    "checkpoint_layout", "is_committed", "CHECKPOINTS_DIR", "MODEL_ONLY_DIR", "SAVE_ID_KEY", "listed_files",
    "unlisted_files", "count_problems", "DICT_LAYOUT", "DICT_TENSORS", "DICT_STRUCTURE", "DICT_PICKLE",
]

MANIFEST = "fastckpt.json"
SAVE_ID_KEY = "fastckpt.save_id"  # in every safetensors file's metadata and (as "save_id") in the manifest
CHECKPOINTS_DIR = "checkpoints"  # full checkpoints with automatic naming
MODEL_ONLY_DIR = "model_only"  # model-only snapshots with automatic naming
FORMAT_VERSION = 1
DICT_LAYOUT = "dict"  # the manifest's layout (and mode) of a plain checkpoint dict
DICT_TENSORS = "state.safetensors"
DICT_STRUCTURE = "state.json"
DICT_PICKLE = "state.pkl"
_DICT_FILES_RE = re.compile(r"^state\.(safetensors|json|pkl)$")
_FASTCKPT_ONLY_RE = re.compile(
    r"^(random_states_\d+\.safetensors|optimizer(_\d+)?(-\d+-of-\d+)?\.safetensors(\.index\.json)?"
    r"|scheduler(_\d+)?\.json)$"
)
_ACCELERATE_RE = re.compile(
    r"^(random_states_\d+\.pkl|(optimizer|scheduler|pytorch_model)(_\d+)?\.bin"
    r"|model(_\d+)?(-\d+-of-\d+)?\.safetensors(\.index\.json)?)$"
)


#: The hidden subfolder an in-place commit stages in (:mod:`fastckpt._io.storage.local.in_place`).
IN_PLACE_STAGING = ".fastckpt-staging"

_EXPECTED_RE = re.compile(  # files a load of fastckpt's layout opens: each must be listed in the manifest
    r"^(random_states_\d+\.safetensors|(model|optimizer)(_\d+)?(-\d+-of-\d+)?\.safetensors(\.index\.json)?"
    r"|adapter_model\.safetensors|(scheduler|optimizer)(_\d+)?\.json)$"
)
_PART_FILE_RE = re.compile(r"^(.*\.safetensors|dcp_metadata\.json|dcp_index\.bin)$")  # files of a sharded save's DCP parts


def listed_files(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every file a (checked) manifest records: ``files`` and a sharded save's ``sharded.files`` (named
    ``part/file``), ``{name: {"bytes", "crc32c", "tensors", "xxh3"}}``."""
    files = dict(manifest.get("files", {}))
    sharded = manifest.get("sharded")
    if isinstance(sharded, dict):
        files.update(sharded.get("files", {}))
    return files


def unlisted_files(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """The files in ``folder`` a load would open (model*/optimizer*/random_states_* safetensors, shard indexes,
    scheduler*/optimizer*.json, a sharded save's part files) that its manifest does not list; sorted."""
    if manifest.get("layout") not in (None, "accelerate", DICT_LAYOUT):
        return []  # fastckpt.dcp's own folders ("layout": "dcp") list their files themselves
    pattern = {"accelerate": _ACCELERATE_RE, DICT_LAYOUT: _DICT_FILES_RE}.get(manifest.get("layout"), _EXPECTED_RE)
    listed = listed_files(manifest)
    found = [n for n in os.listdir(folder) if pattern.match(n) and n not in listed and (folder / n).is_file()]
    sharded = manifest.get("sharded")
    for part in sharded.get("parts", []) if isinstance(sharded, dict) else []:
        if isinstance(part, str) and (folder / part).is_dir():
            found += [f"{part}/{n}" for n in os.listdir(folder / part)
                      if _PART_FILE_RE.match(n) and f"{part}/{n}" not in listed]
    return sorted(found)


def checkpoint_layout(folder: Path) -> str:
    """``"fastckpt"`` or ``"accelerate"``: how to read ``folder`` (the rule is in the module docs).

    Raises:
        MissingStateError: no manifest and no accelerate files, or fastckpt files without a manifest (an
            unfinished save).
        HeaderError: the manifest is not valid JSON.
    """
    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            data = load_json(manifest.read_text(encoding="utf-8"), f"{manifest}", object)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HeaderError(f"{manifest}: not valid JSON: {exc}") from None
        return "accelerate" if isinstance(data, dict) and data.get("layout") == "accelerate" else "fastckpt"
    names = os.listdir(folder)
    partial = sorted(n for n in names if _FASTCKPT_ONLY_RE.match(n))
    # an in-place commit is renaming the new files in right now, or finished between the two looks (manifest back)
    if partial and (IN_PLACE_STAGING in names or MANIFEST in names):
        raise CheckpointChangedError(
            f"{folder}: a save is being committed in place (its {MANIFEST} comes last); retry the load"
        )
    if partial:
        raise MissingStateError(
            f"{folder}: holds fastckpt files ({', '.join(partial[:3])}) but no {MANIFEST}: a save that did not finish"
        )
    if any(_ACCELERATE_RE.match(n) for n in names):
        return "accelerate"
    raise MissingStateError(f"{folder}: no {MANIFEST} and no accelerate checkpoint files; not a checkpoint")


def is_committed(folder: Path) -> bool:
    """Whether ``folder`` is a finished checkpoint: fastckpt's (has the manifest) or stock accelerate's."""
    if (folder / MANIFEST).is_file():
        return True
    if not (folder / "random_states_0.pkl").is_file():
        return False
    return not any(_FASTCKPT_ONLY_RE.match(n) for n in os.listdir(folder))


def part_name(base: str, index: int, suffix: str) -> str:
    """accelerate's names: ``part_name("model", 0, ".safetensors") == "model.safetensors"``, index 1 -> ``model_1``."""
    return f"{base}{suffix}" if index == 0 else f"{base}_{index}{suffix}"


def random_states_name(rank: int) -> str:
    """``random_states_{rank}.safetensors``."""
    return f"random_states_{rank}.safetensors"


def manifest_dict(mode: str, files: dict[str, int], counts: dict[str, int], step: int,
                  checksums: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The manifest content: format version, mode, part counts, and every file's size in bytes (with its crc32c
    fields from ``checksums``, see :mod:`fastckpt._io.storage.local.integrity`)."""
    checksums = checksums or {}
    return {
        "format": "fastckpt",
        "format_version": FORMAT_VERSION,
        "fastckpt_version": __version__,
        "mode": mode,
        "step": step,
        **counts,
        "files": {name: {"bytes": size, **checksums.get(name, {})} for name, size in sorted(files.items())},
    }


def is_model_file(name: str) -> bool:
    """Whether a checkpoint file holds model weights (``model*.safetensors``, its shard index, ``config.json``)."""
    return name.startswith(("model", "adapter_")) or name == "config.json"


def read_manifest(folder: Path, *, check_sizes: bool = True, model_files_only: bool = False,
                  check_counts: bool = True, parsed: dict[str, Any] | None = None,
                  check_entries: bool = True) -> dict[str, Any]:
    """Read and check ``folder/fastckpt.json``.

    ``parsed``: the manifest as already read (a :class:`~fastckpt._io.storage.base.CheckpointView`'s, see
    :func:`peek_manifest`): checked, not read again.

    ``check_counts``: ``models`` / ``optimizers`` / ``schedulers`` must match the files listed (see
    :func:`count_problems`).

    ``model_files_only``: check the sizes of the model files alone (a model-only load of a full checkpoint whose
    optimizer files were pruned or damaged still loads its weights).

    ``check_entries=False`` (with ``check_sizes=False``): the top-level ``files`` entries are checked when they are
    read (:class:`CheckedOnUse`), not all at once: one rank of a DCP load opens a few of the N shard files a
    manifest lists, and checking every entry made its read grow with N.

    Raises:
        MissingStateError: no manifest (not a fastckpt checkpoint, or an unfinished save).
        MissingStateError: a file the counts promise is neither listed nor on disk (names it).
        HeaderError: the manifest is not valid JSON, has a format version this fastckpt cannot read, a ``mode``
            other than ``"full"`` / ``"model_only"`` or a field of another type than fastckpt writes.
        IntegrityError: a listed file is missing or has another size than recorded (names both sizes); a file the
            counts promise is on disk but not listed ("not in the manifest").
    """
    path = folder / MANIFEST
    try:
        manifest = load_json(path.read_text(encoding="utf-8"), f"{path}", object) if parsed is None else parsed
    except FileNotFoundError:
        raise MissingStateError(
            f"{folder}: no {MANIFEST}; not a fastckpt checkpoint, or a save that did not finish"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HeaderError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "fastckpt":
        raise HeaderError(f"{path}: not a fastckpt manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise HeaderError(f"{path}: format_version {manifest.get('format_version')!r}, this fastckpt reads {FORMAT_VERSION}")
    _check_manifest_fields(path, manifest, entries=check_entries or check_sizes)
    if not (check_entries or check_sizes):
        manifest = {**manifest, "files": CheckedOnUse(manifest.get("files", {}), path)}
    if check_counts:
        _check_counts(folder, manifest)
    if check_sizes:
        for name, info in manifest.get("files", {}).items():
            if model_files_only and not is_model_file(name):
                continue
            file = folder / name
            try:
                problem = recorded_size_problem(file, info["bytes"], MANIFEST)
            except FileNotFoundError:
                raise IntegrityError(f"{file}: listed in {MANIFEST} ({info['bytes']} bytes) but missing") from None
            if problem is not None:
                raise IntegrityError(problem)
    return manifest


def peek_manifest(folder: Path) -> dict[str, Any] | None:
    """``folder/fastckpt.json`` parsed (read once, through ``folder``: a pinned view's handle records it), or None
    when it is missing or not a JSON object (:func:`read_manifest` then raises the typed error naming why)."""
    try:
        manifest = load_json((folder / MANIFEST).read_text(encoding="utf-8"), f"{folder / MANIFEST}", object)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


_HEX8 = re.compile("[0-9a-f]{8}")
_HEX32 = re.compile("[0-9a-f]{32}")


def _is_hex8(value: Any) -> bool:
    return isinstance(value, str) and _HEX8.fullmatch(value) is not None  # one call per entry, not one per digit


def is_hash_hex(value: Any) -> bool:
    """Whether ``value`` is a content hash as the manifest stores it: 32 lowercase hex digits (xxh3-128)."""
    return isinstance(value, str) and _HEX32.fullmatch(value) is not None


def _check_sharing_fields(bad: Any, manifest: dict[str, Any]) -> None:
    """``frozen`` (trainable-only saves), ``shared`` / ``frozen_files`` (share_unchanged) and ``peft`` have the
    types fastckpt writes."""
    frozen = manifest.get("frozen", {})
    if not isinstance(frozen, dict) or not all(isinstance(v, dict) for v in frozen.values()):
        raise bad("'frozen' must map model names to {tensor: {dtype, shape, xxh3}}")
    for model, record in frozen.items():
        for name, info in record.items():
            shape = info.get("shape") if isinstance(info, dict) else None
            if (not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or not isinstance(shape, list)
                    or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                    or not is_hash_hex(info.get("xxh3"))):
                raise bad(f"frozen[{model!r}][{name!r}] must be {{dtype: str, shape: [int], xxh3: 32 hex digits}}, "
                          f"got {info!r}")
    shared = manifest.get("shared", {})
    if not isinstance(shared, dict) or not all(isinstance(v, str) for v in shared.values()):
        raise bad("'shared' must map file names to the checkpoint files they were linked from")
    frozen_files = manifest.get("frozen_files", [])
    if not isinstance(frozen_files, list) or not all(isinstance(v, str) for v in frozen_files):
        raise bad("'frozen_files' must be a list of file names")
    if not isinstance(manifest.get("peft", ""), str):
        raise bad(f"'peft' must be a file name, got {manifest['peft']!r}")


class CheckedOnUse(dict):
    """A manifest's ``files`` whose entries are checked (as :func:`read_manifest` checks them: HeaderError naming
    the manifest and the entry) the first time ``get`` or ``[]`` reads them."""

    def __init__(self, files: dict[str, Any], path: Path) -> None:
        super().__init__(files)
        self._path = path
        self._checked: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        info = super().__getitem__(name)
        if name not in self._checked:
            _check_file_entries(lambda msg: HeaderError(f"{self._path}: {msg}"), {name: info}, top=True)
            self._checked.add(name)
        return info

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return self[name] if name in self else default


def _check_manifest_fields(path: Path, manifest: dict[str, Any], *, entries: bool = True) -> None:
    """The manifest's fields have the types fastckpt writes; file names stay inside the folder (HeaderError).
    ``entries=False``: not the top-level ``files`` entries (checked on use, :class:`CheckedOnUse`)."""
    def bad(msg: str) -> HeaderError:
        return HeaderError(f"{path}: {msg}")

    for key in ("models", "optimizers", "schedulers", "step"):
        value = manifest.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad(f"{key!r} must be a non-negative integer, got {value!r}")
    modes = {"dcp": ("dcp",), DICT_LAYOUT: (DICT_LAYOUT,)}.get(manifest.get("layout"), ("full", "model_only"))
    if manifest.get("mode") not in modes:
        raise bad(f"'mode' must be {' or '.join(map(repr, modes))}, got {manifest.get('mode')!r}")
    _check_sharing_fields(bad, manifest)
    files = manifest.get("files", {})
    if not isinstance(files, dict):
        raise bad(f"'files' must be an object, got {type(files).__name__}")
    if entries:
        _check_file_entries(bad, files, top=True)
    sharded = manifest.get("sharded")
    if sharded is not None:
        if not isinstance(sharded, dict) or not isinstance(sharded.get("files", {}), dict):
            raise bad("'sharded' must be an object whose 'files' is an object")
        parts = sharded.get("parts", [])
        if not isinstance(parts, list) or not all(isinstance(p, str) and _safe_name(p) for p in parts):
            raise bad(f"'sharded'['parts'] must be a list of folder names, got {parts!r}")
        _check_file_entries(bad, sharded.get("files", {}), top=False)


def _safe_name(name: Any) -> bool:
    return (isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


def count_problems(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """Where ``models`` / ``optimizers`` / ``schedulers`` promise a file the manifest does not list: one line per
    file, saying "not in the manifest" when the file is on disk (a hand-edited manifest) and "missing" otherwise."""
    if manifest.get("layout") is not None:
        return []  # accelerate's and fastckpt.dcp's files follow their own names
    files = manifest.get("files", {})
    sharded = manifest.get("sharded")
    parts = set(sharded.get("parts", [])) if isinstance(sharded, dict) else set()
    wanted: list[tuple[str, ...]] = []  # the names that would do, the first one is named
    for i in range(manifest.get("models", 0)):
        if i == 0 and manifest.get("peft") in files:
            continue
        base = part_name("model", i, "")
        if isinstance(sharded, dict):
            wanted += [(base,)] if base not in parts else []
        elif base + ".safetensors" not in files and base + ".safetensors.index.json" not in files:
            wanted.append((base + ".safetensors", base + ".safetensors.index.json"))
    for j in range(manifest.get("optimizers", 0)):
        base = part_name("optimizer", j, "")
        if isinstance(sharded, dict):
            wanted += [(n,) for n in (base + ".json",) if n not in files] + ([(base,)] if base not in parts else [])
        elif base + ".safetensors" not in files and base + ".safetensors.index.json" not in files:
            wanted.append((base + ".safetensors", base + ".safetensors.index.json"))
    wanted += [(n,) for k in range(manifest.get("schedulers", 0)) if (n := part_name("scheduler", k, ".json")) not in files]
    counts = (f"{MANIFEST} records {manifest.get('models', 0)} models, {manifest.get('optimizers', 0)} optimizers, "
              f"{manifest.get('schedulers', 0)} schedulers")
    problems = []
    for names in wanted:
        on_disk = next((n for n in names if (folder / n).exists()), None)
        if on_disk is not None:
            problems.append(f"{folder / on_disk}: not in the manifest ({counts} but lists no such file)")
        else:
            problems.append(f"{folder / names[0]}: missing ({counts}; neither {MANIFEST} lists it nor is it on disk)")
    return problems


def _check_counts(folder: Path, manifest: dict[str, Any]) -> None:
    """IntegrityError for a counted file on disk that the manifest does not list, else MissingStateError naming
    the files the counts promise (see :func:`count_problems`)."""
    problems = count_problems(folder, manifest)
    if any(": not in the manifest" in p for p in problems):
        raise IntegrityError("; ".join(problems))
    if problems:
        raise MissingStateError("; ".join(problems))


def _check_file_entries(bad: Any, files: dict[str, Any], *, top: bool) -> None:
    for name, info in files.items():
        if top and not _safe_name(name):
            raise bad(f"file name {name!r} points outside the checkpoint folder")
        if not top and (not isinstance(name, str) or len(name.split("/")) != 2
                        or not all(_safe_name(p) for p in name.split("/"))):
            raise bad(f"sharded file name {name!r} points outside its part folder")
        if not isinstance(info, dict):
            raise bad(f"files[{name!r}] must be an object, got {info!r}")
        size = info.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"files[{name!r}]['bytes'] must be a non-negative integer, got {size!r}")
        if "crc32c" in info and not _is_hex8(info["crc32c"]):
            raise bad(f"files[{name!r}]['crc32c'] must be 8 hex digits, got {info['crc32c']!r}")
        tensors = info.get("tensors", {})
        if not isinstance(tensors, dict) or not all(_is_hex8(v) for v in tensors.values()):
            raise bad(f"files[{name!r}]['tensors'] must map tensor names to 8 hex digits")
        hashes = info.get("xxh3", {})
        if not isinstance(hashes, dict) or not all(is_hash_hex(v) for v in hashes.values()):
            raise bad(f"files[{name!r}]['xxh3'] must map tensor names to 32 hex digits")
