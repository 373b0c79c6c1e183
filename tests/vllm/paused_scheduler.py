"""vLLM's scheduler with a test hook: every running request paused at a token count.

test_reasoning_resume's kill batch needs a decoder with each of its streams at a
given point at once, then killed. Timing cannot do that on a loaded machine (a
frozen engine thawed for a few milliseconds ran past narrow kill points, or a
batch admitted over several steps drifted apart). This scheduler makes it exact:
while the file named by the engine's `--additional-config` key `PAUSE_KEY`
holds a number N, a running request that has N output tokens is not scheduled
again (vLLM's per-request `next_decode_eligible_step` gate), so each request of
the batch stops at token N whenever it was admitted, and its client has
everything up to there once the engine's API server has sent it on. A request
that names its own count (`vllm_xargs: {PAUSE_AT_KEY: N}`, which vLLM keeps in
its sampling params' `extra_args`) stops there instead, so that one batch can
cut each of its requests at a point of its own (test_structured_resume). Without
the file the scheduler is vLLM's own.

Used as `--scheduler-cls paused_scheduler.PausedScheduler` (this folder on the
engine's PYTHONPATH) with `--additional-config '{"connex_pause_file": PATH}'`.
"""

from __future__ import annotations

import time
from pathlib import Path

from vllm.v1.core.sched.scheduler import Scheduler

PAUSE_KEY = "connex_pause_file"
# A request's own pause count (its `vllm_xargs`), while the file exists.
PAUSE_AT_KEY = "connex_pause_at"
# How long a step with every running request paused waits before it returns
# (nothing to compute): the engine loop steps again at once, and would spin a
# core the API server and the router need.
IDLE_S = 0.005


class PausedScheduler(Scheduler):
    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        config = vllm_config.additional_config
        self._pause_file = Path(config[PAUSE_KEY]) if PAUSE_KEY in config else None

    def _pause_at(self) -> int | None:
        if self._pause_file is None:
            return None
        try:
            return int(self._pause_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def schedule(self, *args, **kwargs):
        at = self._pause_at()
        paused = 0
        if at is not None:
            for request in self.running:
                if request.num_output_tokens + request.num_output_placeholders >= own_count(
                    request, at
                ):
                    # `schedule` skips a running request until this step.
                    request.next_decode_eligible_step = self.current_step + 2
                    paused += 1
        output = super().schedule(*args, **kwargs)
        if paused and not output.num_scheduled_tokens:
            time.sleep(IDLE_S)
        return output


def own_count(request, default: int) -> int:
    """The count at which `request` pauses: its own, or the file's."""
    extra = getattr(request.sampling_params, "extra_args", None) or {}
    return int(extra.get(PAUSE_AT_KEY, default))
