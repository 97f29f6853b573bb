"""The ``specimg`` command: its commands, and how any error ends (one line, exit status 2)."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import warnings
from typing import Any, NoReturn

import click

from specimg.cli.bench import bench
from specimg.cli.generate import generate
from specimg.cli.methods import methods
from specimg.cli.train import make_drafter_data_command, train_demo, train_drafter_command
from specimg.cli.tune import tune
from specimg.errors import SpecimgError
from specimg.plugins import get_plugin_manager
from specimg.relax import BudgetError
from specimg.runs.folder import unmade_on_failure

_NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())
"""What click (8.2 and later) raises for a bare ``specimg``: the help, not a one-line error."""
_OUT_OF_MEMORY = "out of memory; lower --batch-size (or -n, --num-samples) and run the same command again: it resumes"


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors end with one line on stderr and exit status 2, and so does
    a method that breaks its budget, naming the package to blame; warnings take one line."""
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        try:
            with unmade_on_failure():
                cli.main(args=argv, prog_name="specimg", standalone_mode=False)
        except BudgetError as err:
            provider = get_plugin_manager().provider(err.method)
            origin = f"plugin {provider.name!r} ({provider.source})" if provider else "its plugin"
            _fail(f"{err}, a bug in {origin}: leave {err.method} out of --method and report it to its authors")
        except SpecimgError as err:
            _fail(str(err))
        except _NO_ARGS as err:
            err.show()
            sys.exit(2)
        except click.ClickException as err:
            hint = f" (see '{err.ctx.command_path} --help')" if isinstance(err, click.UsageError) and err.ctx else ""
            _fail(f"{err.format_message()}{hint}")
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                # standard output to /dev/null, so that the interpreter's last flush of what a full
                # disk refused does not add a traceback to the one error line
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                where = f"{err.filename}: " if err.filename else "writing the output: "
                _fail(f"{where}{err.strerror}; free space and run the same command again: it resumes")
            if not err.filename:
                raise
            # a path in the way (a file where a folder goes, a folder where a file goes, no permission):
            # every output is written whole or not at all, so the run resumes once the path is cleared
            path = err.filename2 or err.filename  # a rename's destination, not its temporary source
            _fail(f"{path}: {err.strerror}; clear the way and run the same command again: it resumes")
        except (click.Abort, KeyboardInterrupt):
            click.echo("specimg: interrupted; the same command resumes where it stopped", err=True)
            sys.exit(130)
        except MemoryError:
            _fail(_OUT_OF_MEMORY)
        except RuntimeError as err:  # torch's: an OutOfMemoryError on a GPU, a plain RuntimeError from the CPU allocator
            if type(err).__name__ != "OutOfMemoryError" and "can't allocate memory" not in str(err):
                raise
            _fail(_OUT_OF_MEMORY)


def _fail(message: str) -> NoReturn:
    click.echo(f"specimg: error: {message}", err=True)
    sys.exit(2)


def _one_line_warning(message: Warning | str, *args: Any, **kwargs: Any) -> None:
    click.echo(f"specimg: warning: {message}", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specimg")
def cli() -> None:
    """Speculative decoding with relaxed acceptance for autoregressive image models."""


@cli.command()
def plugins() -> None:
    """List installed plugins, where they come from and the methods they register; a
    faulty plugin is listed with its error (and left out everywhere else)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each fault is in the listing
        pm = get_plugin_manager()
    rows = [("plugin", "package", "methods", "module", "status")] + [
        (p.name, p.source, " ".join(p.methods) or "-", p.target, f"FAILED: {p.error}" if p.error else "ok") for p in pm.plugins
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4])


@cli.command()
def models() -> None:
    """List the built-in models, the supported model families and presets, and how to point at each."""
    from specimg.models.demo import bundle_exists
    from specimg.models.families import catalogue

    for line in catalogue(demo_installed=bundle_exists()):
        click.echo(line)


for command in (methods, generate, bench, tune, train_demo, make_drafter_data_command, train_drafter_command):
    cli.add_command(command)
