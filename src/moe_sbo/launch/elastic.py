"""Elastic expert parallelism: a rank is lost and the others go on. They agree on who is lost, form a
group without it, finish the forward that was in flight, serve degraded (experts left without a
replica masked, as DeepEP's elastic buffer does) and then exact (those experts loaded into spare
slots); a replacement rank can join and receive its experts from its peers.

One recovery, on every surviving rank (``ElasticGroup.run``)::

    forward n fails on a peer (closed socket, expired wait)
      -> destroy the old group (peers blocked on this rank fail now, not at the bound)
      -> check in for epoch e; wait until every member checked in, is dead (the launcher's notice,
         or a heartbeat that stopped) or outlived ``agree_s``; the first proposal written wins   detect
      -> join epoch e+1's group on a fresh prefix of the store no rank owns                     re-form
      -> rebuild each layer's dispatcher and placement over the survivors (degraded)
      -> re-run forward n: ranks that had finished it take part with no tokens, then go on
      -> restore: experts without a live replica go into spare slots, read from the source   restore

The hard part is agreement without a leader. Survivors see the failure at different moments (a rank
may finish forward n and fail in n+1 while another fails in n), and a stalled rank may wake up late.
So every epoch has one decision, written once (``compare_set``: the first proposal stays, every rank
reads the same one); it lists the members of the next group and the forward each was in. A rank
missing from it is fenced (``RankFenced``): it never joins the new group, whose store keys and
buffers are new. A rank lost while the group re-forms (a second loss) makes the join time out, and
the survivors recover once more at the next epoch.

The store is the launcher's (``LocalRanks(elastic=...)`` hosts it in its own process) or
torchrun's agent's: a rank's death never takes it down. Keys, under ``moe_sbo/elastic/``:
``hb/<member>`` heartbeat counters, ``dead/<member>`` the launcher's death notices,
``e<epoch>/in/<member>`` check-ins, ``e<epoch>/decision``, ``joins/<n>`` join requests, ``pg/<epoch>/``
each epoch's process group.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..dispatch import EPGroup, make_dispatcher
from ..dispatch.membership import POLL_S, agree
from ..dispatch.node_aware import clear_subgroups
from ..eplb.placement import Placement
from ..eplb.runtime import EPLBOptions, ReplicaTable, initial_placement
from ..eplb.transfer import fill_slots
from ..layer import MoELayer
from .group import pick_device

PREFIX = "moe_sbo/elastic"

# An expert's weights from outside the group: ``source(expert)`` -> the arguments of
# ``RoutedExperts.set_expert`` after the slot: (gate_up [2I, H], down [H, I]) and, for FP8 experts,
# their block scales. ``weights.seeded_expert`` and ``hf.checkpoint.LayerLoader.expert_source`` make them.
ExpertSource = Callable[[int], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class ElasticOptions:
    """How a group and its layers survive the loss of a rank.

    ``spare_slots_per_rank``: expert slots per rank beyond E / P, the layer's EPLB redundant slots
    (``eplb()`` builds its options): replicas while all ranks live, the room the experts of a lost
    rank are restored into. After the loss of one of P ranks the survivors hold every expert again
    when ``(P - 1) * (E / P + spare) >= E``. ``degraded``: serve with the experts that have no live
    replica masked until they are restored (False: restore before the in-flight forward is re-run,
    or raise ``ExpertsLost``). ``restore``: restore right after the re-run (False: the caller calls
    ``ElasticMoE.restore`` on every rank, between forwards).

    ``heartbeat_s``: how often each rank bumps its heartbeat; ``dead_after_s``: a heartbeat unchanged
    this long marks a rank dead (a launcher that sees the process end says so at once);
    ``agree_s``: how long survivors wait for a member that is alive to check in before they declare it
    lost (a stalled rank; a rank that wakes up later is fenced off).
    """

    spare_slots_per_rank: int = 1
    degraded: bool = True
    restore: bool = True
    heartbeat_s: float = 0.1
    dead_after_s: float = 3.0
    agree_s: float = 5.0

    def __post_init__(self) -> None:
        if self.spare_slots_per_rank < 0:
            raise ValueError(f"spare_slots_per_rank must be >= 0, got {self.spare_slots_per_rank}")
        for name in ("heartbeat_s", "dead_after_s", "agree_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.dead_after_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"dead_after_s must exceed two heartbeats ({2 * self.heartbeat_s:g} s), got {self.dead_after_s}; "
                "a live rank would be declared dead"
            )

    def eplb(self, **options: Any) -> EPLBOptions:
        """The EPLB options of a layer under this policy: ``spare_slots_per_rank`` redundant slots."""
        return EPLBOptions(redundant_per_rank=self.spare_slots_per_rank, **options)


class RankFenced(RuntimeError):
    """This rank was declared lost (dead or stalled past the bound) and the others went on without
    it: it must not touch the group again. Its process should exit; a fresh process can join."""


class ExpertsLost(RuntimeError):
    """Experts have no live replica and cannot be restored (no spare slot or no source), and the
    policy does not allow serving degraded (``ElasticOptions.degraded``)."""


@dataclass(frozen=True)
class Recovery:
    """One loss, as this rank lived it.

    ``lost``: the member ids the survivors agreed on; ``epoch``: the new group's; ``members``: its
    members in rank order. ``t_detect_ms``: from this rank's failed collective to the decision;
    ``t_reform_ms``: joining the new group and rebuilding the layers; ``t_rerun_ms``: the forward in
    flight, re-run degraded; ``t_restore_ms``: restoring (0 when nothing was restored). ``reran``:
    this rank's forward was re-run (False: it had finished it and took part with no tokens).
    ``degraded_tokens``: this rank's tokens of the re-run that lost an expert (masked).
    ``missing_experts``: experts that had no live replica after the loss; ``restored_from``:
    ``replica`` (none was missing), ``checkpoint`` (read from the source) or ``none`` (still degraded).
    The lost members' own tokens were never here: their callers must re-submit them.
    """

    lost: tuple[int, ...]
    epoch: int
    members: tuple[int, ...]
    t_detect_ms: float
    t_reform_ms: float
    t_rerun_ms: float
    t_restore_ms: float
    reran: bool
    degraded_tokens: int
    missing_experts: tuple[int, ...]
    restored_from: str


@dataclass(frozen=True)
class RestoreReport:
    """One restore: experts read from the source into this rank's slots (``loaded``, all ranks:
    ``loaded_total``), experts still missing (no spare slot), and how long it took."""

    loaded: tuple[int, ...]
    loaded_total: int
    still_missing: tuple[int, ...]
    t_restore_ms: float


class ElasticGroup:
    """This process's place in an elastic EP group: its member id, the current epoch's members, the
    store, a heartbeat, and the layers that re-form with the group.

    ``store``: a client of a store no rank hosts (``LocalRanks(elastic=...)``'s, or torchrun's).
    ``member``: this process's id, never reused (a replacement gets a new one). ``members``: the
    epoch's members in rank order; a process not among them joins later (``join``).
    ``timeout_s``: the bound of every wait on a peer (the groups' timeout, the join).
    """

    def __init__(
        self,
        store: Any,
        member: int,
        members: Sequence[int],
        options: ElasticOptions | None = None,
        *,
        timeout_s: float = 25.0,
        backend: str = "gloo",
        epoch: int = 0,
    ):
        self.store, self.member, self.members = store, member, tuple(members)
        self.options = options or ElasticOptions()
        self.timeout_s, self.backend, self.epoch = timeout_s, backend, epoch
        self.op = 0  # the index of the next elastic forward (any layer's): what check-ins compare
        self.layers: list[ElasticMoE] = []  # in the order every rank made them (the order they re-form in)
        self.recoveries: list[Recovery] = []
        self._last_layer: ElasticMoE | None = None
        self._stop = threading.Event()
        self._beats = store.clone()  # the heartbeat thread's own connection
        self._beats.add(f"{PREFIX}/hb/{member}", 1)
        self._heartbeat = threading.Thread(target=self._beat, name=f"moe-sbo-heartbeat-{member}", daemon=True)
        self._heartbeat.start()

    @property
    def rank(self) -> int:
        return self.members.index(self.member)

    @property
    def size(self) -> int:
        return len(self.members)

    def _beat(self) -> None:
        key = f"{PREFIX}/hb/{self.member}"
        while not self._stop.wait(self.options.heartbeat_s):
            try:
                self._beats.add(key, 1)
            except Exception:  # noqa: BLE001 - the store went away: the group is over, stop beating
                return

    def join_group(self, device: torch.device | None = None) -> None:
        """Join the current epoch's process group (this process must be a member)."""
        if self.member not in self.members:
            raise ValueError(f"member {self.member} is not among epoch {self.epoch}'s members {list(self.members)}")
        store = dist.PrefixStore(f"{PREFIX}/pg/{self.epoch}", self.store)
        kwargs: dict[str, Any] = {}
        if self.backend == "nccl" and device is not None:
            kwargs["device_id"] = device
        dist.init_process_group(
            self.backend,
            store=store,
            rank=self.rank,
            world_size=self.size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
            **kwargs,
        )
        self.store.set(f"{PREFIX}/epoch", str(self.epoch))

    def close(self) -> None:
        """Stop the heartbeat (the process group is the caller's to destroy)."""
        self._stop.set()
        self._heartbeat.join(timeout=5)

    # ---- forwards and recovery -------------------------------------------------------------------

    def run(self, elastic: ElasticMoE, x_TH: torch.Tensor) -> torch.Tensor:
        """``elastic.layer(x_TH)``; on a lost peer, recover and re-run it in the new group.

        A ``RuntimeError`` that is not a communication failure (this rank's own) still goes through the
        agreement, marked as raised, so that the peers blocked on this rank learn it at once: every
        member re-forms the same group and raises, naming the rank (the group serves on)."""
        op = self.op
        self.op += 1
        try:
            y_TH = elastic.layer(x_TH)
        except RankFenced:
            raise
        except RuntimeError as err:  # gloo/NCCL errors and expired waits (DistBackendError included)
            err.__traceback__ = None  # its frames hold the failed forward's pending work (and the group)
            y_TH = self._recover(op, elastic, x_TH, err, own=not _lost_peer(err))
        self._last_layer = elastic
        return y_TH

    def _recover(
        self, op: int, elastic: ElasticMoE, x_TH: torch.Tensor, err: BaseException, own: bool = False
    ) -> torch.Tensor:
        first_members = self.members
        laid_out = self.members  # the members the layers' slot tables are rows of
        joining = False  # whether the last round failed while joining the new group
        while True:  # a second loss during recovery starts another round at the next epoch
            started = time.monotonic()
            self._drop_group()
            # A join that fails (a member lost after the agreement) fails on each rank when its own
            # connection attempts run out: up to the bound apart. Wait for the others that long.
            decision = self._agree(op, own, self.options.agree_s + (self.timeout_s if joining else 0))
            detected = time.monotonic()
            lost = tuple(m for m in first_members if m not in decision["members"])
            try:
                joining = True
                self._reform(decision)
                joining = False
                missing = sorted(set().union(*(e.regroup(laid_out) for e in self.layers)))
                laid_out = self.members
                reformed = time.monotonic()
                if decision.get("raised"):  # a rank's own error, not a loss: the same group serves on
                    if own:
                        raise err
                    raise RuntimeError(
                        f"member(s) {decision['raised']} raised in this forward (their own error names the problem); "
                        "the group re-formed and serves on"
                    ) from err
                if not self.options.degraded:
                    for e in self.layers:
                        e.restore_or_raise()
                # The forward in flight is the earliest any survivor was in. A rank that had finished it
                # takes part in its re-run with no tokens (its output stands), then runs its own.
                reran = op == min(decision["ops"].values())
                if reran:
                    y_TH = elastic.layer(x_TH)
                else:
                    (self._last_layer or elastic).layer(x_TH.new_empty(0, x_TH.shape[1]))
                rerun_done = time.monotonic()
                masked = reran and elastic.layer.replicas.any_masked
                degraded_tokens = int(elastic.layer.last_masked_tokens) if masked else 0
                restore_ms, restored_from = self._restore_after_rerun(bool(missing))
                if not reran:
                    y_TH = elastic.layer(x_TH)
            except (RankFenced, ExpertsLost):
                raise
            except RuntimeError as again:
                if again is err or not _lost_peer(again):
                    raise
                err = again
                continue
            self.recoveries.append(
                Recovery(
                    lost=lost,
                    epoch=self.epoch,
                    members=self.members,
                    t_detect_ms=1e3 * (detected - started),
                    t_reform_ms=1e3 * (reformed - detected),
                    t_rerun_ms=1e3 * (rerun_done - reformed),
                    t_restore_ms=restore_ms,
                    reran=reran,
                    degraded_tokens=degraded_tokens,
                    missing_experts=tuple(missing),
                    restored_from=restored_from,
                )
            )
            return y_TH

    def _restore_after_rerun(self, missing: bool) -> tuple[float, str]:
        """Restore every layer now if the policy says so: (milliseconds, where the experts came from)."""
        if not missing:
            return 0.0, "replica"  # every lost expert had a live replica
        if not self.options.restore and self.options.degraded:
            return 0.0, "none"  # the caller restores, between forwards
        reports = [e.restore() for e in self.layers]
        complete = not any(r.still_missing for r in reports)
        return sum(r.t_restore_ms for r in reports), "checkpoint" if complete else "none"

    def _drop_group(self) -> None:
        """Destroy this process's groups and drop every reference to them (the layers' dispatchers,
        node_aware's legs): a gloo group closes its connections only when its last reference goes, and
        then peers blocked on this rank fail at once instead of at the bound."""
        for elastic in self.layers:
            elastic.retire_dispatcher()
        clear_subgroups()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _key(self, *parts: object) -> str:
        return "/".join((PREFIX, f"e{self.epoch}", *map(str, parts)))

    def _agree(self, op: int, raised: bool, patience_s: float) -> dict:
        """Check in for this epoch (the forward this rank was in; whether it raised on its own), then
        the epoch's one decision (``dispatch.membership.agree``; ``RankFenced`` when this rank is not
        in it), with ``ops`` (member -> forward) and ``raised`` (members whose own error it was). A
        member that checks in before the decision is in it: a stall that ends in time loses nobody."""
        beats: dict[int, tuple[int, float]] = {}
        decision = agree(
            self.store,
            "/".join((PREFIX, f"e{self.epoch}")),
            self.member,
            self.members,
            [op, raised],
            gone=lambda member: self._dead(member, beats, time.monotonic()),
            patience_s=patience_s,
        )
        info = {int(m): said for m, said in decision["info"].items()}
        decision["ops"] = {m: said[0] for m, said in info.items()}
        decision["raised"] = [m for m, said in info.items() if said[1]]
        if self.member not in decision["members"]:
            raise RankFenced(
                f"member {self.member} (rank {self.rank} of epoch {self.epoch}) was declared lost by the others "
                f"(they went on as {decision['members']}); this process must not use the group again: exit it, "
                "and start a fresh process to rejoin"
            )
        return decision

    def _dead(self, member: int, beats: dict[int, tuple[int, float]], now: float) -> bool:
        """Whether ``member`` is dead: the launcher said so, or its heartbeat stopped ``dead_after_s`` ago."""
        if self.store.check([f"{PREFIX}/dead/{member}"]):
            return True
        count = int(self.store.add(f"{PREFIX}/hb/{member}", 0))
        seen, since = beats.get(member, (None, now))
        if seen != count:
            beats[member] = (count, now)
            return False
        return now - since > self.options.dead_after_s

    def _reform(self, decision: dict) -> None:
        self.epoch += 1
        self.members = tuple(decision["members"]) + tuple(decision.get("joiners", ()))
        self.join_group()

    # ---- growing back ----------------------------------------------------------------------------

    def admit(self, count: int = 1) -> None:
        """Let ``count`` waiting processes (``join``) into the group; every member calls it between
        forwards. The layers grow back: each new rank receives its experts from its peers
        (``fill_slots``), and where the expert count allows, the placement returns to the layer's
        initial one (E divisible by the new size), else the new ranks take the least-replicated experts.
        Sync: the host blocks until ``count`` join requests are in (bounded by ``timeout_s``)."""
        deadline = time.monotonic() + self.timeout_s
        decision_key = self._key("decision")
        if self.rank == 0:
            first = int(self.store.add(f"{PREFIX}/joins/admitted", 0))
            while int(self.store.add(f"{PREFIX}/joins/count", 0)) < first + count:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"admit: {count} process(es) asked to join within {self.timeout_s:g} s")
                time.sleep(POLL_S)
            joiners = [int(self.store.get(f"{PREFIX}/joins/{n}")) for n in range(first + 1, first + count + 1)]
            self.store.add(f"{PREFIX}/joins/admitted", count)
            proposal = {
                "members": list(self.members),
                "ops": {str(m): self.op for m in self.members},
                "joiners": joiners,
                "rows": [e.placement.rows() for e in self.layers],
            }
            self.store.compare_set(decision_key, "", json.dumps(proposal))
        decision = self._wait_decision(decision_key, deadline)
        old_members = self.members
        self._drop_group()
        self._reform(decision)
        for elastic, rows in zip(self.layers, decision["rows"]):
            elastic.grow(old_members, rows)

    def join(
        self, make_layers: Callable[[], Sequence[MoELayer]], source: ExpertSource | None = None
    ) -> list[ElasticMoE]:
        """This process (not a member) asks to join; once the members ``admit`` it, it joins their next
        group, makes its layers (``make_layers``, called in the new group: weights need not be loaded,
        they come from the peers) and receives their experts. Returns its elastic layers."""
        n = int(self.store.add(f"{PREFIX}/joins/count", 1))
        self.store.set(f"{PREFIX}/joins/{n}", str(self.member))
        deadline = time.monotonic() + self.timeout_s
        while True:  # the epoch whose decision admits this process
            self.epoch = int(self.store.get(f"{PREFIX}/epoch"))
            key = self._key("decision")
            if self.store.check([key]):
                decision = json.loads(self.store.get(key))
                if self.member in decision.get("joiners", ()):
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"join: member {self.member} was not admitted within {self.timeout_s:g} s")
            time.sleep(POLL_S)
        old_members = tuple(decision["members"])
        self.members = old_members
        self._reform(decision)
        self.op = next(iter(decision["ops"].values()))
        made = [ElasticMoE(layer, self, source) for layer in make_layers()]
        for elastic, rows in zip(made, decision["rows"]):
            elastic.grow(old_members, rows)
        return made

    def _wait_decision(self, key: str, deadline: float) -> dict:
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no decision at {key} within {self.timeout_s:g} s")
            time.sleep(POLL_S)
        decision = json.loads(self.store.get(key))
        decision["ops"] = {int(m): o for m, o in decision["ops"].items()}
        return decision


def _lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a communication failure (a peer gone, a wait expired), not a bug of this rank."""
    text = str(err).lower()
    return any(
        word in text for word in ("connection", "timed out", "timeout", "closed", "reset", "broken pipe", "peer")
    )


class ElasticMoE:
    """An ``MoELayer`` that survives the loss of a rank of its EP group (``ElasticGroup``).

    ``layer``: built with ``eplb=group.options.eplb()`` (its spare slots) and a dispatcher other
    than ``local``. ``source``: where experts without a live replica are read from when they are
    restored (``ExpertSource``; None: they stay masked). ``elastic(x)`` is the layer's forward,
    recovered and re-run on a loss; ``group.recoveries`` tells what happened.
    """

    def __init__(self, layer: MoELayer, group: ElasticGroup, source: ExpertSource | None = None):
        if layer.eplb is None or layer.placement is None:
            raise ValueError(
                "an elastic layer needs expert slots it can re-place: build the MoELayer with "
                "eplb=ElasticOptions(...).eplb()"
            )
        spare = group.options.spare_slots_per_rank
        if layer.eplb.redundant_per_rank != spare:
            raise ValueError(
                f"the layer's eplb redundant_per_rank must equal ElasticOptions.spare_slots_per_rank={spare}, got "
                f"{layer.eplb.redundant_per_rank}; build it with eplb=options.eplb()"
            )
        if layer.dispatcher.name == "local":
            raise ValueError("dispatcher 'local' has no group to lose a rank from; use allgather, alltoall, ...")
        self.layer, self.group, self.source = layer, group, source
        group.layers.append(self)

    def __call__(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.group.run(self, x_TH)

    forward = __call__

    @property
    def placement(self) -> Placement:
        """The layer's placement over the current group (an elastic layer always has one)."""
        placement = self.layer.placement
        assert placement is not None, "an elastic layer is built with eplb, so it has a placement"
        return placement

    @property
    def missing_experts(self) -> tuple[int, ...]:
        """Experts no slot of the group holds (masked) now."""
        return self.placement.missing_experts()

    def regroup(self, old_members: Sequence[int]) -> tuple[int, ...]:
        """After a loss: the survivors' slots as they are, over the new group (no weight moves); the
        experts left without a slot are masked. Returns them."""
        old = self.layer.placement
        assert old is not None, "an elastic layer has a placement"
        rows = old.rows()
        kept = [rows[old_members.index(m)] for m in self.group.members]
        flat = torch.tensor([e for row in kept for e in row], dtype=torch.int64)
        partial = bool((torch.bincount(flat, minlength=old.num_logical) == 0).any())
        placement = Placement(flat, old.num_logical, len(kept), partial=partial)
        self._rebuild(placement)
        return placement.missing_experts()

    def restore_or_raise(self) -> None:
        """``restore``, and ``ExpertsLost`` if experts are still missing (the policy forbids degraded)."""
        if self.missing_experts and self.restore().still_missing:
            raise ExpertsLost(
                f"experts {list(self.missing_experts)} have no live replica and no spare slot or source to restore "
                "them, and ElasticOptions.degraded is False; give the layer more spare slots "
                "(spare_slots_per_rank) or a source, or allow degraded serving"
            )

    @torch.no_grad()
    def restore(self) -> RestoreReport:
        """Put every missing expert into a spare slot (one whose expert has another replica), read
        from ``source`` by the rank that takes it. Every rank of the group calls it, between forwards.
        Afterwards the outputs are the full layer's. Experts that find no spare slot stay masked."""
        started = time.monotonic()
        placement = self.layer.placement
        assert placement is not None, "an elastic layer has a placement"
        missing = placement.missing_experts()
        if not missing or self.source is None:
            return RestoreReport((), 0, missing, 1e3 * (time.monotonic() - started))
        held = placement.rows()
        wanted, unplaced = spare_slot_plan(held, missing)
        report = fill_slots(self.layer.experts.slot_tensors(), held, wanted, self.group.rank, None)
        for slot, expert in report.to_load:
            self.layer.experts.set_expert(slot, *self.source(expert))
        flat = torch.tensor([e for row in wanted for e in row], dtype=torch.int64)
        restored = Placement(flat, placement.num_logical, placement.num_ranks, partial=bool(unplaced))
        self.layer.placement = restored
        self.layer.replicas.update(restored)
        loaded_total = len(missing) - len(unplaced)
        return RestoreReport(
            tuple(e for _, e in report.to_load), loaded_total, tuple(unplaced), 1e3 * (time.monotonic() - started)
        )

    @torch.no_grad()
    def grow(self, old_members: Sequence[int], rows: list[list[int]]) -> None:
        """After new ranks joined: their slots filled from their peers, the placement the layer's
        initial one where the sizes allow; router and shared experts sent from rank 0."""
        layer, group = self.layer, self.group
        eplb = layer.eplb
        assert eplb is not None, "an elastic layer has eplb options"
        num_logical, slots = layer.cfg.num_experts, len(rows[0])
        held = [rows[old_members.index(m)] if m in old_members else [-1] * slots for m in group.members]
        if num_logical % group.size == 0 and num_logical // group.size + eplb.redundant_per_rank == slots:
            wanted = initial_placement(num_logical, group.size, eplb).rows()
        else:
            wanted = _fill_new_ranks(held, num_logical)
        for tensor in _replicated_tensors(layer):
            dist.broadcast(tensor, src=0)
        report = fill_slots(layer.experts.slot_tensors(), held, wanted, group.rank, None)
        for slot, expert in report.to_load:
            if self.source is None:
                raise ExpertsLost(f"expert {expert} has no replica in the group and this layer has no source")
            layer.experts.set_expert(slot, *self.source(expert))
        flat = torch.tensor([e for row in wanted for e in row], dtype=torch.int64)
        self._rebuild(Placement(flat, num_logical, group.size))

    def retire_dispatcher(self) -> None:
        """Keep what the next dispatcher needs (``_DispatcherSpec``) and let the old one go, with its
        references to the old group."""
        old = getattr(self.layer, "dispatcher", None)
        if old is not None:
            self._spec = _DispatcherSpec(old.name, dict(old.options), old.hooks, old.deliver_fp8, old.ep.ranks_per_node)
            del self.layer.dispatcher  # two-batch overlap's twin goes with it (a weak-keyed cache)
            del old

    def _rebuild(self, placement: Placement) -> None:
        """The layer's dispatcher, placement and replica table over the current group (the dispatcher's
        hooks carry over: the same registry)."""
        self.retire_dispatcher()
        layer, spec = self.layer, self._spec
        size, rank = dist.get_world_size(), dist.get_rank()
        per_node = spec.ranks_per_node
        ep = EPGroup(None, rank, size, per_node if per_node and size % per_node == 0 else None)
        options = dict(spec.options)
        if options.get("ranks_per_node") and size % options["ranks_per_node"]:
            options.pop("ranks_per_node")  # node_aware: the nodes no longer split evenly; one node
        new = make_dispatcher(spec.name, placement.num_physical, ep, **options)
        new.hooks = spec.hooks
        new.deliver_fp8 = spec.deliver_fp8
        layer.dispatcher = new
        layer.placement = placement
        device = layer.router.weight.device
        layer.replicas = ReplicaTable(placement, rank, device, ranks_per_node=new.ep.node_size)


@dataclass(frozen=True)
class _DispatcherSpec:
    """What a layer's dispatcher is made of, beyond its group: rebuilt from this over a new group."""

    name: str
    options: dict
    hooks: Any
    deliver_fp8: bool
    ranks_per_node: int | None


def spare_slot_plan(held: list[list[int]], missing: Sequence[int]) -> tuple[list[list[int]], list[int]]:
    """Where the ``missing`` experts go: each into a slot whose expert has the most replicas (at least
    two), on a rank that has taken the fewest so far and does not hold it. Returns the new slot table
    and the experts that found no slot."""
    wanted = [list(row) for row in held]
    counts = Counter(e for row in held for e in row)
    taken = [0] * len(held)
    unplaced = []
    for expert in missing:
        spots = [
            (-counts[e], taken[r], r, j)
            for r, row in enumerate(wanted)
            if expert not in row
            for j, e in enumerate(row)
            if counts[e] > 1
        ]
        if not spots:
            unplaced.append(expert)
            continue
        _, _, r, j = min(spots)
        counts[wanted[r][j]] -= 1
        wanted[r][j] = expert
        counts[expert] += 1
        taken[r] += 1
    return wanted, unplaced


def _fill_new_ranks(held: list[list[int]], num_logical: int) -> list[list[int]]:
    """Slots of new ranks (rows of -1) filled with the experts that have the fewest replicas (missing ones first)."""
    counts = Counter({e: 0 for e in range(num_logical)})
    counts.update(e for row in held for e in row if e >= 0)
    wanted = [list(row) for row in held]
    for row in wanted:
        for j, e in enumerate(row):
            if e < 0:
                expert = min((c, x) for x, c in counts.items() if x not in row)[1]
                row[j] = expert
                counts[expert] += 1
    return wanted


def _replicated_tensors(layer: MoELayer) -> list[torch.Tensor]:
    """The weights every rank holds alike: the router's and the shared experts'."""
    tensors = [layer.router.weight.data, layer.router.e_score_correction_bias.data]
    if layer.shared_experts is not None:
        tensors += [layer.shared_experts.gate_up_proj.data, layer.shared_experts.down_proj.data]
    return tensors


# ---- the process's group -------------------------------------------------------------------------


@dataclass(frozen=True)
class ElasticJoin:
    """What a rank of ``LocalRanks(elastic=...)`` needs to join: the launcher's store, the policy, its
    member id and the first epoch's members (a process not among them joins later, ``join``)."""

    host: str
    port: int
    options: ElasticOptions
    member: int
    members: tuple[int, ...]


def join_elastic(
    device: str, local_rank: int, timeout_s: float, local_world_size: int, how: ElasticJoin
) -> torch.device:
    """Connect to the launcher's store, start this process's ``ElasticGroup`` (``session``) and, for a
    first-epoch member, join its process group. Returns this rank's device."""
    torch_device, backend = pick_device(device, local_rank, timeout_s, local_world_size)
    store = dist.TCPStore(how.host, how.port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    group = ElasticGroup(store, how.member, how.members, how.options, timeout_s=timeout_s, backend=backend)
    attach(group)
    if how.member in how.members:
        group.join_group(torch_device)
    return torch_device


_SESSION: ElasticGroup | None = None


def attach(group: ElasticGroup | None) -> None:
    """Make ``group`` this process's elastic group (``session``): the launcher's worker does, at start."""
    global _SESSION
    _SESSION = group


def session() -> ElasticGroup:
    """This process's elastic group (a rank of ``LocalRanks(elastic=...)``)."""
    if _SESSION is None:
        raise RuntimeError(
            "no elastic group in this process: start the ranks with LocalRanks(..., elastic=ElasticOptions())"
        )
    return _SESSION
