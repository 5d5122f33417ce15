"""The ``disttrain`` console script: one entry point, one small function per subcommand.

Subcommands import their heavy dependencies (kopf, kubernetes, rich) lazily, so ``disttrain crd`` and
``disttrain validate`` work with the base install.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from disttrain.api import crd, validation


def cmd_crd(args: argparse.Namespace) -> int:
    """Print the CustomResourceDefinition rendered from the models."""
    sys.stdout.write(crd.render_crd())
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Check manifests with the CRD's rules plus the plan rules; print every problem with its field path."""
    failed = 0
    for name in args.files:
        try:
            documents = list(validation.load_documents(pathlib.Path(name)))
        except validation.ManifestError as error:
            print(error, file=sys.stderr)
            failed += 1
            continue
        for source, obj in documents:
            problems = validation.validate_object(obj)
            errors = [p for p in problems if p.severity is validation.Severity.ERROR]
            for problem in problems:
                print(f"{source}: {problem}", file=sys.stderr if problem in errors else sys.stdout)
            if errors:
                failed += 1
            else:
                print(f"{source}: valid")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disttrain", description="Elastic distributed PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p_crd = sub.add_parser("crd", help="print the DistTrainJob CustomResourceDefinition (YAML)")
    p_crd.set_defaults(func=cmd_crd)

    p_validate = sub.add_parser("validate", help="validate DistTrainJob manifests; exit 1 on any error")
    p_validate.add_argument("files", nargs="+", metavar="FILE")
    p_validate.set_defaults(func=cmd_validate)

    from disttrain.operator.local import cli as local_cli  # light: argparse wiring only

    local_cli.add_parser(sub)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
