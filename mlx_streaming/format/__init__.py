"""The stream directory format, version 2 (docs/FORMAT.md).

A stream directory is an mlx-lm model directory whose routed experts were
moved out of the safetensors into one blob per MoE layer, and whose
per-layer dense weights into one record per transformer layer:

    config.json, tokenizer files, model*.safetensors   (the always-resident spine)
    experts/manifest.json                              (written last)
    experts/layer{L:03d}.blob                          (num_experts records)
    spine/layer{L:03d}.blob                            (one dense record, version 2)

Each blob holds one fixed-stride record per expert, so reading a missed
expert is a single ``pread`` of ``stride`` bytes at ``expert * stride``.
Version 1 directories (the whole spine in safetensors) are still read.
"""

from .layout import (  # noqa: F401
    FORMAT_NAME,
    FORMAT_VERSION,
    READ_VERSIONS,
    EXPERTS_DIR,
    SPINE_DIR,
    MANIFEST_NAME,
    CONVERT_STATE_NAME,
    RECORD_ALIGNMENT,
    LOW_RECORD_ALIGNMENT,
    SEGMENT_ALIGNMENT,
    DTYPES,
    dtype_name,
    dtype_from_name,
    align,
    Segment,
    LayerSpec,
    SpineFile,
    MtpSpec,
    LowBits,
    LOW_BITS,
    LOW_GROUP_SIZES,
    DenseSpec,
    Manifest,
    layout_record,
    record_checksum,
    MAX_DIM,
    layer_in_path,
)
from .parse import (  # noqa: F401
    Malformed,
    layer_from_dict,
    layer_to_dict,
    manifest_from_dict,
    dense_from_dict,
    manifest_to_dict,
)
from .files import (  # noqa: F401
    experts_dir,
    manifest_path,
    VOCABULARY_FILES,
    TOKENIZER_PATTERNS,
    has_vocabulary,
    write_json_atomic,
    fsync_path,
    write_manifest,
    read_manifest,
    spine_dir,
    dense_path,
    check_dense_size,
    read_dense,
    dense_checksum,
    blob_path,
    check_blob_size,
    write_copies_command,
    SAFETENSORS_ITEMSIZE,
    MAX_SAFETENSORS_HEADER,
    SPINE_PATTERN,
    spine_files,
    check_safetensors,
    file_crc32,
    spine_manifest,
    check_spine_files,
    crc_or_none,
)
from .check import (  # noqa: F401
    damaged_spine,
    checked_layers,
    damaged_records,
    damaged_experts,
)
