"""``sglang-npu``: SGLang on Ascend as slime's rollout engine.

What it produces from the ``ascend_rollout_*`` settings:

* server arguments: ``device=npu``, ``attention_backend`` (``ascend``), graph mode
  (``cuda_graph_backend_{decode,prefill}=disabled`` when off), ``mem_fraction_static`` and ``sampling_backend`` when set. The weight-update
  group needs no server argument: slime asks its accelerator for the backend and the ``npu``
  accelerator answers ``hccl``.
* environment: ``ASCEND_USE_FIA`` (decode through ``npu_fused_infer_attention_score``),
  ``HCCL_HOST_SOCKET_PORT_RANGE`` / ``HCCL_NPU_SOCKET_PORT_RANGE`` (the HCCL group's ports), and
  ``PYTORCH_NPU_ALLOC_CONF`` without ``expandable_segments`` (it breaks SGLang's sleep mode on NPU,
  as it does on CUDA, where slime already strips ``PYTORCH_CUDA_ALLOC_CONF``).

Both reach the engine through the runtime patch ``engine.sglang_npu_launch`` (installed at
process start by this plugin); the HCCL port ranges also reach the train actors (``train.hccl_port_env``, as
each starts), since CANN wants every card of a communicator to set them if one does. :func:`validate_server_args` checks produced arguments against the
installed SGLang; :func:`check_sglang_fixes` checks that the installed SGLang contains the
engine fixes slime's NPU fork had to patch in (``docker/npu_patch/sglang.patch``); :func:`speculative_problem` refuses,
at ``parse_args``, the speculative flags SGLang on Ascend would refuse at the engine's start.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from collections.abc import Mapping
from typing import Any

from ..._import_hooks import module_file
from . import RolloutBackend

logger = logging.getLogger("slime_ascend.rollout")

from ...host import ALLOC_CONF_ENVS

HCCL_PORT_ENVS = ("HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE")
# Keys that must have our value: a conflicting user value is an error, not a preference.
REQUIRED_KEYS = ("device",)


class SGLangNPUBackend(RolloutBackend):
    name = "sglang-npu"
    description = "SGLang on Ascend NPUs, launched by slime (device=npu, attention backend ascend, HCCL sync)"
    plugin = "sglang-npu"

    def server_args(self, options: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"device": "npu", "attention_backend": options["attention_backend"]}
        if not options["graph_mode"]:  # graphs are SGLang's default; only switching them off needs args
            out.update(graph_off_args())
        if options.get("mem_fraction") is not None:
            out["mem_fraction_static"] = float(options["mem_fraction"])
        if options.get("sampling_backend") is not None:
            out["sampling_backend"] = options["sampling_backend"]
        return out

    def env(self, options: Mapping[str, Any]) -> dict[str, str]:
        return {
            "ASCEND_USE_FIA": "1" if options["use_fia"] else "0",
            "HCCL_HOST_SOCKET_PORT_RANGE": options["hccl_host_port_range"],
            "HCCL_NPU_SOCKET_PORT_RANGE": options["hccl_npu_port_range"],
            "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False",
        }

    def slime_flags(self, options: Mapping[str, Any], addrs: list[str] | None = None) -> list[str]:
        # Everything else travels in the YAML; pre-launched servers are attached by address.
        return ["--rollout-external-engine-addrs", *addrs] if addrs else []

    def launch_command(
        self, options: Mapping[str, Any], model_path: str, host: str = "0.0.0.0", port: int = 30000, tp_size: int = 1
    ) -> list[str]:
        """``python -m sglang.launch_server`` argv for a server slime attaches as an external engine."""
        argv = ["python", "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
                "--port", str(port), "--tp-size", str(tp_size), "--trust-remote-code"]
        return argv + to_cli(self.server_args(options))

    def validate(self, options: Mapping[str, Any]) -> list[str]:
        problems: list[str] = []
        choices = _cli_choices()
        if choices is None:
            return problems  # sglang not importable here: checked in the engine process instead
        for key, value in self.server_args(options).items():
            allowed = choices.get(key)
            if allowed is not None and value not in allowed:
                setting = {"attention_backend": "ascend_rollout_attention_backend",
                           "sampling_backend": "ascend_rollout_sampling_backend"}.get(key, key)
                problems.append(f"{setting}={value!r} is not accepted by the installed SGLang "
                                f"(--{key.replace('_', '-')} choices: {sorted(map(str, allowed))})")
        return problems


BACKEND = SGLangNPUBackend()


# -- the real SGLang package ------------------------------------------------------------------
def _server_args_class():
    from sglang.srt.server_args import ServerArgs

    return ServerArgs


def server_args_fields() -> dict[str, Any]:
    """Field name -> default of the installed ``ServerArgs`` (a dataclass in older SGLang, a
    ``msgspec.Struct`` in 0.5.2x)."""
    cls = _server_args_class()
    import dataclasses

    if dataclasses.is_dataclass(cls):
        return {
            f.name: (f.default if f.default is not dataclasses.MISSING else None) for f in dataclasses.fields(cls)
        }
    names = tuple(getattr(cls, "__struct_fields__", ()))
    if not names:
        raise TypeError(f"{cls!r} is neither a dataclass nor a msgspec Struct; cannot list its fields")
    defaults = tuple(getattr(cls, "__struct_defaults__", ()))
    padded = (None,) * (len(names) - len(defaults)) + defaults
    out = {}
    for name, default in zip(names, padded):
        factory = getattr(default, "factory", None)  # msgspec.field(default_factory=...)
        out[name] = factory() if callable(factory) and type(default).__name__ == "Factory" else default
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    _server_args_class().add_cli_args(parser)
    return parser


def _cli_choices() -> dict[str, Any] | None:
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        parser = _parser()
    except Exception:  # noqa: BLE001 - an unusable sglang is reported by validate_server_args
        return None
    return {a.dest: a.choices for a in parser._actions if a.choices is not None}


def to_cli(server_args: Mapping[str, Any]) -> list[str]:
    """ServerArgs fields -> ``sglang.launch_server`` flags (``True`` booleans as bare flags)."""
    argv: list[str] = []
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def validate_server_args(server_args: Mapping[str, Any], model_path: str = "/models/placeholder") -> dict[str, Any]:
    """Check produced arguments against the installed SGLang and say what was checked.

    1. every key is a ``ServerArgs`` field;
    2. the ``sglang.launch_server`` flags for them parse with SGLang's own argparse definition
       (types and choices) back to the same values;
    3. ``ServerArgs(model_path=..., **server_args)`` constructs, where construction is side-effect free:
       SGLang 0.5.2x resolves hardware and model in ``resolve_once`` at launch. Older SGLang (slime's
       pin 0.5.15) resolves them in ``__post_init__`` (imports torch_npu, opens the model), which only
       an NPU host with the model can do: there step 3 is reported under ``not_checked``.

    Raises ``ValueError`` naming the first failing key.
    """
    fields = server_args_fields()
    unknown = sorted(set(server_args) - set(fields))
    if unknown:
        raise ValueError(f"not ServerArgs fields in the installed sglang: {unknown}")
    parser = _parser()
    argv = ["--model-path", model_path] + to_cli(server_args)
    try:
        namespace, rest = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"sglang.launch_server rejects {argv}: {exc}") from exc
    if rest:
        raise ValueError(f"sglang.launch_server does not know {rest}")
    for key, value in server_args.items():
        parsed = getattr(namespace, key)
        if parsed != value:
            raise ValueError(f"--{key.replace('_', '-')} {value!r} parses back as {parsed!r}")
    cls = _server_args_class()
    checked = ["field names", "argparse types/choices round trip"]
    not_checked = ["device and model resolution (needs an NPU host and the model)"]
    if hasattr(cls, "resolve_once"):
        instance = cls(model_path=model_path, **dict(server_args))
        for key, value in server_args.items():
            if getattr(instance, key) != value:
                raise ValueError(f"ServerArgs.{key} is {getattr(instance, key)!r} after construction, "
                                 f"expected {value!r}")
        checked.append("ServerArgs construction")
    else:
        not_checked.append("ServerArgs construction (this SGLang resolves device and model in __post_init__)")
    import sglang

    return {
        "sglang_version": getattr(sglang, "__version__", "unknown"),
        "fields": sorted(server_args),
        "checked": checked,
        "not_checked": not_checked,
    }


def graph_off_args() -> dict[str, Any]:
    """Arguments that switch NPU graph capture off: the per-phase backends of SGLang 0.5.2x
    (``--disable-cuda-graph`` is deprecated there), else the older single flag."""
    try:
        fields = server_args_fields()
    except Exception:  # noqa: BLE001 - sglang absent: the current spelling
        fields = {"cuda_graph_backend_decode": None}
    if "cuda_graph_backend_decode" in fields:
        return {"cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled"}
    return {"disable_cuda_graph": True}


# -- environment --------------------------------------------------------------------------------
def strip_expandable_segments(value: str | None) -> str | None:
    """``"expandable_segments:True,max_split_size_mb:128"`` -> ``"max_split_size_mb:128"``."""
    if value is None:
        return None
    kept = [p for p in (part.strip() for part in value.split(",")) if p and not p.startswith("expandable_segments")]
    return ",".join(kept)


def apply_env(env: Mapping[str, str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """Fill ``env`` into ``environ`` (default ``os.environ``) where unset; always strip
    ``expandable_segments`` from the allocator settings. Returns what changed (name -> new value)."""
    environ = os.environ if environ is None else environ
    changed: dict[str, str] = {}
    for name in ALLOC_CONF_ENVS:
        if name in environ:
            stripped = strip_expandable_segments(environ[name])
            if stripped != environ[name]:
                environ[name] = stripped
                changed[name] = stripped
    return {**changed, **fill_unset(env, environ)}


def fill_unset(env: Mapping[str, str], environ: dict[str, str]) -> dict[str, str]:
    """Set each of ``env`` in ``environ`` where unset (a value the job already has wins); returns what was set."""
    changed = {name: value for name, value in env.items() if name not in environ}
    environ.update(changed)
    return changed


# -- HCCL port ranges: the same in every process of a communicator ------------------------------
# CANN (HCCL_HOST_SOCKET_PORT_RANGE / HCCL_NPU_SOCKET_PORT_RANGE): in a multi-card job, if one card of a
# communicator sets the range, every card must. The engines slime launches get them from the launch bridge
# (engine.sglang_npu_launch, where the job left them unset); the weight-update group joins those engines with the
# train actors, which get the same values the same way as they start (train.hccl_port_env), and so does every
# Megatron group among the train actors.
def launches_engines(args: Any) -> bool:
    """slime starts the SGLang engines itself (the bridge runs in them): not external ones, not a train-only run."""
    return not getattr(args, "rollout_external_engine_addrs", None) and not getattr(args, "debug_train_only", False)


def hccl_env(args: Any) -> dict[str, str]:
    """The HCCL port-range variables the bridge sets in the engines where the job leaves them unset."""
    return {k: v for k, v in BACKEND.env(BACKEND.options_from_args(args)).items() if k in HCCL_PORT_ENVS}


def apply_train_env(args: Any, environ: dict[str, str] | None = None) -> dict[str, str]:
    """In a train actor, before its process groups: the engines' HCCL port ranges where unset (returns what was
    set). Nothing where slime starts no engine (external engines keep whatever their own launch gave them)."""
    if not launches_engines(args):
        return {}
    return fill_unset(hccl_env(args), os.environ if environ is None else environ)


def hccl_problem(args: Any, environ: Mapping[str, str]) -> str | None:
    """A port range that would differ between the train actors and the engines slime launches (only
    ``--train-env-vars`` can make them differ: both sides fill the same values where the job has none)."""
    if not launches_engines(args):
        return None
    train_env = getattr(args, "train_env_vars", None)
    train_env = train_env if isinstance(train_env, Mapping) else {}
    for name, ours in hccl_env(args).items():
        engine = environ.get(name, ours)
        train = train_env.get(name, engine)
        if train != engine:
            return (f"sglang-npu: {name} would be {train!r} in the train actors (--train-env-vars) but {engine!r} in "
                    "the engines; CANN requires every card of an HCCL communicator (the weight-update group joins "
                    f"them) to set the same range. Fix: drop {name} from --train-env-vars, or export one value for "
                    "the whole job (before `ray start` and in its runtime env)")
    return None


def fill_server_args(
    server_args_dict: dict[str, Any], ours: Mapping[str, Any], defaults: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """Our values where slime's dict holds SGLang's default (or lacks the key); a user's explicit
    value wins, except for :data:`REQUIRED_KEYS`. Returns (new dict, {key: (user value, ours)} kept)."""
    out = dict(server_args_dict)
    kept: dict[str, tuple[Any, Any]] = {}
    for key, value in ours.items():
        if key not in defaults:
            continue  # not a field of this SGLang: validate_server_args reports it
        current = out.get(key, defaults[key])
        if current == defaults[key] or current == value:
            out[key] = value
        elif key in REQUIRED_KEYS:
            raise ValueError(
                f"sglang-npu needs ServerArgs.{key}={value!r}, but slime's args give {current!r}. "
                f"Fix: drop --sglang-{key.replace('_', '-')} (or its --sglang-config override)."
            )
        else:
            kept[key] = (current, value)
    return out, kept


# -- engine fixes slime's NPU fork patched into SGLang -----------------------------------------
# (what, module, snippet that must be in its source). docker/npu_patch/sglang.patch targets SGLang
# dce8b06; each of these hunks is present upstream in SGLang 0.5.23 (or reachable with ASCEND_USE_FIA=1).
SGLANG_FIXES: tuple[tuple[str, str, str], ...] = (
    ("rotary: NPU skips the CUDA rotary kernel", "sglang.srt.layers.rotary_embedding.base", "and not (_is_npu)"),
    ("rotary: bf16 query with fp32 cos/sin cache falls back on NPU", "sglang.srt.layers.rotary_embedding.base",
     "self.cos_sin_cache.dtype == torch.float"),
    ("vocab embedding: no torch.compile for the vocab mask on NPU", "sglang.srt.layers.vocab_parallel_embedding",
     "disable=_is_npu"),
    ("qwen3: split_qkv_rmsnorm_rope keyword API", "sglang.srt.models.qwen3", "q_weight=self.q_norm.weight"),
    ("qwen3-moe: split_qkv_rmsnorm_rope keyword API", "sglang.srt.models.qwen3_moe", "q_weight=self.q_norm.weight"),
    ("qwen3: lm_head follows the attention-TP (DP lm_head) group", "sglang.srt.models.qwen3", "use_attn_tp_group="),
    ("ascend attention: FIA decode path selectable (ASCEND_USE_FIA)",
     "sglang.srt.hardware_backend.npu.attention.ascend_backend", '"ASCEND_USE_FIA"'),
    ("NPU graph runner: replay attribute chosen without per-batch arguments",
     "sglang.srt.hardware_backend.npu.graph_runner.npu_graph_runner", "def _get_update_attr_name(self):"),
)


def _module_source(module_name: str) -> str | None:
    path = module_file(module_name)
    return None if path is None else path.read_text(errors="replace")


def missing_snippets(expected: tuple[tuple[str, str, str], ...], fix: str) -> list[str]:
    """Each (what, module, snippet) of ``expected`` whose module the installed SGLang lacks, or whose source lacks
    the snippet, as one line (``fix`` says what to do about a missing snippet). Reads source; imports nothing."""
    problems: list[str] = []
    for what, module_name, snippet in expected:
        source = _module_source(module_name)
        if source is None:
            problems.append(f"{what}: {module_name} not found in the installed sglang")
        elif snippet not in source:
            problems.append(f"{what}: {module_name} lacks {snippet!r} ({fix})")
    return problems


def check_sglang_fixes() -> list[str]:
    """Fixes from slime's NPU fork missing in the installed SGLang (read from source; imports nothing)."""
    return missing_snippets(SGLANG_FIXES, "apply slime's docker/npu_patch/sglang.patch")


# -- speculative decoding on Ascend ---------------------------------------------------------------
# SGLang's own rules, read from the installed SGLang (0.5.15.post1): on ``device=npu`` it pins the attention backends to
# ``ascend`` and the page size to 128 unless one is given (``_handle_npu_backends`` -> ``set_default_server_args``,
# before the speculative hook runs), then refuses a draft tree (``--speculative-eagle-topk`` above 1) with pages above
# one token on any backend but flashinfer / fa3 / triton, and n-gram speculation off CUDA. Each refusal is a
# ValueError at the engine's start, after Ray, the train actors and the engines' placement; here it is one line in
# ``parse_args``. (module, snippet that must be in its source) for each rule, checked by
# :func:`check_speculative_rules` against the installed SGLang.
NPU_DEFAULT_PAGE_SIZE = 128
SPECULATIVE_RULES: tuple[tuple[str, str, str], ...] = (
    ("NPU pins the attention backend to ascend", "sglang.srt.hardware_backend.npu.utils",
     'args.attention_backend = "ascend"'),
    ("NPU's default page size", "sglang.srt.hardware_backend.npu.utils",
     f"args.page_size = {NPU_DEFAULT_PAGE_SIZE}"),
    ("a draft tree with pages needs flashinfer, fa3 or triton", "sglang.srt.arg_groups.speculative_hook",
     '_PAGE_TREE_SPEC_BACKENDS = ("flashinfer", "fa3", "triton")'),
    ("n-gram speculation is CUDA-only", "sglang.srt.arg_groups.speculative_hook",
     'raise ValueError("Ngram speculative decoding only supports CUDA device.")'),
)


def check_speculative_rules() -> list[str]:
    """The rules :func:`speculative_problem` stands for that the installed SGLang no longer has (read from source)."""
    return missing_snippets(SPECULATIVE_RULES, "re-read SGLang's rule and update sglang-npu")


def speculative_problem(args: Any) -> str | None:
    """What SGLang on Ascend would refuse at the engine's start of slime's ``--sglang-speculative-*`` flags
    (:data:`SPECULATIVE_RULES`), as one line with its fix; None when nothing. Reads slime's command line (not a
    per-group ``--sglang-config`` override)."""
    algorithm = getattr(args, "sglang_speculative_algorithm", None)
    if not algorithm:
        return None
    if str(algorithm).upper() == "NGRAM":
        return ("--sglang-speculative-algorithm NGRAM: SGLang runs n-gram speculation on CUDA only (it refuses it at "
                "the engine's start on device npu). Fix: --sglang-speculative-algorithm EAGLE (or NEXTN) with the "
                "model's MTP layer, as slime's GLM-5 scripts pass, or drop the flag")
    topk = getattr(args, "sglang_speculative_eagle_topk", None)
    given = getattr(args, "sglang_page_size", None)
    page_size = NPU_DEFAULT_PAGE_SIZE if given is None else int(given)
    if topk is not None and int(topk) > 1 and page_size > 1:
        given = "SGLang's NPU default" if given is None else "--sglang-page-size"
        return (f"--sglang-speculative-eagle-topk {topk}: on Ascend SGLang attends with its 'ascend' backend at page "
                f"size {page_size} ({given}), and a draft tree (top-k above 1) with pages above one token needs "
                "flashinfer, fa3 or triton: SGLang would refuse it at the engine's start. Fix: "
                "--sglang-speculative-eagle-topk 1 (what slime's GLM-5 scripts pass)")
    return None


# -- plugin hooks -----------------------------------------------------------------------------
def validate_plugin(args: Any, settings: Any) -> None:
    """Plugin-level check at first use (RolloutManager, train actors)."""
    from ...plugins.settings import SettingsError

    options = BACKEND.options_from_args(args)
    problems = BACKEND.validate(options)
    device = getattr(args, "sglang_device", None)
    if device not in (None, "npu"):
        problems.append(f"--sglang-device {device!r} conflicts with sglang-npu (drop the flag)")
    from ..replay_routes import refusal

    routes = refusal(args, managed_engines_add_routes=False)  # SGLang adds them only when the request asks
    if routes:
        problems.append(routes)
    from ...plugins import runtime

    hccl = hccl_problem(args, runtime.environ())
    if hccl:
        problems.append(hccl.removeprefix("sglang-npu: "))
    speculative = speculative_problem(args)
    if speculative:
        problems.append(speculative)
    if problems:
        raise SettingsError("sglang-npu: " + "; ".join(problems))
