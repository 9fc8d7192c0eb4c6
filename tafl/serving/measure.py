"""`python -m tafl.serving.measure REF ...`: each package's cost on this machine (tafl.serving.tuning.measure), as a
JSON list on stdout. The process that chooses the service's plan runs this as a child, so that ONNX Runtime never
loads into it. A package that does not load is left out, with its reason on stderr: the service's own load says
what is wrong with it."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from tafl.packaging.signing import trusted_keys_from_env
from tafl.serving.runtime import resolve_package
from tafl.serving.tuning import measure


def main(refs: list[str]) -> int:
    keys = trusted_keys_from_env()
    out = []
    for ref in refs:
        try:
            out.append(asdict(measure(resolve_package(ref, keys))))
        except Exception as exc:  # noqa: BLE001 - reported by the service's own load
            print(f"{ref}: {exc}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
