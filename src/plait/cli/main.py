"""Entry point of the `plait` console script: builds the parser from the subcommand modules."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import warnings

__all__ = ["main", "script"]

# subcommand name -> module under plait.cli that defines `add_parser(subparsers)`;
# each module's parser sets `func` to the callable that runs it and returns an exit code.
_SUBCOMMANDS = {
    "train": "plait.cli.train",
    "schedule": "plait.cli.schedule",
    "bench": "plait.cli.bench",
    "checkpoint": "plait.cli.checkpoint",
    "profile": "plait.cli.profile",
    "simulate": "plait.cli.simulate",
    "plan": "plait.cli.plan",
    "experiment": "plait.cli.experiment",
    "capabilities": "plait.cli.capabilities",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait",
        description="Train one PyTorch model on many workers; plans predicted before they run.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plait")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


class _Version(argparse.Action):
    """argparse's "version" action, the version looked up only when asked for (reading the
    installed package's metadata costs every other command tens of milliseconds)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show program's version number and exit")  # fmt: skip

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"plait {_version()}")
        parser.exit()


def script() -> int:
    """The `plait` command (and `python -m plait`): `main`, then the objects it made are
    frozen out of the interpreter's last collection, which walked every one torch and the
    command created (0.3-1 s at exit, after the work was done). Not in `main`, which tests
    and notebooks call in a process that goes on."""
    code = main()
    gc.freeze()
    return code


def main(argv: list[str] | None = None) -> int:
    """Run `plait ARGV`; Ctrl-C at any moment (a command that imports torch takes seconds
    before it starts) ends it with one line, not a traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("plait: stopped by SIGINT", file=sys.stderr)
        return 128 + 2
    except BrokenPipeError:  # `plait ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    parser.add_argument("--version", action=_Version)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # a setting that does nothing warns in one line, like an error, without a source line
    warnings.formatwarning = lambda message, *_, **__: f"plait {args.command}: warning: {message}\n"

    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # bad user input: say what and how to fix it, no traceback
        print(f"plait {args.command}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        # only a command that launched workers can raise their errors, and it has imported
        # the launcher; a command that did not (`plait schedule`) never imports it, or torch
        launch = sys.modules.get("plait.train.launch")
        if launch is None:
            raise
        if isinstance(err, launch.WorkerFailed):  # one line naming the rank and cause
            print(f"plait {args.command}: error: {err}", file=sys.stderr)
            return 1
        if isinstance(err, launch.Interrupted):
            print(f"plait {args.command}: {err}; workers stopped", file=sys.stderr)
            return 128 + int(err.signum)
        raise


if __name__ == "__main__":
    sys.exit(main())
