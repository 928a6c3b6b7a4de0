"""The processes of bench/gpu_check.py other than accum-train: the workload, and the two peers a user
would write or pick instead of accum-train, each in a process of its own as a user runs it.

    python bench/gpu_peers.py workload --model DIR --data FILE --layers 16 --seq-len 2048 --rows 144
    python -m torch.distributed.run --nproc_per_node=1 --standalone bench/gpu_peers.py fsdp2 --model DIR --data FILE
    python bench/gpu_peers.py trainer --model DIR --data FILE

- `workload`: the Llama-3.2-1B shape built on the GPU (fp32, seed 0: a CPU init of 1.2B weights
  takes long) and saved with safetensors, so every contestant starts from the same weights and
  loads them in seconds; a ByT5 tokenizer beside it (accum-train asks for one; the data are ids);
  random token ids as a pre-tokenised .jsonl. Prints what the parent needs for MFU.
- `fsdp2`: the least a user writes for the same training: `fully_shard` on each decoder layer, then
  the root, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), FSDP2's own sync (every
  microbatch), each microbatch's summed loss over the step's global count of loss tokens, plain
  `torch.optim.AdamW` (torch's default implementation), grad clip 1.0. NCCL, or gloo without CUDA.
- `trainer`: `transformers.Trainer` with bf16=True, everything at its defaults but what makes it
  this workload (constant rate, adamw_torch, weight decay 0, sequential sampling, no tqdm), timed
  by a TrainerCallback at the end of each optimizer step.

Each peer prints one line `RESULT {json}`: the seconds of every optimizer step (from the end of the
step before, the GPU synchronised), torch.cuda.max_memory_allocated in GiB, the mean loss of the steps.
Without CUDA they run on the CPU in fp32 (gpu_check.py --tiny: the plumbing, not the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROLES = ("workload", "fsdp2", "trainer")
RESULT = "RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--model", required=True, help="folder with config.json (workload writes the weights there)")
    parser.add_argument("--data", required=True, help="pre-tokenised .jsonl, one {'input_ids': [...]} per row")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seq-len", type=int, default=2048, help="workload: tokens per row")
    parser.add_argument("--rows", type=int, default=144, help="workload: rows of random token ids")
    parser.add_argument("--vocab-top", type=int, default=128000, help="workload: ids drawn from [3, this)")
    return parser.parse_args(argv)


def report(record: dict) -> None:
    print(RESULT + json.dumps(record), flush=True)


def read_rows(data: str):
    import torch

    return torch.tensor([json.loads(line)["input_ids"] for line in Path(data).read_text().splitlines()])


def peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def workload(args: argparse.Namespace) -> None:
    """Weights, tokenizer and data on disk; one RESULT line with the device and the FLOPs of a token."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, ByT5Tokenizer

    sys.path.insert(0, str(REPO))
    from accum_cli.rundir.metrics import flops_per_token, peak_flops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.model)
    ByT5Tokenizer().save_pretrained(args.model)
    g = torch.Generator().manual_seed(1234)
    with open(args.data, "w") as f:
        for row in torch.randint(3, args.vocab_top, (args.rows, args.seq_len), generator=g).tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    n_params = sum(p.numel() for p in model.parameters())  # a tied matrix once, as accum-train counts it
    report(
        {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "device_memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30
            if device.type == "cuda"
            else None,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "n_params": n_params,
            "flops_per_token": flops_per_token(n_params, config.num_hidden_layers, config.hidden_size, args.seq_len),
            "peak_flops": peak_flops(device),
        }
    )


def fsdp2(args: argparse.Namespace) -> None:
    """The hand-written FSDP2 loop; under torch.distributed.run, every rank reads the whole file and
    takes its share of each step (microbatch b of a step goes to rank b % W)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    g, m = args.global_batch, args.micro_batch
    if g % (m * world):
        raise SystemExit(f"--global-batch {g} is not a multiple of micro batch x world size = {m * world}")
    accum = g // (m * world)
    rows = read_rows(args.data)[: g * args.steps]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device).train()
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    step_s, losses = [], []
    started = time.perf_counter()
    for step in range(args.steps):
        batch = rows[step * g : (step + 1) * g]
        # HF shifts the labels: every token but the first of a row is a loss token. The count is the
        # whole step's, over all ranks, so the accumulated gradient is the mean over the global batch.
        loss_tokens = batch.shape[0] * (batch.shape[1] - 1)
        total = torch.zeros((), device=device)
        for k in range(accum):
            b = k * world + rank
            ids = batch[b * m : (b + 1) * m].to(device, non_blocking=True)
            out = model(input_ids=ids, labels=ids, num_items_in_batch=loss_tokens)
            # FSDP2 divides the reduced gradients by the world size; the loss is already a share
            # of the global mean, so multiply it back: the gradient is the sum over ranks.
            (out.loss * world).backward()
            total += out.loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item())  # synchronises, as a loop that logs its loss does
        now = time.perf_counter()
        step_s.append(now - started)
        started = now
    if rank == 0:
        report(
            {
                "step_s": step_s,
                "peak_gib": peak_gib(device),
                "mean_loss": sum(losses) / len(losses),
                "accum_steps": accum,
            }
        )
    dist.destroy_process_group()


def trainer(args: argparse.Namespace) -> None:
    """transformers.Trainer on this process's device (one GPU: no DDP), bf16 on CUDA."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    cuda = torch.cuda.is_available()
    rows = read_rows(args.data)[: args.global_batch * args.steps]

    class Rows(torch.utils.data.Dataset):
        """Map-style rows, labels = input_ids (HF shifts them): no `datasets` needed."""

        def __len__(self) -> int:
            return rows.shape[0]

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": rows[i], "labels": rows[i]}

    ends: list[float] = []

    def clock() -> None:
        if cuda:
            torch.cuda.synchronize()  # on_step_end may come before the step's kernels have run
        ends.append(time.perf_counter())

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock()

        def on_step_end(self, args, state, control, **kwargs):
            clock()

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    wanted = dict(
        output_dir=str(Path(args.data).parent / "trainer-out"), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.global_batch // args.micro_batch, max_steps=args.steps,
        learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=args.grad_clip, optim="adamw_torch", bf16=cuda, use_cpu=not cuda, save_strategy="no",
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, train_sampling_strategy="sequential",
    )  # fmt: skip
    # train_sampling_strategy is recent (transformers 5.2x); on an older one the default random order
    # costs nothing here: the rows are all alike.
    known = {f.name for f in dataclasses.fields(TrainingArguments)}
    training_args = TrainingArguments(**{k: v for k, v in wanted.items() if k in known})
    trained = Trainer(model=model, args=training_args, train_dataset=Rows(), callbacks=[Clock()])
    output = trained.train()
    report(
        {
            "step_s": [b - a for a, b in zip(ends, ends[1:], strict=False)],
            "peak_gib": peak_gib(next(trained.model.parameters()).device),
            "mean_loss": output.training_loss,  # it logs no step's own loss at its default logging_steps
            "accum_steps": training_args.gradient_accumulation_steps,
        }
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    {"workload": workload, "fsdp2": fsdp2, "trainer": trainer}[args.role](args)


if __name__ == "__main__":
    main()
