"""Fake rollout engines for the weight-switch tests: what slime's SGLangEngine actor offers the switch,
with Ray's ``.remote()`` / ``ray.get`` reduced to calls."""

from __future__ import annotations


class Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return lambda: self.fn(*args, **kwargs)  # a "ref": get() calls it


def get(ref, timeout=None):
    return [r() for r in ref] if isinstance(ref, list) else ref()


class Engine:
    """What slime's SGLangEngine actor offers the switch; ``broken`` paths fail to load."""

    def __init__(self, version="default", path="/ckpt", broken=(), answer_false=(), lies=False):
        self.version, self.path, self.broken, self.answer_false, self.lies = version, path, broken, answer_false, lies
        self.log: list[str] = []
        self.paused = False
        for name in ("pause_generation", "continue_generation", "flush_cache", "update_weights_from_disk",
                     "get_weight_version"):
            setattr(self, name, Call(getattr(self, "_" + name)))

    def _pause_generation(self):
        self.paused = True
        self.log.append("pause")

    def _continue_generation(self):
        self.paused = False
        self.log.append("continue")

    def _flush_cache(self):
        self.log.append("flush")

    def _update_weights_from_disk(self, model_path, weight_version):
        self.log.append(f"load {weight_version}")
        assert self.paused
        if model_path in self.broken:
            raise RuntimeError(f"HTTPError 400: cannot load {model_path}\n  (details)")
        if model_path in self.answer_false:
            return {"success": False, "message": "architecture differs"}
        if not self.lies:
            self.version, self.path = str(weight_version), model_path
        return {"success": True}

    def _get_weight_version(self):
        return self.version
