"""Read other tools' dumps as accucheck captures. Imports errors (and, per importer, store);
never torch or the other tool at import time.

- `accucheck.importers.msprobe`: MindStudio Probe (msprobe) PyTorch dumps: `import_msprobe`.
- `capture_path(path)`: what `accucheck diff` calls on REF / CAND: a capture file is returned
  as it is; an msprobe dump directory is imported into a temporary capture first.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from accucheck.errors import UserError


def capture_path(path: str | os.PathLike, *, progress: Callable[[str], None] | None = None,
                 on_close: Callable[[Callable[[], None]], object] | None = None) -> str:
    """`path` itself unless it is a directory; a directory must be an msprobe dump (a
    dump.json under it) and is imported into a temporary capture, whose path is returned.
    The temporary file is removed by the callback registered with `on_close` (e.g. click's
    `ctx.call_on_close`), else at interpreter exit. Raises UserError for a directory that is
    not an msprobe dump, or a malformed one."""
    p = Path(path)
    if not p.is_dir():
        return str(path)
    from accucheck.importers.msprobe import find_dumps, import_msprobe

    find_dumps(p)  # UserError when it is no msprobe dump: before making a temporary folder
    tmp = Path(tempfile.mkdtemp(prefix="accucheck-msprobe-"))

    def cleanup() -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    if on_close is not None:
        on_close(cleanup)
    else:
        atexit.register(cleanup)
    try:
        out = import_msprobe(p, tmp / f"{p.resolve().name or 'dump'}.h5", progress=progress)
    except BaseException:
        cleanup()
        raise
    if progress:
        progress(f"msprobe dump {p} -> temporary capture ({out.records} records, "
                 f"store {out.store}); `accucheck import msprobe {p} -o FILE.h5` keeps one")
    return str(out.path)

