"""Weight versions: which copy of a stage's weights each action computes with, and when
copies are made and dropped, decided from the program alone.

A stage's live weights are the latest version: the one its UPDATEs advance (the k-th
UPDATE of a stage produces version k). An action that must compute on another version
gets a copy, made by an action this module inserts into the concrete program:

- ``STASH s v``: keep a copy of stage s's current weights as version v, when a forward
  on the current version will be followed by an UPDATE of s before its backward (weight
  stashing, Narayanan et al., SOSP 2019), or when an UPDATE is about to overwrite a
  version that a later forward still uses (2BW's older buffer);
- ``PREDICT s v``: weights predicted for version v from the current ones, when a forward
  targets a version not produced yet (SpecTrain, Chen et al. 2018; XPipe, Guan et al.
  2019); later forwards targeting v reuse the same prediction while it is alive;
- ``FREE s v``: drop a copy once no micro-batch in flight computes on it and no later
  forward asks for it.

A micro-batch's backward always uses the weights its forward used. Because the decisions
depend on the program and never on timing, the runtime, the simulator and the validator
agree on every version (the property the asynchronous-schedule oracles rely on).

`WeightPlanner` walks one rank's concrete actions in order with a look-ahead, checks them
against the schedule's policy (see `plait.schedule.ir.POLICIES`) and returns them with
the copy actions inserted; `VersionError` names the first action that breaks a rule.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from plait.schedule.ir import Action, Op

__all__ = ["VersionError", "WeightPlanner"]

_LAST_BACKWARD = (Op.B, Op.BW)
_BACKWARD = (Op.B, Op.BI, Op.BW)
_SENDS = (Op.SEND_F, Op.SEND_B)


class VersionError(ValueError):
    """An action whose weight version breaks the schedule's policy: `index` is its
    position among the actions given to `WeightPlanner.plan`."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(why)
        self.index = index
        self.why = why


@dataclass
class _Slot:
    op: Op  # STASH or PREDICT
    users: set[int] = field(default_factory=set)  # micro-batches in flight on this copy


class _Ahead:
    """Positions in `actions + ahead` that the planner's questions need, built once."""

    def __init__(self, seq: Sequence[Action]) -> None:
        self.updates: dict[int, list[int]] = defaultdict(list)
        self.forwards: dict[tuple[int, int | None], list[int]] = defaultdict(list)
        self.last_backward: dict[tuple[int, int], int] = {}
        for q, a in enumerate(seq):
            if a.op is Op.UPDATE:
                self.updates[a.stage].append(q)
            elif a.op is Op.F:
                self.forwards[(a.stage, a.version)].append(q)
            elif a.op in _LAST_BACKWARD:
                self.last_backward[(a.stage, a.microbatch)] = q

    def update_between(self, stage: int, after: int, before: int) -> bool:
        positions = self.updates.get(stage, [])
        i = bisect_right(positions, after)
        return i < len(positions) and positions[i] < before

    def forward_after(self, stage: int, version: int, after: int) -> bool:
        positions = self.forwards.get((stage, version), [])
        return bisect_right(positions, after) < len(positions)


class WeightPlanner:
    """Weight copies of one rank's concrete program under `policy`, decided in order.

    State (the current version of each stage, the copies alive, which copy each
    micro-batch in flight computes on) persists across calls of `plan`, so a program can
    be planned window by window. `first_version` (micro-batch -> version its forward used
    on its first stage, for 'vertical' and '2bw') and `applied` ((stage, micro-batch) ->
    the version its gradient is applied to, for 'predict') add the policy checks that need
    facts from other ranks or from the whole program; `max_versions` bounds the versions
    a stage holds at once.
    """

    def __init__(
        self,
        policy: str,
        *,
        first_version: Mapping[int, int] | None = None,
        applied: Mapping[tuple[int, int], int] | None = None,
        max_versions: int | None = None,
    ) -> None:
        self.policy = policy
        self.max_versions = max_versions  # per stage, at once (2BW: two)
        # checks only the validator asks for, with facts from every rank: the version each
        # micro-batch used on its first stage; the version its gradient is applied to
        self.first_version = first_version or {}
        self.applied = applied
        self.current: dict[int, int] = defaultdict(int)
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.used: dict[tuple[int, int], tuple[int, int] | None] = {}  # None: the live weights
        self.forward_version: dict[tuple[int, int], int] = {}
        self.peak_versions: dict[int, int] = defaultdict(lambda: 1)  # per stage
        self.peak_copies = 0  # copies alive at once on this rank, besides the live weights

    def plan(self, actions: Sequence[Action], ahead: Sequence[Action] = ()) -> list[Action]:
        """`actions` with the weight-copy actions inserted; `ahead` (the actions that will
        follow, as far as known) informs the decisions and is not planned."""
        seq = [*actions, *ahead]
        look = _Ahead(seq)
        out: list[Action] = []
        pending: list[Action] = []  # drops wait for the sends of the action that made them
        for q, a in enumerate(actions):
            if a.op not in _SENDS:
                out += pending
                pending = []
            try:
                before, after = self._step(q, a, look)
            except VersionError as err:
                raise VersionError(q, err.why) from None
            out += before
            out.append(a)
            pending += after
            self._count(q)
        return out + pending

    def free_all(self) -> list[Action]:
        """FREE for every copy still alive (the end of a stream)."""
        out = [Action(Op.FREE, s, 0, v) for (s, v), slot in self.slots.items() if not slot.users]
        for action in out:
            del self.slots[(action.stage, action.version)]  # type: ignore[arg-type]
        return out

    @property
    def live_versions(self) -> dict[int, int]:
        """Per stage with copies: the number of distinct versions alive now."""
        return {s: self._versions(s) for s in {s for s, _ in self.slots}}

    # ------------------------------------------------------------------ rules
    def _step(self, q: int, a: Action, look: _Ahead) -> tuple[list[Action], list[Action]]:
        if a.op is Op.F:
            made = self._forward(q, a, look)
            key = self.used[(a.stage, a.microbatch)]
            return made, [] if key is None else self._maybe_free(q, a, key[1], look)
        if a.op in _BACKWARD:
            return [], self._backward(q, a, look)
        if a.op is Op.UPDATE:
            return self._update(q, a, look), []
        if a.op in (Op.STASH, Op.PREDICT, Op.FREE):
            raise VersionError(
                q, f"{a}: copy actions are derived from the versions; remove them from the program"
            )
        return [], []

    def _forward(self, q: int, a: Action, look: _Ahead) -> list[Action]:
        s, x = a.stage, a.microbatch
        current = self.current[s]
        v = current if a.version is None else a.version
        self._check_forward(a, v, current)
        self.forward_version[(s, x)] = v
        key = (s, v)
        made: list[Action] = []
        if key not in self.slots:
            last = look.last_backward.get((s, x))
            # a backward beyond the look-ahead: copy to be safe (a synchronous window holds
            # its backwards; the validator checks that they exist)
            safe = self.policy == "sync" if last is None else not look.update_between(s, q, last)
            if v == current and safe:
                self.used[(s, x)] = None  # computes on the live weights
                return made
            if v == current and self.policy != "sync":
                op = Op.STASH
            elif v > current and self.policy == "predict":
                op = Op.PREDICT
            elif v == current:
                raise VersionError(
                    q, f"an UPDATE of stage {s} comes before the backward of micro-batch {x}: "
                    "a synchronous schedule updates a stage only after all its backwards",
                )  # fmt: skip
            else:
                raise VersionError(q, self._unavailable(s, v, current))
            self.slots[key] = _Slot(op)
            made.append(Action(op, s, x, v))
        self.slots[key].users.add(x)
        self.used[(s, x)] = key
        return made

    def _check_forward(self, a: Action, v: int, current: int) -> None:
        s, x = a.stage, a.microbatch
        policy = self.policy
        if policy in ("sync", "stash") and v != current:
            why = "uses the current weights" if policy == "stash" else "computes on current weights"
            raise VersionError(
                -1, f"{a}: a '{policy}' schedule {why}: stage {s} is at version {current}"
            )
        if policy in ("vertical", "2bw"):
            first = self.first_version.get(x)
            if first is not None and first != v:
                raise VersionError(
                    -1, f"{a}: micro-batch {x} ran its first stage on version {first}: a "
                    f"'{policy}' schedule uses one version per micro-batch on every stage",
                )  # fmt: skip
        if policy == "predict" and self.applied is not None:
            target = self.applied.get((s, x))
            if target is not None and target != v:
                raise VersionError(
                    -1, f"{a}: the gradient of micro-batch {x} is applied to version {target} "
                    f"of stage {s}: predict weights for version {target}",
                )  # fmt: skip

    def _unavailable(self, s: int, v: int, current: int) -> str:
        if v > current:
            return (
                f"version {v} of stage {s} does not exist yet (the stage is at {current}): "
                "only a 'predict' schedule computes on future versions"
            )
        return (
            f"version {v} of stage {s} is no longer held (the stage is at {current}): "
            "no micro-batch in flight kept it"
        )

    def _backward(self, q: int, a: Action, look: _Ahead) -> list[Action]:
        s, x = a.stage, a.microbatch
        if (s, x) not in self.used:
            raise VersionError(q, f"{a} has no forward of micro-batch {x} before it")
        v = self.forward_version[(s, x)]
        if a.version is not None and a.version != v:
            raise VersionError(
                q, f"{a}: its forward {s}F{x} used version {v}: a backward must use the "
                "weights of its forward (weight stashing)",
            )  # fmt: skip
        key = self.used[(s, x)]
        if key is None and self.current[s] != v:
            raise VersionError(q, f"{a}: stage {s} was updated after {s}F{x} ran on it")
        if a.op is Op.BI:
            return []
        del self.used[(s, x)]
        del self.forward_version[(s, x)]
        if key is None:
            return []
        self.slots[key].users.discard(x)
        return self._maybe_free(q, a, key[1], look)

    def _update(self, q: int, a: Action, look: _Ahead) -> list[Action]:
        s = a.stage
        current = self.current[s]
        if a.version is not None and a.version != current + 1:
            raise VersionError(
                q, f"{a}: stage {s} has made {current} updates, so this one produces "
                f"version {current + 1}",
            )  # fmt: skip
        live = [x for (stage, x), key in self.used.items() if stage == s and key is None]
        if live:
            raise VersionError(
                q, f"{a} changes the weights that micro-batch {live[0]} is still computing on"
            )
        made: list[Action] = []
        if (s, current) not in self.slots and look.forward_after(s, current, q):
            self.slots[(s, current)] = _Slot(Op.STASH)
            made.append(Action(Op.STASH, s, a.microbatch, current))
        self.current[s] = current + 1
        return made

    def _maybe_free(self, q: int, a: Action, v: int, look: _Ahead) -> list[Action]:
        """FREE the copy (stage of `a`, v) if nothing in flight or ahead needs it."""
        s = a.stage
        slot = self.slots.get((s, v))
        if slot is None or slot.users or look.forward_after(s, v, q):
            return []
        del self.slots[(s, v)]
        return [Action(Op.FREE, s, a.microbatch, v)]

    # ----------------------------------------------------------------- counts
    def _versions(self, s: int) -> int:
        current = self.current[s]
        return 1 + sum(
            1
            for (stage, v), slot in self.slots.items()
            if stage == s and not (slot.op is Op.STASH and v == current)
        )

    def _count(self, q: int) -> None:
        stages = {s for s, _ in self.slots}
        for s in stages:
            versions = self._versions(s)
            self.peak_versions[s] = max(self.peak_versions[s], versions)
            if self.max_versions is not None and versions > self.max_versions:
                held = sorted({v for stage, v in self.slots if stage == s} | {self.current[s]})
                raise VersionError(
                    q, f"{versions} versions of stage {s} alive at once ({held}): "
                    f"{self.policy.upper()} keeps at most {self.max_versions} versions",
                )  # fmt: skip
        self.peak_copies = max(self.peak_copies, len(self.slots))
