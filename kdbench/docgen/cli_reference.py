"""The ``cli`` block (docs/cli.md): every command's usage and flags, from the parser itself."""

from __future__ import annotations

import argparse

from kdbench.docgen.markdown import NONE, WIDTH, code, first_paragraph, prose, table, yaml_value


def cli_parser() -> argparse.ArgumentParser:
    """kdbench's parser, from the function :mod:`kdbench.cli` builds it with."""
    from kdbench import cli

    return cli.build_parser()


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog=parser.prog, width=WIDTH)


def _usage(parser: argparse.ArgumentParser) -> str:
    f = _formatter(parser)
    f.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return f.format_help().strip()


def subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _argument_row(parser: argparse.ArgumentParser, action: argparse.Action) -> tuple[str, str, str, str]:
    takes_value = action.nargs != 0
    many = {"+": "one or more", "*": "any number", "?": "optional"}.get(action.nargs, "")
    if action.option_strings:
        name = ", ".join(code(o) for o in action.option_strings)
    else:
        name = code(action.metavar or action.dest)
    if not takes_value:
        value = "flag"
    elif action.choices is not None:
        value = code(" | ".join(str(c) for c in action.choices))
    elif action.option_strings:
        value = code(action.metavar or action.dest.upper())
    else:
        value = ""
    value = ", ".join(v for v in (value, many) if v) or NONE
    if action.required or (not action.option_strings and action.nargs not in ("?", "*")):
        default = "required"
    elif not takes_value:
        default = "off"
    elif action.default is None or action.default is argparse.SUPPRESS:
        default = NONE
    else:
        default = code(yaml_value(action.default))
    help_text = _formatter(parser)._expand_help(action) if action.help else ""
    return name, value, default, help_text


def cli_reference() -> str:
    """Every subcommand of ``kdbench``: heading, help line, usage, arguments; then the examples epilog."""
    parser = cli_parser()
    sub = subparsers(parser)
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    out = [prose(first_paragraph(parser.description)), "", "```text", _usage(parser), "```"]
    for name, sp in sub.choices.items():
        out += ["", f"### kdbench {name}", ""]
        if helps.get(name):
            out += [prose(helps[name][:1].upper() + helps[name][1:]) + ".", ""]
        if sp.description and sp.description != helps.get(name):
            out += [prose(" ".join(sp.description.split())), ""]
        out += ["```text", _usage(sp), "```", ""]
        rows = [_argument_row(sp, a) for a in sp._actions if not isinstance(a, argparse._HelpAction)]
        out += table(["argument", "value", "default", "meaning"], rows) if rows else ["No arguments."]
    if parser.epilog:
        out += ["", "### Examples", "", "```text", parser.epilog.strip("\n"), "```"]
    return "\n".join(out)
