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
``e<epoch>/in/<member>`` check-ins, ``e<epoch>/decision`` (who is lost), ``e<epoch>/admit`` (who
joins), ``joins/<n>`` join requests, ``pg/<epoch>/`` each epoch's process group.

This module is the group side. The layer side (``ElasticMoE``: re-placing a layer's experts over each
new group, restoring them) is ``elastic_layer.py``; the policy, the errors and the ``Recovery`` record
are ``elastic_options.py``. Their public names are re-exported here.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..dispatch.membership import POLL_S, agree
from ..dispatch.node_aware import clear_subgroups
from ..layer import MoELayer
from .elastic_layer import ElasticMoE, ExpertSource, RestoreReport
from .elastic_options import ElasticOptions, ExpertsLost, RankFenced, Recovery
from .group import pick_device

__all__ = [
    "ElasticGroup",
    "ElasticJoin",
    "ElasticMoE",
    "ElasticOptions",
    "ExpertSource",
    "ExpertsLost",
    "RankFenced",
    "Recovery",
    "RestoreReport",
    "attach",
    "join_elastic",
    "session",
]

PREFIX = "moe_sbo/elastic"
# Recovery rounds in a row that lose nobody before the error is taken for this rank's own: an error
# that only reads like a lost peer would otherwise re-form the group forever.
MAX_ROUNDS_WITHOUT_LOSS = 2
log = logging.getLogger("moe_sbo.elastic")


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
        """Bump this member's heartbeat until ``close``. A failed bump (a store timeout under load) is
        logged and retried: a heartbeat that stopped silently would get this live member declared lost."""
        key = f"{PREFIX}/hb/{self.member}"
        failing = False
        while not self._stop.wait(self.options.heartbeat_s):
            try:
                self._beats.add(key, 1)
            except Exception as err:  # noqa: BLE001 - any store error: keep trying while the group runs
                if not failing:
                    log.warning("member %d: heartbeat failed (%s); retrying", self.member, err)
                failing = True
                continue
            if failing:
                log.warning("member %d: heartbeat back", self.member)
            failing = False

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
        rounds_without_loss = 0
        while True:  # a second loss during recovery starts another round at the next epoch
            started = time.monotonic()
            before = set(self.members)
            self._drop_group()
            # A join that fails (a member lost after the agreement) fails on each rank when its own
            # connection attempts run out: up to the bound apart. Wait for the others that long.
            decision = self._agree(op, own, self.options.agree_s + (self.timeout_s if joining else 0))
            detected = time.monotonic()
            lost = tuple(m for m in first_members if m not in decision["members"])
            if set(decision["members"]) == before and not decision.get("raised"):
                rounds_without_loss += 1
                if rounds_without_loss > MAX_ROUNDS_WITHOUT_LOSS:
                    raise RuntimeError(
                        f"{rounds_without_loss} recoveries in a row lost no member: this error is not a lost peer"
                    ) from err
            else:
                rounds_without_loss = 0
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
        decision_key = self._key("admit")  # not the epoch's loss decision (``agree``'s): a loss may race it
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
            key = self._key("admit")
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
    """Whether ``err`` is a communication failure (a peer gone, a wait expired), not a bug of this rank:
    torch.distributed's own error types (a backend's or the network's, NCCL's ``ncclRemoteError`` and
    an aborted communicator among them), or gloo's words for a closed peer or an expired wait."""
    if isinstance(err, dist.DistNetworkError | dist.DistBackendError):
        return True
    text = str(err).lower()
    return any(
        word in text
        for word in ("connection", "timed out", "timeout", "closed", "reset", "broken pipe", "peer", "aborted")
    )


# ---- the launcher's view -------------------------------------------------------------------------


@dataclass
class DecisionWatch:
    """What the launcher reads of the group's decisions (``LocalRanks``): the members the survivors
    declared lost, each with the launcher's clock when it first read so. ``members``: the members
    of the epoch read next (the first epoch's to start); ``epoch``: that epoch."""

    members: set[int]
    epoch: int = 0
    lost_since: dict[int, float] = field(default_factory=dict)
    _next_read: float = 0.0

    def lost(self, store: Any, now: float) -> dict[int, float]:
        """Read the decisions made since the last read (at most every ``READ_EVERY_S``)."""
        if now < self._next_read:
            return self.lost_since
        self._next_read = now + READ_EVERY_S
        while True:  # one decision per epoch: a loss (who is left) or an admission (who joins)
            loss, admit = (f"{PREFIX}/e{self.epoch}/{name}" for name in ("decision", "admit"))
            if store.check([loss]):
                left = set(json.loads(store.get(loss))["members"])
                for member in self.members - left:
                    self.lost_since.setdefault(member, now)
                self.members = left
            elif store.check([admit]):
                self.members |= set(json.loads(store.get(admit))["joiners"])
            else:
                return self.lost_since
            self.epoch += 1


READ_EVERY_S = 0.2  # how often the launcher reads the group's decisions


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
    if backend == "nccl":
        # A failed NCCL collective must raise in this process, not end it (the default here, 1, tears
        # the process down): mode 2 aborts the communicator and raises at the wait, so the survivors
        # can re-form. Set before the first group is made, when PyTorch reads it.
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
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
