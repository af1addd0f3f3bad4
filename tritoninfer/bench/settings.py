"""``tritoninfer bench --set MODULE.NAME=VALUE``: a module constant of tritoninfer changed for the run
(routing knobs such as ``sampling._CAP`` or ``_launch.CACHED_DRIVER_PATH``), so that two runs time one
tree with and without a change. Applied after the interpreter switch; listed in the report's
environment table."""

from __future__ import annotations

import importlib
from typing import List, Sequence, Tuple

# (module.name, value) applied in this process, for the report
APPLIED: List[Tuple[str, object]] = []


class SettingError(ValueError):
    pass


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(argv without the ``--set`` options, their ``MODULE.NAME=VALUE`` texts)."""
    rest, sets = [], []
    it = iter(argv)
    for a in it:
        if a == "--set":
            value = next(it, None)
            if value is None:
                raise SettingError("--set: expected MODULE.NAME=VALUE after it")
            sets.append(value)
        elif a.startswith("--set="):
            sets.append(a[len("--set="):])
        else:
            rest.append(a)
    return rest, sets


def _convert(text: str, current: object, where: str) -> object:
    if isinstance(current, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingError(f"--set {where}: expected a boolean (1/0, true/false), got {text!r}")
    for kind in (int, float):
        if isinstance(current, kind):
            try:
                return kind(text)
            except ValueError:
                raise SettingError(f"--set {where}: expected {kind.__name__}, got {text!r}") from None
    if isinstance(current, str):
        return text
    raise SettingError(f"--set {where}: only bool, int, float and str constants can be set, "
                       f"not {type(current).__name__}")


def apply(sets: Sequence[str]) -> None:
    """Sets each ``MODULE.NAME=VALUE`` (module relative to ``tritoninfer``; the constant must exist,
    and the value takes its type)."""
    for text in sets:
        target, sep, value = text.partition("=")
        module_name, dot, name = target.rpartition(".")
        if not sep or not dot or not name:
            raise SettingError(f"--set: expected MODULE.NAME=VALUE (e.g. sampling._CAP=4096), got {text!r}")
        full = module_name if module_name.startswith("tritoninfer") else f"tritoninfer.{module_name}"
        try:
            module = importlib.import_module(full)
        except ImportError:
            raise SettingError(f"--set {target}: no module {full}") from None
        if not hasattr(module, name):
            raise SettingError(f"--set {target}: {full} has no {name}")
        new = _convert(value, getattr(module, name), target)
        setattr(module, name, new)
        APPLIED.append((f"{full}.{name}", new))
