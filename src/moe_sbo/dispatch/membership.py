"""Who is still in a group after a failure: every rank that saw it checks in, and one decision is
written once, on a store no failed rank can take down.

The hard part is having one answer without a leader. Ranks see a failure at different moments, and a
slow rank may check in after another has given up waiting for it. So the decision is written with
the store's ``compare_set``: the first proposal stays and every rank reads that one; a rank missing
from it learns so when it reads it. Used by elastic EP (``launch/elastic.py``) and by the DeepEP
``Buffer``'s shrink mode (``deep_ep/shrink.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

POLL_S = 0.01  # how often a waiting rank reads the store


def agree(
    store: Any,
    prefix: str,
    me: int,
    members: Sequence[int],
    info: Any,
    *,
    gone: Callable[[int], bool],
    patience_s: float,
) -> dict:
    """Check in under ``prefix`` with ``info`` (JSON-able), then return the one decision for
    ``prefix``: ``{"members": [...], "info": {"<member>": info}}``, the members that checked in, in
    ``members``' order, with what each said.

    Whoever sees first that every member checked in or is ``gone`` (dead, or left), or that
    ``patience_s`` passed since it checked in, proposes; the first proposal is the decision.
    ``gone(member)`` is asked about members that have not checked in.

    Sync: the host polls the store every ``POLL_S`` until the decision exists."""
    store.set(f"{prefix}/in/{me}", json.dumps(info))
    key = f"{prefix}/decision"
    started = time.monotonic()
    while True:
        if store.check([key]):
            return json.loads(store.get(key))
        checked = {}
        for member in members:
            mine = f"{prefix}/in/{member}"
            if store.check([mine]):
                checked[member] = json.loads(store.get(mine))
        waiting = [m for m in members if m not in checked and not gone(m)]
        if not waiting or time.monotonic() - started > patience_s:
            present = [m for m in members if m in checked]
            proposal = {"members": present, "info": {str(m): checked[m] for m in present}}
            return json.loads(store.compare_set(key, "", json.dumps(proposal)))
        time.sleep(POLL_S)
