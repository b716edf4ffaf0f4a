"""Multi-width base pretraining on levels 1..3 (labels only there). Same steps/lr/batch/schedule as BaseRecipe;
the width W is drawn per step (whole batch one W) uniformly from --widths."""
import argparse, time
import numpy as np, torch
from rw import OUT, build_base, fit, evaluate, fresh, log, log_start

ap = argparse.ArgumentParser()
ap.add_argument("--widths", default="8-20")
ap.add_argument("--steps", type=int, default=1500)
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--fmt", default="pad")
ap.add_argument("--name", required=True)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--eval_widths", default="8,10,12,16,20")
args = ap.parse_args()
lo, hi = map(int, args.widths.split("-")) if "-" in args.widths else (int(args.widths),) * 2
widths = list(range(lo, hi + 1))
torch.manual_seed(args.seed)
model = build_base(args.seed)
rng = np.random.default_rng([0x7EA1, args.seed])
probs = np.array([1, 2, 4]) / 7
logf = OUT / f"{args.name}.log"; OUT.mkdir(exist_ok=True)
log_start(logf, args)

def batch(step):
    w = int(rng.choice(widths))
    counts = rng.multinomial(128, probs)
    parts = [fresh(rng, lv, int(c), w, args.fmt) for lv, c in zip((1, 2, 3), counts) if c]
    return [(torch.cat([p[0] for p in parts]), parts[0][1])]

t0 = time.process_time()
fit(model, batch, args.steps, args.lr, 100, logf, "pretrain", wd=0.01)
train_cpu = time.process_time() - t0
model.save_pretrained(OUT / args.name)
res = {w: evaluate(model, w, [1, 2, 3, 4], 256, args.fmt) for w in map(int, args.eval_widths.split(","))}
log(logf, tag="done", train_cpu_s=round(train_cpu, 1), eval=res)
