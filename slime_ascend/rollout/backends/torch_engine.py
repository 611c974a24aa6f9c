"""``torch``: the torch engine attached to slime as an external engine.

:class:`~slime_ascend.rollout.torch_engine.engine.TorchEngine` speaks SGLang's HTTP surface
(``/generate``, ``/server_info``, disk weight sync, pause/abort), so slime reaches it with
``--rollout-external-engine-addrs`` and ``--update-weight-transport disk``. Start one with
``slime-ascend serve-torch --model DIR --port PORT`` or, in-process, with :func:`serve`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from . import RolloutBackend


class TorchEngineBackend(RolloutBackend):
    name = "torch"
    description = "torch engine (torch + transformers) with SGLang's HTTP surface; attached as an external engine"

    def slime_flags(self, options: Mapping[str, Any], addrs: list[str] | None = None) -> list[str]:
        return ["--rollout-external-engine-addrs", *(addrs or ["127.0.0.1:30000"]), "--update-weight-transport",
                "disk", "--update-weight-disk-dir", "DIR"]

BACKEND = TorchEngineBackend()


@contextlib.contextmanager
def serve(model_path: str | None = None, host: str = "127.0.0.1", port: int = 0, **engine_kwargs: Any) -> Iterator[str]:
    """Serve a fresh :class:`TorchEngine` from a thread; yields its address ``host:port`` as
    slime's ``--rollout-external-engine-addrs`` takes it."""
    from ..torch_engine.engine import TorchEngine

    engine = TorchEngine(model_path=model_path, **engine_kwargs)
    with engine.start_in_thread(host=host, port=port) as url:
        yield url.removeprefix("http://")
