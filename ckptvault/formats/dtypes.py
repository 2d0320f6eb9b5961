"""One dtype vocabulary (the safetensors names) and what each costs per element."""

from __future__ import annotations

# name -> (bytes per element, bytes per scalar component): complex numbers group as their floats.
DTYPES: dict[str, tuple[int, int]] = {
    "BOOL": (1, 1),
    "U8": (1, 1),
    "I8": (1, 1),
    "F8_E4M3": (1, 1),
    "F8_E5M2": (1, 1),
    "F8_E8M0": (1, 1),
    "I16": (2, 2),
    "U16": (2, 2),
    "F16": (2, 2),
    "BF16": (2, 2),
    "I32": (4, 4),
    "U32": (4, 4),
    "F32": (4, 4),
    "C64": (8, 4),
    "I64": (8, 8),
    "U64": (8, 8),
    "F64": (8, 8),
    "C128": (16, 8),
}

# numpy dtype names (np.dtype(x).name) -> our names; bfloat16 has no numpy name.
NUMPY_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "complex64": "C64",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
    "complex128": "C128",
}

# torch storage class names (torch.save pickles them) -> our names.
TORCH_STORAGES = {
    "BoolStorage": "BOOL",
    "ByteStorage": "U8",
    "CharStorage": "I8",
    "ShortStorage": "I16",
    "IntStorage": "I32",
    "LongStorage": "I64",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "FloatStorage": "F32",
    "DoubleStorage": "F64",
    "ComplexFloatStorage": "C64",
    "ComplexDoubleStorage": "C128",
    "UInt16Storage": "U16",
    "UInt32Storage": "U32",
    "UInt64Storage": "U64",
    "Float8_e4m3fnStorage": "F8_E4M3",
    "Float8_e5m2Storage": "F8_E5M2",
}


def element_width(dtype: str) -> int:
    """Bytes per scalar component (what byte grouping groups by); 0 when the dtype is unknown."""
    return DTYPES.get(dtype, (0, 0))[1]


def item_size(dtype: str) -> int:
    """Bytes per element; 0 when the dtype is unknown."""
    return DTYPES.get(dtype, (0, 0))[0]
