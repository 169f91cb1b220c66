"""The capture format's constants and small types (accucheck.store's docstring describes the
layout): statistics rows, index rows, content hashes, the bfloat16 encoding, the meta header."""
from __future__ import annotations

import datetime as _dt
import errno
import re
from dataclasses import dataclass, field
from typing import Sequence

import h5py
import numpy as np

from accucheck.errors import UserError
from accucheck.keys import RecordKey, layer_of




FORMAT = "accucheck"
SCHEMA_VERSION = 1
SCHEMA_MINOR = 2  # 1: /index/hash; 2: /index/sketch; a reader reads every minor of its version
STAT_FIELDS = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "zero", "numel")
KINDS = ("module", "op", "logits")
_KIND_SET = frozenset(KINDS)
STORE_MODES = ("stats", "full")
_STR = h5py.string_dtype("utf-8")
_INDEX_COLUMNS = {
    "key": _STR, "kind": _STR, "dtype": _STR, "shape": _STR, "data": _STR,
    "checksum": np.int64,
}
_OPTIONAL_COLUMNS = {"extra": _STR, "hash": np.int64}  # absent in older schema-1 files
SAMPLE_SIZE = 64  # values per record in the optional /index/sample column
_NATIVE = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
           "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "int32": np.int32,
           "int64": np.int64, "bool": np.bool_}
_INDEX_CHUNK = 256  # rows per HDF5 chunk of the index: small files stay small, big ones fast
REGENERATE_HINT = "re-run `accucheck capture` with this accucheck version to regenerate it"


@dataclass(frozen=True)
class Stats:
    min: float
    max: float
    mean: float
    std: float
    absmax: float
    l2: float
    nan: int
    inf: int
    zero: int
    numel: int

    @classmethod
    def from_row(cls, row: Sequence[float]) -> "Stats":
        v = [float(x) for x in row]
        return cls(v[0], v[1], v[2], v[3], v[4], v[5], int(v[6]), int(v[7]), int(v[8]), int(v[9]))

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in STAT_FIELDS}


@dataclass(frozen=True)
class IndexRow:
    key: RecordKey
    order: int
    kind: str
    dtype: str
    shape: tuple[int, ...]
    stats: Stats
    checksum: int
    data: str  # dataset name under /tensors, "" when only statistics were stored
    extra: str = ""  # JSON object with per-record details (input links, op call site / args) or ""
    sample: np.ndarray | None = field(default=None, compare=False, repr=False)
    # SAMPLE_SIZE values at fixed positions (see /index/sample); None when not captured
    sketch: np.ndarray | None = field(default=None, compare=False, repr=False)
    # the sketch row (accucheck.store.sketch, /index/sketch); None when not captured
    hash: int = field(default=0, compare=False)
    # content hash of the stored tensor (see /index/hash); 0: none (statistics only, old file)

    @property
    def has_data(self) -> bool:
        return bool(self.data)


@dataclass(frozen=True)
class RequestTokens:
    prompt_ids: np.ndarray
    generated_ids: np.ndarray
    prompt: str | None


def sample_positions(numel: int, size: int = SAMPLE_SIZE) -> np.ndarray:
    """The flat positions of a record's /index/sample values (see the format above): every
    element when the tensor has fewer than `size` (the rest is NaN padding)."""
    if numel < size:
        return np.arange(size)
    return np.arange(size) * (numel - 1) // (size - 1)


def content_hash(arr: np.ndarray) -> int:
    """/index/hash of a stored tensor: the first 8 bytes of the SHA-256 of its C-order bytes,
    as a signed int64, never 0 (0 means "no hash"). SHA-256, not blake2b: OpenSSL's runs on
    the CPUs' SHA extensions (~1.7 GB/s per core here against ~0.5-1 for blake2b), and this
    runs on every stored tensor of a capture."""
    import hashlib

    a = np.ascontiguousarray(arr)
    h = hashlib.sha256(memoryview(a).cast("B") if a.ndim and a.size else a.tobytes())
    return int.from_bytes(h.digest()[:8], "little", signed=True) or 1


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact float32 values of bfloat16 numbers stored as their uint16 bit patterns."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_ERRNO_IN_MESSAGE = re.compile(r"errno = (\d+)")


def _disk_full(e: BaseException) -> bool:
    """True for a write that failed because the disk (or `ulimit -f`, or a quota) is full; HDF5
    reports the errno of the failed write(2) inside its message."""
    if isinstance(e, OSError) and e.errno in _DISK_FULL:
        return True
    m = _ERRNO_IN_MESSAGE.search(str(e))
    return bool(m) and int(m.group(1)) in _DISK_FULL


def meta_header(runner: str) -> dict:
    """The first keys of every capture's meta, whoever writes it (the HF and vLLM runners, the
    msprobe importer): the tool and its version, when (UTC, seconds) and which runner."""
    import accucheck

    return {"tool": "accucheck", "tool_version": accucheck.__version__,
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "runner": runner}


def _split_axis(shape: tuple[int, ...], max_elems: int) -> tuple[int, int]:
    """(k, step): blocks of at most `max_elems` elements in C order are `step` indices of axis k
    with every later axis whole, one block per index of the axes before k."""
    k = 0
    while k < len(shape) - 1 and int(np.prod(shape[k + 1:])) > max_elems:
        k += 1
    inner = int(np.prod(shape[k + 1:])) if k + 1 < len(shape) else 1
    return k, max(1, min(shape[k], max_elems // max(inner, 1)))


def _as_str(v) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def parse_ranges(text: str) -> list[tuple[int, int]] | None:
    """"0-3,28,29" -> [(0, 3), (28, 28), (29, 29)] (inclusive; capture --layers, --requests);
    None when `text` is not such a list."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            return None
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            return None
        out.append((lo, hi))
    return out


def parse_positions(text: str) -> int | None:
    """--positions: "all" -> None (every position), "last:N" -> N (N >= 1), "decode" -> 0
    (no prefill position). UserError.usage for anything else."""
    if text == "all":
        return None
    if text == "decode":
        return 0
    m = re.fullmatch(r"last:(\d+)", text)
    if not m or int(m.group(1)) < 1:
        raise UserError.usage(f"--positions {text!r}: use all, decode or last:N (N >= 1)")
    return int(m.group(1))


LOGITS_TOPK_MAX = 4096
LOGITS_IDS_SLOT = "1"  # a top-k logits record's token ids: `logits#0:out.1` beside `out.0`


def parse_logits(text: str) -> int | None:
    """--logits: "full" -> None (every vocabulary entry, raw logits), "topk:K" -> K (the K
    largest log-probabilities per position and the following token's, with their token ids).
    UserError.usage for anything else."""
    if text == "full":
        return None
    m = re.fullmatch(r"topk:(\d+)", text)
    if not m or not 1 <= int(m.group(1)) <= LOGITS_TOPK_MAX:
        raise UserError.usage(f"--logits {text!r}: use full or topk:K (1 <= K <= "
                              f"{LOGITS_TOPK_MAX})")
    return int(m.group(1))


def logits_topk(meta: dict) -> int | None:
    """K when a capture holds its logits as top-k log-probabilities (capture --logits topk:K,
    meta "options"."logits"): `logits` slot "0" [.., positions, K + 1] float32, column 0 the
    log-probability of the token that follows the position (the next prompt token; the token
    the step takes), columns 1..K the K largest in descending order; slot "1" their token ids
    (int64; -1 and NaN where no token follows). None: full raw logits."""
    o = meta.get("options") if isinstance(meta.get("options"), dict) else {}
    text = o.get("logits")
    if not isinstance(text, str) or text == "full":
        return None
    m = re.fullmatch(r"topk:(\d+)", text)
    return int(m.group(1)) if m else None


def parse_layers(text: str) -> list[tuple[int, int]]:
    """--layers "0-3,28,29" -> [(0, 3), (28, 28), (29, 29)] (inclusive). UserError.usage for
    anything else."""
    out = parse_ranges(text)
    if out is None:
        raise UserError.usage(f"--layers {text!r}: use layer numbers and ranges, e.g. "
                              f"0-3,28,29")
    return out


def parse_requests(text: str) -> tuple[int, ...]:
    """--requests "0,2-3" -> (0, 2, 3). UserError.usage for anything else."""
    ranges = parse_ranges(text)
    if ranges is None:
        raise UserError.usage(f"--requests {text!r}: use request numbers and ranges, e.g. "
                              f"0,2-3")
    if sum(hi - lo + 1 for lo, hi in ranges) > 1_000_000:
        raise UserError.usage(f"--requests {text!r}: more than a million requests")
    return tuple(sorted({r for lo, hi in ranges for r in range(lo, hi + 1)}))


@dataclass(frozen=True)
class Selection:
    """What a capture chose to record of its run (capture --positions / --requests /
    --layers, kept in meta "options"): "all" / "last:N" / "decode" prefill positions, the
    request numbers recorded (empty: every one), the decoder-layer ranges ("0-3,28"; None:
    every layer). A capture written before these options existed records everything."""
    positions: str = "all"
    requests: tuple[int, ...] = ()
    layers: str | None = None

    @classmethod
    def of(cls, meta: dict) -> "Selection":
        o = meta.get("options") if isinstance(meta.get("options"), dict) else {}
        pos = o.get("positions")
        req = o.get("requests")
        lay = o.get("layers")
        return cls(pos if isinstance(pos, str) else "all",
                   tuple(int(r) for r in req) if isinstance(req, list) else (),
                   lay if isinstance(lay, str) else None)

    @property
    def partial(self) -> bool:
        return self != Selection()

    def recorded(self, key: RecordKey) -> bool:
        """Whether this selection records `key`'s request, step and layer at all."""
        if self.positions == "decode" and key.step == 0:
            return False
        if self.requests and key.req not in self.requests:
            return False
        if self.layers and (k := layer_of(key.module)) is not None:
            return any(lo <= k <= hi for lo, hi in parse_ranges(self.layers) or [])
        return True

    def describe(self) -> str:
        """"prefill positions last:4, requests 0,2, layers 0-3" ("everything" when whole)."""
        parts = []
        if self.positions == "decode":
            parts.append("decode steps only")
        elif self.positions != "all":
            parts.append(f"prefill positions {self.positions}")
        if self.requests:
            parts.append("requests " + ",".join(str(r) for r in self.requests))
        if self.layers:
            parts.append(f"layers {self.layers}")
        return ", ".join(parts) or "everything"
