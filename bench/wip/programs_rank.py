"""Research: can one generation's training teach the programs base a new program length, and what does it need?

Builds (once, cached under ``--home``) the programs base under ``programs/v2`` (levels 1-2, weights 1:2, 1,500
steps at lr 2e-3, context 1,024: the profile's recipe without its proposer part), then trains it on the runs
written out (``programs.worked``: the right run, the upper bound of anything a selection can give) of train-split
tasks, 2,048 a level at levels 2-3 and 512 at level 1, ``--steps`` steps of 64 at ``--lr`` (rsi's warmup and cosine
schedule), one arm per ``--arms`` entry: ``full`` (every weight) or ``loraR`` (PEFT LoRA of rank R, alpha 2R, on
every projection, as the cycle's TrainSpec). Scores greedy accuracy of the output (the last value) on 128
held-out tasks a level, levels 1-4, and writes JSON with ``--out``.

    .venv/bin/python bench/wip/programs_rank.py [--arms full,lora16,lora128] [--steps 300] [--lr 1e-3]
        [--home /tmp/programs-rank] [--out F]
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default="full,lora16,lora128")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--home", type=Path, default=Path("/tmp/programs-rank"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    arms = args.arms.split(",")
    if not all(a == "full" or (a.startswith("lora") and a[4:].isdigit()) for a in arms):
        raise SystemExit(f"--arms: full or loraR (R an integer), comma-separated (got {args.arms!r})")
    import torch
    from transformers import AutoModelForCausalLM

    from rsi.basemodel import BOS_ID, EOS_ID, PAD_ID, BaseRecipe, build_tokenizer, train_base
    from rsi.task_generators import programs
    from rsi.tasks import get_family
    from rsi.train import lr_at

    recipe = BaseRecipe(family="programs", harness="programs/v2", train_levels=(1, 2), level_weights=(1.0, 2.0),
                        steps=1500, warmup=100, lr=2e-3, max_position_embeddings=1024)
    base = args.home / f"base-{recipe.digest()}"
    if not (base / "model.safetensors").exists():
        train_base(recipe, base, eval_n=64)
    family, tok = get_family("programs"), build_tokenizer()

    def ids(task) -> list[int]:
        prompt = f"{task.payload['program']} ; x={task.payload['input']} ="
        return [BOS_ID] + tok.encode(prompt, add_special_tokens=False)

    @torch.no_grad()
    def accuracy(model, level: int) -> float:
        model.eval()
        tasks, right = family.tasks("heldout", 7, level, 128), 0
        for i in range(0, len(tasks), 64):
            chunk = [ids(t) for t in tasks[i:i + 64]]
            width = max(map(len, chunk))
            x = torch.tensor([[PAD_ID] * (width - len(s)) + s for s in chunk])
            y = model.generate(input_ids=x, attention_mask=(x != PAD_ID).long(), max_new_tokens=400, do_sample=False,
                               eos_token_id=EOS_ID, pad_token_id=PAD_ID)
            for task, row in zip(tasks[i:i + 64], y):
                text = tok.decode([c for c in row[width:].tolist() if c not in (EOS_ID, PAD_ID)])
                right += text.rsplit(" | ", 1)[-1].split(" ")[-1] == str(task.answer)
        return right / len(tasks)

    train = [t for lv in (2, 3) for t in family.tasks("train", 11, lv, 2048)] + family.tasks("train", 11, 1, 512)
    rows = []
    for arm in arms:
        torch.manual_seed(0)
        rng = random.Random(1)
        model = AutoModelForCausalLM.from_pretrained(base)
        if arm != "full":
            from peft import LoraConfig, get_peft_model

            rank = int(arm[4:])
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJ, lora_dropout=0.0)
            model = get_peft_model(model, config)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
        schedule = argparse.Namespace(lr=args.lr, warmup=10, steps=args.steps, min_lr_ratio=0.1)
        started, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
        model.train()
        losses = []
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, schedule)
            seqs, labels = [], []
            for task in rng.sample(train, 64):
                prompt = ids(task)
                answer = tok.encode(programs.worked(task.payload), add_special_tokens=False) + [EOS_ID]
                seqs.append(prompt + answer)
                labels.append([-100] * len(prompt) + answer)
            width = max(map(len, seqs))
            x = torch.tensor([s + [PAD_ID] * (width - len(s)) for s in seqs])
            y = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
            loss = model(input_ids=x, attention_mask=(x != PAD_ID).long(), labels=y).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(loss.detach()))
        trainable = sum(p.numel() for p in params)
        rows.append({"arm": arm, "trainable": trainable, "first_loss": losses[0], "final_loss": losses[-1],
                     "train_s": round(time.perf_counter() - started, 1),
                     "train_cpu_s": round(resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu, 1),
                     "heldout": {lv: accuracy(model, lv) for lv in (1, 2, 3, 4)}})
        print(rows[-1], flush=True)
    rows.insert(0, {"arm": "base", "heldout": {lv: accuracy(AutoModelForCausalLM.from_pretrained(base), lv)
                                               for lv in (1, 2, 3, 4)}})
    print(rows[0], flush=True)
    if args.out:
        write_result(args.out, {"base": str(base), "recipe": recipe.model_dump(mode="json"), "arms": rows},
                     run_config(args))


if __name__ == "__main__":
    main()
