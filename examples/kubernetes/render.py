"""Fill a Kubernetes template (pytorchjob.yaml) from environment variables.

`${NAME}` takes the variable NAME (an error names it and the template line when unset),
`${NAME:-default}` falls back to the default, `$${` writes a literal `${` (shell in the
container), and a bare `$NAME` is left alone for the container's shell. WORKER_REPLICAS
defaults to NNODES - 1.

    IMAGE=registry/megatron-dpp:latest NNODES=4 python examples/kubernetes/render.py > job.yaml
    kubectl apply -f job.yaml

--check also parses the result with PyYAML (the dry run of the tests and of CI).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

PLACEHOLDER = re.compile(r"\$(\$)?\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
DEFAULT_TEMPLATE = Path(__file__).with_name("pytorchjob.yaml")


class TemplateError(ValueError):
    """A placeholder without a value; the message names the variable and the line."""


def derived_values(env) -> dict[str, str]:
    values = dict(env)
    if "WORKER_REPLICAS" not in values:
        nnodes = values.get("NNODES", "2")
        if not nnodes.isdigit() or int(nnodes) < 1:
            raise TemplateError(f"NNODES={nnodes!r} is not a positive whole number")
        values["WORKER_REPLICAS"] = str(int(nnodes) - 1)
    return values


def render(text: str, env, source: str = "template") -> str:
    values = derived_values(env)
    lines = []
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        def fill(match, number=number):
            escaped, name, default = match.groups()
            if escaped:
                return match.group(0)[1:]
            if name in values and values[name] != "":
                return values[name]
            if default is not None:
                return default
            raise TemplateError(f"{source}:{number}: ${{{name}}} has no default; set {name}")

        lines.append(PLACEHOLDER.sub(fill, line))
    return "".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("template", nargs="?", default=str(DEFAULT_TEMPLATE))
    parser.add_argument("--check", action="store_true", help="parse the result as YAML")
    args = parser.parse_args(argv)
    try:
        text = render(Path(args.template).read_text(), os.environ, args.template)
    except TemplateError as error:
        parser.exit(2, f"render.py: error: {error}\n")
    if args.check:
        import yaml

        list(yaml.safe_load_all(text))
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
