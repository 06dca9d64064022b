#!/usr/bin/env python3
"""Compile check without code generation: runs each translation unit of a configured build
(compile_commands.json, CMAKE_EXPORT_COMPILE_COMMANDS=ON) whose source lies under one of the
given directories with -fsyntax-only instead of -c. The compiler still parses everything and
instantiates every template the code uses, so type errors are found; it generates and optimises
no code, which is most of the time of compiling these template-heavy programs. Link errors are
not found.

Usage: scripts/syntax_check.py BUILD_DIR SOURCE_DIR...   (exit status 1 when a unit fails)
"""

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def syntax_only(command):
    """The compile command with -fsyntax-only in place of -c and without its output file."""
    args = shlex.split(command)
    out = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-o", "-MF", "-MT"):
            skip = True
        elif arg not in ("-c", "-MD"):
            out.append(arg)
    return out + ["-fsyntax-only"]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    build = sys.argv[1]
    dirs = [os.path.realpath(d) + os.sep for d in sys.argv[2:]]
    with open(os.path.join(build, "compile_commands.json")) as f:
        entries = json.load(f)
    units = [e for e in entries if any(os.path.realpath(e["file"]).startswith(d) for d in dirs)]
    if not units:
        sys.exit(f"syntax_check: no translation unit under {' '.join(sys.argv[2:])} in {build}")

    def check(entry):
        run = subprocess.run(syntax_only(entry["command"]), cwd=entry["directory"],
                             capture_output=True, text=True)
        return entry["file"], run.returncode, run.stderr

    failed = 0
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for file, code, errors in pool.map(check, units):
            print(f"syntax_check: {'ok    ' if code == 0 else 'FAILED'} {file}", flush=True)
            if code != 0:
                failed += 1
                sys.stderr.write(errors)
    print(f"syntax_check: {len(units) - failed} of {len(units)} units compile", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
