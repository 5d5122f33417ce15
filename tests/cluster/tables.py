"""kubectl's tables, read by column: a CRD column with no value prints as blank cells (not ``<none>``), and
names such as LAST REFORM hold a space, so splitting a row on whitespace misreads it."""

from __future__ import annotations

import re


def kubectl_table(text: str) -> list[dict[str, str]]:
    """The rows of one ``kubectl get`` table as {COLUMN: cell}, cut at the header's column starts (kubectl aligns
    every row of one table to them; a ``--watch`` stream re-aligns each row, so read it otherwise)."""
    header, *rows = text.splitlines()
    starts = [m.start() for m in re.finditer(r"(?<!\S)\S+(?: \S+)*", header)]
    ends = [*starts[1:], None]
    names = [header[a:b].strip() for a, b in zip(starts, ends, strict=True)]
    return [
        {name: row[a:b].strip() for name, a, b in zip(names, starts, ends, strict=True)} for row in rows if row.strip()
    ]
