"""Output paths: what every command checks before it creates or touches an output, and how an
existing output is replaced. Imports accucheck.errors only.

The rule, for every command: every input and option is checked before any output is created or
touched; an output that replaces an existing file is written beside it (a temporary name in the
same folder) and renamed into place only on success; an input is never an output (exit 2);
nothing is deleted that this run did not write.
"""
from __future__ import annotations

import glob
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

from accucheck.errors import UserError, one_line


def check_output_file(path: str | os.PathLike, force: bool) -> Path:
    """The checks every writer of a file makes before touching anything (UserError, exit 3)."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p} is a directory: give a file name for -o")
    if (p.exists() or p.is_symlink()) and not force:
        raise UserError(f"{p} exists: choose another -o or pass --force to overwrite it")
    parent = p.parent
    if not parent.exists():
        raise UserError(f"output folder {parent} does not exist: create it first")
    if not parent.is_dir():
        raise UserError(f"output folder {parent} is a file, not a folder: choose another -o")
    if not os.access(parent, os.W_OK):
        raise UserError(f"output folder {parent} is not writable: choose another -o")
    return p


def free_bytes(path: str | os.PathLike, size: int = 0) -> int | None:
    """Bytes that can still be written into a file of `size` bytes at `path`: free space of its
    file system and the `ulimit -f` limit (RLIMIT_FSIZE). None when neither can be asked."""
    free = None
    try:
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
    except (OSError, AttributeError):
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY:
            room = max(0, soft - size)
            free = room if free is None else min(free, room)
    except (ImportError, OSError, ValueError):
        pass
    return free


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: the same inode when both exist, else the same resolved
    path."""
    pa, pb = Path(a), Path(b)
    try:
        if pa.exists() and pb.exists():
            return os.path.samefile(pa, pb)
    except OSError:
        pass
    return pa.resolve() == pb.resolve()


def inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether `path` is `folder` or lies under it (resolved paths)."""
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents


def check_not_input(out: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None],
                    what: str = "-o") -> None:
    """Usage error (exit 2) when `out` is one of `inputs` ({flag: path}, None skipped)."""
    for flag, path in inputs.items():
        if path and same_file(out, path):
            raise UserError.usage(f"{what} {out} is also {flag} {path}: an input is never an "
                                  f"output; write to another file")


def check_output_dir(d: str | os.PathLike) -> Path:
    """A directory that exists or can be created: no file in its place or above it."""
    d = Path(d)
    if d.exists() and not d.is_dir():
        raise UserError(f"{d} is a file, not a directory: choose another directory")
    for parent in d.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{parent} is a file, not a directory: choose another "
                                f"directory than {d}")
            if not os.access(parent, os.W_OK):
                raise UserError(f"{parent} is not writable: choose another directory than {d}")
            break
    return d


def temp_beside(path: str | os.PathLike) -> Path:
    """A new empty file in `path`'s folder (".NAME.*.partial") to write a replacement of `path`
    into, with the permissions `path` has (or the umask's default for a new file)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(fd)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(tmp, mode)
    return Path(tmp)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `data` beside `path` and rename it into place: an existing file is replaced whole
    or not at all (UserError, exit 3, on a write error; `path` is then unchanged)."""
    path = Path(path)
    tmp = temp_beside(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {one_line(e, 160)}; {path} is unchanged") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def outputs_overlap(outputs: Iterable[str | os.PathLike],
                    inputs: Mapping[str, str | os.PathLike | None], what: str) -> None:
    """Usage error (exit 2) when an input is one of `outputs` or lies inside one (a folder that
    this run replaces)."""
    outs = list(outputs)
    for flag, path in inputs.items():
        if not path:
            continue
        for o in outs:
            if same_file(path, o) or inside(path, o):
                raise UserError.usage(f"{flag} {path} is also an output of {what} ({o}): an "
                                      f"input is never an output; move it out of the way or "
                                      f"choose another output")


SPILL_MANIFEST = "capture.json"


def spill_dirs(capture: str | os.PathLike) -> list[Path]:
    """The spill directories a killed vLLM capture of `capture` left beside it
    (`.NAME.ranks-*` holding SPILL_MANIFEST: capture.runners.vllm_salvage), sorted."""
    p = Path(capture)
    return sorted(d for d in p.parent.glob(f".{glob.escape(p.name)}.ranks-*")
                  if (d / SPILL_MANIFEST).is_file())
