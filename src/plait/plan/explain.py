"""Plain-words explanations of a plan search: why the winner beats the runner-up."""

from __future__ import annotations

import dataclasses

from plait.plan.describe import recompute
from plait.plan.loader import replica_batch
from plait.plan.search import PlanSearch, RankedPlan, Rejection, describe
from plait.schedule import schedule_kind
from plait.sim import SimPlan

__all__ = ["compression", "context", "experts", "explain", "staleness", "time_breakdown"]

_GIB = 2.0**30


def time_breakdown(ranked: RankedPlan) -> dict[str, float]:
    """Seconds per step on an average pipeline rank: compute, tensor-parallel collectives,
    exposed data-parallel reduction, optimizer, and pipeline idle time (bubble); and, when
    the input pipeline is modelled, the wait for input beyond the simulated step."""
    wait = {}
    if ranked.loader_step_s > 0:
        wait = {"waiting for input": ranked.step_time_s - ranked.simulated_step_s}
    if ranked.result is None:  # unequal devices: only the step and its bubble are known
        return {"bubble": ranked.bubble_fraction * ranked.simulated_step_s, **wait}
    ranks = ranked.result.ranks
    n = len(ranks)
    return {
        **wait,
        "compute": sum(r.compute_s for r in ranks) / n,
        "tensor-parallel communication": sum(r.tp_comm_s for r in ranks) / n,
        "expert all-to-all": sum(r.ep_comm_s for r in ranks) / n,
        "context-parallel ring (exposed)": sum(r.cp_comm_s for r in ranks) / n,
        "data-parallel gradient reduction (partly hidden)": sum(r.dp_comm_s for r in ranks) / n,
        "optimizer step": sum(r.optimizer_s for r in ranks) / n,
        "bubble": ranked.bubble_fraction * ranked.result.pipeline_time_s,
    }


def _options(a: RankedPlan, b: RankedPlan) -> list[str]:
    """What differs between two plans, in the winner's terms."""
    pa, pb = a.plan, b.plan
    out = []
    for label, x, y in (
        ("data", pa.dp, pb.dp),
        ("expert", pa.ep, pb.ep),
        ("context", pa.cp, pb.cp),
        ("tensor", pa.tp, pb.tp),
        ("pipeline", pa.pp, pb.pp),
        ("micro-batch size", pa.micro_batch_size, pb.micro_batch_size),
        ("micro-batches", pa.microbatches, pb.microbatches),
        ("ZeRO stage", pa.zero, pb.zero),
    ):
        if x != y:
            parallel = ("data", "expert", "context", "tensor", "pipeline")
            degree = " parallel degree" if label in parallel else ""
            out.append(f"{label}{degree} {x} instead of {y}")
    if (pa.schedule, pa.chunks) != (pb.schedule, pb.chunks):
        out.append(f"schedule {_schedule(pa)} instead of {_schedule(pb)}")
    if recompute(pa) != recompute(pb):
        out.append(f"recomputation {recompute(pa)} instead of {recompute(pb)}")
    if pa.sequence_parallel != pb.sequence_parallel:
        out.append("sequence parallelism " + ("on" if pa.sequence_parallel else "off"))
    if (pa.offload_activations, pa.offload_optimizer) != (pb.offload_activations,
                                                          pb.offload_optimizer):  # fmt: skip
        out.append(
            f"offload of activations {pa.offload_activations}, optimizer state "
            f"{'on' if pa.offload_optimizer else 'off'}"
        )
    if pa.compress != pb.compress:
        out.append(f"gradient compression {pa.compress} instead of {pb.compress}")
    return out


def _schedule(p: SimPlan) -> str:
    return p.schedule + (f"x{p.chunks}" if p.chunks > 1 else "")


def compression(search: PlanSearch) -> str:
    """What the best plan's gradient compression saves against the same plan uncompressed;
    empty when it compresses nothing."""
    a = search.best
    if a.plan.compress == "none":
        return ""
    plain = next(
        (r for r in search.ranked if r.plan == dataclasses.replace(a.plan, compress="none")), None
    )
    lossy = (
        "rounds each gradient to 16 bits"
        if a.plan.compress in ("fp16", "bf16")
        else "sends an approximation (error feedback keeps the rest for later updates)"
    )
    text = f"It compresses the data-parallel gradients ({a.plan.compress}): it {lossy}"
    if plain is None:
        return text + "."
    ratio = plain.step_time_s / a.step_time_s
    verdict = (
        "the data-parallel link is slow enough for compression to pay"
        if ratio > 1.01
        else "compression gains next to nothing here"
    )
    return text + (
        f"; uncompressed, the same plan takes {plain.step_time_s:.3g} s per step instead of "
        f"{a.step_time_s:.3g} s ({ratio:.2f}×): {verdict}."
    )


def _all_to_all(r: RankedPlan) -> float:
    """Seconds per step an average pipeline rank spends in the experts' all-to-alls."""
    if r.result is None:
        return 0.0
    return sum(x.ep_comm_s for x in r.result.ranks) / len(r.result.ranks)


def _sans_ep(r: RankedPlan | Rejection) -> dict[str, object]:
    return {k: v for k, v in dataclasses.asdict(r.plan).items() if k != "ep"}


def experts(search: PlanSearch) -> str:
    """Why the best plan spreads its experts over that many ranks: what the token
    all-to-all costs it against what sharding the experts saves in memory, next to the
    best plan of another ep (or why none fits); empty for a model without experts."""
    a = search.best
    others = [r for r in search.ranked if r.plan.ep != a.plan.ep]
    rejected = [r for r in search.rejected if r.plan.ep != a.plan.ep]
    if a.plan.ep == 1 and not others and not rejected:
        return ""
    if a.plan.ep > 1:
        text = (
            f"It spreads the experts over ep={a.plan.ep} ranks: each holds 1/{a.plan.ep} of "
            f"them, and their token all-to-alls cost {_all_to_all(a):.3g} s per step "
            f"({_all_to_all(a) / a.step_time_s:.1%})."
        )
    else:
        text = "It keeps every expert on every rank (ep=1): no token all-to-all."
    same = [r for r in others if _sans_ep(r) == _sans_ep(a)]
    if same or others:
        b = (same or others)[0]
        text += (
            f" With ep={b.plan.ep} ({describe(b.plan)}) a step takes {b.step_time_s:.4g} s "
            f"instead of {a.step_time_s:.4g} s, of which {_all_to_all(b):.3g} s all-to-all, "
            f"and the fullest device holds {max(b.peak_memory_bytes) / _GIB:.1f} GiB instead "
            f"of {max(a.peak_memory_bytes) / _GIB:.1f} GiB."
        )
    fewer = [r for r in rejected if r.plan.ep < a.plan.ep]
    if fewer:
        r = min(fewer, key=lambda x: x.excess_bytes if x.excess_bytes > 0 else float("inf"))
        text += (
            f" With ep={r.plan.ep} ({describe(r.plan)}) each rank would hold "
            f"{a.plan.ep // r.plan.ep}× the experts and does not fit: {r.reason}."
        )
    return text


def context(search: PlanSearch) -> str:
    """Why the best plan splits its sequences over cp ranks: what that saves in activation
    memory and costs in ring transfers, against the closest plan without it (one that fits,
    or why none does); empty when the best plan has cp=1."""
    a = search.best
    cp = a.plan.cp
    if cp == 1:
        return ""
    ring = sum(r.cp_comm_s for r in a.result.ranks) / len(a.result.ranks) if a.result else 0.0
    text = (
        f"cp={cp}: it splits each {a.plan.seq_len}-token sequence over {cp} ranks (ring "
        f"attention), so each rank keeps the activations of {a.plan.seq_len // cp} tokens "
        f"per sequence ({100 / cp:.0f}%), for {ring:.3g} s per step of ring transfers its "
        "attention does not hide."
    )
    alone = [r for r in search.ranked if r.plan.cp == 1]
    if alone:
        b = alone[0]
        return text + (
            f" The best plan with cp=1, {describe(b.plan)}, takes {b.step_time_s:.4g} s per "
            f"step (simulated) instead of {a.step_time_s:.4g} s."
        )
    if search.without_cp is not None:
        e, p = search.without_cp
        turned = next((r for r in search.rejected if r.plan == p), None)
        if turned is not None:  # simulated, and it did not fit
            return (
                text + f" The fastest plan with cp=1 by estimate, {describe(p)}, {turned.reason}."
            )
        return text + (
            f" The fastest plan with cp=1, {describe(p)}, takes about {e.step_s:.4g} s per "
            f"step (estimated; {max(e.memory_bytes) / _GIB:.1f} GiB on its fullest device)."
        )
    short = [r for r in search.rejected if r.plan.cp == 1 and r.excess_bytes > 0]
    if short:
        r = min(short, key=lambda x: x.excess_bytes)
        text += (
            f" At cp=1 no layout the search estimated fits the activations of a "
            f"{a.plan.seq_len}-token sequence: the closest, {describe(r.plan)}, {r.reason}."
        )
    return text


def staleness(search: PlanSearch) -> str:
    """What an asynchronous best plan costs in staleness, against the best synchronous one;
    empty when the best plan is synchronous."""
    a = search.best
    kind = schedule_kind(a.plan.schedule)
    if kind.synchronous:
        return ""
    text = (
        f"It trains asynchronously ({kind.summary}): {kind.staleness}, so each update "
        "uses stale weights and training may need more updates to reach the same loss."
    )
    sync = next((r for r in search.ranked if schedule_kind(r.plan.schedule).synchronous), None)
    if sync is not None:
        text += (
            f" The best synchronous plan, {describe(sync.plan)}, takes "
            f"{sync.step_time_s:.3g} s per step: the asynchronous one pays off if it needs "
            f"fewer than {sync.step_time_s / a.step_time_s:.2f}× the synchronous updates."
        )
    return text


def explain(search: PlanSearch) -> str:
    """Why the best plan beats the runner-up: what it gains, what it pays; for an
    asynchronous best plan, what its staleness costs."""
    a = search.best
    runner = next((r for r in search.ranked[1:] if _layout(r) != _layout(a)), None)
    why = search.offload_reason and f"It offloads: {search.offload_reason}."
    parts = (staleness(search), compression(search), experts(search), context(search), why)
    stale = " ".join(x for x in parts if x)
    if runner is None:
        only = f"only one layout fits: {describe(a.plan)}"
        return " ".join(x for x in (only, _input(a, "Its"), stale) if x)
    b = runner
    margin = b.step_time_s - a.step_time_s
    lines = [
        f"{describe(a.plan)} beats {describe(b.plan)} by {margin:.3g} s per step "
        f"({margin / b.step_time_s:.1%})."
        if margin > 1e-3 * b.step_time_s
        else f"{describe(a.plan)} ties with {describe(b.plan)} (within 0.1% of a step, "
        "where the simpler plan is preferred).",
    ]
    differs = _options(a, b)
    if differs:
        lines.append("It uses " + "; ".join(differs) + ".")
    lines += [x for x in (_input(a, "Its"), _input(b, "The runner-up's", a)) if x]
    ta, tb = time_breakdown(a), time_breakdown(b)
    gains = [(k, tb[k] - ta[k]) for k in ta if k in tb and tb[k] - ta[k] > 1e-9]
    pays = [(k, ta[k] - tb[k]) for k in ta if k in tb and ta[k] - tb[k] > 1e-9]
    if gains:
        lines.append("It gains " + ", ".join(f"{v:.3g} s less {k}" for k, v in _top(gains)) + ".")
    if pays:
        lines.append("It pays " + ", ".join(f"{v:.3g} s more {k}" for k, v in _top(pays)) + ".")
    lines.append(
        f"Memory headroom: {a.headroom_bytes / _GIB:.1f} GiB on its fullest device versus "
        f"{b.headroom_bytes / _GIB:.1f} GiB."
    )
    ties = [
        r
        for r in search.ranked[1:]
        if _layout(r) == _layout(a) and r.step_time_s <= a.step_time_s * 1.001
    ]
    if ties:
        lines.append(
            "Variants of the same layout run as fast (the one with less sharding and "
            "recomputation is preferred): " + "; ".join(describe(r.plan) for r in ties) + "."
        )
    if stale:
        lines.append(stale)
    return " ".join(lines)


def _input(r: RankedPlan, whose: str, said: RankedPlan | None = None) -> str:
    """When the input pipeline sets `r`'s step: the load against the simulated step (in
    short when `said`, already explained, waits for the same load)."""
    if not r.input_bound:
        return ""
    batch = replica_batch(r.plan, r.hetero)
    if said is not None and said.input_bound and said.loader_step_s == r.loader_step_s:
        return f"{whose} step waits for the same load (simulated {r.simulated_step_s:.3g} s)."
    return (
        f"{whose} step is bound by the input pipeline: each of its dp={r.plan.dp} replicas "
        f"loads {batch} samples at {batch / r.loader_step_s:.4g} samples/s in "
        f"{r.loader_step_s:.3g} s, longer than the simulated step of "
        f"{r.simulated_step_s:.3g} s (a prefetching loader overlaps the two)."
    )


def _layout(r: RankedPlan) -> tuple[object, ...]:
    """What shapes the step: degrees, schedule and micro-batching (not memory options)."""
    p = r.plan
    return (p.dp, p.ep, p.cp, p.tp, p.pp, p.schedule, p.chunks, p.micro_batch_size, p.rank_order)


def _top(items: list[tuple[str, float]]) -> list[tuple[str, float]]:
    return sorted(items, key=lambda kv: -kv[1])[:3]
