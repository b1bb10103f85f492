"""examples/gpt_lm against nanoGPT's `shakespeare_char` CPU run, side by side.

nanoGPT's README runs, on a CPU ("I only have a macbook"):

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False
        --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12
        --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
        --lr_decay_iters=2000 --dropout=0.0

(`eval_interval` 250 from the config file, learning rate 1e-3 to 1e-4, 100
warm-up steps, AdamW betas 0.9/0.99, weight decay 0.1, clipping at 1.0, no
biases.) Its loop is written out below in plain PyTorch (`nanogpt`), with the
model of nanoGPT's `model.py` (pre-norm blocks, `scaled_dot_product_attention`
with `is_causal`, exact GELU, tied embeddings, GPT-2 initialization): per
step one forward and backward, the next batch drawn between them, global
clipping, AdamW, `loss.item()` (its `log_interval=1`); every `eval_interval`
iterations (iteration 0 included) `estimate_loss` over `eval_iters` random
batches of each split, and a `torch.save` checkpoint when the validation
loss improves. Iterations 0 .. max_iters train, as nanoGPT's (2001 steps for
2000), and the reported validation loss is the estimate at `max_iters`.
Without CUDA nanoGPT's float16 `GradScaler` disables itself and the
autocast context is a no-op: float32, as here.

Then `examples/gpt_lm/train.py --backend B --eval-batches N` on each backend:
the same evaluation work (N random batches of 12 windows per split and
interval, run as one batch per split), plus its samples and checkpoints at
every interval. Each run is a fresh process, timed from the outside (wall:
imports and compilation included); runs alternate nanoGPT, backends, nanoGPT,
... for `--repeats` rounds. Training ms/step is the time of the training
steps alone (evaluation, checkpoints, samples left out; for ours, the
compilation is in it); "after the first interval" leaves out the first
evaluation interval's steps on both sides (ours: the compilation).

    python benchmarks/nanogpt_side_by_side.py                  # 2000 steps, all
    python benchmarks/nanogpt_side_by_side.py --steps 500 --backends jax,torch

Targets (issue 16): training ms/step at most nanoGPT's on every backend, wall
time at most nanoGPT's at equal evaluation work, validation loss <= 1.886,
JAX within 1.2x of the fastest backend.
"""

import argparse
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt_lm" / "train.py"
BACKENDS = ("tensorflow", "jax", "torch")


# nanoGPT, written out.


def nanogpt_model(vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0):
    """nanoGPT's `model.py` GPT with `bias=False`; the caller seeds torch
    first (the initialization draws from its generator). With `dropout`, as
    nanoGPT: on the embeddings, inside `scaled_dot_product_attention`
    (`dropout_p`, which its flash kernel takes), after each residual branch."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class LayerNorm(nn.Module):  # bias=False: weight only
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
            self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(n_embd, dim=2)  # 3 x (B, T, C)
            q = q.view(B, T, n_head, C // n_head).transpose(1, 2)  # (B, nh, T, hs)
            k = k.view(B, T, n_head, C // n_head).transpose(1, 2)  # (B, nh, T, hs)
            v = v.view(B, T, n_head, C // n_head).transpose(1, 2)  # (B, nh, T, hs)
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout if self.training else 0.0, is_causal=True
            )  # (B, nh, T, hs)
            y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
            return F.dropout(self.c_proj(y), dropout, self.training)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

        def forward(self, x):
            return F.dropout(self.c_proj(self.gelu(self.c_fc(x))), dropout, self.training)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = LayerNorm(n_embd), CausalSelfAttention()
            self.ln_2, self.mlp = LayerNorm(n_embd), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self, vocab_size):
            super().__init__()
            self.wte = nn.Embedding(vocab_size, n_embd)
            self.wpe = nn.Embedding(block_size, n_embd)
            self.h = nn.ModuleList([Block() for _ in range(n_layer)])
            self.ln_f = LayerNorm(n_embd)
            self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
            self.wte.weight = self.lm_head.weight  # tied
            self.apply(self._init_weights)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

        def _init_weights(self, module):
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

        def forward(self, idx, targets):
            pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
            x = F.dropout(self.wte(idx) + self.wpe(pos), dropout, self.training)  # (B, T, C)
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))  # (B, T, V)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            return logits, loss

    return GPT(vocab_size)


def nanogpt_optimizer(model, learning_rate, weight_decay=0.1, betas=(0.9, 0.99)):
    """nanoGPT's AdamW: weight decay on matrices and embeddings only."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


# nanoGPT's shakespeare_char configurations: its README's CPU run, and its
# config file's (a GPU).
CPU_CONFIG = dict(block_size=64, batch_size=12, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
GPU_CONFIG = dict(block_size=256, batch_size=64, n_layer=6, n_head=6, n_embd=384, dropout=0.2)


def nanogpt(steps, eval_interval, eval_iters, out_dir, config=None, device="cpu",
            compile=False):
    """nanoGPT's `train.py` with `config` (`CPU_CONFIG` by default); returns
    its times and losses. On a CUDA `device` as nanoGPT runs there: bfloat16
    autocast, batches pinned and copied without blocking, `torch.compile`
    with `compile`."""
    import contextlib

    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import common

    config = dict(CPU_CONFIG if config is None else config)
    block_size, batch_size = config["block_size"], config["batch_size"]
    n_layer, n_head, n_embd = config["n_layer"], config["n_head"], config["n_embd"]
    learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-3, 1e-4, 100, steps
    weight_decay, beta1, beta2, grad_clip = 1e-1, 0.9, 0.99, 1.0
    torch.manual_seed(1337)

    # data/shakespeare_char/prepare.py: characters of the whole text, 90/10.
    text = common.load_text()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}

    def get_batch(split):
        data = splits[split]
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack(
            [torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix]
        )
        if device != "cpu":
            x = x.pin_memory().to(device, non_blocking=True)
            y = y.pin_memory().to(device, non_blocking=True)
        return x, y

    model = nanogpt_model(len(chars), block_size, n_layer, n_head, n_embd, config["dropout"])
    model.to(device)
    optimizer = nanogpt_optimizer(model, learning_rate, weight_decay, (beta1, beta2))
    raw_model = model
    if compile:
        model = torch.compile(model)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device != "cpu"
        else contextlib.nullcontext()
    )

    def get_lr(it):
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it >= lr_decay_iters:  # nanoGPT's `>`, the same value; spares 0/0 when
            return min_lr  # a short run ends within the warm-up
        ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split)
                with autocast:
                    _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    seconds = {"training": 0.0, "evaluation": 0.0, "checkpoints": 0.0}
    first_interval = None  # the training seconds of the first interval
    best_val_loss, losses, iter_num = 1e9, None, 0
    X, Y = get_batch("train")
    while True:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num)
        if iter_num % eval_interval == 0:
            start = time.perf_counter()
            losses = estimate_loss()
            seconds["evaluation"] += time.perf_counter() - start
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}",
                  flush=True)
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    start = time.perf_counter()
                    torch.save(
                        {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                         "iter_num": iter_num, "best_val_loss": best_val_loss},
                        os.path.join(out_dir, "ckpt.pt"),
                    )
                    seconds["checkpoints"] += time.perf_counter() - start
        start = time.perf_counter()
        with autocast:
            _, loss = model(X, Y)
        X, Y = get_batch("train")  # the next batch, while (on a GPU) the step runs
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # log_interval=1
        seconds["training"] += time.perf_counter() - start
        iter_num += 1
        if iter_num == eval_interval:
            first_interval = seconds["training"]
        if iter_num > steps:
            break
    return {"val_loss": losses["val"], "steps": iter_num, "seconds": seconds,
            "first_interval": first_interval}


# The runs.


def run_nanogpt(args):
    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, __file__, "--worker", "--steps", str(args.steps),
                   "--eval-interval", str(args.eval_interval), "--eval-iters",
                   str(args.eval_iters), "--output-dir", out_dir]
        wall, lines = _timed(command)
    result = json.loads(lines[-1])
    seconds = result["seconds"]
    return {
        "wall": wall,
        "ms_per_step": 1e3 * seconds["training"] / result["steps"],
        "steady_ms": (
            1e3 * (seconds["training"] - result["first_interval"])
            / (result["steps"] - args.eval_interval)
            if result["first_interval"] is not None and result["steps"] > args.eval_interval
            else math.nan  # one interval: nothing after it
        ),
        "eval_s": seconds["evaluation"],
        "val_loss": result["val_loss"],
    }


def run_ours(args, backend):
    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, str(EXAMPLE), "--backend", backend, "--fresh",
                   "--steps", str(args.steps), "--eval-interval", str(args.eval_interval),
                   "--eval-batches", str(args.eval_iters), "--output-dir", out_dir]
        wall, lines = _timed(command)
    text = "\n".join(lines)
    return {
        "wall": wall,
        "ms_per_step": float(re.search(r"^training: ([\d.]+) ms/step", text, re.M)[1]),
        "steady_ms": _steady_ms(text),
        "eval_s": float(re.search(r"evaluation ([\d.]+) s", text)[1]),
        "val_loss": float(re.search(r"^val_loss: ([\d.]+)$", text, re.M)[1]),
    }


def _steady_ms(text):
    """The example's ms/step after its first interval, or NaN (one interval)."""
    found = re.search(r"^training: .*\(([\d.]+) after the first interval", text, re.M)
    return float(found[1]) if found else math.nan


def _timed(command):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ))
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return wall, result.stdout.strip().splitlines()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-interval", type=int, default=250)
    parser.add_argument("--eval-iters", type=int, default=20,
                        help="nanoGPT's eval_iters; ours: --eval-batches")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--repeats", type=int, default=1, help="rounds, interleaved")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = nanogpt(args.steps, args.eval_interval, args.eval_iters, args.output_dir)
        print(json.dumps(result))
        return

    names = ["nanoGPT"] + args.backends.split(",")
    results = {name: [] for name in names}
    loads = []
    for round_ in range(args.repeats):
        for name in names:
            before = os.getloadavg()
            result = run_nanogpt(args) if name == "nanoGPT" else run_ours(args, name)
            loads.append((before, os.getloadavg()))
            results[name].append(result)
            print(f"round {round_ + 1} {name}: {json.dumps(result)} "
                  f"(load average before {before[0]:.1f}, after {os.getloadavg()[0]:.1f})",
                  flush=True)

    def median(name, key):
        return statistics.median(r[key] for r in results[name])

    print(f"\n{args.steps} steps, evaluation every {args.eval_interval} of "
          f"{args.eval_iters} batches per split; medians of {args.repeats} round(s)")
    print("| run | wall s | training ms/step | after the first interval | evaluation s | "
          "validation loss | wall / nanoGPT | ms/step / nanoGPT | after the first / nanoGPT |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        print(
            f"| {name} | {median(name, 'wall'):.1f} | {median(name, 'ms_per_step'):.1f} | "
            f"{median(name, 'steady_ms'):.1f} | "
            f"{median(name, 'eval_s'):.1f} | {median(name, 'val_loss'):.4f} | "
            f"{median(name, 'wall') / median('nanoGPT', 'wall'):.2f} | "
            f"{median(name, 'ms_per_step') / median('nanoGPT', 'ms_per_step'):.2f} | "
            f"{median(name, 'steady_ms') / median('nanoGPT', 'steady_ms'):.2f} |"
        )
    ours = [n for n in names if n != "nanoGPT"]
    if "jax" in ours:
        fastest = min(median(n, "ms_per_step") for n in ours)
        print(f"JAX / fastest backend (training ms/step): "
              f"{median('jax', 'ms_per_step') / fastest:.2f}")
    one_minute = [before[0] for before, _ in loads] + [after[0] for _, after in loads]
    print(f"load average (1 min) around the runs: {min(one_minute):.1f} to {max(one_minute):.1f} "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
