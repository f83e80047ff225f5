#!/usr/bin/env python3
"""Write ``.env`` for docker-compose.yml: every variable of deploy/env.example, freshly random.

    python3 deploy/make_env.py              # writes .env beside docker-compose.yml
    python3 deploy/make_env.py --out PATH   # elsewhere

Tokens are 32 random bytes (URL-safe base64); each ``*_SHA256`` variable holds
the SHA-256 hex digest of the token it is named after, the form kvtier serve's
tenants take. An existing file is never overwritten (rotate by hand: edit
it, then ``docker compose up -d``). The file is created with mode 0600.
Standard library only: the host needs no kvtier install.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import sys
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
EXAMPLE = DEPLOY / "env.example"
DEFAULT_OUT = DEPLOY.parent / ".env"
_ASSIGNMENT = re.compile(r"^([A-Z][A-Z0-9_]*)=\s*$")


def variables(example: Path = EXAMPLE) -> list[str]:
    """The variable names of ``example``, in order (lines ``NAME=`` with no value)."""
    names = []
    for line in example.read_text().splitlines():
        m = _ASSIGNMENT.match(line)
        if m:
            names.append(m.group(1))
    return names


def generate(names: list[str]) -> dict[str, str]:
    """A fresh value for each name; ``X_SHA256`` is the SHA-256 hex of ``X``'s value."""
    values: dict[str, str] = {}
    for name in names:
        if not name.endswith("_SHA256"):
            values[name] = secrets.token_urlsafe(32)
    for name in names:
        if name.endswith("_SHA256"):
            token = values.get(name.removesuffix("_SHA256"))
            if token is None:
                raise ValueError(f"{name} names no token variable {name.removesuffix('_SHA256')}")
            values[name] = hashlib.sha256(token.encode()).hexdigest()
    return {name: values[name] for name in names}  # in the example's order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    values = generate(variables())
    text = "".join(f"{k}={v}\n" for k, v in values.items())
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        print(
            f"{args.out} exists; not overwritten (remove it first to start afresh)", file=sys.stderr
        )
        return 1
    with os.fdopen(fd, "w") as f:
        f.write(text)
    print(f"wrote {args.out} (mode 0600): {', '.join(values)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
