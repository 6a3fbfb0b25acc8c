"""rollout.colocated: the rollout servers hand their memory to the learner between a step's
rollouts and its weight sync.

After the rollouts every server in the rotation (all idle then) releases its weights and KV
memory (`release`); after the update, before the weight sync loads the new weights, exactly
those are resumed (`resume`). Real SGLang can do this only when started with
--enable-memory-saver, which `check_memory_saver` verifies before the first step.
"""
from __future__ import annotations

import logging
import time

from cleaner_jax.config import ConfigError
from cleaner_jax.rollout.sglang_answers import RolloutServerError
from cleaner_jax.session import Session

log = logging.getLogger("cleaner_jax.train")


class ColocatedRollout:
    """The release and resume of the session's rollout servers around the learner phase."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.released: list[str] = []  # the servers whose memory is released now

    def release(self) -> dict[str, float]:
        """Release the weights and KV memory of every server in the rotation (all idle: the
        step's rollouts are done); `resume` brings back exactly these."""
        t0 = time.perf_counter()
        self.released = self.session.fleet.live_urls()
        answers = self.session.run(self.session.client.release_memory_occupation(urls=self.released))
        seconds = time.perf_counter() - t0
        log.info("rollout memory released in %.3f s: %s", seconds, answers)
        return {"time/colocate/release_s": seconds}

    def resume(self) -> dict[str, float]:
        """Resume what `release` released, before the weight sync loads the new weights (real
        SGLang's resumed weights hold no values until then). A server that died meanwhile is
        left to the fleet, which restarts or re-admits it fresh on the current weights
        (docs/reliability.md row 1); any other refusal stops the run."""
        t0 = time.perf_counter()
        client, fleet = self.session.client, self.session.fleet
        for url in self.released:
            try:
                log.info("rollout memory resumed: %s", self.session.run(client.resume_memory_occupation(urls=[url])))
            except RolloutServerError:
                if url not in fleet.unreachable():
                    raise
                log.warning("rollout server %s died while its memory was released (%s); the fleet brings it back",
                            url, client.out_of_rotation[url])
        self.released = []
        return {"time/colocate/resume_s": time.perf_counter() - t0}

    def check_memory_saver(self) -> None:
        """Every server must support memory release (real SGLang only with
        --enable-memory-saver, which /server_info reports), checked before the first step."""
        for url in self.session.fleet.live_urls():
            info = self.session.run(self.session.client.server_info(url))
            if info.get("enable_memory_saver") is not True:
                raise ConfigError(f"config.rollout.colocated: {url} was not started with --enable-memory-saver "
                                  f"(/server_info has enable_memory_saver={info.get('enable_memory_saver')!r}), so it "
                                  "cannot release its memory: restart it with the flag or set rollout.colocated=False")
