"""The scheduler half of ConnexConnector (in vLLM's EngineCore process).

Producer (prefill): a request sent with `do_remote_decode` gets a hold on its
prompt blocks in the very step its prompt is computed (the worker creates it right
after that forward), so the hold exists before anyone can learn its
`transfer_id`. `request_finished` returns the hold's kv_transfer_params. A hold
in place keeps the blocks (delay free) until the worker reports it released,
expired or evicted (finished_sending); a staged hold is a host copy made in that
step, so the blocks go back to vLLM at once.

Consumer (decode): a request carrying a hold reports the prompt tokens it lacks
locally as loadable asynchronously; the worker pulls exactly those blocks (a
partial local prefix hit pulls only the hold's blocks past it). A full
local prefix hit pulls nothing and reports nothing, and the hold is still renewed
while the request runs and released when it finishes normally. One transfer per
request: a load that failed is not retried (vLLM's `kv_load_failure_policy`
decides between recompute and fail).

With several KV cache groups (vLLM's hybrid KV cache manager), a hold is every
group's prompt blocks, one group after another. A sliding-window group's blocks
before the window are freed when the prompt's request finishes (vLLM replaces
them with its null block, id 0): the hold leaves them out (holds block 0, which
vLLM never hands to a request), and a decoder, whose own table has the null
block at the same positions (it skips the same tokens), pulls the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.request import Request, RequestStatus

from .config import ConnexConfig
from .grammar_replay import GrammarReplay
from .params import Layout, ParamsError, RemoteHold, hold_params, remote_hold, wants_hold

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    from .keeper import HoldKeeper

logger = logging.getLogger("connex.vllm.scheduler")

NORMAL_FINISH = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class HoldSpec:
    req_id: str
    transfer_id: str
    block_ids: list[int]


@dataclass
class LoadSpec:
    req_id: str
    transfer_id: str
    remote_ctrl: str
    epoch: int
    remote_block_ids: list[int]
    local_block_ids: list[int]
    # The positions, among the hold's blocks, that local_block_ids take (in
    # order), and the hold's block count: a decoder with the prompt's first
    # blocks cached, or with sliding-window groups (whose blocks before the
    # window it never reads), pulls only those.
    hold_indices: list[int] = field(default_factory=list)
    hold_blocks: int = 0
    # The prefill's TP size (0: this engine's): another one is read by runs of
    # KV heads from the prefill ranks that hold this rank's.
    remote_tp: int = 0
    # Set when the load must fail without a pull (e.g. a layout mismatch).
    error: str | None = None


# vLLM's null block: the placeholder of a block its attention no longer reads
# (a sliding-window group's before the window). Never handed to a request.
NULL_BLOCK = 0


def pair_blocks(
    load: LoadSpec, hold: RemoteHold, local: tuple[list[int], ...], first: int, last: int
) -> str | None:
    """Fills `load` with the blocks to pull: for each KV cache group, its
    blocks `first .. last` that this decoder's table has (not the null block),
    each from the same position of the group in the hold. An error when the
    hold lacks one of them."""
    per_group = len(hold.block_ids) // len(local)
    if last > per_group:
        return (
            f"hold {hold.transfer_id} has {per_group} blocks per KV cache group for "
            f"{hold.num_tokens} tokens; blocks {first}..{last} are needed"
        )
    for group, ids in enumerate(local):
        if len(ids) < last:
            return f"KV cache group {group} has {len(ids)} blocks here; {last} are needed"
        for position in range(first, last):
            mine = ids[position]
            if mine == NULL_BLOCK:
                continue  # before this group's window: never read here
            index = group * per_group + position
            theirs = hold.block_ids[index]
            if theirs == NULL_BLOCK:
                return (
                    f"hold {hold.transfer_id} lacks block {position} of KV cache group "
                    f"{group} (the prefill freed it: its window had moved past it)"
                )
            load.hold_indices.append(index)
            load.remote_block_ids.append(theirs)
            load.local_block_ids.append(mine)
    return None


@dataclass(frozen=True)
class BadParams:
    """kv_transfer_params that claim a hold this decoder cannot read."""

    error: str


@dataclass
class ConnexMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    holds: list[HoldSpec] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


class ConnexScheduler:
    def __init__(
        self,
        cfg: ConnexConfig,
        engine_id: str,
        layout: Layout,
        is_producer: bool,
        is_consumer: bool,
        keeper: HoldKeeper | None = None,
        hold_mode: str = "in_place",
        replay: GrammarReplay | None = None,
    ) -> None:
        self.cfg = cfg
        self.staged = hold_mode == "staged"
        self.engine_id = engine_id
        self.layout = layout
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.keeper = keeper
        # A decoder's: continuations of structured requests get their grammar
        # fast-forwarded over the generated tokens (grammar_replay.py).
        self.replay = replay
        # Producer state.
        self._producing: dict[str, Request] = {}  # req_id -> Request (wants a hold)
        self._held: dict[str, HoldSpec] = {}  # req_id -> its live hold
        self._hold_seq = 0
        # Consumer state.
        self._consumed: set[str] = set()  # requests whose one transfer is decided
        # Checked params of requests still waiting to be scheduled: vLLM asks
        # get_num_new_matched_tokens every step until it schedules one.
        self._checked: dict[str, RemoteHold | BadParams | None] = {}
        # Requests whose blocks wait for their hold to be freed (finished_sending).
        self._awaiting_free: set[str] = set()
        # This step's work for the workers.
        self._meta = ConnexMetadata()
        self.inflight = 0

    # ---- both roles --------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self.inflight += 1
        if self.is_producer and wants_hold(request.kv_transfer_params):
            self._producing[request.request_id] = request
        # A decoder renews the hold it will pull from as soon as the request
        # arrives, not once it is scheduled: a request that waits in a full
        # queue longer than the lease would otherwise find its hold expired
        # (NixlConnector heartbeats from here too).
        if self.keeper is not None:
            hold = self._remote(request)
            if isinstance(hold, RemoteHold):
                self._keep(request.request_id, hold)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnexMetadata:
        if self._producing:
            self._plan_holds(scheduler_output)
        meta, self._meta = self._meta, ConnexMetadata()
        if (
            self._awaiting_free
            and scheduler_output.total_num_scheduled_tokens == 0
            and not (meta.holds or meta.drops or meta.loads)
        ):
            # vLLM steps without pause while finished requests keep blocks, which
            # on an idle prefill holding KV burns a core and starves neighbours.
            # Nothing is computed in such a step; pacing it only delays noticing
            # a freed hold or a new request by at most idle_step_ms.
            time.sleep(self.cfg.idle_step_ms / 1000)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._awaiting_free -= set(connector_output.finished_sending or ())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`block_ids`: the request's blocks as vLLM hands them over (every KV
        cache group's, one list)."""
        req_id = request.request_id
        self.inflight = max(self.inflight - 1, 0)
        if self.keeper is not None and (req_id in self._consumed or self.keeper.keeps(req_id)):
            # Only a normal finish releases: after an abort or error the router may
            # resume the request elsewhere from the same hold (it releases the hold
            # itself when the client is gone). A router that continues several
            # choices from one hold asks that none of them release it
            # (`release_on_finish: false`): it releases the hold itself.
            params = getattr(request, "kv_transfer_params", None) or {}
            keep = params.get("release_on_finish") is False
            release = request.status in NORMAL_FINISH and not keep
            self.keeper.finish(req_id, release=release)
        self._consumed.discard(req_id)
        self._checked.pop(req_id, None)
        if self.replay is not None:
            self.replay.forget(req_id)
        if req_id not in self._producing:
            return False, None
        self._producing.pop(req_id)
        return self._finish_hold(request, block_ids)

    # ---- producer ----------------------------------------------------------------

    def _plan_holds(self, scheduler_output: SchedulerOutput) -> None:
        preempted = scheduler_output.preempted_req_ids or ()
        for req_id in preempted if not self.staged else ():
            # Its blocks are gone: the hold on them must go too; a new one is taken
            # when its prompt has been computed again. (A staged hold is a copy:
            # it stays.)
            hold = self._held.pop(req_id, None)
            if hold is not None:
                self._meta.drops.append(hold.transfer_id)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._producing.get(req_id)
            if request is None or req_id in self._held:
                continue
            if request.num_computed_tokens + n >= request.num_prompt_tokens:
                self._take_hold(request)

    def _take_hold(self, request: Request) -> HoldSpec:
        assert self._kv_cache_manager is not None
        self._hold_seq += 1
        from connex._transfer import new_transfer_id  # 128 random bits; holders refuse fewer

        transfer_id = f"{self.engine_id}-{self._hold_seq}-{new_transfer_id()}"
        groups = self._kv_cache_manager.get_block_ids(request.request_id)
        needed = -(-request.num_prompt_tokens // self.layout.block_size)
        block_ids: list[int] = []
        for group, ids in enumerate(groups):
            ids = list(ids[:needed])
            ids += [NULL_BLOCK] * (needed - len(ids))
            # Blocks the finish frees (before the window): not held.
            freed = self._freed_at_finish(group, request.num_prompt_tokens)
            block_ids += [NULL_BLOCK] * min(freed, needed) + ids[freed:]
        hold = HoldSpec(request.request_id, transfer_id, block_ids)
        self._held[request.request_id] = hold
        self._meta.holds.append(hold)
        return hold

    def _freed_at_finish(self, group: int, num_tokens: int) -> int:
        """The blocks of KV cache group `group` that vLLM frees as a request of
        `num_tokens` computed tokens finishes (a sliding-window group's blocks
        before its window; none of a full-attention group), as its own
        manager of the group counts them. With the hybrid KV cache manager on,
        a model whose layers all slide is one such group."""
        assert self._kv_cache_manager is not None
        managers = self._kv_cache_manager.coordinator.single_type_managers
        skipped = managers[group].get_num_skipped_tokens(num_tokens)
        return max(skipped, 0) // self.layout.block_size

    def _finish_hold(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        hold = self._held.pop(request.request_id, None)
        if request.status not in NORMAL_FINISH:
            if hold is None:
                return False, None
            # Nobody will ever learn this hold's id; keep the blocks until the
            # worker has dropped it, since it may be reading them right now (a
            # staged hold reads its own copy: the blocks go now).
            self._meta.drops.append(hold.transfer_id)
            if self.staged:
                return False, None
            self._awaiting_free.add(request.request_id)
            return True, None
        if hold is None:
            # The prompt finished in a step we did not see (should not happen);
            # hold what was computed, from the next step on (in place only: a
            # staged copy would be taken after vLLM reused the blocks).
            if not block_ids or self.staged:
                return False, None
            hold = self._take_hold(request)
        if self.staged:
            # Copied to host memory in the step that computed the prompt, which
            # has ended: the blocks are vLLM's again.
            return False, self._params(request, hold)
        self._awaiting_free.add(request.request_id)
        # In place, a block vLLM freed before handing the table over (a
        # sliding-window group's, when the request computed past its prompt)
        # may be another request's by the time a decoder reads it: the params
        # name the null block there, and a decoder that needs it fails the
        # load by name instead of reading someone else's KV.
        kept = set(block_ids)
        still = [b if b in kept else NULL_BLOCK for b in hold.block_ids]
        return True, self._params(request, dataclasses.replace(hold, block_ids=still))

    def _params(self, request: Request, hold: HoldSpec) -> dict[str, Any]:
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        return hold_params(
            transfer_id=hold.transfer_id,
            remote_ctrl=self.cfg.ctrl_addr(0),
            engine_id=self.engine_id,
            block_ids=hold.block_ids,
            num_tokens=num_tokens,
            backend=self.cfg.backend,
            lease_s=self.cfg.retain_s,
            layout=self.layout,
        )

    # ---- consumer ----------------------------------------------------------------

    def _keep(self, req_id: str, hold: RemoteHold) -> None:
        assert self.keeper is not None
        self.keeper.keep(req_id, hold.all_ctrls(), hold.transfer_id, hold.epoch, hold.lease_s)

    def _remote(self, request: Request) -> RemoteHold | BadParams | None:
        """The hold this request pulls from, `BadParams` when its kv_transfer_params
        claim a hold this decoder cannot read, None when there is nothing to pull."""
        req_id = request.request_id
        if not self.is_consumer or req_id in self._consumed:
            return None
        if req_id not in self._checked:
            self._checked[req_id] = self._check(request)
        return self._checked[req_id]

    def _check(self, request: Request) -> RemoteHold | BadParams | None:
        try:
            hold = remote_hold(request.kv_transfer_params)
        except ParamsError as err:
            return BadParams(f"bad kv_transfer_params: {err}")
        if hold is not None and hold.backend != self.cfg.backend:
            return BadParams(
                f"hold {hold.transfer_id} is served by the {hold.backend} backend; "
                f"this decoder uses {self.cfg.backend}"
            )
        return hold

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # vLLM asks only once the request's grammar is compiled, before it is
        # first scheduled (and again after a preemption: replayed once).
        if self.replay is not None and self.replay.replay(request) is not None:
            # Not scheduled (None: vLLM skips it this step); the scheduler
            # finishes it with an error at its next update.
            return None, False
        hold = self._remote(request)
        if hold is None:
            return 0, False
        if isinstance(hold, BadParams):
            # Claimed as loadable so that the load fails, and vLLM's
            # kv_load_failure_policy (recompute or fail) decides, as for any
            # other failed pull.
            count = request.num_prompt_tokens - num_computed_tokens
        else:
            count = min(hold.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        hold = self._remote(request)
        if hold is None:
            return
        req_id = request.request_id
        self._consumed.add(req_id)
        self._checked.pop(req_id, None)
        if isinstance(hold, BadParams):
            logger.error("kv load failed: request %s: %s", req_id, hold.error)
            if num_external_tokens > 0:
                self._meta.loads.append(LoadSpec(req_id, "", "", 0, [], [], error=hold.error))
            return
        if self.keeper is not None and not self.keeper.keeps(req_id):
            self._keep(req_id, hold)
        if num_external_tokens <= 0:
            # Full local prefix hit: nothing to pull, nothing to report; the hold is
            # still renewed and released like any other.
            return
        bs = self.layout.block_size
        end = min(hold.num_tokens, request.num_prompt_tokens)
        first = (end - num_external_tokens) // bs
        last = -(-end // bs)
        load = LoadSpec(
            req_id=req_id,
            transfer_id=hold.transfer_id,
            remote_ctrl=hold.remote_ctrl,
            epoch=hold.epoch,
            remote_block_ids=[],
            local_block_ids=[],
            hold_blocks=len(hold.block_ids),
            remote_tp=hold.layout.tp_size,
        )
        load.error = self.layout.mismatch(hold.layout) or pair_blocks(
            load, hold, blocks.get_block_ids(), first, last
        )
        if load.error is not None:
            logger.error("kv load failed: request %s: %s", req_id, load.error)
        self._meta.loads.append(load)

    # Set by the connector when vLLM binds its KV cache manager.
    _kv_cache_manager: KVCacheManager | None = None
