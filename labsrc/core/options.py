"""Typed lab options: one dataclass per lab, its field docstrings the help text, the same checks from a cell or a shell.

    @dataclass
    class Options(LabOptions):
        global_batch: int = 0
        \"\"\"Samples per step over all ranks (0: the profile's).\"\"\"

    Options.make(global_batch=64).to_argv()      -> ["--global-batch", "64"]
    Options.parse(["--global-batch", "64"])      -> Options(global_batch=64, ...)
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from dataclasses import dataclass

from labsrc.core.world import RequestError


def field_docs(cls) -> dict[str, str]:
    """{field: docstring} from the string literal under each field, through the class's bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _base_type(hint):
    """(element type, is a sequence) for int, float, str, bool, X | None and tuple[X, ...]."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        return args[0], True
    if args and origin is not None:  # X | None
        return _base_type(args[0])
    return hint, False


@dataclass
class LabOptions:
    """What every lab takes; a lab's Options adds its own fields, each with a docstring."""

    profile: str | None = None
    """Sizes to use: ci, cpu or gpu (default: LABSRC_PROFILE, else picked from the hardware)."""
    backend: str | None = None
    """Process-group backend, nccl or gloo (default: NCCL when each rank has its own GPU, else gloo)."""
    seed: int = 0
    """Base random seed."""
    pg_timeout_s: float = 120.0
    """Seconds a collective may wait for the other ranks before it fails."""

    def validate(self) -> None:
        """Raise RequestError saying what to do; a lab's Options extends this (calling super)."""
        from labsrc.core.profiles import PROFILES
        if self.profile is not None and self.profile not in PROFILES:
            raise RequestError(f"profile {self.profile!r} is unknown: use one of {sorted(PROFILES)}.")
        if self.backend is not None and self.backend not in ("nccl", "gloo"):
            raise RequestError(f"backend {self.backend!r} is unknown: use 'nccl' or 'gloo'.")
        if self.pg_timeout_s <= 0:
            raise RequestError(f"pg_timeout_s must be positive seconds (got {self.pg_timeout_s}).")

    def check_world(self, world_size: int) -> None:
        """Raise RequestError if these options cannot run on world_size ranks (the launcher asks before starting)."""
        if getattr(self, "global_batch", 0):  # the labs that take a global batch: it must split over the ranks
            from labsrc.core.plan import check_batch_splits
            check_batch_splits(self.global_batch, world_size)

    # -- building -------------------------------------------------------------------------------------

    @classmethod
    def make(cls, **values):
        """Options from keyword values, checked: unknown names and bad values raise RequestError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise RequestError(f"{cls.__module__.rsplit('.', 1)[-1]} has no option(s) {unknown}; "
                               f"its options are {sorted(known)}.")
        hints = typing.get_type_hints(cls)
        converted = {}
        for name, value in values.items():
            kind, sequence = _base_type(hints[name])
            if value is None or kind is bool:
                converted[name] = value
            elif sequence:
                items = value.replace(",", " ").split() if isinstance(value, str) else value
                converted[name] = tuple(cls._convert(name, kind, item) for item in items)
            else:
                converted[name] = cls._convert(name, kind, value)
        options = cls(**converted)
        options.validate()
        return options

    @staticmethod
    def _convert(name: str, kind, value):
        try:
            if kind is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return kind(value)
        except (TypeError, ValueError):
            raise RequestError(f"option {name} must be {kind.__name__} (got {value!r}).") from None

    def changed(self) -> dict:
        """The fields that differ from their defaults."""
        defaults = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(defaults, f.name)}

    def to_argv(self) -> list[str]:
        """The command-line flags that give these options to the lab's main() (only those not at default)."""
        argv: list[str] = []
        for name, value in self.changed().items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + name.replace("_", "-"))
            elif isinstance(value, tuple):
                argv += [flag, *map(str, value)]
            elif value is not None:
                argv += [flag, str(value)]
        return argv

    @classmethod
    def parser(cls, description: str = "") -> argparse.ArgumentParser:
        """An argparse parser with one flag per field, its help the field's docstring."""
        parser = argparse.ArgumentParser(description=description or (cls.__doc__ or "").strip())
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind, sequence = _base_type(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%")
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            elif sequence:
                parser.add_argument(flag, type=kind, nargs="*", default=default, help=help_text)
            else:
                parser.add_argument(flag, type=kind, default=default, help=help_text)
        return parser

    @classmethod
    def parse(cls, argv: list[str] | None = None):
        """Options from command-line flags; a bad value exits with status 2 and the reason."""
        parser = cls.parser()
        namespace = parser.parse_args(sys.argv[1:] if argv is None else argv)
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(namespace).items()}
        try:
            options = cls(**values)
            options.validate()
        except RequestError as exc:
            parser.error(str(exc))
        return options


def positive(name: str, value, allow_zero: bool = False) -> None:
    """RequestError unless value > 0 (or >= 0): the check most options need."""
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = "0 or more" if allow_zero else "more than 0"
        raise RequestError(f"option {name} must be {bound} (got {value}).")
