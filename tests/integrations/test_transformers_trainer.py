"""``fastckpt.transformers.Trainer`` with the real ``transformers.Trainer`` loop (tiny GPT-2 with dropout, CPU; see
tests/helpers/trainer_runs.py): a run stopped after the checkpoint of step 4 and resumed logs the same losses and
ends with bit-identical weights as an uninterrupted run; checkpoints hold no pickle; ``save_total_limit``,
``save_only_model``, ``load_best_model_at_end``, ``resume_from_checkpoint=True``, async saves, the mixin, and
resuming from a checkpoint the stock Trainer wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
import transformers
from helpers.trainer_runs import Dataset, losses, run, weights

import fastckpt
import fastckpt.transformers
from fastckpt.errors import UnsafePickleError


def same_weights(a, b) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return out, run("fastckpt", out)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("part")
    stopped = run("fastckpt", out, stop_at=4)
    assert stopped.state.global_step == 4
    names = sorted(p.name for p in out.iterdir())
    return out, names, run("fastckpt", out, resume=True, seed=3)  # another init: the checkpoint's weights win


def test_resume_after_step_4_is_exact(uninterrupted, resumed):
    _, full = uninterrupted
    _, names, again = resumed
    assert names == ["checkpoint-4"]
    assert [s for s, *_ in losses(again, 4)] == [5, 6, 7, 8, 9, 10]
    assert losses(again, 4) == losses(full, 4)  # loss, grad_norm and learning rate of every step after 4
    assert same_weights(again, full)
    assert again.state.global_step == 10 and again.state.epoch == full.state.epoch
    assert again.optimizer.state_dict()["state"].keys() == full.optimizer.state_dict()["state"].keys()
    for i, s in full.optimizer.state_dict()["state"].items():
        assert all(torch.equal(v, again.optimizer.state_dict()["state"][i][k]) for k, v in s.items())
    assert again.lr_scheduler.state_dict() == full.lr_scheduler.state_dict()


def test_training_is_the_stock_trainers(uninterrupted, tmp_path):
    _, full = uninterrupted
    stock = run("stock", tmp_path, save_strategy="no")
    assert losses(stock) == losses(full) and same_weights(stock, full)


def test_resume_without_the_rng_states_would_diverge(uninterrupted, resumed, tmp_path, monkeypatch):
    """The check above can fail: dropout draws from the RNG, so a resume that skips the RNG restore differs."""
    _, full = uninterrupted
    out, _, _ = resumed
    monkeypatch.setattr(fastckpt.transformers.CheckpointMixin, "_load_rng_state", lambda self, checkpoint: None)
    again = run("fastckpt", tmp_path, resume=str(out / "checkpoint-4"))
    assert losses(again, 4) != losses(full, 4)


def test_checkpoint_files_hold_no_pickle(uninterrupted):
    out, full = uninterrupted
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]
    folder = out / "checkpoint-4"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "fastckpt.json", "generation_config.json", "model.safetensors", "optimizer.safetensors",
        "random_states_0.safetensors", "scheduler.json", "trainer_state.json", "training_args.json"]
    state = transformers.TrainerState.load_from_json(str(folder / "trainer_state.json"))
    assert state.global_step == 4 and [e["step"] for e in state.log_history] == [1, 2, 3, 4]
    assert json.loads((folder / "training_args.json").read_text())["save_steps"] == 4
    manifest = json.loads((folder / "fastckpt.json").read_text())
    assert {"trainer_state.json", "training_args.json"} <= set(manifest["files"])
    final = st.load_file(out / "checkpoint-10" / "model.safetensors")  # the official reader
    live = weights(full)
    assert all(torch.equal(final[k], live[k]) for k in final) and "transformer.wte.weight" in final


def test_save_total_limit_keeps_the_newest(tmp_path):
    (tmp_path / "checkpoint-99").mkdir()  # an unfinished save of another run: neither counted nor removed
    (tmp_path / "checkpoint-99" / "model.safetensors").write_bytes(b"partial")
    run("fastckpt", tmp_path, save_steps=2, save_total_limit=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-8", "checkpoint-99"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_resume_true_picks_the_latest_finished_checkpoint(resumed, tmp_path):
    import shutil

    out, _, again = resumed
    shutil.copytree(out / "checkpoint-4", tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-6").mkdir()  # a save that did not finish: fastckpt files, no manifest
    shutil.copy(out / "checkpoint-4" / "optimizer.safetensors", tmp_path / "checkpoint-6")
    assert transformers.trainer_utils.get_last_checkpoint(str(tmp_path)).endswith("checkpoint-6")  # stock's pick
    trainer = run("fastckpt", tmp_path, resume=True, save_strategy="no")
    assert [s for s, *_ in losses(trainer)] == list(range(1, 11))  # 1-4 from checkpoint-4's trainer_state.json
    assert losses(trainer, 4) == losses(again, 4)  # resumed from checkpoint-4


def test_resume_true_without_a_checkpoint_raises(tmp_path):
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        run("fastckpt", tmp_path, resume=True)


def test_save_only_model(tmp_path):
    trainer = run("fastckpt", tmp_path, save_only_model=True, stop_at=4)
    folder = tmp_path / "checkpoint-4"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "fastckpt.json", "generation_config.json", "model.safetensors", "trainer_state.json",
        "training_args.json"]
    saved = st.load_file(folder / "model.safetensors")
    live = weights(trainer)
    assert all(torch.equal(saved[k], live[k]) for k in saved)
    with pytest.warns(fastckpt.ResumeWarning) as caught:  # issue 27 item 8: not silently
        again = run("fastckpt", tmp_path, save_only_model=True, resume=True, seed=3)  # weights + step, fresh optimizer
    assert [str(w.message) for w in caught if w.category is fastckpt.ResumeWarning] == [
        f"{folder}: saved with save_only_model=True (weights and trainer_state.json only): resuming from it restores "
        "the weights and the step count, and starts the optimizer (AdamW: no moments, no step counts), the "
        "learning-rate scheduler (LambdaLR: back to its first step's learning rate) and the RNG states (dropout, data "
        "order) afresh, so training from here differs from an uninterrupted run; resume from a checkpoint saved "
        "without save_only_model for an exact resume"]
    assert [s for s, *_ in losses(again, 4)] == [5, 6, 7, 8, 9, 10] and again.state.global_step == 10


def test_load_best_model_at_end_as_the_stock_trainer(tmp_path):
    kw = dict(eval_dataset=Dataset(8, seed=1), eval_strategy="steps", eval_steps=2, save_steps=2, save_total_limit=1,
              load_best_model_at_end=True, metric_for_best_model="eval_loss", learning_rate=0.2)
    ours = run("fastckpt", tmp_path / "ours", **kw)
    stock = run("stock", tmp_path / "stock", **kw)
    best = Path(stock.state.best_model_checkpoint).name
    assert best != "checkpoint-10"  # the large learning rate makes a middle checkpoint the best one
    assert Path(ours.state.best_model_checkpoint).name == best
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == [best]  # as the stock Trainer leaves it
    assert sorted(p.name for p in (tmp_path / "stock").iterdir()) == [best]
    assert same_weights(ours, stock)  # the best checkpoint's weights, loaded at the end


def test_resume_from_a_stock_trainer_checkpoint(uninterrupted, tmp_path):
    _, full = uninterrupted
    run("stock", tmp_path, stop_at=4)
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth"} <= {p.name for p in (tmp_path / "checkpoint-4").iterdir()}
    again = run("fastckpt", tmp_path, resume=True, seed=3)
    assert losses(again, 4) == losses(full, 4) and same_weights(again, full)
    assert (tmp_path / "checkpoint-8" / "fastckpt.json").is_file()


def test_a_stock_file_that_needs_full_unpickling_is_refused(tmp_path):
    run("stock", tmp_path, stop_at=4, save_steps=4)
    folder = tmp_path / "checkpoint-4"
    state = torch.load(folder / "scheduler.pt", weights_only=True)
    state["extra"] = Path("not/allowed")  # a pickled object weights_only=True refuses
    torch.save(state, folder / "scheduler.pt")
    with pytest.raises(UnsafePickleError, match=r"scheduler\.pt: the LR scheduler cannot be read with weights_only"):
        run("fastckpt", tmp_path, resume=True, seed=3)


def test_async_save_gives_the_same_run_and_checkpoints(uninterrupted, tmp_path, monkeypatch):
    from fastckpt._io.async_save.writer import AsyncSave

    out, full = uninterrupted
    in_flight = []
    save = fastckpt.transformers.CheckpointMixin._save_checkpoint

    def recorded(self, model, trial):
        save(self, model, trial)
        in_flight.append(type(self._fastckpt_pending))  # training goes on while this one is written

    monkeypatch.setattr(fastckpt.transformers.CheckpointMixin, "_save_checkpoint", recorded)
    ours = run("fastckpt", tmp_path, trainer_kwargs={"fastckpt_async_save": True})
    assert in_flight == [AsyncSave] * 3 and ours._fastckpt_pending is None  # committed before train() returned
    assert losses(ours) == losses(full) and same_weights(ours, full)
    for n in (4, 8, 10):
        a = st.load_file(tmp_path / f"checkpoint-{n}" / "model.safetensors")
        b = st.load_file(out / f"checkpoint-{n}" / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in b)
        assert (tmp_path / f"checkpoint-{n}" / "optimizer.safetensors").read_bytes() == (
            out / f"checkpoint-{n}" / "optimizer.safetensors").read_bytes()
    again = run("fastckpt", tmp_path, resume=str(tmp_path / "checkpoint-4"), seed=3,
                trainer_kwargs={"fastckpt_async_save": True}, output_dir=str(tmp_path / "again"))
    assert losses(again, 4) == losses(full, 4) and same_weights(again, full)


def test_mixin_with_a_trainer_subclass(uninterrupted, tmp_path):
    class Scaled(transformers.Trainer):  # stands for a Trainer subclass such as TRL's SFTTrainer
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)

    class Ours(fastckpt.transformers.CheckpointMixin, Scaled):
        pass

    from helpers.trainer_runs import StopAt, arguments, model

    _, full = uninterrupted
    Ours(model=model(), args=arguments(tmp_path), train_dataset=Dataset(), callbacks=[StopAt(4)]).train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    assert (tmp_path / "checkpoint-4" / "fastckpt.json").is_file()
    trainer = Ours(model=model(3), args=arguments(tmp_path), train_dataset=Dataset())
    trainer.train(resume_from_checkpoint=True)
    assert losses(trainer, 4) == losses(full, 4) and same_weights(trainer, full)


def test_bad_async_option_raises():
    with pytest.raises(ValueError, match="fastckpt_async_save must be False, True or 'snapshot'"):
        fastckpt.transformers.CheckpointMixin.__init__(object.__new__(fastckpt.transformers.CheckpointMixin),
                                                       fastckpt_async_save="yes")


def test_save_model_writes_no_pickle(uninterrupted, tmp_path):
    _, full = uninterrupted
    full.save_model(str(tmp_path / "final"))
    names = sorted(p.name for p in (tmp_path / "final").iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "training_args.json"]
    assert json.loads((tmp_path / "final" / "training_args.json").read_text())["max_steps"] == 10
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "final")
    live = weights(full)
    assert all(torch.equal(v, live[k]) for k, v in again.state_dict().items())


def test_the_processing_class_files_join_the_commit(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), unk_token="[UNK]",
        pad_token="[UNK]")
    run("fastckpt", tmp_path / "run", stop_at=4, trainer_kwargs={"processing_class": tok})
    tok.save_pretrained(tmp_path / "stock")
    folder = tmp_path / "run" / "checkpoint-4"
    manifest = json.loads((folder / "fastckpt.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (tmp_path / "stock" / name).read_bytes()
        assert name in manifest["files"]
    again = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    assert again("a a")["input_ids"] == tok("a a")["input_ids"]


def test_the_mixin_after_the_trainer_class_is_refused():
    with pytest.raises(TypeError, match="Wrong: CheckpointMixin must come before the Trainer class in the bases"):
        class Wrong(transformers.Trainer, fastckpt.transformers.CheckpointMixin):
            pass
