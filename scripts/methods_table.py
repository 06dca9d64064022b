#!/usr/bin/env python3
"""The README's table of attention methods, generated from the method registry.

Reads `randattn-cli methods --json` (every registered method with its summary, its options and
their defaults) and renders the Markdown table that README.md holds between the lines
`<!-- methods:begin -->` and `<!-- methods:end -->`.

    methods_table.py --cli build/tools/cli/randattn-cli --write README.md   # regenerate
    methods_table.py --cli build/tools/cli/randattn-cli --check README.md   # exit 1 if stale
"""

import argparse
import json
import subprocess
import sys

BEGIN, END = "<!-- methods:begin -->", "<!-- methods:end -->"


def default_text(option):
    value = option["default"]
    if value is None:
        return "`" + option["flag"] + "`"
    if isinstance(value, bool):
        # A setting that is on by default is listed by the flag that turns it off (--no-NAME).
        return "`" + option["flag"] + "`"
    return f"`{option['flag']} {value}`"


def render(methods):
    lines = ["| method | computes | options (CLI flag and default) | shared QK |",
             "|---|---|---|---|"]
    for name, entry in methods.items():
        options = ", ".join(default_text(o) for o in entry["options"].values()) or "none"
        shared = "yes (`--shared-qk`)" if entry["shared_qk"] else "no"
        summary = entry["summary"].replace("|", "\\|")  # a bar would end the cell
        lines.append(f"| `{name}` | {summary} | {options} | {shared} |")
    return "\n".join(lines)


def splice(text, table):
    try:
        head, rest = text.split(BEGIN + "\n", 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        sys.exit(f"the markers {BEGIN} and {END} were not found")
    return head + BEGIN + "\n" + table + "\n" + END + tail


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", required=True)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="README")
    mode.add_argument("--check", metavar="README")
    args = parser.parse_args()
    listing = subprocess.run([args.cli, "methods", "--json"], capture_output=True, text=True,
                             check=True).stdout
    table = render(json.loads(listing))
    path = args.write or args.check
    with open(path) as f:
        text = f.read()
    updated = splice(text, table)
    if args.write:
        with open(path, "w") as f:
            f.write(updated)
        return 0
    if updated != text:
        print(f"{path}: the methods table differs from the registry; regenerate it with "
              f"scripts/methods_table.py --write {path}")
        return 1
    print(f"{path}: the methods table matches the registry")
    return 0


if __name__ == "__main__":
    sys.exit(main())
