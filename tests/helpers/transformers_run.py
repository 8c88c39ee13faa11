"""Transformers ``Trainer`` runs for tests/test_integrations_transformers.py: a 2-layer GPT-2
built from a config (nothing downloaded), trained by ``Trainer`` with torch DDP, then with
``trainer.train()`` inside ``use_mini_ddp()``, in the same two processes.

``torchrun --standalone --nproc-per-node 2 transformers_run.py OUT_DIR``; ``use_cpu=True``,
gradient accumulation over two micro-batches, dropout off (the two runs draw no random
numbers the other does not). Each rank writes ``OUT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from mini_ddp.integrations import use_mini_ddp

VOCAB, LENGTH = 64, 16


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences; labels are the inputs (causal language modelling)."""

    def __init__(self, n: int = 32) -> None:
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _train(mini: bool, out: str) -> tuple[list[torch.Tensor], str, bool]:
    args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2,
                             seed=0, report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0)
    model = tiny_gpt2()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    with use_mini_ddp() if mini else nullcontext():
        trainer.train()
    wrapped = trainer.model_wrapped
    return ([p.detach().clone() for p in model.parameters()], type(wrapped).__name__,
            trainer.model is model and isinstance(wrapped, DDP) and wrapped.module is model)


def main(out_dir: Path) -> None:
    """The run; each rank writes ``out_dir/rank{R}.json``."""
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        theirs, theirs_by, _ = _train(False, tmp)
        ours, ours_by, unwrapped = _train(True, tmp)
    start = list(tiny_gpt2().parameters())
    out = {"same": all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True)),
           "changed": not all(torch.equal(a, b) for a, b in zip(ours, start, strict=True)),
           "wrapped_by": ours_by, "torch wrapped_by": theirs_by, "unwrapped": unwrapped,
           "rebinding restored": torch.nn.parallel.DistributedDataParallel is DDP}
    rank = torch.distributed.get_rank()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    from torchrun_json import run_rank

    run_rank(lambda: main(Path(sys.argv[1])))
