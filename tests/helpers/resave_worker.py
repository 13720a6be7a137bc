"""Re-saves one checkpoint folder in a loop, each save of one value k everywhere (weights, SGD momentum buffers,
scheduler ``last_epoch``), until killed (prints ``ready``, then ``committed`` once the first save is in place): the writer side of tests/io/test_concurrent_readers.py.

    python tests/helpers/resave_worker.py TARGET
"""

from __future__ import annotations

import sys

import torch


def build(k: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(k)
            opt.state[p]["momentum_buffer"].fill_(k)
    return model, opt


def main(target: str) -> None:
    import fastckpt

    model, opt = build(0.0)
    k = 1
    print("ready", flush=True)
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(k)
                opt.state[p]["momentum_buffer"].fill_(k)
        fastckpt.save_state(model, opt, output_dir=target, durable=False)
        if k == 1:
            print("committed", flush=True)  # the first save is in place: the reader may start
        k += 1


if __name__ == "__main__":
    main(sys.argv[1])
