"""The plan's arithmetic and its printout: from what a compile measured to memory against the
device's budget, FLOPs, per-axis collective traffic, predicted step time and MFU (the model
in sharding/hardware.py), and the ranking `--search` prints.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from typing import Any, Callable

from configs import Config
from configs.schema import MESH_AXES
from model import flops_per_token
from sharding.hardware import Hardware, predict
from planner.rank import rank
from sharding.mesh import resolve_mesh_shape
from pipeline import bubble_formula, bubble_fraction

GB = 1e9


def _aggregate(ops: list[dict]) -> list[dict]:
    """Per (kind, the op it is written as, dtype, mesh axes, link): executions per step, buffer
    bytes (also split by element type, `by_dtype`) and ring bytes sent."""
    total: dict[tuple, dict] = defaultdict(lambda: {"count": 0, "bytes": 0.0, "wire_bytes": 0.0, "by_dtype": {}})
    for op in ops:
        if not op["axes"]:
            continue  # a group of one device moves nothing
        t = total[(op["kind"], op.get("lowered_as", ""), op["dtype"], tuple(op["axes"]), op["inter_node"],
                   op.get("beside", False))]
        t["count"] += op["count"]
        t["bytes"] += op["count"] * op["bytes"]
        t["wire_bytes"] += op["count"] * op["wire_bytes"]
        for dt, b in op.get("by_dtype") or [(op["dtype"], op["bytes"])]:
            t["by_dtype"][dt] = t["by_dtype"].get(dt, 0) + op["count"] * b
    return [{"kind": k, "lowered_as": w, "dtype": d, "axes": list(a), "inter_node": i, "beside": b, **v}
            for (k, w, d, a, i, b), v in sorted(total.items())]


def by_link(collectives: list[dict]) -> dict[str, dict[str, float]]:
    """Buffer bytes and ring bytes sent per device per step over each kind of link ("intra":
    ICI or NVLink; "inter": DCN or InfiniBand), from the aggregated collectives."""
    out: dict[str, dict[str, float]] = {}
    for c in collectives:
        t = out.setdefault("inter" if c["inter_node"] else "intra", {"bytes": 0.0, "wire_bytes": 0.0})
        t["bytes"] += c["bytes"]
        t["wire_bytes"] += c["wire_bytes"]
    return out


def kind_text(c: dict) -> str:
    """A collective's kind, and the op the compiler wrote it as where that is another."""
    return f"{c['kind']} (as {c['lowered_as']})" if c.get("lowered_as") else c["kind"]


def traffic(collectives: list[dict], least: dict[str, float]) -> dict[str, Any]:
    """Bytes each device sends per step, per mesh-axis group, beside the layout's minimum."""
    sent: dict[str, float] = defaultdict(float)
    for c in collectives:
        sent["+".join(c["axes"])] += c["wire_bytes"]
    rows = [{"axes": k, "sent": sent.get(k, 0.0), "minimum": least.get(k, 0.0)} for k in sorted(set(sent) | set(least))]
    total_sent, total_min = sum(sent.values()), sum(least.values())
    return {"rows": rows, "sent": total_sent, "minimum": total_min,
            "ratio": total_sent / total_min if total_min else None}


def entry(cfg: Config, n: int, hw: Hardware, measured: dict, state: dict[str, int]) -> dict[str, Any]:
    """One plan: memory, FLOPs, collectives against their minimum, and the predicted time."""
    # The sequences its objective trains (DPO: two a pair); a frozen model's forward is not model FLOPs.
    tokens = state["sequences"] * cfg.model.seq_len
    model_flops = flops_per_token(cfg.model) * tokens / n
    total = measured["total_bytes"]
    memory = {
        "params": state["params"],
        "optimizer": state["optimizer"],
        "batch": measured["batch_bytes"],
        "arguments": measured["argument_bytes"],
        "temps": measured["temp_bytes"],
        "outputs_not_aliased": measured["output_bytes"] - measured["alias_bytes"],
        "total": total,
        "budget": hw.memory_budget,
        "margin": hw.memory_budget - total,
    }
    collectives = _aggregate(measured["collectives"])
    roof = measured["roofline"]
    time = predict(hw=hw, model_flops=model_flops, compute_s=roof["seconds"], collectives=collectives,
                   bubble=measured["bubble"])
    return {
        "compiler": measured["compiler"],
        "memory": memory,
        "fits": total <= hw.memory_budget and not measured.get("out_of_memory"),
        "flops": {"model": model_flops, "compiled": roof["flops"], "xla_cost_analysis": measured["xla_flops"]},
        "hbm_bytes": roof["bytes"],
        "collectives": collectives,
        "traffic": traffic(collectives, state["minimum"]),
        "links": by_link(collectives),
        "time": time,
        "compile_s": measured["compile_s"],
        "side_program": measured.get("side_program"),  # the objective's own program: GRPO's decoding
        "notes": measured["notes"],
    }


def _describe(cfg: Config | None, overrides: list[str], n: int) -> dict[str, Any]:
    if cfg is None:
        return {"overrides": overrides}
    layout = resolve_mesh_shape(cfg.mesh, n)
    out = {"overrides": overrides, "layout": layout, "remat": cfg.model.remat}
    if layout["pipeline"] > 1:
        p = cfg.pipeline
        layout.update(microbatches=p.microbatches, repeats=p.repeats, schedule=p.schedule)
        # The idle share the predicted step time divides by, and where it comes from.
        out["pipeline"] = {"schedule": p.schedule,
                           "bubble": bubble_fraction(layout["pipeline"], p.repeats, p.microbatches, p.schedule),
                           "bubble_formula": bubble_formula(p.schedule, layout["pipeline"], p.repeats, p.microbatches)}
    return out


def evaluate(
    args: argparse.Namespace,
    rows: list[dict],
    hw: Hardware,
    measure: Callable[[list[list[str]]], list[dict]],
    state_bytes: Callable[[Config, int], dict[str, int]],
    compiler: str,
) -> dict[str, Any]:
    """Measures the candidate rows in rounds, one remat policy per round (one child process
    each), skipping policies that cannot win; returns the ranked plan."""
    n = args.devices
    for row in rows:
        row.update(_describe(row["cfg"], row["overrides"], n))
    pending = [r for r in rows if r["status"] == "pending"]
    for r in pending:
        r["state"] = state_bytes(r["cfg"], n)
        if args.search and r["state"]["params"] + r["state"]["optimizer"] > hw.memory_budget:
            need = (r["state"]["params"] + r["state"]["optimizer"]) / GB
            r.update(status="does not fit", reason=f"parameters + optimizer state alone need {need:.1f} GB")
    if args.search and getattr(args, "top", 0):
        rank(rows, n, hw, args.top)
        pending = [r for r in rows if r["status"] == "pending"]
    # Memory falls and time grows along --remat (none saves most, full least). Per mesh: the
    # fastest policy first; if it does not fit, the most frugal; if that fits, the ones between
    # in order. The first that fits ends the mesh; if the most frugal does not fit, none will.
    order = list(dict.fromkeys(r["remat"] for r in pending))
    rounds = order[:1] + order[-1:] + order[1:-1] if len(order) > 1 else order
    mesh_of = lambda r: " ".join(o for o in r["overrides"] if not o.startswith("model.remat="))  # noqa: E731
    fitting: dict[str, str] = {}  # mesh -> the policy that fits
    frugal_fails: set[str] = set()
    for i, policy in enumerate(rounds):
        batch = [r for r in pending if r["remat"] == policy and r["status"] == "pending"]
        for r in batch:
            if mesh_of(r) in fitting:
                r.update(status="skipped", reason=f"recomputes more than remat {fitting[mesh_of(r)]}, which fits")
            elif mesh_of(r) in frugal_fails:
                r.update(status="skipped", reason=f"saves more than remat {order[-1]}, which does not fit")
        batch = [r for r in batch if r["status"] == "pending"]
        for r, measured in zip(batch, measure([r["overrides"] for r in batch]) if batch else []):
            if "error" in measured:
                r.update(status="failed", reason=f"compile failed: {measured['error']}")
                continue
            if "out_of_memory" in measured:  # the TPU compiler refuses what does not fit
                r.update(status="does not fit", reason=f"the compiler: {measured['out_of_memory']}")
                if i == 1:
                    frugal_fails.add(mesh_of(r))
                continue
            r.update(entry(r["cfg"], n, hw, measured, r["state"]))
            r["status"] = "fits" if r["fits"] else "does not fit"
            if r["fits"]:
                fitting[mesh_of(r)] = policy
            elif i == 1:
                frugal_fails.add(mesh_of(r))
    order_of = {"fits": 0, "does not fit": 1, "not compiled": 2, "skipped": 3, "failed": 4, "invalid": 5}
    rows.sort(key=lambda r: (order_of[r["status"]], r.get("time", {}).get("step_s", float("inf")),
                             r.get("analytic_rank", 0)))
    plans = [{k: v for k, v in r.items() if k not in ("cfg", "fits", "state")} for r in rows]
    return {
        "config": args.config,
        "devices": n,
        "compiler": compiler,
        "hardware": {**dataclasses.asdict(hw), "memory_budget": hw.memory_budget},
        "plans": plans,
        "best": 0 if plans and plans[0]["status"] == "fits" else None,
    }


def _size(n: float) -> str:
    return f"{n / GB:.3f} GB" if abs(n) >= 0.1 * GB else f"{n / 1e6:.3f} MB"


def _seconds(x: float) -> str:
    """Three significant digits: a tiny model's step is microseconds, which 3 decimals show as 0.000."""
    return f"{x:.3g}"


def _layout_text(p: dict) -> str:
    """`data=8 fsdp=1 tensor=2`, the same for a layout refused before compiling (read from its
    mesh overrides) as for one that was compiled."""
    layout = p.get("layout")
    if layout is None:
        given = dict(o.split("=", 1) for o in p["overrides"] if "=" in o)
        layout = {key.removeprefix("mesh."): int(value) for key, value in given.items()
                  if key.removeprefix("mesh.") in MESH_AXES and value.lstrip("-").isdigit()}
        if "pipeline.schedule" in given:
            layout["schedule"] = given["pipeline.schedule"]
    # Rules given on the command line, as written.
    storage = [o for o in p.get("overrides", []) if o.startswith("sharding.params")]
    return " ".join([f"{k}={v}" for k, v in layout.items() if v != 1 or k in ("data", "fsdp")] + storage)


def print_plan(plan: dict) -> None:
    p, hw = plan["plans"][0], plan["hardware"]
    print(f"compiled by: {plan['compiler']}")
    if "memory" not in p:
        print(f"{plan['config']} on {plan['devices']} x {hw['name']}: {_layout_text(p)}: {p['status']}: {p['reason']}")
        return
    m, f, t = p["memory"], p["flops"], p["time"]
    print(f"{plan['config']} on {plan['devices']} x {hw['name']}: {_layout_text(p)}, remat {p['remat']}")
    for note in p["notes"]:
        print(f"  note: {note}")
    print(f"memory per device (budget {hw['memory_budget'] / GB:.1f} = {hw['memory_bytes'] / GB:.0f} "
          f"GB less {hw['memory_reserve']:.0%} runtime reserve)")
    for key in ("params", "optimizer", "batch", "temps", "outputs_not_aliased"):
        print(f"  {key:<22}{_size(m[key]):>14}")
    verdict = "fits" if p["status"] == "fits" else "does NOT fit"
    print(f"  {'total':<22}{_size(m['total']):>14}  -> {verdict}, margin {m['margin'] / GB:.1f} GB")
    side = p.get("side_program")
    if side:  # GRPO: the rollouts' KV-cached decoding, a program of its own beside the step
        fits = "fits" if side["total_bytes"] <= hw["memory_budget"] else "does NOT fit"
        print(f"  {'rollout decoding':<22}{_size(side['total_bytes']):>14}  -> {fits} (its own program: arguments "
              f"{_size(side['argument_bytes'])}, temps with the KV cache {_size(side['temp_bytes'])})")
    print(f"FLOPs per device per step: model {f['model']:.3e}, compiled kernels {f['compiled']:.3e} "
          f"(remat recompute included); HBM traffic {_size(p['hbm_bytes'])}")
    print("collectives per device per step (count includes loop trips; sent = ring-algorithm bytes of the op "
          "as the compiler wrote it)")
    print(f"  {'kind':<32}{'dtype':<10}{'axes':<16}{'count':>7}{'buffer':>14}{'sent':>14}  {'link':<6}{'seconds':>9}  overlap")
    for c in p["collectives"]:
        link = "inter" if c["inter_node"] else "intra"
        print(f"  {kind_text(c):<32}{c['dtype']:<10}{'+'.join(c['axes']):<16}{c['count']:>7}{_size(c['bytes']):>14}"
              f"{_size(c['wire_bytes']):>14}  {link:<6}{c['seconds']:>9.4f}  {'yes' if c['overlapped'] else 'no'}")
    for link, sums in sorted(p.get("links", {}).items()):
        print(f"  {link + ' links, all':<32}{'':<10}{'':<16}{'':>7}{_size(sums['bytes']):>14}{_size(sums['wire_bytes']):>14}")
    tr = p["traffic"]
    print("communication against the layout's minimum (bytes sent per device per step)")
    for row in tr["rows"]:
        ratio = f"{row['sent'] / row['minimum']:.2f}x" if row["minimum"] else "-"
        print(f"  {row['axes'] or '(none)':<20}{_size(row['sent']):>14} sent {_size(row['minimum']):>14} minimum  {ratio}")
    if tr["ratio"] is not None:
        print(f"  {'total':<20}{_size(tr['sent']):>14} sent {_size(tr['minimum']):>14} minimum  {tr['ratio']:.2f}x")
    if "pipeline" in p:
        pp = p["pipeline"]
        print(f"pipeline schedule {pp['schedule']}: bubble {pp['bubble']:.3f} = {pp['bubble_formula']}")
    print(f"predicted step {_seconds(t['step_s'])} s, MFU {t['mfu']:.1%}: compute (roofline) {_seconds(t['compute_s'])} s, "
          f"overlapped comm {_seconds(t['overlapped_comm_s'])} s, exposed comm {_seconds(t['exposed_comm_s'])} s, "
          f"bubble {t['bubble']:.3f} (compile {p['compile_s']:.1f} s)")


def print_search(plan: dict) -> None:
    hw = plan["hardware"]
    print(f"compiled by: {plan['compiler']}")
    print(f"{plan['config']} on {plan['devices']} x {hw['name']} (budget {hw['memory_budget'] / GB:.1f} GB per device)")
    analytic = any("estimate" in p for p in plan["plans"])  # --top: the estimate each layout was ranked by
    print("| rank | layout | remat | status | GB/dev | step s | MFU | comm / minimum | compute s | exposed comm s "
          "| overlapped comm s | bubble |" + (" analytic rank: GB floor, step s |" if analytic else ""))
    print("| --- " * (13 if analytic else 12) + "|")
    for i, p in enumerate(plan["plans"]):
        rank = str(i + 1) if p["status"] == "fits" else "-"
        if "time" in p:
            t = p["time"]
            ratio = p["traffic"]["ratio"]
            cols = [f"{p['memory']['total'] / GB:.2f}", _seconds(t["step_s"]), f"{t['mfu']:.1%}",
                    f"{ratio:.2f}" if ratio is not None else "-", _seconds(t["compute_s"]), _seconds(t["exposed_comm_s"]),
                    _seconds(t["overlapped_comm_s"]), f"{t['bubble']:.3f}"]
        else:
            cols = [p.get("reason", "")] + [""] * 7
        if analytic:
            e = p.get("estimate")
            cols.append(f"{p['analytic_rank']}: {e['memory'] / GB:.1f}, {_seconds(e['step_s'])}" if e else "-")
        print(f"| {rank} | {_layout_text(p)} | {p.get('remat', '')} | {p['status']} | " + " | ".join(cols) + " |")
    notes = {note for p in plan["plans"] for note in p.get("notes", [])}
    for note in sorted(notes):
        print(f"note: {note}")
