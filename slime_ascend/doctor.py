"""``slime-ascend doctor``: what this environment has, and whether our patches fit its slime."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import site
import sys
from importlib import metadata
from pathlib import Path

from .startup import bootstrap as _bootstrap
from .plugins.runtime import ENV

PTH_NAME = "slime_ascend_bootstrap.pth"


@dataclasses.dataclass
class Line:
    topic: str
    status: str  # ok | warn | fail | info | skip (not checkable on this host: not a failure)
    detail: str


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cann_version() -> str | None:
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        home = os.environ.get(var)
        if not home:
            continue
        for name in ("version.cfg", "ascend_toolkit_install.info", "compiler/version.info"):
            path = Path(home) / name
            if path.is_file():
                for line in path.read_text(errors="replace").splitlines():
                    if "version" in line.lower() and "=" in line:
                        return line.split("=", 1)[1].strip()
        return f"found at {home} (version file not found)"
    return None


def find_pth() -> list[str]:
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return [str(Path(d) / PTH_NAME) for d in dirs if (Path(d) / PTH_NAME).is_file()]


def versions() -> list[Line]:
    lines = [Line("python", "info", sys.version.split()[0])]
    torch_version = _dist_version("torch")
    lines.append(Line("torch", "ok" if torch_version else "fail", torch_version or "not installed"))
    npu = _dist_version("torch-npu") or _dist_version("torch_npu")
    lines.append(Line("torch-npu", "ok" if npu else "info", npu or "not installed (CPU/GPU host)"))
    cann = cann_version()
    lines.append(Line("CANN", "ok" if cann else "info", cann or "not found (ASCEND_HOME_PATH unset)"))
    from .patch import slime_version

    slime = slime_version()
    spec = importlib.util.find_spec("slime")
    where = next(iter(spec.submodule_search_locations)) if spec and spec.submodule_search_locations else ""
    lines.append(Line("slime", "ok" if slime != "absent" else "skip",
                      f"{slime} at {where}" if where else
                      "not importable: the patch targets in slime are not checked here (install THUDM/slime from "
                      "source and put it on PYTHONPATH to check them)"))
    dists = ("ray", "megatron-core", "sglang", "mindspeed", "transformers")
    return lines + [Line(dist, "info", _dist_version(dist) or "not installed") for dist in dists]


def activation() -> list[Line]:
    value = os.environ.get(ENV)
    pth = find_pth()
    lines = [
        Line("bootstrap .pth", "ok" if pth else "fail",
             ", ".join(pth) if pth else f"{PTH_NAME} not found in site-packages: reinstall slime-ascend"),
        Line(ENV, "ok" if value else "info", value or "unset: the bootstrap is inert in this process"),
    ]
    error = _bootstrap.activation_error()
    if error is not None:
        lines.append(Line("activation", "fail", str(error)))
    elif value:
        lines.append(Line("activation", "ok", f"process-start actions ran for: {', '.join(sorted(_bootstrap.started()))}"))
    if value:
        if os.environ.get("RAY_ADDRESS"):
            lines.append(Line("ray workers", "warn",
                              f"RAY_ADDRESS is set: workers of that cluster see {ENV} only if it was exported before "
                              "`ray start` on every node (or passed as runtime_env env_vars); run "
                              "`slime-ascend doctor --ray` to check a live cluster"))
        else:
            lines.append(Line("ray workers", "ok",
                              "a local ray.init() from this environment passes it to every worker"))
    return lines


def ray_probe() -> Line:
    """Ask a live Ray cluster's worker what it sees (connects to RAY_ADDRESS or starts a local one)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        def probe():
            from slime_ascend.startup import bootstrap as b

            return os.environ.get(ENV), sorted(b.started())

        seen, ran = ray.get(probe.remote(), timeout=60)
    finally:
        if started:
            ray.shutdown()
    want = os.environ.get(ENV)
    ok = (seen or "") == (want or "")
    return Line("ray worker probe", "ok" if ok else "fail",
                f"a worker sees {ENV}={seen!r} (driver: {want!r}); plugins started there: {ran}")


def patch_targets() -> list[Line]:
    """One line per patch this host can check (ok or fail); the patches it cannot check (the package their targets
    live in is not importable, or the device runtime they need is not loaded) as one ``skip`` line per reason,
    naming the patches: a fresh host without slime is not a failure."""
    from . import patch

    lines, unchecked = [], {}
    for p in patch.all_patches():
        reason = p.not_checkable()
        problems = [] if reason else p.verify()
        if problems and all(pr.startswith("cannot import target") for pr in problems):
            reason = f"a target cannot be imported here ({problems[0].removeprefix('cannot import target: ')})"
        if reason:
            unchecked.setdefault(reason, []).append(p.id)
        elif problems:
            lines.append(Line(f"patch {p.id}", "fail", "; ".join(problems)))
        else:
            lines.append(Line(f"patch {p.id}", "ok", f"target matches (checked on slime {', '.join(p.checked_on)})"))
    for reason, ids in unchecked.items():
        lines.append(Line("patches not checked", "skip",
                          f"{reason}: {len(ids)} patch{'es' if len(ids) > 1 else ''} ({', '.join(ids)})"))
    return lines


def plugins() -> list[Line]:
    from .plugins import registry

    lines = [Line("plugins", "ok", ", ".join(sorted(registry.available())) or "none installed")]
    lines += [Line(f"plugin {name}", "fail", why) for name, why in sorted(registry.broken().items())]
    return lines


def ascend_environment(environ=None, dev: str = "/dev") -> list[Line]:
    """What an Ascend job started from this shell would inherit (``slime-ascend dryrun`` checks a whole launch):
    both allocator variables (torch_npu refuses to start), and NPUs ``ray start`` here would not count."""
    from .accelerator import launch

    environ = os.environ if environ is None else environ
    lines = []
    clash = launch.alloc_conf_problem(environ)
    if clash:
        lines.append(Line("allocator variables", "fail", clash.removeprefix("npu: ")))
    ray = launch.ray_npu_detection_problem(dev)
    if ray:
        lines.append(Line("ray NPU count", "fail", ray.removeprefix("ray: ")))
    return lines


def exit_status(lines: list[Line]) -> int:
    """1 where a check found a real problem (a ``fail`` line), else 0: what this host cannot check is no failure."""
    return 1 if any(line.status == "fail" for line in lines) else 0


def run(check_patches: bool = True, probe_ray: bool = False) -> list[Line]:
    lines = versions() + activation() + plugins() + ascend_environment()
    if check_patches:
        lines += patch_targets()
    if probe_ray:
        lines.append(ray_probe())
    return lines


def format_lines(lines: list[Line]) -> str:
    width = max(len(l.topic) for l in lines)
    marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "info": "    ", "skip": "SKIP"}
    return "\n".join(f"[{marks[l.status]}] {l.topic:<{width}}  {l.detail}" for l in lines)
