"""A tiny Lightning training run, stopped and resumed through ``fastckpt.lightning.CheckpointIO``.

Imported by ``test_lightning.py`` (one process) and run as a script by it for two processes
(``python lightning_fit.py OUT_DIR``: ``strategy="ddp"``, gloo, ``devices=2``; Lightning's subprocess launcher starts
the second process, which runs this script again). Every scenario runs inside that one launch; process ``r``
writes ``OUT_DIR/results_{r}.json`` (one entry per scenario: how the resumed run differed from the uninterrupted
one).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import TorchCheckpointIO
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import fastckpt
import fastckpt.lightning
from fastckpt.lightning.resume import attach_to_loading_trainer
from fastckpt.lightning.rng import collect_rng_states, restore_rng_states

BATCHES = 8  # samples 32, batch 4: 8 batches per epoch in one process (4 per process with two)


class TinyModule(pl.LightningModule):
    """Linear -> ReLU -> Dropout -> Linear, AdamW, a per-step StepLR; records (global_step, loss) per batch."""

    def __init__(self, hidden: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(hidden, 1))
        self.losses: list[tuple[int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append((self.global_step, loss.item()))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(world_size: int = 1, stateful: bool = True, sampler: str = "auto") -> torch.utils.data.DataLoader:
    """A shuffled loader whose order is set by the epoch alone, with the sampler set by us for this process
    (``LOCAL_RANK``) of ``world_size`` (seed 7; Lightning keeps a ``DistributedSampler`` it is given).

    ``stateful``: torchdata's resumable ``StatefulDataLoader`` with torchdata's ``StatefulDistributedSampler``;
    Lightning saves the loader's position in ``loops`` and a mid-epoch resume goes on with the next batch. The
    sampler must be one whose order is drawn lazily: torchdata's batch sampler calls ``iter(sampler)`` when the
    loader's iterator is made, which Lightning does before ``set_epoch`` in the first epoch after a resume, so a
    plain ``DistributedSampler`` would replay epoch 0's order there. Not ``shuffle=True``:
    torchdata's ``RandomSampler`` is no torch ``RandomSampler``, so with several processes Lightning wraps it in a
    ``DistributedSamplerWrapper``, whose order follows the inner sampler's ``generator``, saved nowhere.
    Otherwise (or with ``sampler="plain"``) a plain ``DistributedSampler``, with ``stateful=False`` in a plain
    DataLoader (a mid-epoch resume restarts the epoch); ``sampler="shuffle"``: ``shuffle=True`` and no sampler of
    ours. No ``generator``, as users write it (the README's recipe): making an iterator draws its base seed from the
    global RNG (dropout's), which the plugin accounts for (:mod:`fastckpt.lightning.resume`)."""
    g = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    cls = StatefulDataLoader if stateful else torch.utils.data.DataLoader
    if sampler == "shuffle":
        return cls(data, batch_size=4, shuffle=True, generator=torch.Generator())
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    sampler_cls = StatefulDistributedSampler if stateful and sampler == "auto" else torch.utils.data.DistributedSampler
    return cls(data, batch_size=4, sampler=sampler_cls(data, num_replicas=world_size, rank=rank, shuffle=True, seed=7))


def trainer(max_steps: int, plugin: Any, callbacks: list, root: Path, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(max_steps=max_steps, plugins=[plugin], callbacks=callbacks, default_root_dir=root,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, deterministic=True, **kwargs)


def fit(max_steps: int, root: Path, *, ckpt_path: str | None = None, plugin: Any = None,
        callbacks: list | None = None, stateful: bool = True, sampler: str = "auto",
        seed_per_rank: bool = False, **kwargs: Any) -> tuple[pl.Trainer, TinyModule]:
    """A run from the same seed (``seed_per_rank``: seed 1000 * rank on each process, so the processes draw other
    dropout masks): ``max_steps`` steps, or from ``ckpt_path`` up to ``max_steps``."""
    pl.seed_everything(1000 * int(os.environ.get("LOCAL_RANK", "0")) if seed_per_rank else 0, verbose=False)
    model = TinyModule()
    t = trainer(max_steps, plugin if plugin is not None else fastckpt.lightning.CheckpointIO(), callbacks or [], root,
                **kwargs)
    t.fit(model, loader(kwargs.get("devices", 1), stateful, sampler), ckpt_path=ckpt_path)
    return t, model


def final_state(t: pl.Trainer, model: TinyModule) -> dict[str, Any]:
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": t.optimizers[0].state_dict(), "scheduler": t.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": t.global_step, "epoch": t.current_epoch}


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors by ``torch.equal``, everything else by ``==`` and type)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [path]
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path}: keys {list(a)} vs {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


class TorchIOWithRng(TorchCheckpointIO):
    """Lightning's own ``torch.save`` plugin plus the RNG states fastckpt's plugin keeps: the reference a resume
    through fastckpt must equal bit for bit where Lightning's loops themselves do not resume exactly."""

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint({**checkpoint, fastckpt.lightning.RNG_KEY: collect_rng_states()}, path)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict:
        checkpoint = super().load_checkpoint(path, weights_only=False)
        rng = checkpoint.pop(fastckpt.lightning.RNG_KEY)
        restore_rng_states(rng)
        attach_to_loading_trainer(rng, checkpoint.get("epoch"))  # as fastckpt's plugin: only the loops differ
        return checkpoint


def limits(steps: int, by_epochs: bool, devices: int = 1) -> tuple[int, dict[str, int]]:
    """The Trainer's stop: ``max_steps=steps``, or with ``by_epochs`` the epochs those steps fill (and no
    ``max_steps``): :func:`fit`'s ``max_steps`` and extra Trainer arguments."""
    return (-1, {"max_epochs": steps // (BATCHES // devices)}) if by_epochs else (steps, {})


def stopped_and_resumed(root: Path, stop: int, total: int, plugin: Any, *, at_epoch_end: bool = False,
                        by_epochs: bool = False, rank_rng: bool = False,
                        **kwargs: Any) -> tuple[pl.Trainer, TinyModule]:
    """``stop`` steps saving through ``plugin()`` with ModelCheckpoint (after step ``stop``, or with
    ``at_epoch_end`` at the end of the epoch that step closes), then a resume from that checkpoint to ``total``
    (``by_epochs``: the Trainer stops by ``max_epochs``, see :func:`limits`; ``rank_rng``: with the
    ``RankRNGStates`` callback)."""
    dirpath = root / "ckpts"
    every = {"every_n_epochs": 1, "save_on_train_epoch_end": True} if at_epoch_end else {"every_n_train_steps": stop}
    devices = kwargs.get("devices", 1)
    steps, extra = limits(stop, by_epochs, devices)
    callbacks = [ModelCheckpoint(dirpath=dirpath, save_top_k=-1, **every)]
    fit(steps, root / "first", plugin=plugin(), callbacks=callbacks + [fastckpt.lightning.RankRNGStates()] * rank_rng,
        **extra, **kwargs)
    ckpt = next(p for p in sorted(dirpath.iterdir()) if p.name.endswith(f"step={stop}.ckpt"))
    steps, extra = limits(total, by_epochs, devices)
    return fit(steps, root / "resumed", ckpt_path=str(ckpt), plugin=plugin(), **extra, **kwargs)


def compare(reference: tuple[pl.Trainer, TinyModule], resumed: tuple[pl.Trainer, TinyModule],
            stop: int) -> list[str]:
    """The differences of a resumed run from ``reference`` (logged losses from step ``stop``, final state)."""
    problems = differences([x for x in reference[1].losses if x[0] >= stop], resumed[1].losses, "losses")
    problems += differences(final_state(*reference), final_state(*resumed), "final")
    if not resumed[1].losses or resumed[1].losses[0][0] != stop:
        problems.append(f"the resumed run did not start at step {stop}")
    return problems


def uninterrupted(root: Path, total: int, *, by_epochs: bool = False, plugin_kwargs: dict | None = None,
                  **kwargs: Any) -> tuple[pl.Trainer, TinyModule]:
    """``total`` steps in one go (no checkpoint callback)."""
    steps, extra = limits(total, by_epochs, kwargs.get("devices", 1))
    return fit(steps, root, plugin=fastckpt.lightning.CheckpointIO(**(plugin_kwargs or {})), **extra, **kwargs)


def resume_matches(root: Path, stop: int, total: int, *, plugin_kwargs: dict | None = None,
                   full: tuple[pl.Trainer, TinyModule] | None = None, **kwargs: Any) -> list[str]:
    """An uninterrupted run of ``total`` steps (or ``full``, such a run made before with the same arguments)
    against ``stop`` steps + a resume through fastckpt's plugin from ModelCheckpoint's step-``stop`` folder; the
    differences, empty when bit-identical. ``kwargs``: :func:`stopped_and_resumed`'s and the Trainer's."""
    def plugin() -> Any:
        return fastckpt.lightning.CheckpointIO(**(plugin_kwargs or {}))

    if full is None:
        full = uninterrupted(root / "full", total, by_epochs=kwargs.get("by_epochs", False),
                             **{k: v for k, v in kwargs.items() if k not in ("by_epochs", "at_epoch_end", "rank_rng")})
    ckpt_dir = root / "resume" / "ckpts"
    problems = compare(full, stopped_and_resumed(root / "resume", stop, total, plugin, **kwargs), stop)
    if not all(p.is_dir() for p in ckpt_dir.iterdir()):
        problems.append(f"{ckpt_dir} holds files, not checkpoint folders")
    return problems


def matches_torch_io(root: Path, stop: int, total: int, *, at_epoch_end: bool = False,
                     plugin_kwargs: dict | None = None, **kwargs: Any) -> list[str]:
    """A resume through fastckpt's plugin against the same resume through Lightning's ``TorchCheckpointIO`` (+ the
    same RNG states): where Lightning's loops themselves do not replay an uninterrupted run (a checkpoint made in
    ``on_train_epoch_end`` of a run stopped by ``max_steps``; see the test module), fastckpt must change nothing of
    what they do."""
    def ours() -> Any:
        return fastckpt.lightning.CheckpointIO(**(plugin_kwargs or {}))

    resumed = stopped_and_resumed(root / "fastckpt", stop, total, ours, at_epoch_end=at_epoch_end, **kwargs)
    reference = stopped_and_resumed(root / "torch", stop, total, TorchIOWithRng, at_epoch_end=at_epoch_end,
                                    **kwargs)
    return compare(reference, resumed, stop)


class SignalAt(pl.Callback):
    """Process ``rank`` sends itself SIGUSR1 at the end of step ``step`` (a preemption only it sees)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGUSR1)


def preempted_matches(root: Path, at: int, total: int, *, full: tuple[pl.Trainer, TinyModule], expect: int,
                      **kwargs: Any) -> list[str]:
    """Process 1 alone gets SIGUSR1 at step ``at``: ``PreemptionCheckpoint`` saves step ``expect`` (the next
    boundary, agreed by both) to ``ckpts/last.ckpt`` and raises ``Preempted`` on both; the resume from it against
    ``full``."""
    preempt = fastckpt.lightning.PreemptionCheckpoint(root / "ckpts")
    try:
        fit(total, root / "first", callbacks=[SignalAt(at, 1), preempt], **kwargs)
        return ["the fit was not preempted"]
    except fastckpt.Preempted as exc:
        problems = [] if (exc.step, exc.code) == (expect, 0) else [f"preempted at {exc.step} ({exc.code})"]
    resumed = fit(total, root / "resumed", ckpt_path=str(root / "ckpts" / "last.ckpt"), **kwargs)
    return problems + compare(full, resumed, expect)


def main(out: Path) -> None:
    """Every two-process scenario in one launch, each against the uninterrupted run; process ``r`` writes its
    differences (its own losses included) to ``results_{r}.json``."""
    warnings.filterwarnings("ignore")
    kwargs = {"strategy": "ddp", "accelerator": "cpu", "devices": 2}
    half = BATCHES // 2  # steps per epoch on each of two processes
    by_steps = uninterrupted(out / "full_steps", 3 * half, **kwargs)
    by_epochs = uninterrupted(out / "full_epochs", 3 * half, by_epochs=True, **kwargs)
    results = {
        "mid_epoch": resume_matches(out / "mid_epoch", half + 1, 3 * half, full=by_steps, **kwargs),
        "async": resume_matches(out / "async", half + 1, 3 * half, full=by_steps, plugin_kwargs={"async_save": True},
                                **kwargs),
        "last_batch": resume_matches(out / "last_batch", half, 3 * half, full=by_steps, stateful=False, **kwargs),
        "epoch_end": resume_matches(out / "epoch_end", half, 3 * half, full=by_epochs, at_epoch_end=True,
                                    by_epochs=True, **kwargs),
    }
    results["preempted"] = preempted_matches(out / "preempted", half + 1, 3 * half, full=by_steps, expect=half + 2,
                                             **kwargs)
    # processes seeded differently: exact with every process's RNG states (RankRNGStates); without them process
    # 1 resumes with process 0's states (the negative control: must differ)
    seeded = uninterrupted(out / "full_seeded", 3 * half, seed_per_rank=True, **kwargs)
    results["rank_seeds"] = resume_matches(out / "rank_seeds", half + 1, 3 * half, full=seeded, seed_per_rank=True,
                                           rank_rng=True, **kwargs)
    results["rank_seeds_without_callback"] = resume_matches(out / "rank_seeds_plain", half + 1, 3 * half,
                                                            full=seeded, seed_per_rank=True, **kwargs)
    # stock Lightning's inexact DDP case (StatefulDataLoader(shuffle=True) in a DistributedSamplerWrapper): must differ
    results["shuffle_true"] = resume_matches(out / "shuffle_true", half + 1, 3 * half, sampler="shuffle", **kwargs)
    (out / f"results_{os.environ.get('LOCAL_RANK', '0')}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
