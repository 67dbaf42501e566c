"""INPUT behind an fsspec URL (`s3://bucket/day=*/part-*.parquet`, `gs://...`, `hf://datasets/...`, `file://...`,
`memory://...`): the filesystem and the files a URL names, for `reader.open_input`. fsspec and the backend's
package (s3fs, gcsfs, huggingface_hub...) are optional: without them the message names the package to install."""
from __future__ import annotations

from typing import Any, Callable

from cbatch.config import UserError


class RemoteInputError(UserError):
    """A URL INPUT that cannot be reached or read; the message names the URL and the fix."""


def is_url(given: str) -> bool:
    """A `protocol://...` INPUT (a local path, even one with a colon, is not)."""
    scheme, sep, _ = given.partition("://")
    return bool(sep) and scheme.replace("+", "").replace("-", "").isalnum()


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec.core
    except ImportError:
        raise RemoteInputError(f"{url}: an INPUT URL needs fsspec (and its backend, e.g. s3fs for s3://): "
                               "pip install 'cbatch[remote]'") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:  # fsspec names the backend's package ("Install s3fs to access S3")
        raise RemoteInputError(f"{url}: {exc}") from None
    except ValueError as exc:  # an unknown protocol
        raise RemoteInputError(f"{url}: {exc}") from None


def url_of(fs: Any, path: str) -> str:
    """The URL of a path of `fs` (as messages name it)."""
    return fs.unstrip_protocol(path)


def list_files(url: str, glob_chars: set[str], is_input_name: Callable[[str], bool]) -> tuple[Any, list[str]]:
    """(filesystem, its paths of INPUT's files, sorted): the file a URL names, a folder's input files (names not
    starting with `.` or `_`), or a glob's matches. Raises RemoteInputError naming the URL."""
    fs, path = _filesystem(url)
    try:
        if glob_chars & set(path):
            files = sorted(p for p, entry in fs.glob(path, detail=True).items() if entry.get("type") == "file")
            if not files:
                raise RemoteInputError(f"{url}: the pattern matches no file")
        elif fs.isdir(path):
            names = fs.ls(path, detail=True)
            files = sorted(e["name"] for e in names if e.get("type") == "file")
            files = [f for f in files if not f.rsplit("/", 1)[-1].startswith((".", "_"))
                     and is_input_name(f.rsplit("/", 1)[-1])]
            if not files:
                raise RemoteInputError(f"{url}: the folder has no .jsonl or .parquet file")
        else:
            files = [path]
    except RemoteInputError:
        raise
    except Exception as exc:  # credentials, network, permissions: the backend's own words
        raise RemoteInputError(f"{url}: cannot list the input ({type(exc).__name__}: {exc})") from None
    return fs, files


def check_readable(fs: Any, path: str) -> None:
    url = url_of(fs, path)
    try:
        kind = fs.info(path).get("type")  # one request (exists and isfile would make two)
    except FileNotFoundError:
        raise RemoteInputError(f"{url}: no such input file") from None
    except Exception as exc:
        raise RemoteInputError(f"{url}: cannot reach the input ({type(exc).__name__}: {exc})") from None
    if kind != "file":
        raise RemoteInputError(f"{url}: the input is not a file")
