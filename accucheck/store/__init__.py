"""HDF5 capture files: the only package that imports h5py (format: the constants and small
types; writer: CaptureWriter; reader: CaptureReader / open_capture; everything is imported from
here). Imports accucheck.errors, keys, paths.

One capture = one HDF5 file, schema version 1. Everything below can be read with h5py alone:

    /                       attrs: format = "accucheck", schema_version = 1 (int),
                                   schema_minor = 2 (int; absent = 0: written before
                                   /index/hash; readers accept every minor of their version),
                                   complete = True only after a clean close
    /meta                   scalar UTF-8 string: JSON object (tool version, time, device,
                            environment fingerprint, seed, dtype, mode, runner, store mode,
                            model id / path / config hash / weight hash, capture options)
    /index/key              [n] UTF-8 strings: record keys (see accucheck.keys), one row per record
    /index/kind             [n] strings: "module" | "op" | "logits"
    /index/dtype            [n] strings: torch dtype name of the captured tensor ("bfloat16", ...)
    /index/shape            [n] strings: JSON list of ints
    /index/stats            [n, 10] float64: min, max, mean, std, absmax, l2, nan, inf, zero, numel
                            (min / max / mean / std over the finite elements; computed in float32
                            for 16-bit inputs, float64 otherwise)
    /index/checksum         [n] int64: sum of the raw bit patterns (as integers) mod 2**52
                            (permutation-invariant: equal checksums do NOT prove equal tensors)
    /index/data             [n] strings: dataset name under /tensors, "" in stats mode; rows
                            holding the same tensor name the same dataset (a weight recorded
                            as an op input at every call is stored once, as is one tensor
                            recorded by two modules: o_proj's output is self_attn's)
    /index/extra            [n] strings (OPTIONAL: files written before it existed lack it; a
                            reader treats it as all ""): "" or a JSON object with per-record
                            details, on the first output record of a module / op call:
                            "src" (eager captures; absent when empty): {"<in slot>": "<site>"}
                            for each floating-point input that IS an earlier recorded tensor of
                            the same request and step, the site being its key without
                            "r{req}.s{step}:" ({"hidden_states":
                            "model.layers.0.input_layernorm#0:out.0"}); an input neither linked
                            nor a weight has its own "in" record
                            (accucheck.capture.record.recorder).
                            Op records (kind "op") also carry
                            {"site": "transformers/.../modeling_llama.py:154 in forward",
                             "args": [...], "kwargs": {...}} where "args"/"kwargs" describe the
                            op call with tensors as {"t": "<in slot>"}
                            (see accucheck.capture.record.ops)
    /index/hash             [n] int64 (OPTIONAL, schema_minor >= 1; files without it read as
                            all 0): a content hash of the stored tensor: the first 8 bytes of
                            the SHA-256 of its C-order bytes in the stored representation
                            (bfloat16 as its uint16 bit patterns), as a signed little-endian
                            int64, never 0; 0 when no tensor is stored. Position-sensitive:
                            two records with the same non-zero hash, dtype and shape hold the
                            same tensor (up to a 2**-64 collision), so a diff need not read
                            them (compare.parallel.unread_pair)
    /index/sample           [n, 64] float64 (OPTIONAL, like extra): a fixed sample of the
                            tensor's values at flat (C-order) positions
                            (j * (numel - 1)) // 63 for j = 0..63 (every element, NaN-padded,
                            when numel < 64): the same positions on every device for the same
                            shape, so two stats-mode captures can estimate rel_l2 from it
    /index/sketch           [n, 129] float64 (OPTIONAL, schema_minor >= 2; NaN rows: none): the
                            exponent e of c = 2**e ~ 0.1 x the tensor's RMS, then a 128-bucket
                            count sketch of sign(x) log1p(|x| / c) (accucheck.store.sketch: the
                            positions, the signs, the reference definition), so two stats-mode
                            captures measure the RMS elementwise relative error of a record
    /tensors/<8 digits>     the tensor in its original dtype and shape (contiguous; chunked
                            with --compression gzip / lzf). bfloat16 is stored bit-exact as uint16 with attribute
                            dtype = "bfloat16": `(u16.astype(uint32) << 16).view(float32)`
                            gives the exact values.
    top-k logits            (capture --logits topk:K, meta options.logits "topk:K"; store.
                            logits_topk): the `logits` record's slot "0" holds [.., positions,
                            K + 1] float32 log-probabilities (column 0: the token that follows
                            the position; then the K largest, descending) and slot "1" their
                            int64 token ids (-1 / NaN where none follows); both keep their
                            tensors in the stats store too
    /requests/<i>/prompt_ids     int64 token ids of prompt i
    /requests/<i>/generated_ids  int64 token ids generated (or forced) at steps 1..N
                                 (attribute `prompt`: the prompt text when known)

Row order in /index is execution order (HDF5 iterates group members alphabetically, so
"layers.10" would sort before "layers.2"; the index is an array and keeps call order).
The index is appended as the capture runs and flushed at step ends (at most once a second), so a
capture killed midway still opens: `complete` is then false and readers refuse it unless asked not to.
Nothing in a file is ever deserialised as code: strings, numbers and arrays only.

Writing never loses an existing file: a writer that replaces one (force) writes a temporary file
beside it (".NAME.*.partial" in the same folder) and renames it into place only on a clean,
complete close; an interrupted or failed capture removes the temporary file and leaves the old
one as it was. A new file is written in place, so a capture killed midway leaves it incomplete.
A full disk (or `ulimit -f`) ends the capture with one UserError; the file keeps the records
flushed so far and opens as incomplete.

A reader checks, when it opens a file, the layout it relies on (attributes, /meta, every /index
column, record keys, statistics, /requests) and raises a UserError that names the file and what
is wrong; a tensor is checked against its index row (present, same shape) when it is read.
"""
from accucheck.store.format import (FORMAT, KINDS, REGENERATE_HINT, SAMPLE_SIZE,  # noqa: F401
                                    SCHEMA_MINOR, SCHEMA_VERSION, STAT_FIELDS, STORE_MODES,
                                    _INDEX_COLUMNS, _OPTIONAL_COLUMNS, IndexRow, RequestTokens,
                                    Selection, Stats, bf16_bits_to_float32, content_hash,
                                    LOGITS_IDS_SLOT, logits_topk, meta_header, parse_layers,
                                    parse_logits, parse_positions, parse_ranges,
                                    parse_requests, sample_positions)
from accucheck.store.sketch import (SKETCH_FLOOR, SKETCH_SIZE, SKETCH_WIDTH,  # noqa: F401
                                    sketch_rel, sketch_row)
from accucheck.store.sketch import tables as sketch_tables  # noqa: F401
from accucheck.store.reader import CaptureReader, open_capture  # noqa: F401
from accucheck.store.writer import CaptureWriter  # noqa: F401
