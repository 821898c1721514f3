"""Watch attention logits grow at a high learning rate, and keep them at tau with QK-Clip.

    python examples/monitor_qk_clip.py [--steps 300] [--lr 0.05] [--tau 30] [--out monitor-run]

Trains the lab's small transformer (one layer of attnscale.MultiHeadAttention, two heads of
d_k = 64, AdamW) on multi-query associative recall twice from the same initialisation and data:

* ``plain``: no guard. The monitor records every 5th step and its alert rules fire when a head's
  max logit passes ``--alert``, or grows 4x within 200 steps to above ``--alert``;
* ``qk-clip``: the monitor records every step, and after each optimizer step QK-Clip rescales the
  heads whose max logit in that step exceeded ``--tau``.

Writes OUT/plain.jsonl and OUT/qk-clip.jsonl (``attnscale monitor --run OUT/plain.jsonl`` plots
either), OUT/summary.json, and OUT/monitor_qk_clip.png, the figure of docs/monitor.md. One to two
minutes on two cores at the defaults.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

import attnscale
from attnscale.diagnostics.monitor import AlertRules, JsonlWriter, StepRecord
from attnscale.diagnostics.qk_clip import qk_clip
from attnscale.lab.tasks import MQAR
from attnscale.lab.training import ModelConfig, TinyTransformer, evaluate


def train(args: argparse.Namespace, out: Path, clip: bool) -> dict:
    name = "qk-clip" if clip else "plain"
    task = MQAR(context=16, queries=8, n_keys=32, n_values=32)
    torch.manual_seed(args.seed)
    model = TinyTransformer(task, ModelConfig(d_model=32, num_heads=2, head_dim=64))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = torch.Generator().manual_seed(args.seed + 1)
    alerts = []
    # Growth is only alarming at large logits: early in training every logit grows from its small start.
    rules = AlertRules(max_logit=args.alert, growth_factor=4.0, growth_window=200, growth_floor=args.alert, min_normalized_entropy=None, saturation_jump=None)
    mon = attnscale.monitor(model, every=1 if clip else 5, writers=[JsonlWriter(out / f"{name}.jsonl")], alerts=rules, on_alert=alerts.append)
    clipped = 0
    with mon:
        for _ in range(args.steps):
            batch = task.sample(args.batch, data)
            logits, _ = model(batch)
            F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()).backward()
            opt.step()
            opt.zero_grad()
            record = mon.step()
            if clip:
                clipped += qk_clip(model, record, args.tau).count
    final = evaluate(model, task.sample(256, torch.Generator().manual_seed(args.seed + 2)))
    logged = [max(h.max_logit for h in r.heads) for r in mon.history]
    return {
        "run": name,
        "records": mon.history,
        "final_accuracy": final.accuracy,
        "final_max_logit": final.max_logit,
        "peak_max_logit": max(logged),
        "clipped_heads": clipped,
        "alerts": alerts,
    }


def figure(runs: Sequence[dict], tau: float, alert: float) -> Figure:
    fig = Figure(figsize=(7.5, 3.6), layout="constrained")
    ax = fig.subplots()
    for run, colour in zip(runs, ("tab:red", "tab:blue")):
        records: list[StepRecord] = run["records"]
        for head in (0, 1):
            ys = [next(h.max_logit for h in r.heads if h.head == head) for r in records]
            ax.plot([r.step for r in records], ys, color=colour, lw=1.6 if head == 0 else 1.0, ls="-" if head == 0 else "--",
                    label=f"{run['run']}, head {head} (final acc {run['final_accuracy']:.2f})")
        for alert in run["alerts"][:1]:
            ax.axvline(alert.step, color=colour, ls=":", lw=1.2)
            ax.annotate(f"first alert (step {alert.step})", (alert.step, 1.5), color=colour, fontsize="small", xytext=(3, 0), textcoords="offset points")
    ax.axhline(tau, color="0.3", lw=0.8, ls="-.", label=f"QK-Clip tau = {tau:g}")
    ax.set_xlabel("training step")
    ax.set_ylabel("max attention logit (after the scale)")
    ax.set_yscale("log")
    ax.set_title(f"MQAR, one layer, 2 heads of d_k = 64, AdamW lr = {runs[0]['lr']:g}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=5e-2)
    parser.add_argument("--tau", type=float, default=30.0, help="QK-Clip's threshold (default 30)")
    parser.add_argument("--alert", type=float, default=60.0, help="alert when a max logit passes this (default 60)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="monitor-run", metavar="DIR")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [train(args, out, clip=False), train(args, out, clip=True)]
    for run in runs:
        run["lr"] = args.lr
    figure(runs, args.tau, args.alert).savefig(out / "monitor_qk_clip.png", dpi=130)
    summary = {r["run"]: {**{k: v for k, v in r.items() if k not in ("records", "run", "alerts")}, "alerts": [a.message for a in r["alerts"]]} for r in runs}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
