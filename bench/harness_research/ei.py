"""LoRA expert iteration (FACTS recipe) on a fixed width W: target lowest level >= 4 under 90 % greedy;
512 tasks at L + 128 at L+1, k=8, T=1.0, keep verified exact matches (pools grow, one per problem);
100 steps batch 128 lr 1e-3 (warmup 10, cosine to 0.1), 50 % frontier pools L/L+1, 50 % replay over 1..L-1
(fresh labels only for 1..3, at widths --replay_widths; own verified pools for 4..L-1 at W). Eval 256/level."""
import argparse, json, time
import numpy as np, torch
from rw import OUT, evaluate, fit, fresh, log, log_start, render, sample_verified, add_lora


def run_ei(model, w, max_level, gens, logf, fmt="pad", replay_widths=None, pools=None, seed=0, steps=100,
           lr=1e-3, eval_n=256, stop_acc=0.9, min_level=4):
    replay_widths = replay_widths or [w]
    pools = pools if pools is not None else {}
    rng = np.random.default_rng([0xB0, seed, w])
    hist = []
    acc = evaluate(model, w, range(1, min(max_level, w) + 1), eval_n, fmt)
    log(logf, tag="ei_eval", gen=0, w=w, acc=acc)
    for g in range(1, gens + 1):
        todo = [lv for lv in range(min_level, min(max_level, w) + 1) if acc.get(lv, 0) < stop_acc]
        if not todo:
            log(logf, tag="ei_done", gen=g - 1, w=w)
            break
        L = todo[0]
        t0 = time.process_time()
        for lv, n in ((L, 512), (L + 1, 128)):
            if lv > w:
                continue
            got = sample_verified(model, w, lv, n, 8, 1.0, fmt, seed * 100 + g)
            s = set(map(tuple, pools.get(lv, []))); s.update(got)
            pools[lv] = sorted(s)
        t_roll = time.process_time() - t0
        front = [(lv, p) for lv in (L, L + 1) for p in pools.get(lv, [])]
        rep_levels = list(range(1, L))

        def batch(step):
            groups = []
            if front:
                idx = rng.integers(0, len(front), 64)
                groups.append(render([front[i][1] for i in idx], w, fmt))
            lvls = rng.choice(rep_levels, 128 - (64 if front else 0))
            own = [pools[lv][rng.integers(len(pools[lv]))] for lv in lvls if lv >= 4 and pools.get(lv)]
            if own:
                groups.append(render(own, w, fmt))
            n_fresh = int(sum(1 for lv in lvls if lv <= 3))
            if n_fresh:
                wr = int(rng.choice(replay_widths))
                lv_f = [int(lv) for lv in lvls if lv <= 3]
                parts = [fresh(rng, lv, lv_f.count(lv), wr, fmt) for lv in (1, 2, 3) if lv in lv_f]
                groups.append((torch.cat([p[0] for p in parts]), parts[0][1]))
            return groups

        t1 = time.process_time()
        losses = fit(model, batch, steps, lr, 10)
        t_train = time.process_time() - t1
        acc = evaluate(model, w, range(1, min(max_level, w) + 1), eval_n, fmt)
        rec = dict(tag="ei_gen", gen=g, w=w, target=L, pool={k: len(v) for k, v in sorted(pools.items())},
                   loss=round(float(np.mean(losses[-20:])), 4), roll_cpu=round(t_roll, 1),
                   train_cpu=round(t_train, 1), gen_cpu=round(time.process_time() - t0, 1), acc=acc)
        log(logf, **rec)
        hist.append(rec)
    return pools, acc, hist


if __name__ == "__main__":
    from transformers import AutoModelForCausalLM
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--width", type=int, default=10)
    ap.add_argument("--max_level", type=int, default=10)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--fmt", default="pad")
    ap.add_argument("--replay_widths", default="")
    ap.add_argument("--name", required=True)
    ap.add_argument("--transfer_widths", default="16")
    ap.add_argument("--adapter", default="", help="continue this LoRA adapter (e.g. a migrated one)")
    ap.add_argument("--pools", default="", help="pools.json to start from (levels >= 4, re-rendered at --width)")
    args = ap.parse_args()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    if args.adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(base, args.adapter, is_trainable=True)
    else:
        model = add_lora(base)
    pools0 = ({int(k): [tuple(p) for p in v] for k, v in json.loads(open(args.pools).read()).items()}
              if args.pools else None)
    rw_ = args.replay_widths
    rws = None if not rw_ else (list(range(*[int(x) + i for i, x in enumerate(rw_.split("-"))])) if "-" in rw_
                                 else [int(x) for x in rw_.split(",")])
    logf = OUT / f"{args.name}.log"
    log_start(logf, args)
    pools, acc, hist = run_ei(model, args.width, args.max_level, args.gens, logf, args.fmt, rws, pools=pools0)
    model.save_pretrained(OUT / args.name)
    (OUT / f"{args.name}.pools.json").write_text(json.dumps({k: v for k, v in pools.items()}))
    for tw in map(int, filter(None, args.transfer_widths.split(","))):
        log(logf, tag="transfer", w=tw, acc=evaluate(model, tw, range(1, args.max_level + 3), 256, args.fmt))
