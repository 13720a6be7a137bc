"""``fastckpt.lightning.CheckpointIO``: PyTorch Lightning's checkpoints through :func:`fastckpt.save` / :func:`fastckpt.load`.

Lightning hands the plugin one checkpoint dict (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``,
``callbacks``, ``epoch``, ``global_step``, ``hyper_parameters``, ...) and a path ending in ``.ckpt``. The plugin
writes the folder ``path`` (so ``epoch=0-step=10.ckpt/`` holds ``state.safetensors``, ``state.json`` and the
manifest; see :mod:`fastckpt._plan.dict_save`), committed atomically, every key and type as Lightning gave it
(the optimizer state's integer keys included). ``ModelCheckpoint`` works unchanged: ``save_top_k`` removes folders
through :meth:`CheckpointIO.remove_checkpoint`, ``save_last="link"`` makes ``last.ckpt`` a symlink to a folder
(removing a link removes the link only, and a save to a path that is a link replaces the link, never the
checkpoint it points to).

Lightning itself saves no RNG state, so a resumed run would draw other dropout masks. The plugin adds process 0's
RNG states under ``"fastckpt_rng_states"`` (every process's with the :class:`~fastckpt.lightning.RankRNGStates`
callback) and :meth:`CheckpointIO.load_checkpoint` restores this process's (``restore_rng=True``) and takes the
key out again; see :mod:`fastckpt.lightning.rng`. A run resumed mid-epoch gets them restored once more after
Lightning rebuilt the training loader's iterator, which draws from the global RNG (:mod:`fastckpt.lightning.resume`).
A mid-epoch resume also needs a resumable DataLoader
(``torchdata``'s ``StatefulDataLoader`` with a stateful sampler), whose position Lightning saves in ``loops``; the
README's Lightning section gives the recipe for an exact resume and the cases stock Lightning cannot resume exactly.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.plugins.io import CheckpointIO as _LightningCheckpointIO
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fastckpt._io.async_save.writer import finish_pending, wait_for_saves_to
from fastckpt._io.group.distributed import DEFAULT_TIMEOUT, Session
from fastckpt._io.storage.local.numbering import remove_checkpoint_dir
from fastckpt.errors import UnsafePickleError
from fastckpt.lightning.resume import attach_to_loading_trainer
from fastckpt.lightning.rng import RNG_KEY, collect_rng_states, restore_rng_states
from fastckpt.plain import load, save

__all__ = ["CheckpointIO"]

class CheckpointIO(_LightningCheckpointIO):
    """A Lightning ``CheckpointIO`` plugin writing pickle-free, crash-safe checkpoint folders.

    Args:
        async_save: ``True``: :meth:`save_checkpoint` returns at once and the checkpoint is written in the
            background; parameters and optimizer state are streamed from the live tensors and only the next
            ``optimizer.step()`` of an optimizer seen stepping waits for (copies) its tensors not yet written
            (tensors of optimizers that never stepped, and everything else, are copied at the call). At most one
            save is in flight: the next save first waits for the previous one. ``"snapshot"``: copy every tensor
            at the call into a reused host buffer pool. False (default): write before returning.
        host_memory_budget: ``async_save=True``: host bytes (an int or ``"4GB"``) the copies may hold.
        trust_pickle: values of the checkpoint that only pickle can store (a custom object in
            ``hyper_parameters``) go to the checkpoint's pickle part, and :meth:`load_checkpoint` reads it unless
            ``weights_only=True``. Default False: such a value raises ``TypeError`` naming its key path.
        restore_rng: :meth:`load_checkpoint` restores this process's RNG states saved with the checkpoint (see
            :mod:`fastckpt.lightning.rng`; warns when another number of processes saved them).
        durable: fsync files and folders before each commit.
        threads: writer threads; 0 picks min(8, cores).
        timeout: seconds :meth:`teardown` waits for the other processes (several processes only).

    Example:
        >>> trainer = pl.Trainer(plugins=[fastckpt.lightning.CheckpointIO(async_save=True)],
        ...                      callbacks=[ModelCheckpoint(every_n_train_steps=100, save_top_k=2, monitor="loss")])
        >>> trainer.fit(model, loader, ckpt_path="checkpoints/last.ckpt")
    """

    def __init__(self, *, async_save: bool | str = False, host_memory_budget: int | str | None = None,
                 trust_pickle: bool = False, restore_rng: bool = True, durable: bool = True,
                 threads: int = 0, timeout: float = DEFAULT_TIMEOUT) -> None:
        if async_save not in (False, True, "snapshot"):
            raise ValueError(f"async_save must be False, True or 'snapshot', got {async_save!r}")
        super().__init__()
        self.async_save = async_save
        self.host_memory_budget = host_memory_budget
        self.trust_pickle = trust_pickle
        self.restore_rng = restore_rng
        self.durable = durable
        self.threads = threads
        self.timeout = timeout
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._hook: Any = None
        if async_save is True:
            self._watch_optimizers()

    def _watch_optimizers(self) -> None:
        """Learn the optimizers that step (a global step pre-hook), for streaming async saves."""
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(
                lambda optimizer, _args, _kwargs: self._optimizers.add(optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to the folder ``path`` (a ``.ckpt`` name is kept as the folder's name).

        Raises:
            TypeError: ``storage_options`` is given (as Lightning's ``TorchCheckpointIO``), or a value needs pickle
                and ``trust_pickle`` is False (names its key path).
            DestinationNotWritableError: ``path``'s folder cannot be made or takes no new files: raised here in
                every ``async_save`` mode, before anything is written (:func:`fastckpt.save` makes the parent
                folders at the call: Lightning links into them).
            OSError, DtypeError: see :func:`fastckpt.save`; the previous checkpoint at ``path`` is intact.
        """
        if storage_options is not None:
            raise TypeError(f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                            f"{type(self).__name__}; pass no storage_options")
        if self.async_save is True:
            self._watch_optimizers()
        target = Path(path)
        if target.is_symlink():  # last.ckpt -> a top-k checkpoint (save_last="link"): replace the link only
            wait_for_saves_to(Path(os.path.realpath(target)))
            target.unlink()
        state = dict(checkpoint)
        state.setdefault(RNG_KEY, collect_rng_states())  # RankRNGStates put every process's there
        save(state, target, trust_pickle=self.trust_pickle, async_save=self.async_save,
             optimizers=list(self._optimizers) if self.async_save is True else None,
             host_memory_budget=self.host_memory_budget, durable=self.durable, threads=self.threads)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Read the checkpoint folder ``path`` (a ``last.ckpt`` symlink is followed).

        Args:
            map_location: a device or a ``{saved: device}`` dict for the tensors; None: where they were saved
                (Lightning's default, ``lambda storage, loc: storage``, means the same and is accepted).
            weights_only: True refuses the pickle part (as ``torch.load(weights_only=True)`` refuses pickles);
                False reads it; None reads it when the plugin was made with ``trust_pickle=True``.

        Returns:
            The checkpoint dict as it was given to :meth:`save_checkpoint`.

        Raises:
            FileNotFoundError: nothing at ``path`` (``MissingStateError``, as Lightning expects).
            UnsafePickleError: the checkpoint has a pickle part and pickle is not allowed (see ``weights_only``).
            HeaderError / IntegrityError: a damaged checkpoint.
        """
        if callable(map_location):
            map_location = None  # Lightning's "keep every storage where it was saved"
        trust = weights_only is False or (weights_only is None and self.trust_pickle)
        try:
            checkpoint = load(path, map_location=map_location, trust_pickle=trust)
        except UnsafePickleError as exc:
            raise UnsafePickleError(f"{exc} (Lightning: pass weights_only=False, or make the plugin with "
                                    "trust_pickle=True)") from None
        rng = checkpoint.pop(RNG_KEY, None) if isinstance(checkpoint, dict) else None
        if rng is not None and self.restore_rng:
            restore_rng_states(rng)
            # again once a mid-epoch resume rebuilt the training loader's iterator (which draws a base seed)
            attach_to_loading_trainer(rng, checkpoint.get("epoch"))
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint folder ``path`` (after its async save, if one is in flight); a symlink
        (``last.ckpt``) is removed alone; nothing at ``path`` is not an error."""
        target = Path(path)
        if target.is_symlink():
            target.unlink()
            return
        if not target.exists():
            return
        wait_for_saves_to(target.absolute())
        if target.is_dir():
            remove_checkpoint_dir(target.absolute())
        else:
            target.unlink()  # a file Lightning's own TorchCheckpointIO wrote

    def teardown(self) -> None:
        """Wait for the async save in flight and stop watching optimizers; Lightning calls this at the end of
        ``fit`` on every process. With several processes they then wait for each other (at most ``timeout``
        seconds), so no process goes on (to a resume, say) before process 0 committed its last checkpoint.

        Raises:
            Exception: the async save failed (on process 0; the other processes raise ``CheckpointError`` naming it).
            CollectiveTimeoutError: another process did not reach its teardown within ``timeout``.
        """
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        error: BaseException | None = None
        try:
            finish_pending(wait=True)
        except Exception as exc:
            error = exc
        Session(f"{type(self).__name__}.teardown (the last async checkpoint)", self.timeout).agree(
            error, step="teardown")
