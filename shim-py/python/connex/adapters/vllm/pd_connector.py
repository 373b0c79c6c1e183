"""ConnexConnector: vLLM's KV connector for Connex P/D with request resume.

Load it with
`--kv-transfer-config '{"kv_connector":"ConnexConnector",
"kv_connector_module_path":"connex.adapters.vllm.pd_connector",
"kv_role":"kv_producer"|"kv_consumer"|"kv_both","kv_connector_extra_config":{...}}'`
(keys in `config.py`). vLLM makes one instance per process and role: the
scheduler half (`scheduler.py`) plans holds and loads, the worker half
(`worker.py`) moves the bytes through the transfer crate. This class only routes
vLLM's calls to the half that owns them, and starts the router agent.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .config import ConfigError, ConnexConfig
from .grammar_replay import GrammarReplay
from .params import MAX_COMPAT_VALUE_LEN, Layout
from .scheduler import ConnexMetadata, ConnexScheduler
from .stats import ConnexKVStats, ConnexPromMetrics
from .worker import ConnexWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from connex.agent import Agent

    from .keeper import HoldKeeper

logger = logging.getLogger("connex.vllm")


def local_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Layout:
    """This engine's KV layout, as a hold carries it. Several KV cache groups
    (vLLM's hybrid KV cache manager: full and sliding-window layers, each kind
    its group) share the KV tensors, one layer of each group per tensor, with
    one page size: a block of any group is that many bytes of every tensor."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("ConnexConnector needs a KV cache (this model has no KV cache group)")
    for index, group in enumerate(groups):
        check_group_kind(index, group.kv_cache_spec)
    spec = groups[0].kv_cache_spec
    sizes = {(g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes) for g in groups}
    if len(sizes) != 1:
        raise ValueError(
            "ConnexConnector needs one block size and page size over the KV cache groups; "
            f"this model's groups have {sorted(sizes)} (block size, page bytes)"
        )
    return Layout(
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        block_size=spec.block_size,
        num_layers=max(len(g.layer_names) for g in groups),
        page_bytes=spec.page_size_bytes,
        dtype=str(getattr(spec, "dtype", "")).removeprefix("torch."),
        compat=compat_fingerprint(vllm_config, kv_cache_config),
        kv_groups=len(groups),
    )


def check_group_kind(index: int, spec: object) -> None:
    """Refuses, at start, a KV cache group whose blocks are not the KV of
    token positions with a prefix of them freed: a hold pairs the prefill's
    and the decoder's blocks position by position, which would copy a Mamba
    state, a ring buffer or a window with a gap in the middle into the wrong
    place. Full attention (MLA too), sliding-window and chunked local
    attention groups are moved."""
    from vllm.v1 import kv_cache_interface as kinds

    moved = (kinds.FullAttentionSpec, kinds.SlidingWindowSpec, kinds.ChunkedLocalAttentionSpec)
    gapped = getattr(kinds, "RSWASpec", ())
    if not isinstance(spec, moved) or (gapped and isinstance(spec, gapped)):
        raise ValueError(
            f"ConnexConnector moves KV blocks by token position; KV cache group {index} is "
            f"{type(spec).__name__}, whose blocks are not (full, sliding-window and chunked "
            "local attention are supported)"
        )


def group_kinds(kv_cache_config: KVCacheConfig) -> str:
    """The KV cache groups by kind, in order ("FullAttentionSpec,
    SlidingWindowSpec(16)"): a prefill and a decoder must group alike."""
    kinds = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        kind = type(spec).__name__
        kinds.append(f"{kind}({window})" if window else kind)
    return ",".join(kinds)


def check_parallelism(parallel_config: object) -> None:
    """Refuses, at start, the parallel layouts whose ranks would collide on the
    hold control ports (TP rank r of an engine listens on ctrl_port + r, and a
    decoder's rank r pulls from the prefill's rank r): pipeline parallelism
    (each stage holds other layers, on the same TP ranks) and several data
    parallel engines in one server (each with its own ranks 0..TP-1, and its
    own scheduler registering the same instance). Data parallel ranks that
    are servers of their own (`--data-parallel-rank`, one per pod) are not
    refused: each is an engine like any other."""
    pp = getattr(parallel_config, "pipeline_parallel_size", 1) or 1
    dp_local = getattr(parallel_config, "data_parallel_size_local", 1) or 1
    if pp > 1:
        raise ConfigError(
            f"ConnexConnector does not support pipeline parallelism "
            f"(--pipeline-parallel-size {pp}): its stages' ranks would serve holds "
            "on the same control ports; use tensor parallelism"
        )
    if dp_local > 1:
        raise ConfigError(
            f"ConnexConnector does not support {dp_local} data parallel engines in "
            "one server (--data-parallel-size-local): their ranks would serve holds "
            "on the same control ports and register as one instance; run one server "
            "per data parallel rank (--data-parallel-rank), each its own instance"
        )


def sleep_mode_safe(hold_mode: str) -> bool:
    """Whether holds survive the engine sleeping (vLLM's sleep mode frees or
    offloads the KV cache): staged holds serve copies in the connector's own
    host memory, which sleep leaves alone; holds in place serve the KV cache's
    blocks themselves, which a sleeping engine no longer has."""
    return hold_mode == "staged"


def check_sleep_mode(model_config: object, hold_mode: str) -> None:
    """Refuses, at start, sleep mode with holds in place (vLLM 0.32 has no
    connector declaration for it; 0.33 reads `supports_sleep_mode`)."""
    if getattr(model_config, "enable_sleep_mode", False) and not sleep_mode_safe(hold_mode):
        raise ConfigError(
            "ConnexConnector's holds in place (hold=in_place) serve the KV cache's "
            "blocks, which sleep mode frees: use staged holds (hold=staged) with "
            "--enable-sleep-mode"
        )


def compat_fingerprint(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[tuple[str, str], ...]:
    """What decides what a block's bytes mean beyond its size, by name (as
    NixlConnector's compatibility hash, but named, so that a refusal says what
    differs): the vLLM version, the model, the attention backend asked for
    (`auto`: the platform picks the same one for the same model), the KV cache
    layout the engine core resolved (NHD or HND pages), the cache dtype asked
    for (two fp8 formats have the same bytes) and the heads a page holds."""
    import vllm

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None)
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    several = len(kv_cache_config.kv_cache_groups) > 1
    values = {
        "vllm": vllm.__version__,
        "model": str(vllm_config.model_config.model),
        "attn_backend": getattr(backend, "name", None) or str(backend or "auto"),
        "kv_cache_layout": str(layout or ""),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "kv_heads": str(getattr(spec, "num_kv_heads", "")),
        "head_size": str(getattr(spec, "head_size", "")),
        # Only with several groups: a decoder of an older Connex refuses
        # names it does not know, and one group is what it assumed.
        "kv_groups": group_kinds(kv_cache_config) if several else "",
    }
    # An empty value is unknown here: left out, so never compared.
    return tuple(sorted((k, v[:MAX_COMPAT_VALUE_LEN]) for k, v in values.items() if v))


def kv_events_endpoint(vllm_config: VllmConfig) -> str | None:
    """The ZMQ endpoint of the engine's KV events, when `--kv-events-config`
    publishes them (the agent forwards them to the router for cache_aware)."""
    config = getattr(vllm_config, "kv_events_config", None)
    if config is None or not getattr(config, "enable_kv_cache_events", False):
        return None
    if getattr(config, "publisher", None) != "zmq":
        return None
    endpoint = getattr(config, "endpoint", None)
    return endpoint if isinstance(endpoint, str) else None


def log_like_vllm() -> None:
    """Sends the connector's log records (INFO and up) where vLLM's go: the
    engine's log then says how KV moves (staged or in place, through host
    memory or straight to the device). Without it, Python's default shows
    warnings only."""
    ours = logging.getLogger("connex")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.handlers:
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


class ConnexConnector(KVConnectorBase_V1, SupportsHMA):
    """Declares `SupportsHMA`: with vLLM's hybrid KV cache manager on (its
    default where the model has sliding-window or other layer kinds), a hold
    carries every KV cache group's blocks and a decoder pulls, per group, the
    blocks its attention still reads (a sliding-window group's last window)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_like_vllm()
        check_parallelism(vllm_config.parallel_config)
        ktc = self._kv_transfer_config
        self.cfg = ConnexConfig.from_extra(dict(ktc.kv_connector_extra_config), ktc.kv_port)
        self.engine_id = str(ktc.engine_id)
        is_producer = bool(ktc.is_kv_producer)
        is_consumer = bool(ktc.is_kv_consumer)
        # Staged or in place: the same answer in the scheduler and the workers.
        self.hold_mode = self.cfg.hold
        check_sleep_mode(vllm_config.model_config, self.hold_mode)
        logger.info("ConnexConnector (%s): %s holds", role.name.lower(), self.hold_mode)
        self.scheduler: ConnexScheduler | None = None
        self.worker: ConnexWorker | None = None
        self.agent: Agent | None = None
        if role == KVConnectorRole.SCHEDULER:
            keeper = self._make_keeper() if is_consumer else None
            self.scheduler = ConnexScheduler(
                self.cfg,
                self.engine_id,
                local_layout(vllm_config, kv_cache_config),
                is_producer,
                is_consumer,
                keeper,
                hold_mode=self.hold_mode,
                # vLLM's Scheduler is constructing this connector: found
                # in the calling frames, its internals checked once.
                replay=GrammarReplay.from_caller() if is_consumer else None,
            )
            if len(kv_cache_config.kv_cache_groups) > 1:
                logger.info(
                    "ConnexConnector: %d KV cache groups (%s): holds carry every group's blocks",
                    len(kv_cache_config.kv_cache_groups),
                    group_kinds(kv_cache_config),
                )
            if self.cfg.router:
                self._start_agent(vllm_config, is_producer, is_consumer)
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            groups = kv_cache_config.kv_cache_groups
            self.worker = ConnexWorker(
                self.cfg,
                get_tensor_model_parallel_rank(),
                kv_cache_config.num_blocks,
                # Layers of several groups share tensors (the worker moves each
                # tensor once): in order, so both sides list them alike.
                [name for group in groups for name in group.layer_names],
                is_producer,
                is_consumer,
                hold_mode=self.hold_mode,
                tp_size=get_tensor_model_parallel_world_size(),
                kv_heads=int(getattr(groups[0].kv_cache_spec, "num_kv_heads", 0) or 0)
                if groups
                else 0,
            )

    @property
    def supports_sleep_mode(self) -> bool:
        """vLLM 0.33's question to a connector (it assumes yes): only staged
        holds outlive a sleeping engine's KV cache."""
        return sleep_mode_safe(self.hold_mode)

    def _make_keeper(self) -> HoldKeeper:
        from connex import _transfer

        from .keeper import HoldKeeper

        return HoldKeeper(
            _transfer.Reader(backend=self.cfg.backend, secret=self.cfg.transfer_secret),
            gone_errors=(_transfer.HoldNotFound, _transfer.StaleEpoch),
        )

    def _start_agent(self, vllm_config: VllmConfig, is_producer: bool, is_consumer: bool) -> None:
        from connex.agent import DEREGISTER_FILE_ENV, Agent, engine_load

        role = "both" if is_producer and is_consumer else "prefill" if is_producer else "decode"
        names = vllm_config.model_config.served_model_name
        model = names[0] if isinstance(names, list | tuple) else str(names)
        scheduler = self.scheduler
        assert scheduler is not None and self.cfg.url is not None and self.cfg.router
        url = self.cfg.url
        agent = Agent(
            self.cfg.router,
            role,
            self.cfg.url,
            model,
            ctrl=self.cfg.ctrl_addr(0) if is_producer else None,
            instance_id=self.cfg.instance_id,
            token=self.cfg.register_token,
            load=lambda: engine_load(url, scheduler.inflight),
            deregister_file=os.environ.get(DEREGISTER_FILE_ENV),
            kv_events=kv_events_endpoint(vllm_config),
        )
        self.agent = agent.start()
        atexit.register(agent.stop)

    # ---- scheduler side ----------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler._kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Holds the workers reported freed: their requests no longer keep the
        # engine stepping while idle.
        super().update_connector_output(connector_output)
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call with the hybrid KV cache manager on (`SupportsHMA`): the
        hold was taken of every group's blocks when the prompt was computed;
        these only say whether the request kept any."""
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, [b for ids in block_ids for b in ids])

    # ---- worker side -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, ConnexMetadata):
            self.worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker is not None:
            self.worker.bind(None)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: the scheduler runs a request only once its
        # blocks have arrived.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Nothing to save per layer: holds are taken (in place or staged) once
        # the whole forward has run, in wait_for_save.
        return

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        sending, recving, failed = self.worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    # ---- KV transfer metrics (stats.py) --------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is None:
            return None
        data = self.worker.take_stats()
        return None if data is None else ConnexKVStats(data=data)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return ConnexKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return ConnexPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None and self.scheduler.keeper is not None:
            self.scheduler.keeper.close()
        if self.agent is not None:
            self.agent.stop()
