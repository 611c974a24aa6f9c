"""pytest plugin (``tests/conftest.py`` loads it): with ``--durations``, the session's summary also lists the minutes
each test module took (setup, call and teardown of its tests, summed), slowest first, so that a CI record says where
the time went by module as well as by test phase."""

from __future__ import annotations

from collections import defaultdict

MOST = 30  # modules listed

_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    _seconds[report.nodeid.split("::", 1)[0]] += getattr(report, "duration", 0.0) or 0.0


def module_minutes(seconds: dict[str, float], most: int = MOST) -> list[str]:
    """``seconds`` (module -> seconds) as lines of minutes, slowest first, at most ``most`` of them and a line for the
    rest."""
    ranked = sorted(seconds.items(), key=lambda item: (-item[1], item[0]))
    lines = [f"{s / 60:6.1f} min  {module}" for module, s in ranked[:most]]
    if len(ranked) > most:
        rest = ranked[most:]
        lines.append(f"{sum(s for _, s in rest) / 60:6.1f} min  ({len(rest)} other modules)")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if config.getoption("durations", None) is None or not _seconds:
        return
    terminalreporter.write_sep("=", f"minutes per test module (total {sum(_seconds.values()) / 60:.1f})")
    for line in module_minutes(_seconds):
        terminalreporter.write_line(line)
