"""LoRA fine-tuning benchmark (issue 10): bytes written and wall time per checkpoint while training rank-8 adapters
on a frozen base of about 1 GB, saving every K steps.

Contenders, alternated in every round (the order rotates), each saving into its own project folder:

- ``accelerate save_state``: stock ``Accelerator.save_state`` (the whole base model every time; no fsync).
- ``fastckpt full``: ``fastckpt.save_state(model, optimizer, scheduler)`` (every tensor, durable).
- ``fastckpt trainable_only``: only the adapter + its optimizer state; the frozen base is recorded by hash.
- ``fastckpt share_unchanged``: the full state, frozen shards hard-linked from the previous checkpoint.

and, for the dtype export, ``model_only=True`` against ``model_only=True, dtype=torch.bfloat16``.

Bytes written per checkpoint = the sizes of the new files of its folder with one link (a hard-linked shard costs
nothing). Times are medians over rounds after the first save of each contender (the first share_unchanged save
writes everything); ratios are medians of per-round ratios. Prints a Markdown table and, with ``--write``, puts it in
benches/RESULTS.md between the ``lora-finetune`` markers.

    python benches/lora_finetune.py --rounds 5 --every 1 --write
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import fastckpt

warnings.filterwarnings("ignore")


def build(vocab: int, embd: int, layers: int, rank: int):
    """A GPT-2 body from a config (no network) with LoRA adapters on every attention and MLP projection."""
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=embd, n_head=max(1, embd // 128), vocab_size=vocab,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    base = transformers.GPT2Model(config)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["c_attn", "c_proj", "c_fc"],
                           fan_in_fan_out=True, lora_dropout=0.0)
    return peft.get_peft_model(base, lora)


def new_files_bytes(folder: Path) -> int:
    """Bytes of the files of ``folder`` that are not hard links shared with another checkpoint."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.stat().st_nlink == 1)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=int, default=1, metavar="K", help="training steps between checkpoints")
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--embd", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp folder)")
    parser.add_argument("--write", action="store_true", help="put the table in benches/RESULTS.md")
    args = parser.parse_args(argv)

    from accelerate import Accelerator

    start = time.perf_counter()
    model = build(args.vocab, args.embd, args.layers, args.rank)
    accelerator = Accelerator(cpu=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    frozen = tensor_bytes(p for p in model.parameters() if not p.requires_grad)
    adapter = tensor_bytes(trainable)

    def train(steps: int) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            ids = torch.randint(0, args.vocab, (1, 8))
            model(input_ids=ids).last_hidden_state.square().mean().backward()
            optimizer.step()
            scheduler.step()

    train(1)
    adapter_opt = adapter + tensor_bytes(t for s in optimizer.state.values() for t in s.values()
                                         if torch.is_tensor(t) and t.dim() > 0)
    root = Path(args.dir or tempfile.mkdtemp(prefix="fastckpt-lora-"))
    counters = {}

    def fast(name: str, **kw):
        def save() -> Path:
            return fastckpt.save_state(model, optimizer, scheduler, project_dir=root / name, total_limit=2, **kw)
        return save

    def accel() -> Path:
        n = counters.get("accelerate", 0)
        counters["accelerate"] = n + 1
        folder = root / "accelerate" / f"checkpoint_{n}"
        accelerator.save_state(str(folder))
        return folder

    def export(name: str, **kw):
        def save() -> Path:
            return fastckpt.save_state(model, model_only=True, output_dir=root / name / "weights", **kw)
        return save

    contenders = {
        "accelerate save_state": accel,
        "fastckpt full": fast("full"),
        "fastckpt trainable_only": fast("trainable", trainable_only=True),
        "fastckpt share_unchanged": fast("share", share_unchanged=True),
        "fastckpt model_only (f32)": export("plain"),
        "fastckpt model_only dtype=bf16": export("bf16", dtype=torch.bfloat16),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    written: dict[str, list[int]] = {k: [] for k in contenders}
    for save in contenders.values():  # first checkpoint of each (not counted)
        save()
    order = list(contenders)
    for r in range(args.rounds):
        train(args.every)
        for name in order[r % len(order):] + order[: r % len(order)]:
            t0 = time.perf_counter()
            folder = contenders[name]()
            times[name].append(time.perf_counter() - t0)
            written[name].append(new_files_bytes(folder))
            if name == "accelerate save_state" and r > 0:  # keep two, as total_limit=2 does for the others
                shutil.rmtree(root / "accelerate" / f"checkpoint_{counters['accelerate'] - 3}", ignore_errors=True)
    acc = times["accelerate save_state"]
    plain = times["fastckpt model_only (f32)"]
    rows = []
    for name in contenders:
        speedup = statistics.median(a / t for a, t in zip(acc, times[name]))
        rows.append((name, statistics.median(written[name]), statistics.median(times[name]), speedup))
    share_bytes = statistics.median(written["fastckpt share_unchanged"])
    trainable_bytes = statistics.median(written["fastckpt trainable_only"])
    share_speed = statistics.median(a / t for a, t in zip(acc, times["fastckpt share_unchanged"]))
    trainable_speed = statistics.median(a / t for a, t in zip(acc, times["fastckpt trainable_only"]))
    export_speed = statistics.median(p / t for p, t in zip(plain, times["fastckpt model_only dtype=bf16"]))
    elapsed = time.perf_counter() - start

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = [
        f"{time.strftime('%Y-%m-%d %H:%M')}, {elapsed:.0f} s: `python benches/lora_finetune.py --rounds "
        f"{args.rounds} --every {args.every}`",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.platform()}, torch {torch.__version__}. GPT-2 body from a config "
        f"(vocab {args.vocab}, {args.layers} layers of {args.embd}), LoRA rank {args.rank} on c_attn/c_proj/c_fc: "
        f"frozen {frozen / 1e9:.2f} GB, adapter {adapter / 1e6:.2f} MB, adapter + AdamW state "
        f"{adapter_opt / 1e6:.2f} MB. {args.rounds} rounds after each contender's first checkpoint, one checkpoint "
        f"every {args.every} training step(s), contenders alternated; medians. fastckpt saves are durable (fsync), "
        "accelerate's are not.",
        "",
        "| contender | MB written per checkpoint | x (adapter + optimizer) | s per checkpoint | x accelerate (speedup) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, nbytes, seconds, speedup in rows:
        lines.append(f"| {name} | {nbytes / 1e6:.2f} | {nbytes / adapter_opt:.2f}x | {seconds:.3f} | {speedup:.1f}x |")
    lines += [
        "",
        "Targets:",
        f"- bytes per checkpoint after the first <= 1.05x adapter + optimizer state: share_unchanged "
        f"{share_bytes / adapter_opt:.3f}x ({verdict(share_bytes <= 1.05 * adapter_opt)}), trainable_only "
        f"{trainable_bytes / adapter_opt:.3f}x ({verdict(trainable_bytes <= 1.05 * adapter_opt)}). The excess is "
        "the RNG file, the manifest (crc32c + xxh3 per tensor) and the headers.",
        f"- time per checkpoint >= 20x faster than accelerate's: share_unchanged {share_speed:.1f}x "
        f"({verdict(share_speed >= 20)}), trainable_only {trainable_speed:.1f}x ({verdict(trainable_speed >= 20)}).",
        f"- dtype export >= 0.85x the speed of a plain model-only save: {export_speed:.2f}x "
        f"({verdict(export_speed >= 0.85)}); it writes half the bytes, converting chunk by chunk in the writer.",
    ]
    table = "\n".join(lines)
    print(table)
    if args.write:
        results = Path(__file__).with_name("RESULTS.md")
        text = results.read_text(encoding="utf-8")
        block = f"<!-- lora-finetune:start -->\n## LoRA fine-tuning: trainable-only and shared checkpoints\n\n{table}\n<!-- lora-finetune:end -->"
        pattern = re.compile(r"<!-- lora-finetune:start -->.*<!-- lora-finetune:end -->", re.S)
        text = pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
        results.write_text(text, encoding="utf-8")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
