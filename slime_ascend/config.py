"""``slime-ascend config``: the YAML for slime's ``--custom-config-path``.

The YAML sets slime's hook paths to our dispatchers (only for slots an enabled plugin uses),
the plain slime keys plugins need, and every plugin setting with its default (or the value given
with ``--set``) and a comment. What slime must get on its command line, and the
``SLIME_ASCEND_PLUGINS`` value, are returned separately for the CLI to print (``--flags``: only the
flags, as one shell-quoted line). A combination of plugins whose start-up checks would refuse the
YAML is refused here (:func:`check_combination`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import shlex
from typing import Any

import yaml

from .parallel_layout import Layout, LayoutError
from .plugins import registry, runtime
from .plugins.base import Plugin, option_groups, resolve
from .plugins.runtime import ARGS_KEY, ENV
from .plugins.settings import SettingsError, SettingsView, coerce
from .plugins.slots import SLOTS


@dataclasses.dataclass
class GeneratedConfig:
    yaml_text: str
    plugins: list[str]
    command_line: list[tuple[str, str, str]]  # (flag, plugin, why)
    env_value: str
    flags: list[str] = dataclasses.field(default_factory=list)  # pasteable words (`config --flags`)
    manual: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (text, plugin, why) to add by hand
    notes: list[str] = dataclasses.field(default_factory=list)  # checks that could not run here
    files: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (file name, plugin, writer)

    def flags_line(self) -> str:
        """The pasteable flags as one shell-quoted line (empty when there are none)."""
        return shlex.join(self.flags)

    def write_files(self, directory: str, force: bool = False) -> dict[str, str]:
        """Write the plugins' companion files (``Plugin.config_files``) into ``directory`` with the YAML's
        settings; returns file name -> path. An existing file is kept unless ``force`` (FileExistsError)."""
        values = yaml.safe_load(self.yaml_text) or {}
        self.check_files(directory, force)
        written: dict[str, str] = {}
        for name, _plugin, writer in self.files:
            path = os.path.join(directory, name)
            resolve(writer)(path, values, force)
            written[name] = path
        return written

    def check_files(self, directory: str, force: bool = False) -> None:
        """Refuse (FileExistsError) before anything is written when a companion file exists and not ``force``."""
        for name, _plugin, _writer in self.files:
            path = os.path.join(directory, name)
            if os.path.exists(path) and not force:
                raise FileExistsError(f"{path} exists. Fix: pass --force to overwrite it, or write the YAML elsewhere")

    def launch_line(self, path: str, written: dict[str, str] | None = None) -> str:
        """The whole launch command: the script, the user's own slime flags as a placeholder, the YAML and
        every flag the plugins need (companion files by their written path; values only the user knows in
        capitals)."""
        written = written or {}
        script, words = "train.py", [f"--custom-config-path {shlex.quote(path)}"]
        for flag, _plugin, _why in self.command_line:
            text = " ".join(written.get(w, w) for w in shlex.split(flag))
            if not text.startswith("-"):
                first, _, text = text.partition(" ")
                if first.endswith(".py"):
                    script = first
                if not text.startswith("-"):
                    continue  # advice only
            words.append(text)
        return f"{ENV}={self.env_value} python $SLIME_SRC/{script} <your slime flags> " + " ".join(words)

    def hint(self, path: str, written: dict[str, str] | None = None) -> str:
        written = written or {}
        lines = [f"wrote {path} for plugins: {', '.join(self.plugins)}"]
        lines += [f"wrote {p} ({plugin})" for name, plugin, _ in self.files if (p := written.get(name))]
        lines += ["", "1. export in the driver's environment "
                  "and in the environment of `ray start` on every node (the bootstrap reads it at process start):",
                  f"     export {ENV}={self.env_value}", "", "2. add to your slime launch command:",
                  f"     --custom-config-path {path}"]
        if self.command_line:
            lines.append("   and these flags, which slime reads before the YAML is applied:")
            for flag, plugin, why in self.command_line:
                flag = " ".join(written.get(w, w) for w in flag.split(" "))
                lines.append(f"     {flag:<40} # {plugin}: {why}")
            if self.flags:
                lines.append(f"   (`slime-ascend config {' '.join(self.plugins)} --flags` prints the ready-made ones "
                             "as one shell-quoted line)")
        lines += ["", "3. the whole launch line (your model, data and parallelism flags in place of <your slime flags>):",
                  f"     {self.launch_line(path, written)}"]
        return "\n".join(lines)


def _dump_value(value: Any) -> str:
    # a plain scalar ends with the document end marker "\n..."
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip().removesuffix("\n...")


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["ascend_dis_weight=mask", ...]`` (``--set``) -> ``{"ascend_dis_weight": "mask"}``; values are YAML."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"--set {item!r}: expected KEY=VALUE, e.g. --set ascend_dis_weight=mask")
        try:
            out[key.strip()] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError as exc:
            raise SettingsError(f"--set {item!r}: the value is not valid YAML ({exc.problem})") from None
    return out


def _check_overrides(selection: registry.Selection, overrides: dict[str, Any]) -> None:
    settings = {s.key: s for p in selection.plugins for s in p.settings}
    for key, value in overrides.items():
        if key not in settings:
            close = difflib.get_close_matches(key, sorted(settings), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SettingsError(
                f"--set {key}: not a setting of the plugins {list(selection.names)}; {hint}"
                "Fix: use a key that `slime-ascend plugins` lists for one of them"
            )
        try:
            coerce(settings[key], value)
        except SettingsError as exc:
            raise SettingsError(f"--set {key}: {exc}") from None


def _render(selection: registry.Selection, overrides: dict[str, Any]) -> str:
    out: list[str] = [
        "# slime-ascend configuration for slime's --custom-config-path (generated by `slime-ascend config`).",
        f"# Plugins: {', '.join(selection.names)}. Edit values below; keys are validated at process start.",
        "",
        "# which slime-ascend plugins the hook dispatchers run (must match SLIME_ASCEND_PLUGINS)",
        f"{ARGS_KEY}: {_dump_value(list(selection.names))}",
        "",
    ]
    hook_lines: list[str] = []
    for slot_name in SLOTS:
        entries = selection.slots.get(slot_name)
        who_suffix = ""
        if slot_name == "loss" and not entries:  # loss terms are added by the loss dispatcher
            entries = selection.slots.get("loss_term")
            who_suffix = " (loss term; the base is slime's loss)"
        slot = SLOTS[slot_name]
        if not entries or slot.slime_arg is None:
            continue
        who = ", ".join(p for p, _ in entries) + who_suffix
        hook_lines.append(f"# {slot.name} hook ({slot.mode}) <- {who}")
        value = [slot.dispatcher] if slot.repeatable else slot.dispatcher
        hook_lines.append(f"{slot.slime_arg}: {_dump_value(value)}")
    if hook_lines:
        out += ["# ---- slime hook paths (our dispatchers) ----"] + hook_lines + [""]

    slime_args: dict[str, tuple[Any, str]] = {}
    if "loss" in selection.slots or "loss_term" in selection.slots:
        slime_args["loss_type"] = ("custom_loss", "loss")
    for plugin in selection.plugins:
        for key, value in plugin.slime_args:
            if key in slime_args and slime_args[key][0] != value:
                raise registry.PluginError(
                    f"plugins {slime_args[key][1]!r} and {plugin.name!r} need different values for slime's "
                    f"{key!r} ({slime_args[key][0]!r} vs {value!r}). Fix: enable only one of them."
                )
            slime_args[key] = (value, plugin.name)
    if slime_args:
        out.append("# ---- plain slime settings the plugins need ----")
        for key, (value, who) in slime_args.items():
            out.append(f"{key}: {_dump_value(value)}  # {who}")
        out.append("")

    for plugin in selection.plugins:
        if not plugin.settings:
            continue
        out.append(f"# ---- {plugin.name}: {plugin.description} ----")
        for setting in plugin.settings:
            out.append(f"# {setting.help} ({setting.describe_type()})")
            out.append(f"{setting.key}: {_dump_value(overrides.get(setting.key, setting.default))}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _flags(selection: registry.Selection) -> tuple[list[str], list[tuple[str, str, str]]]:
    """The pasteable command-line words of every plugin (two plugins giving one option different
    values is an error), and what the user must add by hand as ``(text, plugin, why)``."""
    words: list[str] = []
    given: dict[str, tuple[list[str], str]] = {}  # option -> (its values, plugin)
    manual: list[tuple[str, str, str]] = []
    for plugin in selection.plugins:
        for flag in plugin.command_line:
            ready, rest = flag.split()
            for option, *values in option_groups(ready):
                if option in given:
                    if given[option][0] != values:
                        raise registry.PluginError(
                            f"plugins {given[option][1]!r} and {plugin.name!r} need different values for "
                            f"{option} ({shlex.join(given[option][0])!r} vs {shlex.join(values)!r}) on slime's "
                            "command line. Fix: enable only one of them."
                        )
                    continue
                given[option] = (values, plugin.name)
                words += [option, *values]
            if rest is not None:
                manual.append((rest, plugin.name, flag.why))
    return words, manual


def _args_for(selection: registry.Selection, overrides: dict[str, Any], layout: Layout | None = None
              ) -> argparse.Namespace:
    """What slime's args would hold for the keys we control: the YAML, plus the pasteable flags (and the
    layout's sizes)."""
    data = yaml.safe_load(_render(selection, overrides)) or {}
    if layout is not None:
        data.update(layout.slime_args())
    words, _ = _flags(selection)
    for option, *values in option_groups(words):
        key = option.lstrip("-").replace("-", "_")
        parsed = [_scalar(v) for v in values]
        data.setdefault(key, True if not parsed else parsed[0] if len(parsed) == 1 else parsed)
    return argparse.Namespace(**data)


def _scalar(word: str) -> Any:
    """A command-line value as slime's parser would type it, near enough: ``1`` -> 1, ``ppo`` -> 'ppo'."""
    try:
        return yaml.safe_load(word)
    except yaml.YAMLError:
        return word


def _problem(selection: registry.Selection, plugin: Plugin, overrides: dict[str, Any],
             layout: Layout | None = None) -> str | None:
    """The start-up check of ``plugin`` against the args that ``selection`` (and ``layout``) would produce."""
    args = _args_for(selection, overrides, layout)
    saved = dict(runtime._validated)
    try:
        with runtime.ignoring_environment():
            view = SettingsView(plugin.name, runtime.settings_values(plugin, args))
            if plugin.validate:
                resolve(plugin.validate)(args, view)
    except (SettingsError, registry.PluginError) as exc:
        return str(exc)
    finally:
        runtime._validated.clear()
        runtime._validated.update(saved)
    return None


def check_combination(selection: registry.Selection, overrides: dict[str, Any] | None = None) -> list[str]:
    """Refuse a YAML whose start-up validation would fail because of the *combination* of plugins.

    Each plugin's own check runs against the args the whole selection would produce (YAML plus the
    pasteable command-line flags). A failure that the same plugin does not have when generated with
    only its own requirements is a conflict, raised as :class:`PluginError` naming both. A failure it
    has alone too is a value the user still has to fill in (e.g. the OPD teachers): the YAML is written, and a
    note names the value and how to fill it (the job refuses to start until it is).
    Returns notes: those values, and checks that could not run here (e.g. a missing import).
    """
    overrides = dict(overrides or {})
    notes: list[str] = []
    for plugin in selection.plugins:
        if not plugin.validate:
            continue
        try:
            together = _problem(selection, plugin, overrides)
            if together is None:
                continue
            alone = _problem(registry.resolve_selection([plugin.name]), plugin, overrides)
        except Exception as exc:  # noqa: BLE001 - e.g. torch missing on this machine: the check runs at start
            notes.append(f"plugin {plugin.name!r}: its start-up check could not run here ({type(exc).__name__}: "
                         f"{exc}); it runs at process start")
            continue
        if alone is not None:  # the user's value to fill in, whatever the other plugins: say so now, not at start
            notes.append(f"plugin {plugin.name!r} needs a value before the job can start: {together.rstrip('.')} "
                         "(or give it here with --set KEY=VALUE)")
            continue
        raise registry.PluginError(
            f"plugin {plugin.name!r} cannot be enabled with {_culprits(selection, plugin, overrides, together)} "
            f"as configured; its start-up check would refuse this YAML: {together.rstrip('.')} "
            "(to `slime-ascend config`, give a setting's value with --set KEY=VALUE)"
        )
    return notes


def _culprits(selection: registry.Selection, plugin: Plugin, overrides: dict[str, Any], problem: str) -> str:
    """The other plugins that, each on its own, make ``plugin``'s check fail with ``problem`` (else all
    the others)."""
    others = [n for n in selection.names if n != plugin.name and n not in plugin.requires]
    found = []
    for other in others:
        if _problem(registry.resolve_selection([plugin.name, other]), plugin, overrides) == problem:
            found.append(other)
    return " and ".join(repr(n) for n in found or others)


def check_layout(selection: registry.Selection, overrides: dict[str, Any], layout: Layout) -> None:
    """Refuse ``layout`` (one line naming the flag) when Megatron's rules or a plugin's start-up check refuse it
    (a check that fails without the layout too is left to :func:`check_combination`)."""
    layout.check()
    for plugin in selection.plugins:
        if not plugin.validate:
            continue
        try:
            problem = _problem(selection, plugin, overrides, layout)
            if problem is not None and problem != _problem(selection, plugin, overrides):
                raise LayoutError(problem)
        except LayoutError:
            raise
        except Exception:  # noqa: BLE001 - e.g. torch missing here: the plugin's check runs at start
            continue


def build(names: list[str], overrides: dict[str, Any] | None = None, layout: Layout | None = None
          ) -> GeneratedConfig:
    """The YAML for ``names`` (settings at their defaults, or the values in ``overrides``), refused when
    the plugins' start-up checks would reject the combination (:func:`check_combination`); with ``layout``
    its slime flags follow the plugins' in :attr:`GeneratedConfig.flags` (refused by :func:`check_layout`)."""
    overrides = dict(overrides or {})
    if not registry.parse_names(names):  # `config ""` would write a YAML that enables nothing
        raise registry.PluginError(f"no plugin named in {' '.join(map(repr, names)) or 'the command'}. Fix: name "
                                   "at least one plugin, e.g. `slime-ascend config cpu dis -o ascend.yaml` "
                                   "(`slime-ascend plugins` lists them)")
    selection = registry.resolve_selection(names)
    _check_overrides(selection, overrides)
    text = _render(selection, overrides)
    yaml.safe_load(text)  # what we write must load back
    words, manual = _flags(selection)
    notes = check_combination(selection, overrides)
    if layout is not None:
        check_layout(selection, overrides, layout)
        words += layout.flags()
        if "cpu" in selection.names and layout.world > 1:
            notes.append(layout.ray_hint())
    command_line = [(f.flag, p.name, f.why) for p in selection.plugins for f in p.command_line]
    files = [(name, p.name, writer) for p in selection.plugins for name, writer in p.config_files]
    return GeneratedConfig(text, list(selection.names), command_line, ",".join(selection.names), words, manual, notes,
                           files)
