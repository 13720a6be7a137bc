"""What ``fastckpt.accelerate`` handles: the Accelerator's distributed type, and save arguments that go together."""

from __future__ import annotations

from typing import Any

from fastckpt._io.async_save.modes import check_mode

__all__ = ["check_supported", "check_save_args"]

_UNSUPPORTED = {
    "DEEPSPEED": "DeepSpeed keeps its engine's own sharded files: use accelerator.save_state / load_state",
    "MEGATRON_LM": "Megatron-LM keeps its own sharded files: use accelerator.save_state / load_state",
    "XLA": "XLA tensors live on TPU devices: use accelerator.save_state / load_state",
}


def check_supported(accelerator: Any) -> str | None:
    """None, or the FSDP2 state_dict_type (``"SHARDED_STATE_DICT"`` / ``"FULL_STATE_DICT"``).

    Raises:
        NotImplementedError: DeepSpeed, Megatron-LM, XLA, or FSDP1 (each names what to use instead).
    """
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind in _UNSUPPORTED:
        raise NotImplementedError(f"fastckpt.accelerate does not handle DistributedType.{kind}: {_UNSUPPORTED[kind]}")
    if kind != "FSDP":
        return None
    plugin = accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise NotImplementedError("fastckpt.accelerate handles FSDP2 only (FullyShardedDataParallelPlugin("
                                  "fsdp_version=2)); for FSDP1 use accelerator.save_state / load_state")
    sdt = str(getattr(plugin.state_dict_type, "name", plugin.state_dict_type)).rsplit(".", 1)[-1]
    if sdt not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        raise NotImplementedError(f"fastckpt.accelerate handles FSDP2 with SHARDED_STATE_DICT or FULL_STATE_DICT, "
                                  f"not {sdt}; use accelerator.save_state / load_state")
    return sdt


def check_save_args(fsdp: str | None, *, compat: Any, trainable_only: bool, dtype: Any, share_unchanged: bool,
                     async_save: Any, extras: bool) -> None:
    """Raises ValueError / NotImplementedError for arguments that do not go together (before any process waits)."""
    if compat is not None and (trainable_only or dtype is not None or share_unchanged):
        raise ValueError("trainable_only, dtype and share_unchanged need fastckpt's layout; pass compat=None")
    check_mode(async_save)
    if async_save and fsdp is not None:
        raise ValueError("async_save does not apply to FSDP2 yet (its state is gathered or written through "
                         "torch.distributed.checkpoint); save with async_save=False")
    if compat not in (None, "accelerate"):
        raise ValueError(f"compat must be None or 'accelerate', got {compat!r}")
    if fsdp == "SHARDED_STATE_DICT" and compat:
        raise ValueError("compat='accelerate' does not apply to FSDP2 SHARDED_STATE_DICT (its shards are a "
                         "torch.distributed.checkpoint folder); use FULL_STATE_DICT for accelerate's files")
    if fsdp == "SHARDED_STATE_DICT" and extras:
        raise NotImplementedError("extra files and after_commit are not supported for FSDP2 SHARDED_STATE_DICT")
