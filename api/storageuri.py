"""``spec.checkpoint.uri``: the syntax of a checkpoint location in an object store, one definition for the CRD's
CEL rule, ``disttrain validate`` and the trainer.

Only ``s3://BUCKET[/PREFIX]`` is accepted: AWS S3, or an S3-compatible store through ``checkpoint.s3.endpoint``.
The bucket follows S3's naming rules (3-63 lower-case letters, digits, ``.`` and ``-``, starting and ending with a
letter or digit); the prefix has no empty, ``.`` or ``..`` segment. The pattern avoids backslashes and quotes, so
it reads the same in Python's ``re``, in RE2 and inside a CEL string literal.
"""

from __future__ import annotations

import re
from typing import Final

_SEGMENT: Final = "([^/.][^/]*|[.][^/.][^/]*|[.][.][^/]+)"
S3_URI_PATTERN: Final = rf"^s3://[a-z0-9][a-z0-9.-]{{1,61}}[a-z0-9](/{_SEGMENT}(/{_SEGMENT})*)?/?$"
MAX_URI_LENGTH: Final = 1024
SCHEMES: Final = ("s3",)

_BUCKET = re.compile(r"^s3://(?P<bucket>[^/]*)(?:/(?P<prefix>.*))?$")


def uri_problem(uri: str) -> str:
    """Why ``uri`` is not a checkpoint location ("" when it is one)."""
    if re.match(S3_URI_PATTERN, uri):
        return ""
    scheme, sep, _ = uri.partition("://")
    if sep and scheme not in SCHEMES:
        return (
            f"{uri!r}: the scheme {scheme}:// is not supported; only s3://BUCKET/PREFIX (AWS S3, or an "
            "S3-compatible store through checkpoint.s3.endpoint)"
        )
    m = _BUCKET.match(uri)
    if m is None:
        return f"{uri!r} is not an s3://BUCKET/PREFIX URI"
    if not re.match(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", m.group("bucket")):
        return (
            f"{uri!r}: the bucket {m.group('bucket')!r} is not an S3 bucket name (3-63 lower-case letters, digits, "
            "'.', '-', starting and ending with a letter or digit)"
        )
    return f"{uri!r}: the prefix has an empty, '.' or '..' segment"
