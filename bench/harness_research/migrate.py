"""Width migration: LoRA steps on the model's own verified answers re-rendered at --to_width (levels 1-3 may
use fresh labels: --fresh13), constant lr after 10 warmup steps, eval per level at checkpoints; optionally
continue expert iteration at the new width."""
import argparse, json, time
import numpy as np, torch
from rw import OUT, add_lora, evaluate, fresh, log, log_start, render, sample_verified
from ei import run_ei

ap = argparse.ArgumentParser()
ap.add_argument("--base", required=True)
ap.add_argument("--adapter", default="")
ap.add_argument("--pools", default="", help="pools.json from ei.py; else harvest greedy at --from_width")
ap.add_argument("--from_width", type=int, default=10)
ap.add_argument("--to_width", type=int, default=16)
ap.add_argument("--checkpoints", default="0,50,100,200")
ap.add_argument("--rank", type=int, default=0, help="0: keep training the adapter; r: merge it, new rank-r LoRA")
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--fresh13", type=int, default=1)
ap.add_argument("--ei_gens", type=int, default=0)
ap.add_argument("--ei_max_level", type=int, default=14)
ap.add_argument("--eval_max", type=int, default=12)
ap.add_argument("--fmt", default="pad")
ap.add_argument("--name", required=True)
args = ap.parse_args()
from peft import PeftModel
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
logf = OUT / f"{args.name}.log"
log_start(logf, args)
model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
if args.adapter:
    model = PeftModel.from_pretrained(model, args.adapter, is_trainable=True)
    if args.rank:
        model = add_lora(model.merge_and_unload(), r=args.rank, alpha=2 * args.rank)
else:
    model = add_lora(model, r=args.rank or 16, alpha=2 * (args.rank or 16))
t0 = time.process_time()
if args.pools:
    pools = {int(k): [tuple(p) for p in v] for k, v in json.loads(open(args.pools).read()).items()}
else:  # harvest: greedy (k=1) on 400 train tasks per level at the old width, verified
    pools = {}
    for lv in range(4, args.from_width + 1):
        pools[lv] = sample_verified(model, args.from_width, lv, 400, 1, 0.0, args.fmt, 7)
log(logf, tag="pools", harvest_cpu=round(time.process_time() - t0, 1), pool={k: len(v) for k, v in pools.items()})
W = args.to_width
rng = np.random.default_rng([0x316, W])
levels = sorted(set([1, 2, 3] + [lv for lv in pools if pools[lv]]))


def batch(step):
    lv = rng.choice(levels, 128)
    own = [pools[l][rng.integers(len(pools[l]))] for l in lv if l >= 4 or not args.fresh13]
    groups = [render(own, W, args.fmt)] if own else []
    f = [int(l) for l in lv if l <= 3] if args.fresh13 else []
    if f:
        parts = [fresh(rng, l, f.count(l), W, args.fmt) for l in (1, 2, 3) if l in f]
        groups.append((torch.cat([p[0] for p in parts]), parts[0][1]))
    return groups


cps = [int(x) for x in args.checkpoints.split(",")]
done = 0
t_mig = 0.0
for cp in cps:
    if cp > done:
        t1 = time.process_time()
        # constant lr after warmup: lr_at with min_ratio 1 is emulated by steps >> cp; use a long horizon
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        if done == 0:
            opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
        from rw import group_loss
        losses = []
        for step in range(done, cp):
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, (step + 1) / 10)
            loss = group_loss(model, batch(step))
            opt.zero_grad(set_to_none=True); loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step(); losses.append(loss.item())
        model.eval()
        t_mig += time.process_time() - t1
        done = cp
        log(logf, tag="mig_loss", step=cp, loss=round(float(np.mean(losses[-20:])), 4))
    acc = evaluate(model, W, range(1, min(args.eval_max, W) + 1), 256, args.fmt)
    log(logf, tag="mig_eval", step=cp, w=W, mig_cpu=round(t_mig, 1), acc=acc)
model.save_pretrained(OUT / args.name)
if args.ei_gens:
    run_ei(model, W, args.ei_max_level, args.ei_gens, logf, args.fmt, None, pools={k: v for k, v in pools.items()})
    model.save_pretrained(OUT / (args.name + "_ei"))
    log(logf, tag="final", acc=evaluate(model, W, range(1, min(args.ei_max_level + 2, W) + 1), 256, args.fmt))
