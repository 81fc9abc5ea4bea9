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

from .files import (  # noqa: F401
    MAX_SAFETENSORS_HEADER,
    SAFETENSORS_ITEMSIZE,
    SPINE_PATTERN,
    TOKENIZER_PATTERNS,
    VOCABULARY_FILES,
    blob_path,
    check_blob_size,
    check_dense_size,
    check_safetensors,
    check_spine_files,
    crc_or_none,
    dense_checksum,
    dense_path,
    experts_dir,
    file_crc32,
    fsync_path,
    has_vocabulary,
    manifest_path,
    read_dense,
    read_manifest,
    spine_dir,
    spine_files,
    spine_manifest,
    write_copies_command,
    write_json_atomic,
    write_manifest,
)
from .integrity import (  # noqa: F401
    checked_dense,
    checked_layers,
    damaged_experts,
    damaged_records,
    damaged_spine,
)
from .layout import (  # noqa: F401
    CONVERT_STATE_NAME,
    DTYPES,
    EXPERTS_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    LOW_BITS,
    LOW_GROUP_SIZES,
    LOW_RECORD_ALIGNMENT,
    MANIFEST_NAME,
    MAX_DIM,
    READ_VERSIONS,
    RECORD_ALIGNMENT,
    SEGMENT_ALIGNMENT,
    SPINE_DIR,
    DenseSpec,
    LayerSpec,
    LowBits,
    Manifest,
    MtpSpec,
    Segment,
    SpineFile,
    align,
    dtype_from_name,
    dtype_name,
    layer_in_path,
    layout_record,
    record_checksum,
)
from .parse import (  # noqa: F401
    Malformed,
    dense_from_dict,
    layer_from_dict,
    layer_to_dict,
    manifest_from_dict,
    manifest_to_dict,
)
